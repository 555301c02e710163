"""RequestTable: apply a whole scheduler step in one batched call.

Data flow: scheduler output (Python objects, duck-typed like vLLM's
``SchedulerOutput``) -> ``apply`` gathers the few per-new-request attributes
-> ``_table_kernels.tb_step`` validates the whole step and applies it to the
host arrays (and appends the changes to the mirror's staging buffers) ->
``mirror.DeviceMirror`` ships them to device tensors.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from mtpstate import _kernels as K
from mtpstate import _table_kernels as T
from mtpstate.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidStepError,
    StateError,
    UnknownRequestError,
)
from mtpstate.index import RequestIndex, canonical_ids, key_text

__all__ = ["RequestTable"]


def _as_int(x, what: str) -> int:
    if isinstance(x, (bool, np.bool_)):
        raise InvalidStepError(f"{what} must be an int, got bool {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise InvalidStepError(f"{what} must be an int, got {type(x).__name__} {x!r}") from None


def _int_list(seq, what: str) -> list:
    if isinstance(seq, np.ndarray):
        if seq.dtype.kind not in "iu":
            raise InvalidStepError(f"{what} must hold ints, got dtype {seq.dtype}")
        return seq.tolist()
    if isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
        raise InvalidStepError(f"{what} must be a sequence of ints, got {type(seq).__name__}")
    return [_as_int(x, what) for x in seq]


def _blocks(b, what: str):
    if b is None:
        return None
    if isinstance(b, (str, bytes)) or not hasattr(b, "__iter__"):
        raise InvalidStepError(f"{what} must be a tuple with one list of block ids per KV-cache group")
    return tuple(_int_list(g, what) for g in b)


def _ids_list(x, what: str):
    if x is None:
        return []
    return canonical_ids(x, what)


class RequestTable:
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
        ``token_ids_on_device``).
    seed : int, optional
        Hash seed of the request index (rows never depend on it).
    prefault : bool
        Touch every page of the host arrays now (default), so that no step
        pays the kernel's page faults (zeroing a 2 MiB huge page takes
        ~100 us) the first time it writes a row.

    Notes
    -----
    The host arrays are the source of truth; the attributes below are views
    of them, valid for the table's lifetime. Rows are assigned lowest-free
    first, so tensor-parallel ranks fed the same steps agree.
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
        prefault: bool = True,
        _hash_bits: int = 63,
    ):
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
        ng = len(block_sizes)
        self.max_num_reqs = R
        self.max_model_len = L
        self.block_sizes = tuple(block_sizes)
        self.max_num_blocks_per_group = tuple(widths)
        self.num_groups = ng
        self._index = RequestIndex(R, seed=seed, _hash_bits=_hash_bits)

        # host state; the kernels see it through addresses in _ctx, so these
        # arrays must stay referenced (and never be reallocated) while the
        # table lives
        self._state = np.zeros((T.F_NB + ng, R), np.int32)  # [num_fields, max_num_reqs]
        self.block_tables = [np.zeros((R, w), np.int32) for w in widths]  # [max_num_reqs, W_g] per group
        self._bt_addr = np.array([bt.ctypes.data for bt in self.block_tables], np.int64)
        self._bt_w = np.array(widths, np.int64)
        self._flat_bt = np.zeros(ng, np.int64)
        # prediction of each update's rows from the previous one: double
        # buffered, [2, max_num_reqs] (see _table_kernels)
        self._prev_obj = np.zeros((2, R), np.int64)
        self._prev_row = np.full((2, R), -1, np.int32)
        self._row_prev_pos = np.full((2, R), -1, np.int32)
        self._scratch = np.zeros((T.num_scratch_rows(ng), R), np.int32)
        self._mirror = None
        token_ids = None
        if device is not None:
            from mtpstate.mirror import DeviceMirror

            self._mirror = DeviceMirror(self, device, **(mirror_options or {}))
            token_ids = self._mirror.host_token_ids
        self.token_ids = (
            token_ids if token_ids is not None else np.zeros((R, L), np.int32)
        )  # [max_num_reqs, max_model_len]
        if prefault:
            for a in (self._state, self.token_ids, *self.block_tables, self._scratch):
                a.fill(0)

        c = self._ctx = np.zeros(T.TB_SIZE, np.int64)
        c[T.TB_STATE] = self._state.ctypes.data
        c[T.TB_R] = R
        c[T.TB_NG] = ng
        c[T.TB_BT_ADDR] = self._bt_addr.ctypes.data
        c[T.TB_BT_W] = self._bt_w.ctypes.data
        c[T.TB_TOK] = self.token_ids.ctypes.data
        c[T.TB_L] = L
        c[T.TB_PREV_OBJ] = self._prev_obj.ctypes.data
        c[T.TB_PREV_ROW] = self._prev_row.ctypes.data
        c[T.TB_ROW_PREV_POS] = self._row_prev_pos.ctypes.data
        c[T.TB_SCR] = self._scratch.ctypes.data
        c[T.TB_FLAT_BT] = self._flat_bt.ctypes.data
        c[T.TB_FLAT_TOK] = -1
        # staging slots stay 0 (off, no buffer) unless a device mirror opens a step
        self._ix_addr = self._index._ctx_addr
        self._tb_addr = int(c.ctypes.data)
        if self._mirror is not None:
            self._mirror.attach()

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

    def _launch(self, args):
        """Run the step kernel; handle the retry statuses; raise on bad input."""
        canonical = False
        while True:
            status = T.tb_step(self._ix_addr, self._tb_addr, *(id(a) if a is not None else 0 for a in args))
            if status == K.OK:
                self._index._ctx[K.IX_ALLOW_BYTES] = 0
                return args
            if status == K.E_KEY_TOO_LONG:
                self._index._widen_keys(int(self._ctx[T.TB_ERR_ARG]))
                continue
            if status == K.E_STAGE_FULL:
                self._mirror.grow_staging(int(self._ctx[T.TB_ERR_ARG]))
                continue
            if status == K.E_NOT_CANONICAL and not canonical:
                args = self._canonical(args)
                canonical = True
                self._index._ctx[K.IX_ALLOW_BYTES] = 1
                continue
            self._index._ctx[K.IX_ALLOW_BYTES] = 0
            self._raise(status, args)

    def _canonical(self, args):
        """The generic path: every input as lists of exact str / int, or a
        StateError naming what is wrong."""
        fin, nid, nplen, npre, nblk, nnct, nmax, cid, cnct, cblk, cres = args
        if fin is not None:
            fin = _ids_list(fin, "finished request id")
        if nid is not None:
            nid = _ids_list(nid, "new request id")
            nplen = [_as_int(x, f"prompt length of {r!r}") for r, x in zip(nid, nplen)]
            npre = [_int_list(p, f"prefill token ids of {r!r}") for r, p in zip(nid, npre)]
            nblk = [_blocks(b, f"block_ids of {r!r}") for r, b in zip(nid, nblk)]
            for r, b in zip(nid, nblk):
                if b is None:
                    raise InvalidStepError(f"new request {key_text(r)!r}: block_ids is None")
            nnct = [_as_int(x, f"num_computed_tokens of {r!r}") for r, x in zip(nid, nnct)]
            nmax = [_as_int(x, f"max_tokens of {r!r}") for r, x in zip(nid, nmax)]
        if cid is not None:
            ids = _ids_list(cid, "cached request id")
            cnct = _int_list(cnct, "num_computed_tokens")
            cblk = list(cblk)
            if not (len(ids) == len(cnct) == len(cblk)) or (cres is not None and len(cres) != len(ids)):
                raise InvalidStepError(
                    f"cached request lists differ in length: req_ids {len(ids)}, "
                    f"num_computed_tokens {len(cnct)}, new_block_ids {len(cblk)}"
                )
            cnct = [_as_int(x, f"num_computed_tokens of {r!r}") for r, x in zip(ids, cnct)]
            cblk = [_blocks(b, f"new_block_ids of {r!r}") for r, b in zip(ids, cblk)]
            if cres is not None:
                cres = [bool(x) for x in cres]
            cid = ids
        return fin, nid, nplen, npre, nblk, nnct, nmax, cid, cnct, cblk, cres

    def _raise(self, status: int, args) -> None:
        pos = int(self._ctx[T.TB_ERR_POS])
        arg = int(self._ctx[T.TB_ERR_ARG])
        phase = int(self._ctx[T.TB_ERR_PHASE])
        fin, nid, nplen, npre, nblk, nnct, nmax, cid, cnct, cblk, cres = args
        ids = {K.PH_FINISH: fin, K.PH_NEW: nid, K.PH_CACHED: cid}[phase]
        rid = key_text(ids[pos]) if (ids is not None and 0 <= pos < len(ids)) else None
        who = f"{'new' if phase == K.PH_NEW else 'cached'} request {rid!r}"
        L = self.max_model_len
        if status == K.E_UNKNOWN:
            raise UnknownRequestError(rid, "finished or preempted in this step" if arg else "not live")
        if status == K.E_DUPLICATE:
            if phase == K.PH_NEW:
                raise DuplicateRequestError(f"new request id {rid!r} appears twice in the step")
            if pos < 0:
                raise DuplicateRequestError(f"{arg} cached requests exceed max_num_reqs={self.max_num_reqs}")
            raise DuplicateRequestError(f"cached request {rid!r} is listed twice in the step")
        if status == K.E_CAPACITY:
            free = self.max_num_reqs - len(self._index)
            raise CapacityError(f"{arg} new requests but only {free} free rows (+ rows freed by this step)")
        if status == K.E_LENGTHS:
            raise InvalidStepError("the per-request lists of the step differ in length")
        if status == K.E_NCT_RANGE:
            raise InvalidStepError(f"{who}: num_computed_tokens={arg} outside [0, max_model_len={L}]")
        if status == K.E_NEW_NCT_RANGE:
            raise InvalidStepError(f"{who}: num_computed_tokens={arg} outside [0, prefill_len={len(npre[pos])}]")
        if status == K.E_TOO_LONG:
            raise InvalidStepError(f"{who}: prompt/prefill length {arg} exceeds max_model_len={L}")
        if status == K.E_MAX_TOKENS:
            raise InvalidStepError(f"{who}: max_tokens={arg} is negative or overflows int32")
        if status == K.E_TOKEN_VALUE:
            raise InvalidStepError(f"{who}: token ids must be ints in [0, 2**31)")
        if status == K.E_GROUPS:
            raise InvalidStepError(f"{who}: block ids for {arg} KV-cache groups, the table has {self.num_groups}")
        if status == K.E_BLOCK_OVERFLOW:
            raise InvalidStepError(
                f"{who}: block table of group {arg} overflows its {self.max_num_blocks_per_group[arg]} blocks"
            )
        if status == K.E_BLOCK_VALUE:
            raise InvalidStepError(f"{who}: block ids of group {arg} must be ints in [0, 2**31)")
        raise StateError(f"internal error: kernel status {status} in phase {phase} at {pos}")  # pragma: no cover

    @staticmethod
    def _gather_new(new_reqs):
        nid, nplen, npre, nblk, nnct, nmax = [], [], [], [], [], []
        for r in new_reqs:
            nid.append(r.req_id)
            prompt = r.prompt_token_ids
            pre = getattr(r, "prefill_token_ids", None)
            if pre is None:
                pre = prompt
            if pre is None:
                raise InvalidStepError(f"new request {r.req_id!r} has neither prompt_token_ids nor prefill_token_ids")
            nplen.append(len(prompt) if prompt is not None else r.prompt_len)
            npre.append(pre)
            nblk.append(r.block_ids)
            nnct.append(r.num_computed_tokens)
            sp = r.sampling_params
            nmax.append(sp.max_tokens if sp is not None and sp.max_tokens is not None else 1)
        return nid, nplen, npre, nblk, nnct, nmax

    def _step(self, fin, new_reqs, cached):
        nid = nplen = npre = nblk = nnct = nmax = None
        if new_reqs:
            nid, nplen, npre, nblk, nnct, nmax = self._gather_new(new_reqs)
        cid = cnct = cblk = cres = None
        if cached is not None:
            cid = cached.req_ids
            cnct = cached.num_computed_tokens
            cblk = cached.new_block_ids
            resumed = getattr(cached, "resumed_req_ids", None)
            if resumed:
                cres = [r in resumed for r in cid]
        if self._mirror is not None:
            self._mirror.begin_step()
        self._launch((fin, nid, nplen, npre, nblk, nnct, nmax, cid, cnct, cblk, cres))
        if self._mirror is not None:
            self._mirror.end_step(int(self._ctx[T.TB_STG_N]), deduplicate=bool(self._ctx[T.TB_STG_DUPS]))

    # -- public API --------------------------------------------------------

    def apply(self, scheduler_output) -> None:
        """Apply one scheduler step: finish, add, update (see docs/api.md).

        Validates the whole step first: on bad input it raises a
        :class:`~mtpstate.StateError` and changes nothing.
        """
        so = scheduler_output
        fin = so.finished_req_ids
        pre = so.preempted_req_ids
        if not fin and not pre and not so.scheduled_new_reqs:
            # steady-state fast path: only running requests are updated
            c = so.scheduled_cached_reqs
            if not getattr(c, "resumed_req_ids", None):
                ids = c.req_ids
                mirror = self._mirror
                if mirror is not None:
                    mirror.begin_step()
                status = T.tb_update(
                    self._ix_addr, self._tb_addr, id(ids), id(c.num_computed_tokens), id(c.new_block_ids), 0
                )
                if status == K.OK:
                    if mirror is not None:
                        mirror.end_step(int(self._ctx[T.TB_STG_N]))
                    return
                # anything else (generic inputs, errors) takes the full path;
                # a rejected kernel call has changed nothing
        if pre:
            fin = list(fin) + list(pre) if fin else list(pre)
        elif fin:
            fin = list(fin) if type(fin) is not list else fin
        else:
            fin = None
        new_reqs = so.scheduled_new_reqs
        cached = so.scheduled_cached_reqs
        if self._mirror is None and cached is not None and cached.req_ids:
            if not getattr(cached, "resumed_req_ids", None) and self._apply_split(fin, new_reqs, cached):
                return
        self._step(fin, new_reqs, cached)

    def _apply_split(self, fin, new_reqs, cached) -> bool:
        """A step with finished/new requests, applied as: validate finish + add;
        update the running requests with the single-pass kernel (refusing any
        row this step frees); then finish + add. Equivalent to finish, add,
        update whenever no running request is finished, re-sent or added by
        the step; otherwise (and on any error) nothing has changed and the
        general kernel takes the step. Returns whether the step was applied."""
        nid = nplen = npre = nblk = nnct = nmax = None
        if new_reqs:
            nid, nplen, npre, nblk, nnct, nmax = self._gather_new(new_reqs)
        addrs = [id(a) if a is not None else 0 for a in (fin, nid, nplen, npre, nblk, nnct, nmax)]
        ctx = self._ctx
        ctx[T.TB_VALIDATE_ONLY] = 1
        try:
            status = T.tb_step(self._ix_addr, self._tb_addr, *addrs, 0, 0, 0, 0)
        finally:
            ctx[T.TB_VALIDATE_ONLY] = 0
        if status != K.OK:
            return False
        ctx[T.TB_EXCLUDE_STAMP] = ctx[T.TB_STAMP]  # the rows that validation marked freed
        try:
            status = T.tb_update(
                self._ix_addr,
                self._tb_addr,
                id(cached.req_ids),
                id(cached.num_computed_tokens),
                id(cached.new_block_ids),
                0,
            )
        finally:
            ctx[T.TB_EXCLUDE_STAMP] = 0
        if status != K.OK:
            return False  # the update rolled itself back
        # finish + add were validated against state the update did not touch
        status = T.tb_step(self._ix_addr, self._tb_addr, *addrs, 0, 0, 0, 0)
        if status != K.OK:  # pragma: no cover - cannot happen after validation
            raise StateError(f"internal error: validated step failed with status {status}")
        return True

    def finish(self, req_ids) -> None:
        """Remove these requests (unknown ids are ignored)."""
        self._step(list(req_ids) if type(req_ids) is not list else req_ids, None, None)

    def add(self, new_reqs) -> None:
        """Add new requests (objects shaped like vLLM's ``NewRequestData``)."""
        self._step(None, list(new_reqs), None)

    def update(self, cached_reqs) -> None:
        """Update running requests (shaped like vLLM's ``CachedRequestData``)."""
        self._step(None, None, cached_reqs)

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
        from mtpstate._array_kernels import update_from_arrays

        return update_from_arrays(self, req_ids, num_computed_tokens, new_block_offsets, new_block_ids)

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
        # the kernels hold a reference to each id object of the current
        # prediction buffer (see _table_kernels); give them back
        try:
            ctx = self._ctx
            cur, n = int(ctx[T.TB_PREV_CUR]), int(ctx[T.TB_PREV_N])
            objs = self._prev_obj[cur, :n].tolist() if ctx[T.TB_PREV_OWNED] else []
            ctx[T.TB_PREV_N] = 0
        except AttributeError:  # __init__ did not finish
            return
        try:
            from mtpstate._native import decref

            for obj in objs:
                if obj:
                    decref(obj)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # -- device mirror -----------------------------------------------------

    @property
    def device_tensors(self):
        """torch tensors on ``device`` with the host arrays' names and shapes."""
        if self._mirror is None:
            raise StateError("this table has no device mirror (pass device=...)")
        return self._mirror.tensors

    def synchronize(self) -> None:
        """Wait until every launched copy has landed."""
        if self._mirror is not None:
            self._mirror.synchronize()

    def transfer_stats(self) -> dict:
        """``{"bytes": ..., "copies": ...}`` host-to-device traffic of the last step."""
        if self._mirror is None:
            return {"bytes": 0, "copies": 0}
        return self._mirror.stats()

    def __repr__(self) -> str:
        return (
            f"RequestTable(max_num_reqs={self.max_num_reqs}, max_model_len={self.max_model_len}, "
            f"block_sizes={list(self.block_sizes)}, live={len(self)})"
        )
