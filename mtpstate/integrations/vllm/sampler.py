"""vLLM's sampler questions over the step's batch, answered by one kernel pass.

Every step, vLLM 0.34's ``Sampler`` asks a dozen questions of its per-row
arrays for the batch: ``np.any(needs_logits_processing[idx_mapping_np])``,
``get_logprobs_dims``, ``get_top_k_top_p``, ``any_greedy``, each logits
processor's skip check, ... each a fancy index and a reduction (35-53 us a
step on a 2-core VM). :class:`SamplerAnswers` computes all of them with one
call of ``_kernels.sampler.sp_answers`` when mtpstate hands out the step's
batch (``gather_batch_req_state``: after the add hooks, so every new row's
sampling params are in place), and :func:`attach` binds wrappers over the
methods that ask, on the sampler's own objects (instance attributes: the
class stays vLLM's). A wrapper answers only for the batch mtpstate built,
recognised by its ``idx_mapping_np`` object; any other batch (a dummy run's,
a shard's) and any call after a request was added since goes to vLLM's
method unchanged. The sampler's arrays, values and device tensors stay
vLLM's: only how the questions are computed changes.

:class:`SamplingParamsWriter` does the per-request half: new requests'
sampling params read in place before the step (bad ones refused whole) and
written into the sampler's arrays by one kernel call, as vLLM's
``add_request`` would write them (``_kernels.sampling_params``).

Imports no vLLM: it works on the sampler object it is given, after checking
that its classes and the methods it replaces are exactly the ones this was
written against (:data:`mtpstate.integrations.vllm.plugin.COMPUTED`).
"""

from __future__ import annotations

import sys

import numpy as np

from mtpstate._kernels import sampler as _K
from mtpstate._kernels import sampling_params as _P
from mtpstate.errors import InvalidStepError

__all__ = ["SamplerAnswers", "SamplingParamsWriter", "attach", "unsupported_reason"]

# the exact classes whose methods attach() replaces: attribute path -> (module, class)
_CLASSES = {
    "": ("vllm.v1.worker.gpu.sample.sampler", "Sampler"),
    "sampling_states": ("vllm.v1.worker.gpu.sample.states", "SamplingStates"),
    "penalties_state": ("vllm.v1.worker.gpu.sample.penalties", "PenaltiesState"),
    "logprob_token_ids_state": ("vllm.v1.worker.gpu.sample.logprob", "LogprobTokenIdsState"),
    "thinking_budget_state": ("vllm.v1.worker.gpu.sample.thinking_budget", "ThinkingBudgetState"),
}
_LOGIT_BIAS = ("vllm.v1.worker.gpu.sample.logit_bias", "LogitBiasState")
_BAD_WORDS = ("vllm.v1.worker.gpu.sample.bad_words", "BadWordsState")


def _is(obj, where) -> bool:
    t = type(obj)
    return (t.__module__, t.__qualname__) == where


def _builtin_processors(sampler):
    # Sampler.__init__'s list: logit bias, penalties, bad words, then custom ones
    procs = getattr(sampler, "logits_processors", None)
    if not isinstance(procs, list) or len(procs) < 3:
        return None
    lb, pen, bw = procs[:3]
    if not (_is(lb, _LOGIT_BIAS) and pen is getattr(sampler, "penalties_state", None) and _is(bw, _BAD_WORDS)):
        return None
    return lb, bw


def _arrays(sampler, R: int):
    # the per-row arrays sp_answers reads, in _K.SP_ARRAYS order
    ss = sampler.sampling_states
    lb, bw = _builtin_processors(sampler)
    return (
        (ss.temperature.np, np.float32),
        (ss.top_k.np, np.int32),
        (ss.top_p.np, np.float32),
        (ss.min_p.np, np.float32),
        (ss.seeds_set, np.bool_),
        (ss.num_logprobs, np.int32),
        (sampler.needs_logits_processing, np.bool_),
        (sampler.penalties_state.use_penalty, np.bool_),
        (sampler.logprob_token_ids_state.num_token_ids.np, np.int32),
        (lb.use_logit_bias, np.bool_),
        (bw.num_bad_words.np, np.int32),
        (_thinking_rows(sampler.thinking_budget_state, R), np.bool_),
        (lb.restore_when_all_masked.np, np.int32),
    )


