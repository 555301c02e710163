"""RequestTable: apply a whole scheduler step in one batched call.

Data flow: scheduler output (Python objects, duck-typed like vLLM's
``SchedulerOutput``) -> ``binding`` (the step's inputs read once; shapes the
kernel does not read in place converted) -> ``_kernels.step.tb_apply``
validates the whole step and applies it to the host arrays (appending the
changes to the mirror's staging buffers) -> ``results`` (the step's rows and
batch) -> ``mirror.DeviceMirror`` ships the changes to device tensors. A
status other than OK becomes a StateError in ``step_errors``. This module
holds the table's arrays, its public API and the orchestration of a step.
"""

from __future__ import annotations

import math
import operator
from _thread import get_ident as _get_ident

import numpy as np

from mtpstate._kernels import slots as T
from mtpstate._kernels import status as K
from mtpstate._kernels.step import tb_apply
from mtpstate.binding import _NEW_NAMES_ADDR, Step, bind, canonicalize, describe_new, new_from_held, read_cached
from mtpstate.errors import InvalidStepError, StateError
from mtpstate.index import RequestIndex
from mtpstate.results import BatchReqState, StepResult, input_views
from mtpstate.step_errors import raise_step_error
from mtpstate.table_device import _DeviceSide

__all__ = ["RequestTable"]


