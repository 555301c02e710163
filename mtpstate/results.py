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
    )

    def __init__(self, ctx, b, idx, bb, holder):
        self._ctx = ctx
        self._b = b  # [B_ROWS, max_num_reqs] int32
        self._idx = idx  # [max_num_reqs] intp
        self._bb = bb  # [BB_ROWS, max_num_reqs] bool
        self._holder = holder  # [the last batch's req_ids], put there by the kernel
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