def _thinking_rows(tb, R: int) -> np.ndarray:
    # a disabled ThinkingBudgetState has no per-row array: no row uses it
    if not tb.enabled:
        return np.zeros(R, dtype=bool)
    return tb.use_thinking_budget


def unsupported_reason(sampler, max_num_reqs: int) -> str | None:
    """Why :func:`attach` leaves this sampler alone (None: it can attach)."""
    if sampler is None:
        return "no sampler (not the last pipeline stage)"
    for path, where in _CLASSES.items():
        obj = getattr(sampler, path, None) if path else sampler
        if not _is(obj, where):
            return f"sampler{'.' + path if path else ''} is a {type(obj).__qualname__}, not vLLM's {where[1]}"
    if _builtin_processors(sampler) is None:
        return "the sampler's logits processors are not vLLM's (logit bias, penalties, bad words)"
    try:
        arrays = _arrays(sampler, max_num_reqs)
    except AttributeError as e:
        return f"the sampler lacks an array: {e}"
    for name, (a, dtype) in zip(_K.SP_ARRAYS, arrays):
        if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == (max_num_reqs,) and a.flags.c_contiguous):
            return f"the sampler's {name} is not a contiguous {np.dtype(dtype)} array of {max_num_reqs} rows"
    return None


class SamplerAnswers:
    """The sampler's answers for the step's batch (one ``sp_answers`` call).

    ``idx``: the ``idx_mapping_np`` they answer for (None: none). Then
    ``flags`` (``_kernels.sampler.SP_*``), ``max_num_logprobs``,
    ``max_num_token_ids``, ``max_top_k`` (the batch max of top_k, for
    ``return_sampling_mask``), ``max_top_k_top_p`` (top_k's max over rows
    with top_p < 1; -1: none) and ``max_num_bad_words``.

    The live rows' parts of the answers are kept counted (see
    ``_kernels.sampler``): :meth:`rows_changed` after each table step (its
    freed rows out, its new rows to count), :meth:`row_written` for a row
    the sampler's ``add_request`` wrote outside one. A batch of every live
    row is then answered from the counts at any size; any other by a pass
    over its rows. Built with the table, before its first request.
    """

    __slots__ = (
        "idx",
        "flags",
        "max_num_logprobs",
        "max_num_token_ids",
        "max_top_k",
        "max_top_k_top_p",
        "max_num_bad_words",
        "computed",
        "writer",
        "_arrays",
        "_records",
        "_row_state",
        "_dirty",
        "_ctx",
        "_addr",
    )

    def __init__(self, arrays: tuple, max_num_reqs: int, vocab_size: int):
        # arrays: the per-row arrays, in _K.SP_ARRAYS order (see _arrays)
        R = max_num_reqs
        # held: their addresses are read by the kernels every step
        self._arrays = tuple(arrays)
        self._records = np.zeros((R, _K.REC_COLS), np.int32)  # [R, REC_COLS]: each counted row's part
        self._row_state = np.zeros(R, np.uint8)  # [R]: ROW_*
        self._dirty = np.zeros(R, np.int32)  # [R]: rows to count before the next answers
        ctx = np.zeros(_K.A_SIZE, np.int64)
        ctx[_K.A_R], ctx[_K.A_VOCAB] = R, vocab_size
        ctx[_K.A_ARRAYS : _K.A_ARRAYS + len(_K.SP_ARRAYS)] = [a.ctypes.data for a in self._arrays]
        ctx[_K.A_REC], ctx[_K.A_ROW] = self._records.ctypes.data, self._row_state.ctypes.data
        ctx[_K.A_DIRTY], ctx[_K.A_VALID] = self._dirty.ctypes.data, 1
        ctx[_K.A_MAXV : _K.A_MAXV + _K.N_MAX] = _K.MAX_EMPTY
        self._ctx = ctx
        self._addr = ctx.ctypes.data
        self.idx = None
        self.writer = None  # the SamplingParamsWriter, if new requests' params are written here
        self.computed = 0  # steps answered (tests, stats)

    @property
    def from_counts(self) -> int:
        """Batches answered from the counts (the rest by a pass)."""
        return int(self._ctx[_K.A_FAST])

    def rows_changed(self, table_ctx_addr: int) -> None:
        """A table step was applied (its context's address): its freed rows
        leave the counts, its new rows are counted with the next answers."""
        _K.sp_rows_changed(self._addr, table_ctx_addr)

    def row_written(self, req_idx) -> None:
        """The sampler's ``add_request`` wrote row ``req_idx`` outside a
        table step (a row that is not an int: every batch by a pass)."""
        self.idx = None
        r = req_idx if type(req_idx) is int else -1
        _K.sp_row_written(self._addr, r)

    def compute(self, idx_addr: int, n: int, idx: np.ndarray) -> None:
        """Answer for the ``n`` rows at ``idx_addr`` (intp; the step's batch:
        distinct live rows), whose copy ``idx`` is the ``idx_mapping_np``
        vLLM's sampler will be asked with."""
        if self.writer is not None:
            self.writer.flush()  # (add_request calls not yet written)
        if n == 0:  # (vLLM's reductions over an empty batch raise: its own code answers)
            self.idx = None
            return
        (
            self.flags,
            self.max_num_logprobs,
            self.max_num_token_ids,
            self.max_top_k,
            self.max_top_k_top_p,
            self.max_num_bad_words,
        ) = _K.sp_answers(self._addr, idx_addr, n)
        self.idx = idx
        self.computed += 1