class RequestTable(_DeviceSide):
    """Per-request state in flat arrays indexed by row, updated one scheduler
    step at a time.

    Parameters
    ----------
    max_num_reqs : int
        Rows (the most requests live at once).
    max_model_len : int
        Longest sequence; the width of ``token_ids``.
    block_sizes : sequence of int
        Block size of each KV-cache group.
    max_num_blocks_per_group : sequence of int, optional
        Width of each group's block table; default
        ``ceil(max_model_len / block_size)``.
    device : str or torch.device, optional
        Mirror the state to torch tensors on this device (``"cuda"``, or
        ``"cpu"`` to run the same machinery without a GPU). None: host only.
    mirror_options : dict, optional
        Passed to :class:`mtpstate.mirror.DeviceMirror` (``ring_depth``,
        ``token_ids_on_device``, ``staging_capacity``, ``token_chunk``,
        ``fields``, ``engine_lengths``, ``token_ids_target``,
        ``idx_mapping``, ``zero_rows_on_add``, ``graphs``, ``ops``).
    seed : int, optional
        Hash seed of the request index (rows never depend on it).
    max_id_bytes : int
        Longest request id accepted, in UTF-8 bytes (default 65536). Ids can
        come from clients: ids of up to 56 bytes live in the row, longer ones
        in an arena sized by the live long ids (returned as they finish).
        A step with a longer new id is refused with an InvalidStepError
        naming it; check ids when admitting requests with
        :meth:`accepts_request_id`, so that one request is turned away
        instead of a step failing.
    prefault : bool
        Touch every page of the host arrays now (default), so that no step
        pays the kernel's page faults (zeroing a 2 MiB huge page takes
        ~100 us) the first time it writes a row.
    decode_query_len : int, optional
        vLLM's ``decode_query_len`` (speculative steps + 1). When set,
        ``apply`` also builds the step's batch (``StepResult.batch``, vLLM's
        ``BatchReqState``) from ``num_scheduled_tokens`` and
        ``scheduled_spec_decode_tokens`` in the same kernel call. None
        (default): no batch, nothing extra paid.
    sampled_tokens_per_step : int
        Tokens sampled per request and step besides its drafts (vLLM's
        ``model_state.num_new_sampled_tokens_per_step``, 1 for a plain
        decoder): the batch's ``cu_num_logits_np`` counts drafts + this.
    max_num_logits : int, optional
        Logits a step's batch expands (``expanded_idx_mapping_np`` /
        ``expanded_local_pos_np``, vLLM's ``expand_idx_mapping``) at most:
        default ``max_num_reqs * decode_query_len``; the engine's token
        budget bounds it too (a request's logits are among its scheduled
        tokens). A step with more leaves them None.

    Notes
    -----
    The host arrays are the source of truth; the attributes below are views
    of them, valid for the table's lifetime. Rows are assigned lowest-free
    first, so tensor-parallel ranks fed the same steps agree.

    Threads: calls that change the table are serialized by a lock (a second
    thread waits); a call made from inside another (a scheduler object's
    property that calls back into the table) raises StateError.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_sizes=(16,),
        max_num_blocks_per_group=None,
        *,
        device=None,
        mirror_options: dict | None = None,
        seed: int | None = None,
        max_id_bytes: int = 65536,
        prefault: bool = True,
        decode_query_len: int | None = None,
        sampled_tokens_per_step: int = 1,
        max_num_logits: int | None = None,
        _hash_bits: int = 63,
    ):
        R, L, block_sizes, widths = _checked_shape(max_num_reqs, max_model_len, block_sizes, max_num_blocks_per_group)
        ng = len(block_sizes)
        self.max_num_reqs = R
        self.max_model_len = L
        self.block_sizes = tuple(block_sizes)
        self.max_num_blocks_per_group = tuple(widths)
        self.num_groups = ng
        self._index = RequestIndex(R, seed=seed, max_id_bytes=max_id_bytes, _hash_bits=_hash_bits)
        self._guard = self._index._guard  # one lock for the index and the table
        self._python_path_steps = 0

        # host state; the kernels see it through addresses in _ctx, so these
        # arrays must stay referenced (and never be reallocated) while the
        # table lives
        self._state = np.zeros((T.F_NB + ng, R), np.int32)  # [num_fields, max_num_reqs]
        self.block_tables = [np.zeros((R, w), np.int32) for w in widths]  # [max_num_reqs, W_g] per group
        self._bt_addr = np.array([bt.ctypes.data for bt in self.block_tables], np.int64)
        self._bt_w = np.array(widths, np.int64)
        self._flat_bt = np.zeros(ng, np.int64)
        # prediction of each update's rows from the previous one: double
        # buffered, [2, max_num_reqs] (see _kernels.update)
        self._prev_obj = np.zeros((2, R), np.int64)
        self._prev_row = np.full((2, R), -1, np.int32)
        self._row_prev_pos = np.full((2, R), -1, np.int32)
        self._scratch = np.zeros((T.num_scratch_rows(ng), R), np.int32)
        # rows of the last step: cached then new at [0, 2R), freed at [2R, 3R)
        self._res = np.zeros(3 * R, np.int32)
        self._tok_runs = np.zeros((R, T.TR_STRIDE), np.int64)  # [max_num_reqs, TR_STRIDE]: the step's token runs
        self._make_batch_arrays(decode_query_len, sampled_tokens_per_step, max_num_logits)
        self._mirror = None
        self._steps_applied = 0  # steps the kernel applied to the host arrays
        token_ids = None
        host_tokens = True
        if device is not None:
            from mtpstate.mirror import DeviceMirror

            self._mirror = DeviceMirror(self, device, **(mirror_options or {}))
            token_ids = self._mirror.host_token_ids
            host_tokens = self._mirror.keeps_host_token_ids
        if token_ids is None and host_tokens:
            token_ids = np.zeros((R, L), np.int32)
        self.token_ids = token_ids  # [max_num_reqs, max_model_len]; None: the mirror's token target only
        if prefault:
            for a in (self._state, self.token_ids, *self.block_tables, self._scratch):
                if a is not None:
                    a.fill(0)

        self._b_holder = [[]]  # the kernel puts each step's req_ids list here
        self._new_holder = [None]  # what the kernel read of the step's new requests, until the call returns
        c = self._ctx = _kernel_context(self)
        # the same memory as Python ints: what the Python side reads and writes
        # every step (a numpy scalar per access costs several times more)
        cv = self._cv = memoryview(c)
        self._batch = None
        if self.decode_query_len:
            self._batch = BatchReqState(cv, self._b, self._b_idx, self._b_bool, self._b_holder, self._b_inputs)
        self._result = StepResult(self._res, cv, R, self._batch)
        # staging slots stay 0 (off, no buffer) unless a device mirror opens a step
        self._ix_addr = self._index._ctx_addr
        self._tb_addr = int(c.ctypes.data)
        if self._mirror is not None:
            self._mirror.attach()

    def _make_batch_arrays(self, decode_query_len, sampled_tokens_per_step, max_num_logits) -> None:
        """The arrays the kernel builds a step's batch in (empty without
        ``decode_query_len``: no batch, nothing extra paid)."""
        R = self.max_num_reqs
        if decode_query_len is not None:
            decode_query_len = operator.index(decode_query_len)
            if decode_query_len <= 0:
                raise ValueError(f"decode_query_len must be positive, got {decode_query_len}")
        self.decode_query_len = decode_query_len
        nb = R if decode_query_len else 0  # batch arrays only when a batch is built
        self._b = np.zeros((T.B_ROWS, nb), np.int32)  # [B_ROWS, max_num_reqs]
        self._b_idx = np.zeros(nb, np.intp)  # [max_num_reqs]: idx_mapping
        self._b_bool = np.zeros((T.BB_ROWS, nb), np.bool_)  # [BB_ROWS, max_num_reqs]
        self._b_obj = np.zeros((T.BO_ROWS, nb), np.int64)  # [BO_ROWS, max_num_reqs]
        bonus = operator.index(sampled_tokens_per_step)
        if bonus <= 0:
            raise ValueError(f"sampled_tokens_per_step must be positive, got {bonus}")
        self.sampled_tokens_per_step = bonus
        if max_num_logits is None:
            max_num_logits = R * (decode_query_len or 0)
        max_num_logits = operator.index(max_num_logits)
        if max_num_logits < 0:
            raise ValueError(f"max_num_logits must be >= 0, got {max_num_logits}")
        E = self._max_num_logits = max_num_logits if nb else 0
        # the step's inputs for the forward (BI_*, then expanded_local_pos),
        # and expanded_idx_mapping, where no mirror ships them
        b_in = np.zeros(T.BI_ROWS * (R + 1) + E if nb else 0, np.int32)  # [BI_ROWS * (max_num_reqs + 1) + E]
        self._b_exp = np.zeros(E, np.int64)  # [max_num_logits]
        # every buffer the kernel may write them into: address -> its views
        self._b_inputs = {b_in.ctypes.data: input_views(b_in, self._b_exp, R)} if nb else {}
        self._b_in, self._b_in_addr = b_in, b_in.ctypes.data

    # -- views of the host state ------------------------------------------

    @property
    def num_computed_tokens(self) -> np.ndarray:
        """[max_num_reqs] int32: overwritten from the scheduler every step."""
        return self._state[T.F_NCT]

    @property
    def num_computed_prefill_tokens(self) -> np.ndarray:
        """[max_num_reqs] int32: ``min(num_computed_tokens, prefill_len)``."""
        return self._state[T.F_NCPT]

    @property
    def prefill_len(self) -> np.ndarray:
        """[max_num_reqs] int32: number of prefill tokens (prompt + output so far when re-sent)."""
        return self._state[T.F_PREFILL]

    @property
    def prompt_len(self) -> np.ndarray:
        """[max_num_reqs] int32."""
        return self._state[T.F_PROMPT]

    @property
    def max_seq_len(self) -> np.ndarray:
        """[max_num_reqs] int32: ``prompt_len + max_tokens``."""
        return self._state[T.F_MAXSEQ]

    @property
    def num_blocks(self) -> np.ndarray:
        """[num_groups, max_num_reqs] int32: blocks in each row of each group's block table."""
        return self._state[T.F_NB :]

    @property
    def index(self) -> RequestIndex:
        """The id -> row index (read it; mutate only through the table)."""
        return self._index

    # -- internals ---------------------------------------------------------

    def _run_kernel(self, args: tuple) -> int:
        """One launch of the step kernel on its argument tuple, inside a
        staging step of the device mirror when there is one (shipped when the
        kernel accepts the step, closed unshipped otherwise). Returns the
        kernel's status."""
        mirror = self._mirror
        if mirror is not None:
            mirror.begin_step()
        status = tb_apply(self._ix_addr, self._tb_addr, id(args))
        cv = self._cv
        if status == K.OK:
            self._steps_applied += 1  # (before the ship: a failed ship leaves the step applied to the host)
        if mirror is not None:
            if status == K.OK:
                mirror.end_step(cv[T.TB_STG_N], cv[T.TB_STG_TOK_N], cv[T.TB_STG_DUPS] != 0)
            else:
                mirror.abort_step()
        if status == K.OK and cv[T.TB_B_N] == -2:
            _no_batch_list()
        return status

    def _launch(self, b: Step) -> None:
        """Run the step kernel on a bound step; handle the retry statuses
        (the new requests read in Python, grow key storage or staging, the
        generic path); raise on bad input. The caller holds the call guard."""
        if b.new:
            describe_new(b)
        canonical = False
        mirror = self._mirror
        ixc = self._index._ctx
        try:
            while True:
                status = self._run_kernel(_kernel_args(b))
                if status == K.OK:
                    if b.fin is not None or b.pre is not None or b.new or b.reqs is not None:
                        self._index._maybe_shrink_arena()  # rows were freed
                    return
                if b.reqs is not None:
                    # anything but OK: on from what the kernel read (each
                    # attribute is read once), as descriptors built here
                    new_from_held(b, status, self._new_holder[0], self._ctx)
                    if status == K.E_NEW_SLOW or status == K.E_NEW_READ:
                        continue
                if status == K.E_KEY_TOO_LONG:
                    self._index._grow_arena(int(self._ctx[T.TB_ERR_ARG]))
                    continue
                if status == K.E_STAGE_FULL:  # (nothing grows while serving: refused, nothing applied)
                    raise mirror.capacity_error(int(self._ctx[T.TB_ERR_ARG]))
                if status == K.E_NOT_CANONICAL and not canonical:
                    self._python_path_steps += 1
                    canonicalize(b)
                    canonical = True
                    ixc[T.IX_ALLOW_BYTES] = 1
                    continue
                raise_step_error(self, status, b)
        finally:
            ixc[T.IX_ALLOW_BYTES] = 0
            self._new_holder[0] = None
            if mirror is not None:
                mirror.abort_step()

    def _step(self, fin, pre, new_reqs, cached, batch=None) -> StepResult:
        guard = self._guard
        guard.enter()
        try:
            self._launch(bind(fin, pre, new_reqs, cached, batch))
        finally:
            guard.exit()
        return self._result

    # -- public API --------------------------------------------------------

    def apply(self, scheduler_output) -> StepResult:
        """Apply one scheduler step: finish, add, update (see docs/api.md),
        and, for a table with ``decode_query_len``, build its batch.

        Validates the whole step: on bad input it raises a
        :class:`~mtpstate.StateError` naming the request and field, and
        changes nothing.

        Returns
        -------
        StepResult
            Rows of the cached, new and freed requests, and the batch
            (views valid until the next call that changes the table).
        """
        guard = self._guard
        lock = guard._lock
        if lock.acquire(False):
            guard._owner = _get_ident()
        else:
            guard.enter()  # another thread: wait; this one (a callback): StateError
        try:
            return self._apply_locked(scheduler_output)
        finally:
            guard._owner = None
            lock.release()

    def _apply_locked(self, so) -> StepResult:
        try:
            fin = so.finished_req_ids
            pre = so.preempted_req_ids
            new = so.scheduled_new_reqs
            cached = so.scheduled_cached_reqs
            batch = None
            if self.decode_query_len is not None:
                nst = getattr(so, "num_scheduled_tokens", None)
                if nst is not None:
                    spec = getattr(so, "scheduled_spec_decode_tokens", None)
                    batch = (nst, spec, getattr(so, "total_num_scheduled_tokens", None))
        except StateError:
            raise
        except Exception as e:
            raise InvalidStepError(f"not a scheduler output: {e!r}") from None
        cfields = read_cached(cached)
        cid, cnct, cblk, cres = cfields
        # the steady state of decoding (nothing finished or added, exact
        # lists and dicts): the kernel's arguments straight from the step
        tf, tp, tn = type(fin), type(pre), type(new)
        if (
            (tf is set or tf is frozenset or tf is list or tf is tuple)
            and not fin
            and (pre is None or ((tp is set or tp is frozenset or tp is list or tp is tuple) and not pre))
            and (tn is list or tn is tuple)
            and not new
        ):
            tr = type(cres)
            if (
                type(cid) is list
                and type(cnct) is list
                and type(cblk) is list
                and (cres is None or ((tr is set or tr is frozenset or tr is list or tr is tuple) and not cres))
            ):
                nst = spec = total = None
                exact = True
                if batch is not None:
                    nst, spec, total = batch
                    exact = (
                        type(nst) is dict
                        and (spec is None or type(spec) is dict)
                        and (total is None or type(total) is int)
                    )
                args = (None, None, None, cid, 0, id(cnct), 0, cblk, None, nst, spec, total, None)  # the A_* slots
                if exact:
                    # (no mirror: the kernel alone, the cheapest call at N = 1)
                    status = (
                        tb_apply(self._ix_addr, self._tb_addr, id(args))
                        if self._mirror is None
                        else self._run_kernel(args)
                    )
                    if status == K.OK:
                        if self._mirror is None:
                            self._steps_applied += 1  # (_run_kernel counts its own)
                        if batch is not None and self._cv[T.TB_B_N] == -2:
                            _no_batch_list()  # (the direct call; _run_kernel checks it itself)
                        return self._result
                # anything else: the general handling (the kernel changed nothing)
        self._launch(bind(fin, pre, new, cfields, batch))
        return self._result

    def finish(self, req_ids) -> StepResult:
        """Remove these requests (unknown ids are ignored)."""
        return self._step(req_ids, None, None, None)

    def add(self, new_reqs) -> StepResult:
        """Add new requests (objects shaped like vLLM's ``NewRequestData``)."""
        return self._step(None, None, new_reqs, None)

    def update(self, cached_reqs) -> StepResult:
        """Update running requests (shaped like vLLM's ``CachedRequestData``)."""
        return self._step(None, None, None, read_cached(cached_reqs))

    @property
    def python_path_steps(self) -> int:
        """Steps that needed the Python conversion path (exotic input types:
        numpy scalars in lists, str subclasses, ids with lone surrogates,
        ...). vLLM-shaped steps never do."""
        return self._python_path_steps

    def update_arrays(self, req_ids, num_computed_tokens, new_block_offsets=None, new_block_ids=None) -> np.ndarray:
        """Update running requests from arrays an engine already holds.

        Parameters
        ----------
        req_ids : sequence of str or np.ndarray of int
            Request ids, or rows (integer array) of live requests.
        num_computed_tokens : array of int, same length
        new_block_offsets : list of arrays, one per group, optional
            CSR offsets ``[n + 1]``: request i's new blocks of group g are
            ``new_block_ids[g][offsets[g][i]:offsets[g][i + 1]]``.
        new_block_ids : list of arrays, one per group, optional

        Returns
        -------
        np.ndarray[int32]
            The rows updated.
        """
        from mtpstate._kernels.arrays import update_from_arrays

        return update_from_arrays(self, req_ids, num_computed_tokens, new_block_offsets, new_block_ids)

    @property
    def max_id_bytes(self) -> int:
        """The longest request id (UTF-8 bytes) a step may add."""
        return self._index.max_id_bytes

    def accepts_request_id(self, req_id) -> bool:
        """Whether a new request with this id can be added (a str of at most
        ``max_id_bytes`` UTF-8 bytes): what an engine checks when it admits a
        request, to reject that one request rather than fail a step."""
        if not isinstance(req_id, str):
            return False
        try:
            n = len(req_id.encode("utf-8"))
        except UnicodeEncodeError:
            n = len(req_id.encode("utf-8", "surrogatepass"))
        return n <= self._index.max_id_bytes

    def rows(self, req_ids) -> np.ndarray:
        """Rows of live ids (:class:`~mtpstate.UnknownRequestError` otherwise)."""
        return self._index.lookup(req_ids)

    def is_prefilling(self, rows) -> np.ndarray:
        """``num_computed_prefill_tokens[rows] < prefill_len[rows]``."""
        rows = np.asarray(rows)
        return self.num_computed_prefill_tokens[rows] < self.prefill_len[rows]

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, req_id) -> bool:
        return req_id in self._index

    def __copy__(self):
        # the kernels address the arrays by pointer: a copy would write into
        # the original's memory
        raise TypeError("RequestTable cannot be copied or pickled; build a new one and replay the steps")

    __deepcopy__ = __reduce_ex__ = lambda self, *a: self.__copy__()  # noqa: E731

    def __del__(self):
        try:
            _release_prediction(self._ctx, self._prev_obj)
        except Exception:  # at interpreter exit modules may be half torn down: then nothing
            pass

    def __repr__(self) -> str:
        m = self._mirror
        mirror = "" if m is None else f", device={str(m.device)!r}, mirror={m.path!r}"
        if m is not None and m.graph_error:
            mirror += f" ({m.graph_error})"
        return (
            f"RequestTable(max_num_reqs={self.max_num_reqs}, max_model_len={self.max_model_len}, "
            f"block_sizes={list(self.block_sizes)}, live={len(self)}{mirror})"
        )


