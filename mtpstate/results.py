"""What ``RequestTable.apply`` returns: :class:`StepResult` (the step's rows)
and :class:`BatchReqState` (its batch, as vLLM builds it), both views of
arrays the table preallocates, valid until the next call that changes it."""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import slots as T

__all__ = ["BatchReqState", "StepResult"]


class StepResult:
    """The rows of the step just applied, for the engine's next moves.

    Every attribute is a view of an array the table preallocates: valid
    until the next call that changes the table (``apply``, ``finish``,
    ``add``, ``update``), accepted or not. Copy what must outlive it.

    Attributes
    ----------
    cached_rows : np.ndarray[int32]
        Rows of ``scheduled_cached_reqs.req_ids``, in their order.
    new_rows : np.ndarray[int32]
        Rows assigned to ``scheduled_new_reqs``, in their order.
    rows : np.ndarray[int32]
        ``cached_rows`` followed by ``new_rows`` (one array): the batch in
        the scheduler's order, ready for a gather into the engine's order.
    freed_rows : np.ndarray[int32]
        Rows freed by the step (finished, preempted, and live rows of
        re-sent new requests), ascending: the order they were freed in.
    batch : BatchReqState or None
        The step's batch in vLLM's batch order (see :class:`BatchReqState`).
    """

    __slots__ = ("_res", "_ctx", "_R", "_batch")

    def __init__(self, res, ctx, R, batch):
        self._res = res
        self._ctx = ctx
        self._R = R
        self._batch = batch

    @property
    def batch(self) -> BatchReqState | None:
        """The step's batch, as vLLM's ``gather_batch_req_state`` builds it,
        or None when the table has no ``decode_query_len`` or the step no
        ``num_scheduled_tokens``."""
        n = self._ctx[T.TB_B_N]
        if n < 0:
            return None
        b = self._batch
        if b._n != n:
            b._resize(n)
        return b

    @property
    def cached_rows(self) -> np.ndarray:
        return self._res[: self._ctx[T.TB_RES_NC]]

    @property
    def new_rows(self) -> np.ndarray:
        nc = self._ctx[T.TB_RES_NC]
        return self._res[nc : nc + self._ctx[T.TB_RES_NN]]

    @property
    def rows(self) -> np.ndarray:
        return self._res[: self._ctx[T.TB_RES_NC] + self._ctx[T.TB_RES_NN]]

    @property
    def freed_rows(self) -> np.ndarray:
        R2 = 2 * self._R
        return self._res[R2 : R2 + self._ctx[T.TB_RES_NF]]

    def __repr__(self) -> str:
        return (
            f"StepResult(cached_rows={self.cached_rows.tolist()}, new_rows={self.new_rows.tolist()}, "
            f"freed_rows={self.freed_rows.tolist()})"
        )