def _writer_reason(sampler) -> str | None:
    # what keeps every request on vLLM's own add_request
    if sampler.thinking_budget_state.enabled:
        return "a thinking budget is configured"
    if getattr(sampler, "trace_replay_state", None) is not None:
        return "trace replay is enabled"
    if len(sampler.logits_processors) != 3:
        return "custom logits processors are configured"
    return None


def _targets(sampler):
    # sp_write's targets, in _P.SP_TARGETS order, with their dtypes: vLLM's
    # UvaBackedTensors (host side .np) and its host-only arrays
    ss, pen, lpt = sampler.sampling_states, sampler.penalties_state, sampler.logprob_token_ids_state
    lb, bw = _builtin_processors(sampler)
    i32, f32, b = np.int32, np.float32, np.bool_
    return (
        (ss.temperature, f32),
        (ss.top_k, i32),
        (ss.top_p, f32),
        (ss.min_p, f32),
        (ss.seeds_set, b),
        (ss.seeds, np.int64),
        (ss.num_logprobs, i32),
        (sampler.needs_logits_processing, b),
        (sampler.may_mask_logits, b),
        (pen.repetition_penalty, f32),
        (pen.frequency_penalty, f32),
        (pen.presence_penalty, f32),
        (pen.use_penalty, b),
        (lb.num_allowed_token_ids, i32),
        (lb.num_logit_bias, i32),
        (lb.min_lens, i32),
        (lb.num_stop_token_ids, i32),
        (lb.restore_when_all_masked, i32),
        (lb.use_logit_bias, b),
        (bw.num_bad_words, i32),
        (lpt.num_token_ids, i32),
        (lb.prompt_len_np, i32),  # (read: min_lens = prompt_len + min_tokens)
    )


def _host(target) -> np.ndarray:
    # a target's host array: a UvaBackedTensor's .np, or the array itself
    return target if isinstance(target, np.ndarray) else target.np


def _uva_tensors(sampler):
    # the UvaBackedTensors among the writer's targets: the ones with a device side
    return tuple(t for t, _ in _targets(sampler) if not isinstance(t, np.ndarray))


_UVA_BUFFERS = {("vllm.v1.worker.gpu.buffer_utils", "UvaBuffer"), ("vllm.v1.worker.cpu.buffer_utils", "UvaBuffer")}


def _uploads_reason(uvas, R: int) -> str | None:
    depths = set()
    for u in uvas:
        pool = getattr(u, "pool", None)
        bufs = getattr(pool, "_uva_bufs", None)
        if not isinstance(bufs, list) or not bufs or not isinstance(getattr(u, "np", None), np.ndarray):
            return "a sampler array without vLLM's UvaBufferPool"
        depths.add(len(bufs))
        for b in bufs:
            if (type(b).__module__, type(b).__qualname__) not in _UVA_BUFFERS:
                return f"the sampler's buffers are {type(b).__qualname__}s (explicit copies), not UVA buffers"
            if b.np.shape != (R,) or b.np.dtype != u.np.dtype or u.np.shape != (R,) or not u.np.flags.c_contiguous:
                return "a sampler array's buffers are not of its size"
    if len(depths) != 1:
        return "the sampler's arrays have pools of different depths"
    return None