def _checked_shape(max_num_reqs, max_model_len, block_sizes, max_num_blocks_per_group):
    """``(R, L, block_sizes, widths)``, checked: positive ints, one positive
    block-table width per group (default ``ceil(max_model_len / block_size)``)."""
    R = operator.index(max_num_reqs)
    L = operator.index(max_model_len)
    if R <= 0 or L <= 0:
        raise ValueError("max_num_reqs and max_model_len must be positive")
    block_sizes = [operator.index(b) for b in block_sizes]
    if not block_sizes or any(b <= 0 for b in block_sizes):
        raise ValueError("block_sizes must be a non-empty sequence of positive ints")
    if max_num_blocks_per_group is None:
        widths = [math.ceil(L / b) for b in block_sizes]
    else:
        widths = [operator.index(w) for w in max_num_blocks_per_group]
        if len(widths) != len(block_sizes) or any(w <= 0 for w in widths):
            raise ValueError("max_num_blocks_per_group needs one positive width per group")
    return R, L, block_sizes, widths


def _kernel_context(t: RequestTable) -> np.ndarray:
    """The table's context for the kernels (``_kernels.slots`` ``TB_*``):
    the addresses of its arrays and its sizes. The arrays must stay
    referenced, and never be reallocated, while the table lives."""
    R, nb, E = t.max_num_reqs, len(t._b_idx), t._max_num_logits
    c = np.zeros(T.TB_SIZE, np.int64)
    c[T.TB_STATE] = t._state.ctypes.data
    c[T.TB_R] = R
    c[T.TB_STG_STRIDE] = R  # the mirror pads it (aligned device rows)
    c[T.TB_NG] = t.num_groups
    c[T.TB_BT_ADDR] = t._bt_addr.ctypes.data
    c[T.TB_BT_W] = t._bt_w.ctypes.data
    c[T.TB_TOK] = 0 if t.token_ids is None else t.token_ids.ctypes.data
    c[T.TB_L] = t.max_model_len
    c[T.TB_PREV_OBJ] = t._prev_obj.ctypes.data
    c[T.TB_PREV_ROW] = t._prev_row.ctypes.data
    c[T.TB_ROW_PREV_POS] = t._row_prev_pos.ctypes.data
    c[T.TB_SCR] = t._scratch.ctypes.data
    c[T.TB_FLAT_BT] = t._flat_bt.ctypes.data
    c[T.TB_FLAT_TOK] = -1
    c[T.TB_RES] = t._res.ctypes.data
    c[T.TB_TOK_RUNS] = t._tok_runs.ctypes.data
    c[T.TB_DQL] = t.decode_query_len or 0
    c[T.TB_BATCH] = t._b.ctypes.data
    c[T.TB_BATCH_IDX] = t._b_idx.ctypes.data
    c[T.TB_BATCH_BOOL] = t._b_bool.ctypes.data
    c[T.TB_BATCH_OBJ] = t._b_obj.ctypes.data
    c[T.TB_B_N] = -1
    c[T.TB_BIN] = t._b_in_addr if nb else 0
    c[T.TB_BEXP] = t._b_exp.ctypes.data if E else 0
    c[T.TB_B_EXP_CAP] = E
    c[T.TB_BONUS] = t.sampled_tokens_per_step
    c[T.TB_B_HOLDER] = id(t._b_holder)
    c[T.TB_NEW_HOLDER] = id(t._new_holder)
    c[T.TB_NEW_NAMES] = _NEW_NAMES_ADDR.ctypes.data
    return c


def _release_prediction(ctx: np.ndarray, prev_obj: np.ndarray) -> None:
    """Give back the reference the kernels hold to each id object of the
    current prediction buffer (see ``_kernels.update``)."""
    if not ctx[T.TB_PREV_OWNED]:
        return
    cur, n = int(ctx[T.TB_PREV_CUR]), int(ctx[T.TB_PREV_N])
    objs = prev_obj[cur, :n].tolist()
    ctx[T.TB_PREV_N] = 0
    ctx[T.TB_PREV_OWNED] = 0
    from mtpstate._kernels.cpython import py_decref as decref

    for obj in objs:
        if obj:
            decref(obj)


def _kernel_args(b: Step) -> tuple:
    """The step kernel's argument tuple (``A_*`` slots) for a bound step."""
    kind, addr, n = b.vec if b.vec is not None else (0, 0, 0)
    return (
        b.fin,
        b.pre,
        b.desc or None,
        b.cid,
        kind,
        addr,
        n,
        b.cblk,
        b.cres,
        b.nst,
        b.spec,
        b.total,
        b.reqs,
    )


def _no_batch_list() -> None:
    raise MemoryError("mtpstate: no memory for the batch's req_ids list (the step itself was applied)")
