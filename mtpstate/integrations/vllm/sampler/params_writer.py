"""New requests' sampling params read in place and written into vLLM's
sampler arrays by one kernel call per step (``_kernels.sampling_params``)."""

from __future__ import annotations

import sys

import numpy as np

from mtpstate._kernels import sampling_params as _P
from mtpstate.errors import InvalidStepError
from mtpstate.integrations.vllm.sampler.objects import _host, _targets

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
        self._flushed = 0  # noted calls written so far by the flush in progress
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

    def hand_over(self) -> None:
        """The noted add_request calls not yet written, by vLLM's
        ``add_request`` (in order); nothing is noted after this."""
        self._armed = False
        rows, sps = self._rows[self._flushed :], self._sps[self._flushed :]
        self._rows, self._sps, self._flushed, self._reqs = [], [], 0, None
        for row, sp in zip(rows, sps):
            self._orig_add_request(row, sp)
            self.by_vllm += 1

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
            while i < k:
                start = i
                with bg.lock:  # (the kernel draws seeds from numpy's generator, as randint does)
                    i, n_pen, cursor = self._write(rows, sps, k, i, cursor, next_u64, state)
                self._flushed = i
                self.written += i - start
                if n_pen:
                    self._pen_rows.extend(self._pen[:n_pen].tolist())
                if i < k:
                    # outside the lock: vLLM's add_request draws an unseeded
                    # request's seed with np.random.randint, which takes it
                    self._orig_add_request(rows[i], sps[i])
                    self.by_vllm += 1
                    i += 1
                    self._flushed = i
        except Exception:
            # (rows from _flushed on are still noted: hand_over writes them)
            if self.uploads is not None:
                self.uploads.mark(rows[: self._flushed])
            raise
        if self.uploads is not None:
            self.uploads.mark(rows)  # (written here or by vLLM's add_request)
        rows.clear()
        sps.clear()
        self._flushed = 0
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