class SamplerUploads:
    """The written sampler arrays' device side (vLLM's UVA buffers, read in
    place by its kernels) kept current by rows: ``copy_to_uva`` of each (one
    whole-array copy per array in vLLM's ``apply_staged_writes``) becomes one
    kernel call for all of them that copies, into each array's next pool
    slot, only the rows written since that slot was last filled (and
    nothing when no row was written). The slots rotate as vLLM's pool
    rotates them, so a step in flight keeps reading its own."""

    def __init__(self, uvas, R: int):
        D = len(uvas[0].pool._uva_bufs)
        T = len(uvas)
        self._uvas = uvas
        self._pools = [u.pool for u in uvas]
        self._views = [[b.uva() for b in u.pool._uva_bufs] for u in uvas]  # [T][D]: each slot's device view
        o_src, o_size, o_slots, o_count, o_full, o_rows, total = _P._layout(T, D)
        self._rows = np.zeros((D, R), np.int64)  # per slot: the rows written since it was filled
        ctx = np.zeros(total, np.int64)
        ctx[_P.U_T], ctx[_P.U_D], ctx[_P.U_R], ctx[_P.U_INT] = T, D, R, id(int)
        ctx[o_src : o_src + T] = [u.np.ctypes.data for u in uvas]
        ctx[o_size : o_size + T] = [u.np.itemsize for u in uvas]
        ctx[o_slots : o_slots + T * D] = [b.np.ctypes.data for u in uvas for b in u.pool._uva_bufs]
        ctx[o_rows : o_rows + D] = [self._rows[b].ctypes.data for b in range(D)]
        self._ctx = ctx
        self._addr = ctx.ctypes.data
        # every slot holds the arrays now (nothing is in flight yet); slot 0 is current
        for t, u in enumerate(uvas):
            for b in u.pool._uva_bufs:
                b.np[:] = u.np
            u.pool._curr = 0
            u.gpu = self._views[t][0]
            u.copy_to_uva = _Uploaded(self, u)
        self.uploads = 0  # slots filled (stats, tests)

    def mark(self, rows: list) -> None:
        """These rows (a list of ints) were written."""
        _P.sp_mark(self._addr, id(rows), len(rows))

    def upload(self) -> None:
        """Every array's device side current (nothing to do where no row was
        written since the last upload)."""
        if not self._ctx[_P.U_PENDING]:
            return
        b = _P.sp_upload(self._addr)
        for t, u in enumerate(self._uvas):
            self._pools[t]._curr = b  # (as vLLM's pool rotates)
            u.gpu = self._views[t][b]
        self.uploads += 1


class _Uploaded:
    """``UvaBackedTensor.copy_to_uva`` of an array :class:`SamplerUploads`
    keeps current: the upload (if any row was written), then its device
    side."""

    __slots__ = ("_uploads", "_uva")

    def __init__(self, uploads, uva):
        self._uploads = uploads
        self._uva = uva

    def __call__(self, n=None):
        self._uploads.upload()
        gpu = self._uva.gpu
        return gpu if n is None else gpu[:n]


# the attribute names sp_read reads (interned: the kernel has their addresses)
_NAMES = tuple(sys.intern(n) for n in _P.SP_NAMES)