class BatchReqState:
    """The step's batch, field for field vLLM 0.34's ``BatchReqState``
    (``gather_batch_req_state`` in ``vllm/v1/worker/gpu/model_runner.py``),
    computed by the step's kernel call. Only a table built with
    ``decode_query_len`` makes one, from the step's ``num_scheduled_tokens``
    and ``scheduled_spec_decode_tokens``.

    The arrays are views of arrays the table preallocates, valid until the
    next call that changes the table, like :class:`StepResult`'s; ``req_ids``
    is a new list every step (made by the kernel).

    Attributes
    ----------
    req_ids : list[str]
        The scheduled ids in batch order: ``sort_batch_req_ids``' order
        (requests with drafts first; within each, ``decode_query_len``
        tokens first, then by scheduled tokens; ties in dict order).
    num_scheduled_tokens : np.ndarray[int32]
    num_tokens : int
        Sum of ``num_scheduled_tokens`` (checked against the step's
        ``total_num_scheduled_tokens`` when it has one).
    num_draft_tokens_np : np.ndarray[int32] or None
        Draft tokens per request; None when the step has no drafts.
    idx_mapping_np : np.ndarray[intp]
        Batch position -> row.
    prefill_len_np, num_computed_prefill_tokens_np, max_seq_len_np : np.ndarray[int32]
        Those rows' state after the step.
    is_prefilling_np : np.ndarray[bool]
    has_prefill : bool
    prefill_runs_as_decode_np : np.ndarray[bool] or None
        Prefilling with one new token over existing context (runs as a
        decode); None when nothing prefills.
    decode_graph_eligible : bool
    max_query_len : int
        ``max(num_scheduled_tokens)``, 0 for an empty batch.
    query_start_loc_np, cu_num_logits_np, seq_lens_cpu_upper_bound_np, num_computed_tokens_np : np.ndarray[int32]
        The step's inputs for the forward, as vLLM's ``prepare_inputs``
        computes them: ``query_start_loc_np`` has ``max_num_reqs + 1``
        entries (0, the running sum of ``num_scheduled_tokens``, then
        ``num_tokens``: padded as for a full CUDA graph; slice it to the
        padded batch), ``cu_num_logits_np`` ``num_reqs + 1`` (0, the
        running sum of drafts + ``sampled_tokens_per_step``),
        ``seq_lens_cpu_upper_bound_np`` ``max_num_reqs`` (the rows'
        ``num_computed_tokens`` + ``num_scheduled_tokens``, 0 past the
        batch), ``num_computed_tokens_np`` ``num_reqs``. With a device
        mirror that ships them they are views of its pinned staging slot,
        valid for ``ring_depth`` steps.
    expanded_idx_mapping_np : np.ndarray[int64] or None
    expanded_local_pos_np : np.ndarray[int32] or None
        ``num_logits`` entries: each request's row, and 0..k-1, over its k
        logits (vLLM's ``expand_idx_mapping``). None when a request has more
        than ``decode_query_len`` logits (vLLM's kernel writes no more) or
        the step more than the table's ``max_num_logits``.
    num_logits, num_draft_tokens : int
        The batch's logits (the last entry of ``cu_num_logits_np``) and
        draft tokens.
    logits_fit : bool
        Every request is scheduled at least its drafts +
        ``sampled_tokens_per_step`` tokens (vLLM's ``prepare_inputs``
        asserts it when the step has drafts).
    """

    __slots__ = (
        "_ctx",
        "_b",
        "_idx",
        "_bb",
        "_n",
        "_holder",
        "num_scheduled_tokens",
        "_num_draft_tokens",
        "idx_mapping_np",
        "prefill_len_np",
        "num_computed_prefill_tokens_np",
        "max_seq_len_np",
        "is_prefilling_np",
        "_prefill_runs_as_decode",
        "_inputs",
        "_input_views",
        "_presized",
    )

    def __init__(self, ctx, b, idx, bb, holder, inputs):
        self._ctx = ctx
        self._b = b  # [B_ROWS, max_num_reqs] int32
        self._idx = idx  # [max_num_reqs] intp
        self._bb = bb  # [BB_ROWS, max_num_reqs] bool
        self._holder = holder  # [the last batch's req_ids], put there by the kernel
        self._inputs = inputs  # address -> input_views(): where the kernel may write the inputs
        self._input_views = {}  # (address, n or -1 - num_logits) -> the inputs' views (made once per buffer and size)
        self._presized = 0  # of them, made ahead of time (presize_views)
        self._resize(0)

    @property
    def req_ids(self) -> list:
        return self._holder[0]

    def _resize(self, n: int) -> None:
        # views change only when the batch size does (steady decode: never)
        b, bb = self._b, self._bb
        self._n = n
        self.num_scheduled_tokens = b[T.B_NUM_SCHED, :n]
        self._num_draft_tokens = b[T.B_DRAFTS, :n]
        self.prefill_len_np = b[T.B_PREFILL, :n]
        self.num_computed_prefill_tokens_np = b[T.B_NCPT, :n]
        self.max_seq_len_np = b[T.B_MAXSEQ, :n]
        self.idx_mapping_np = self._idx[:n]
        self.is_prefilling_np = bb[T.BB_PREFILLING, :n]
        self._prefill_runs_as_decode = bb[T.BB_RUNS_AS_DECODE, :n]

    @property
    def num_tokens(self) -> int:
        return self._ctx[T.TB_B_NUM_TOKENS]

    @property
    def num_draft_tokens_np(self) -> np.ndarray | None:
        return self._num_draft_tokens if self._ctx[T.TB_B_HAS_DRAFTS] else None

    @property
    def has_prefill(self) -> bool:
        return bool(self._ctx[T.TB_B_HAS_PREFILL])

    @property
    def prefill_runs_as_decode_np(self) -> np.ndarray | None:
        return self._prefill_runs_as_decode if self._ctx[T.TB_B_HAS_PREFILL] else None

    @property
    def decode_graph_eligible(self) -> bool:
        return bool(self._ctx[T.TB_B_GRAPH_OK])

    @property
    def max_query_len(self) -> int:
        return self._ctx[T.TB_B_MAX_QUERY]

    def presize_views(self) -> None:
        """Make now the input views (``query_start_loc_np`` ...
        ``num_computed_tokens_np``) for every batch size and buffer the
        kernel writes them into, so that no step pays for making one."""
        for addr, (a, _, _) in self._inputs.items():
            R = a.shape[1] - 1
            for n in range(R + 1):
                if (addr, n) not in self._input_views:
                    self._input_views[addr, n] = (
                        a[T.BI_QSL],
                        a[T.BI_CU_LOGITS, : n + 1],
                        a[T.BI_SEQ_UB, :R],
                        a[T.BI_NCT, :n],
                    )
        self._presized = len(self._input_views)

    def _views(self):
        key = (self._ctx[T.TB_BIN], self._n)
        v = self._input_views.get(key)
        if v is None:
            a = self._inputs[key[0]][0]
            n = self._n
            R = a.shape[1] - 1
            v = (a[T.BI_QSL], a[T.BI_CU_LOGITS, : n + 1], a[T.BI_SEQ_UB, :R], a[T.BI_NCT, :n])
            self._input_views = bounded_views(self._input_views, self._presized)
            self._input_views[key] = v
        return v

    def _expanded(self, i):
        if not self._ctx[T.TB_B_EXP_OK]:
            return None
        key = (self._ctx[T.TB_BIN], -1 - self._ctx[T.TB_B_NUM_LOGITS])
        v = self._input_views.get(key)
        if v is None:
            _, pos, idx = self._inputs[key[0]]
            m = self._ctx[T.TB_B_NUM_LOGITS]
            v = (idx[:m], pos[:m])
            self._input_views = bounded_views(self._input_views, self._presized)
            self._input_views[key] = v
        return v[i]

    # the inputs' views, in _views' order (see the class docstring)
    query_start_loc_np = property(lambda self: self._views()[0])
    cu_num_logits_np = property(lambda self: self._views()[1])
    seq_lens_cpu_upper_bound_np = property(lambda self: self._views()[2])
    num_computed_tokens_np = property(lambda self: self._views()[3])
    expanded_idx_mapping_np = property(lambda self: self._expanded(0))
    expanded_local_pos_np = property(lambda self: self._expanded(1))

    @property
    def num_logits(self) -> int:
        return self._ctx[T.TB_B_NUM_LOGITS]

    @property
    def num_draft_tokens(self) -> int:
        return self._ctx[T.TB_B_NUM_DRAFTS]

    @property
    def logits_fit(self) -> bool:
        return bool(self._ctx[T.TB_B_LOGITS_FIT])

    INPUT_FIELDS = (
        "query_start_loc_np",
        "cu_num_logits_np",
        "seq_lens_cpu_upper_bound_np",
        "num_computed_tokens_np",
        "expanded_idx_mapping_np",
        "expanded_local_pos_np",
        "num_logits",
        "num_draft_tokens",
        "logits_fit",
    )

    FIELDS = (
        "req_ids",
        "num_scheduled_tokens",
        "num_tokens",
        "num_draft_tokens_np",
        "idx_mapping_np",
        "prefill_len_np",
        "num_computed_prefill_tokens_np",
        "is_prefilling_np",
        "max_seq_len_np",
        "has_prefill",
        "prefill_runs_as_decode_np",
        "decode_graph_eligible",
        "max_query_len",
    )

    def as_dict(self) -> dict:
        """Every field by name (arrays still views)."""
        return {f: getattr(self, f) for f in self.FIELDS}

    def copy_arrays(self) -> dict:
        """The per-request arrays by field name, copied (they outlive the
        next call): three copies in all, of the int32, bool and index blocks,
        each field a view of its block. Fields that are None stay None."""
        n = self._n
        ints = self._b[: T.B_MAXSEQ + 1, :n].copy()  # [5, n]: the int32 outputs are rows 0..B_MAXSEQ
        bools = self._bb[:, :n].copy()  # [BB_ROWS, n]
        has_prefill = self._ctx[T.TB_B_HAS_PREFILL]
        return {
            "num_scheduled_tokens": ints[T.B_NUM_SCHED],
            "num_draft_tokens_np": ints[T.B_DRAFTS] if self._ctx[T.TB_B_HAS_DRAFTS] else None,
            "idx_mapping_np": self._idx[:n].copy(),
            "prefill_len_np": ints[T.B_PREFILL],
            "num_computed_prefill_tokens_np": ints[T.B_NCPT],
            "max_seq_len_np": ints[T.B_MAXSEQ],
            "is_prefilling_np": bools[T.BB_PREFILLING],
            "prefill_runs_as_decode_np": bools[T.BB_RUNS_AS_DECODE] if has_prefill else None,
        }

    def __repr__(self) -> str:
        return f"BatchReqState(num_reqs={self._n}, num_tokens={self.num_tokens}, req_ids={self.req_ids[:4]}...)"


def input_views(buf: np.ndarray, expanded_idx: np.ndarray, R: int):
    """The views of one buffer the step kernel writes the batch's inputs
    into (``TB_BIN``, flat int32: the ``BI_*`` rows, then
    ``expanded_local_pos``) and its ``expanded_idx_mapping`` (int64):
    ``(rows [BI_ROWS, R + 1], expanded_local_pos, expanded_idx_mapping)``."""
    S = R + 1
    rows = buf[: T.BI_ROWS * S].reshape(T.BI_ROWS, S)
    return rows, buf[T.BI_ROWS * S :], expanded_idx


# views a per-size cache may make beyond those made ahead of time
VIEW_CACHE_SLACK = 4096


def bounded_views(views: dict, presized: int = 0) -> dict:
    """A cache of views by size (and buffer), before an entry is added:
    emptied once it holds :data:`VIEW_CACHE_SLACK` more entries than the
    ``presized`` ones made ahead of time, so that it stays bounded in case
    sizes keep changing."""
    return {} if len(views) >= presized + VIEW_CACHE_SLACK else views