class SamplingParamsWriter:
    """New requests' sampling params into vLLM's sampler arrays, without
    ``Sampler.add_request``'s Python per request (``_kernels.sampling_params``).

    :meth:`read` (before the table's step changes anything) reads and checks
    every new request's params: a bad one raises ``InvalidStepError`` naming
    the request and the field, and nothing has changed. :meth:`arm` (after
    the step) lets the sampler's ``add_request`` calls of the runner's add
    loop only note (row, params); :meth:`flush` (the sampler's
    ``apply_staged_writes``, or anything that reads the arrays) writes them
    in one kernel call, seeds drawn from numpy's global generator in
    request order as vLLM draws them, and calls vLLM's own ``add_request``
    for the requests it does not write (a logit bias, allowed token ids,
    min_tokens, bad words, logprob token ids; or params other than the ones
    read), in their place in the order."""

    def __init__(self, sampler, max_num_reqs: int, orig_add_request, guard=None):
        R = max_num_reqs
        self._R = R
        # the table's call guard: another thread waits, and a read re-entered
        # from a params object's property raises instead of overwriting the
        # stash of the read it interrupted
        self._guard = guard
        self._orig_add_request = orig_add_request
        self._pen_rows = sampler.penalties_state._new_penalties_reqs  # vLLM's bincount list
        self._targets = tuple(_host(t) for t, _ in _targets(sampler))  # held: written by address
        self._f = np.zeros((R, _P.F_COLS), np.float64)  # the stash, by new request
        self._i = np.zeros((R, _P.I_COLS), np.int64)
        self._sp_addr = np.zeros(R, np.int64)  # each new request's params object (identity only)
        self._pen = np.zeros(R, np.int64)
        ctx = np.zeros(_P.C_SIZE, np.int64)
        ctx[: _P.N_NAMES] = [id(n) for n in _NAMES]
        ctx[_P.C_FLOAT : _P.C_DICT + 1] = [id(float), id(int), id(None), id(bool), id(list), id(dict)]
        ctx[_P.C_F], ctx[_P.C_I], ctx[_P.C_SP] = self._f.ctypes.data, self._i.ctypes.data, self._sp_addr.ctypes.data
        ctx[_P.C_TARGETS : _P.C_TARGETS + _P.N_TARGETS] = [a.ctypes.data for a in self._targets]
        ctx[_P.C_PEN], ctx[_P.C_R], ctx[_P.C_VOCAB] = self._pen.ctypes.data, R, int(sampler.sampling_states.vocab_size)
        self._ctx = ctx
        self._ctx_addr = ctx.ctypes.data
        self._rows: list[int] = []
        self._sps: list = []
        self._armed = False
        self._reqs = None  # the step's new requests (held: the stash has their params' addresses)
        self._n_read = 0
        self._fast_type = None
        self._bitgen = None
        self.written = 0  # requests written here (stats, tests)
        self.by_vllm = 0  # requests handed to vLLM's add_request
        self.uploads = None  # SamplerUploads: the written rows to the device side

    def read(self, new_reqs) -> None:
        """Read and check the step's new requests' sampling params."""
        self._armed = False
        reqs = new_reqs if type(new_reqs) is list else list(new_reqs)
        n = len(reqs)
        if n > self._R:
            self._reqs = None
            return  # (the table refuses the step)
        g = self._guard
        if g is not None:
            g.enter()
        try:
            sp = getattr(reqs[0], "sampling_params", None) if n else None
            if sp is not None and type(sp) is not self._fast_type:
                self._set_fast_type(sp)
            st, i, field = _P.sp_read(id(reqs), n, self._ctx_addr)
            # (the message reads the value again: still under the guard)
            err = None if st == _P.SPR_OK else _bad_params(reqs[i], st, field)
        finally:
            if g is not None:
                g.exit()
        if err is not None:
            self._reqs = None
            raise err
        self._reqs, self._n_read = reqs, n

    def _set_fast_type(self, sp) -> None:
        # the slot offsets of the params type's fields (a msgspec Struct's
        # members), each checked on this object: a field that is not a plain
        # slot, or that does not read back as getattr does, is read by getattr
        t = type(sp)
        # vLLM's bad_words_token_ids is a property that returns the field
        # _bad_words_token_ids (the guard checks that property's source)
        prop = getattr(t, "bad_words_token_ids", None)
        fget = getattr(prop, "fget", None)
        vllms = (getattr(fget, "__module__", None), getattr(fget, "__qualname__", None)) == (
            "vllm.sampling_params",
            "SamplingParams.bad_words_token_ids",
        )
        alias = {"bad_words_token_ids": "_bad_words_token_ids"} if isinstance(prop, property) and vllms else {}
        offs = [_slot_offset(t, sp, alias.get(name, name)) for name in _NAMES]
        offs[0] = -1  # (sampling_params is the request's attribute)
        self._ctx[_P.C_FAST] = id(t)
        self._ctx[_P.C_OFFS : _P.C_OFFS + _P.N_NAMES] = offs
        self._fast_type = t

    def arm(self) -> None:
        """The step was applied: the add loop's add_request calls are noted
        until :meth:`flush`."""
        self._armed = self._reqs is not None

    def note(self, req_idx, sampling_params) -> bool:
        """An add_request call: noted (True) while armed."""
        if not self._armed:
            return False
        self._rows.append(req_idx)
        self._sps.append(sampling_params)
        return True

    def _write(self, rows, sps, k, i, cursor, next_u64, state):
        g = self._guard
        if g is not None:
            g.enter()
        try:
            return _P.sp_write(id(rows), id(sps), k, i, cursor, self._n_read, self._ctx_addr, next_u64, state)
        finally:
            if g is not None:
                g.exit()

    def flush(self) -> None:
        """Write the noted requests (see the class)."""
        self._armed = False
        rows, sps = self._rows, self._sps
        if not rows:
            self._reqs = None
            return
        try:
            bg = np.random.mtrand._rand._bit_generator  # what np.random.randint draws from
            if self._bitgen is None or self._bitgen[0] is not bg:
                import ctypes

                c = bg.ctypes
                self._bitgen = (bg, ctypes.cast(c.next_uint64, ctypes.c_void_p).value, c.state_address)
            _, next_u64, state = self._bitgen
            k, i, cursor = len(rows), 0, 0
            with bg.lock:
                while i < k:
                    start = i
                    i, n_pen, cursor = self._write(rows, sps, k, i, cursor, next_u64, state)
                    self.written += i - start
                    if n_pen:
                        self._pen_rows.extend(self._pen[:n_pen].tolist())
                    if i < k:
                        self._orig_add_request(rows[i], sps[i])
                        self.by_vllm += 1
                        i += 1
        finally:
            if self.uploads is not None:
                self.uploads.mark(rows)  # (written here or by vLLM's add_request)
            rows.clear()
            sps.clear()
            self._reqs = None


# CPython's member descriptor (Objects/descrobject.c): PyDescr_COMMON
# (header 16, d_type, d_name, d_qualname), then ``PyMemberDef *d_member``;
# PyMemberDef: name, type (int), offset (Py_ssize_t), ...
_D_MEMBER = 40
_M_TYPE, _M_OFFSET = 8, 16
_T_OBJECT_EX = 16  # a slot whose NULL is an unset attribute


def _slot_offset(t, obj, name: str) -> int:
    import ctypes

    for klass in t.__mro__:
        desc = klass.__dict__.get(name)
        if desc is not None:
            break
    else:
        return -1
    if type(desc).__name__ != "member_descriptor" or type(desc) is not type(type.__dict__["__dictoffset__"]):
        return -1
    try:
        member = ctypes.c_void_p.from_address(id(desc) + _D_MEMBER).value
        if not member or ctypes.string_at(ctypes.c_void_p.from_address(member).value) != name.encode():
            return -1
        if ctypes.c_int.from_address(member + _M_TYPE).value != _T_OBJECT_EX:
            return -1
        off = ctypes.c_ssize_t.from_address(member + _M_OFFSET).value
        if not 16 <= off < t.__basicsize__:
            return -1
        slot = ctypes.c_void_p.from_address(id(obj) + off).value
        if slot != id(getattr(obj, name)):  # (it reads back as getattr does)
            return -1
    except Exception:  # noqa: BLE001  (any doubt: getattr)
        return -1
    return off


_WHAT = {
    _P.SPR_MISSING: "cannot be read",
    _P.SPR_TYPE: "is of a type it does not take",
    _P.SPR_NOT_FINITE: "is not finite",
    _P.SPR_RANGE: "is out of range",
}


def _bad_params(req, status: int, field: int) -> InvalidStepError:
    rid = getattr(req, "req_id", "?")
    name = "sampling_params" if field == 0 else f"sampling_params.{_P.SP_NAMES[field]}"
    try:
        value = repr(getattr(req.sampling_params, _P.SP_NAMES[field])) if field else ""
    except Exception as e:  # noqa: BLE001  (the message names what failed)
        value = f"({type(e).__name__}: {e})"
    return InvalidStepError(f"new request {rid!r}: {name} {_WHAT[status]}" + (f": {value[:80]}" if value else ""))


def attach(state, sampler) -> SamplerAnswers | None:
    """Bind the answering wrappers on ``sampler`` (vLLM's ``Sampler``) for
    mtpstate's ``state`` (a ``ModelRunnerV2State``), or leave it alone and
    return None (:func:`unsupported_reason`, or a sampler method that is not
    the one this was written against)."""
    R = state.table.max_num_reqs
    if unsupported_reason(sampler, R) is not None or not _methods_known():
        return None
    a = SamplerAnswers(tuple(x for x, _ in _arrays(sampler, R)), R, int(sampler.sampling_states.vocab_size))
    guard = getattr(state.table, "_guard", None)
    a.writer = (
        None if _writer_reason(sampler) is not None else SamplingParamsWriter(sampler, R, sampler.add_request, guard)
    )
    if a.writer is not None:
        uvas = _uva_tensors(sampler)
        if _uploads_reason(uvas, R) is None:
            a.writer.uploads = SamplerUploads(uvas, R)
    _bind(sampler, a)
    return a


def _methods_known() -> bool:
    # the methods _bind replaces (and the body apply_sampling_params keeps)
    # are vLLM's own, as the plugin's guard checks them
    from mtpstate.integrations.vllm import plugin

    return plugin.sampler_methods_ok()


def _bind(sampler, a: SamplerAnswers) -> None:
    import torch

    ss = sampler.sampling_states
    pen = sampler.penalties_state
    lpt = sampler.logprob_token_ids_state
    tb = sampler.thinking_budget_state
    lb, bw = _builtin_processors(sampler)
    states_mod = sys.modules[type(ss).__module__]  # its launchers, looked up per call as vLLM's methods do
    logits_context = sys.modules[type(sampler).__module__].LogitsContext

    orig_add_request = sampler.add_request

    w = a.writer

    def add_request(req_idx, sampling_params):
        a.idx = None  # the rows' values change: the answers are recomputed with the next batch
        if w is not None:
            # (noted: a row of the step's add loop, one of its new rows)
            if w.note(req_idx, sampling_params):
                return None
            w.flush()  # (in order with any noted before)
        try:
            return orig_add_request(req_idx, sampling_params)
        finally:
            a.row_written(req_idx)  # (a new row of the step is counted already)
            if w is not None and w.uploads is not None:
                w.uploads.mark([req_idx])  # (a row it cannot read marks every row)

    orig_apply_staged_writes = sampler.apply_staged_writes

    def apply_staged_writes():
        if w is not None:
            w.flush()
        return orig_apply_staged_writes()

    orig_get_logprobs_dims = sampler.get_logprobs_dims

    def get_logprobs_dims(idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_get_logprobs_dims(idx_mapping_np)
        lp, tok = a.max_num_logprobs, a.max_num_token_ids
        if lp == _K_NO_LOGPROBS and tok == 0:
            return None
        return (lp if lp != _K_NO_LOGPROBS else 0), tok

    orig_apply_sampling_params = sampler.apply_sampling_params

    def apply_sampling_params(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, *args, **kwargs):
        if idx_mapping_np is not a.idx:
            return orig_apply_sampling_params(
                logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, *args, **kwargs
            )
        if not a.flags & _K.SP_NEEDS_PROCESSING:
            return logits
        return processed(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, *args, **kwargs)

    def processed(
        logits,
        expanded_idx_mapping,
        idx_mapping,
        idx_mapping_np,
        pos,
        input_ids,
        expanded_local_pos,
        seq_lens_upper_bound_np,
        skip_top_k_top_p=False,
    ):
        # vLLM's body after its check (the processors' own checks answered below)
        logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        ctx = logits_context(
            expanded_idx_mapping=expanded_idx_mapping,
            idx_mapping=idx_mapping,
            idx_mapping_np=idx_mapping_np,
            expanded_local_pos=expanded_local_pos,
            input_ids=input_ids,
            pos=pos,
            seq_lens_upper_bound_np=seq_lens_upper_bound_np,
        )
        for processor in sampler.logits_processors:
            logits = processor.apply(logits, ctx)
        sampler.thinking_budget_state.apply(logits, ctx)
        sampler.sampling_states.apply_temperature(logits, expanded_idx_mapping, idx_mapping_np)
        sampler.sampling_states.apply_min_p(logits, expanded_idx_mapping, idx_mapping_np)
        if skip_top_k_top_p:
            return logits
        return sampler.sampling_states.apply_top_k_top_p(logits, expanded_idx_mapping, idx_mapping_np)

    def flag_of(obj, name, flag):
        # a yes/no question over the batch: the answer's flag
        orig = getattr(obj, name)

        def answer(idx_mapping_np):
            if idx_mapping_np is not a.idx:
                return orig(idx_mapping_np)
            return (a.flags & flag) != 0

        return answer

    orig_max_num_logprobs = ss.max_num_logprobs

    def max_num_logprobs(idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_max_num_logprobs(idx_mapping_np)
        return a.max_num_logprobs

    orig_get_top_k_top_p = ss.get_top_k_top_p

    def get_top_k_top_p(expanded_idx_mapping, idx_mapping_np, vocab_size):
        if idx_mapping_np is not a.idx:
            return orig_get_top_k_top_p(expanded_idx_mapping, idx_mapping_np, vocab_size)
        flags = a.flags
        do_top_p = (flags & _K.SP_DO_TOP_P) != 0
        # vLLM's device gathers, for the rows that need them
        top_k = ss.top_k.gpu[expanded_idx_mapping] if flags & _K.SP_DO_TOP_K else None
        top_p = ss.top_p.gpu[expanded_idx_mapping] if do_top_p else None
        return top_k, top_p, do_top_p and a.max_top_k_top_p >= vocab_size

    def launch_if(name, flag, values):
        # apply_temperature / apply_min_p: vLLM's launcher, when a row of the batch needs it
        orig = getattr(ss, name)

        def apply(logits, expanded_idx_mapping, idx_mapping_np):
            if idx_mapping_np is not a.idx:
                return orig(logits, expanded_idx_mapping, idx_mapping_np)
            if a.flags & flag:
                getattr(states_mod, name)(logits, expanded_idx_mapping, getattr(ss, values).gpu)
            return None

        return apply

    orig_pen_apply = pen.apply

    def penalties_apply(logits, ctx):
        if ctx.idx_mapping_np is a.idx and not a.flags & _K.SP_USE_PENALTY:
            return logits
        return orig_pen_apply(logits, ctx)

    orig_lb_apply = lb.apply
    lb_mod = sys.modules[type(lb).__module__]  # its launcher, looked up per call as vLLM's method does

    def logit_bias_apply(logits, ctx):
        if ctx.idx_mapping_np is not a.idx:
            return orig_lb_apply(logits, ctx)
        flags = a.flags
        if not flags & _K.SP_USE_LOGIT_BIAS:
            return logits
        # vLLM's body after its checks (both answered)
        lb_mod.apply_logit_bias(
            logits,
            ctx.expanded_idx_mapping,
            ctx.pos,
            lb.num_allowed_token_ids.gpu,
            lb.allowed_token_ids.gpu,
            lb.num_logit_bias.gpu,
            lb.logit_bias_token_ids.gpu,
            lb.logit_bias.gpu,
            lb.min_lens.gpu,
            lb.num_stop_token_ids.gpu,
            lb.restore_when_all_masked.gpu,
            lb.stop_token_ids.gpu,
            (flags & _K.SP_RESTORE_WHEN_MASKED) != 0,
        )
        return logits

    orig_bw_apply = bw.apply

    def bad_words_apply(logits, ctx):
        if ctx.idx_mapping_np is a.idx and a.max_num_bad_words == 0:
            return logits
        return orig_bw_apply(logits, ctx)

    orig_tb_apply = tb.apply

    def thinking_budget_apply(logits, ctx):
        if ctx.idx_mapping_np is a.idx and not a.flags & _K.SP_USE_THINKING_BUDGET:
            return None
        return orig_tb_apply(logits, ctx)

    orig_max_num_token_ids = lpt.max_num_token_ids

    def max_num_token_ids(idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_max_num_token_ids(idx_mapping_np)
        return a.max_num_token_ids

    sampler.add_request = add_request
    sampler.apply_staged_writes = apply_staged_writes
    sampler.get_logprobs_dims = get_logprobs_dims
    sampler.apply_sampling_params = apply_sampling_params
    ss.any_greedy = flag_of(ss, "any_greedy", _K.SP_ANY_GREEDY)
    ss.any_explicit_seed = flag_of(ss, "any_explicit_seed", _K.SP_ANY_SEED)
    ss.max_num_logprobs = max_num_logprobs
    ss.get_top_k_top_p = get_top_k_top_p
    ss.apply_temperature = launch_if("apply_temperature", _K.SP_TEMPERATURE, "temperature")
    ss.apply_min_p = launch_if("apply_min_p", _K.SP_MIN_P, "min_p")
    pen.apply = penalties_apply
    lb.apply = logit_bias_apply
    bw.apply = bad_words_apply
    tb.apply = thinking_budget_apply
    lpt.max_num_token_ids = max_num_token_ids


_K_NO_LOGPROBS = -1  # vLLM's NO_LOGPROBS (sample/states.py)
