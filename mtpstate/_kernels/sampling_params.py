"""New requests' sampling params, read in place and written into an engine's
per-row sampler arrays by address (vLLM 0.34's ``Sampler.add_request``:
``SamplingStates``, ``PenaltiesState``, and the logit-bias, bad-words and
logprob-token-ids processors' per-row values), instead of a Python call
per request.

Two passes. ``sp_read`` (before the step changes anything) reads each new
request's ``sampling_params`` once, checks it and stashes its values by
request: a bad value is reported (status, request, field) and nothing is
written. ``sp_write`` (after the engine's add hooks, once the rows are
known) writes the stashed values into the rows, normalized as vLLM does,
and draws the seeds of unseeded requests from numpy's global generator in
request order, exactly as ``np.random.randint(INT64_MIN, INT64_MAX)``
would (MT19937's ``next_uint64``, masked rejection of 2**64 - 1). A request
that uses anything else (allowed token ids, logit bias, min_tokens, bad
words, logprob token ids) is a ``SP_SPECIAL`` one: ``sp_write`` stops
there, and the engine's own ``add_request`` runs for it, in order.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.cpython import OFF_SIZE, OFF_TYPE, decref, err_clear, getattr_held, int_value
from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import call_u64, load_i64, view_f32, view_f64, view_i32, view_i64, view_u8
from mtpstate._kernels.pyobjects import INT_NONE, INT_OK, INT_RANGE, read_int

# the attribute names sp_read reads, in this order (their str objects' addresses)
SP_NAMES = (
    "sampling_params",  # of the new request
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "logprobs",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "allowed_token_ids",
    "logit_bias",
    "min_tokens",
    "bad_words_token_ids",
    "logprob_token_ids",
)
N_NAMES = len(SP_NAMES)
# float fields (stash columns of the f64 block), by name index
F_FIELDS = (1, 3, 4, 7, 8, 9)  # temperature, top_p, min_p, and the three penalties
# the i64 block's columns
I_KIND, I_TOP_K, I_SEED_SET, I_SEED, I_LOGPROBS = 0, 1, 2, 3, 4
I_COLS = 5
F_COLS = len(F_FIELDS)

# a request's kind
SP_NONE = 0  # no sampling params (pooling): nothing to write
SP_PLAIN = 1  # written by sp_write
SP_SPECIAL = 2  # the engine's own add_request

# sp_read's statuses (with the request index and the field's name index)
SPR_OK = 0
SPR_MISSING = 1  # reading the attribute raised
SPR_TYPE = 2  # not a type the field takes
SPR_NOT_FINITE = 3  # NaN or inf
SPR_RANGE = 4  # outside the field's range

# sp_write's array addresses, in this order (each [max_num_reqs])
SP_TARGETS = (
    "temperature",  # float32
    "top_k",  # int32
    "top_p",  # float32
    "min_p",  # float32
    "seeds_set",  # bool
    "seeds",  # int64
    "num_logprobs",  # int32
    "needs_logits_processing",  # bool
    "may_mask_logits",  # bool
    "repetition_penalty",  # float32
    "frequency_penalty",  # float32
    "presence_penalty",  # float32
    "use_penalty",  # bool
    "num_allowed_token_ids",  # int32
    "num_logit_bias",  # int32
    "min_lens",  # int32
    "num_stop_token_ids",  # int32
    "restore_when_all_masked",  # int32
    "use_logit_bias",  # bool
    "num_bad_words",  # int32
    "num_token_ids",  # int32
    "prompt_len",  # int32 (read: min_lens = prompt_len + min_tokens)
)
N_TARGETS = len(SP_TARGETS)

_INT32_MAX = 2**31 - 1
_INT64_MIN = -(2**63)


@jit(signature="Tuple((float64, int64))(int64, UniTuple(int64, 4))")
def _number(obj, tp):
    """(value, status) of an exact float or int (tp: float, int, None, bool)."""
    t = load_i64(obj + OFF_TYPE)
    if t == tp[0]:
        v = view_f64(obj + OFF_SIZE, 1)[0]  # PyFloatObject.ob_fval
        if not np.isfinite(v):
            return v, SPR_NOT_FINITE
        return v, SPR_OK
    if t == tp[1]:
        i, ok = int_value(obj)
        if not ok or abs(i) > 2**53:  # (exact as a double)
            return 0.0, SPR_RANGE
        return float(i), SPR_OK
    return 0.0, SPR_TYPE


@jit(signature="Tuple((int64, int64))(int64, UniTuple(int64, 4), int64)")
def _integer(obj, tp, none_value):
    """(value, status) of an exact int, ``none_value`` for None (status
    SPR_TYPE where None is not allowed: ``none_value`` < -2**62)."""
    v, kind = read_int(obj, tp[1], tp[2])
    if kind == INT_OK:
        return v, SPR_OK
    if kind == INT_NONE and none_value >= -(2**62):
        return none_value, SPR_OK
    return 0, (SPR_RANGE if kind == INT_RANGE else SPR_TYPE)


@jit(signature="boolean(int64, UniTuple(int64, 4), int64, int64)")
def _empty(obj, tp, list_type, dict_type):
    """Whether a collection field is unset: None, or an exact list or dict
    with no items (anything else: the engine's own code reads it)."""
    if obj == tp[2]:
        return True
    t = load_i64(obj + OFF_TYPE)
    if t == list_type:
        return load_i64(obj + OFF_SIZE) == 0
    if t == dict_type:
        return load_i64(obj + OFF_SIZE) == 0  # ma_used
    return False


# sp_read's context (int64): the attribute names' addresses, then these
C_FLOAT, C_INT, C_NONE, C_BOOL, C_LIST, C_DICT = range(N_NAMES, N_NAMES + 6)
C_F, C_I, C_SP = range(N_NAMES + 6, N_NAMES + 9)  # the stash's blocks
# then sp_write's: its targets' addresses (SP_TARGETS order), the penalty rows' buffer, R, vocab
C_TARGETS = N_NAMES + 9
C_PEN = C_TARGETS + N_TARGETS
C_R = C_PEN + 1
C_VOCAB = C_R + 1
# a params type whose fields are slots (a msgspec Struct's, vLLM's
# SamplingParams): its address, then each name's slot offset (-1: getattr)
C_FAST = C_VOCAB + 1
C_OFFS = C_FAST + 1
C_SIZE = C_OFFS + N_NAMES


@jit
def sp_read(reqs, n, ctx_addr):
    """Read and check the sampling params of the ``n`` new requests of the
    list ``reqs`` into the stash (``C_F``: float64 [n, F_COLS], ``C_I``:
    int64 [n, I_COLS]; ``C_SP``: int64 [n], each params object's address,
    for identity checks only). Returns ``(status, request, field)``; on a
    failure nothing after it is read."""
    ctx = view_i64(ctx_addr, C_SIZE)
    names = ctx[:N_NAMES]
    tp = (ctx[C_FLOAT], ctx[C_INT], ctx[C_NONE], ctx[C_BOOL])
    list_type, dict_type = ctx[C_LIST], ctx[C_DICT]
    fs = view_f64(ctx[C_F], n * F_COLS)
    ints = view_i64(ctx[C_I], n * I_COLS)
    sps = view_i64(ctx[C_SP], n)
    items = load_i64(reqs + 24)  # the list's item pointer array
    for i in range(n):
        r = load_i64(items + 8 * i)
        sp, exc = getattr_held(r, names[0])
        if sp == 0:
            _drop(exc)
            return SPR_MISSING, i, 0
        sps[i] = sp
        offs = ctx[C_OFFS : C_OFFS + N_NAMES]
        fast = sp != tp[2] and load_i64(sp + OFF_TYPE) == ctx[C_FAST]
        st, field = _read_one(sp, names, offs, fast, tp, list_type, dict_type, fs, ints, i)
        decref(sp)  # (the request holds it)
        if st != SPR_OK:
            return st, i, field
    return SPR_OK, 0, 0


@jit(signature="void(int64)")
def _drop(exc):
    if exc != 0:
        decref(exc)
    else:  # pragma: no cover - CPython sets one
        err_clear()


@jit
def _read_one(sp, names, offs, fast, tp, list_type, dict_type, fs, ints, i):
    """One request's values into row ``i`` of the stash: (status, field).
    ``fast``: its type's fields are slots at ``offs`` (read in place, a
    borrowed reference; an empty slot is an unset attribute); other fields
    and types through getattr."""
    if sp == tp[2]:
        ints[i * I_COLS + I_KIND] = SP_NONE
        return SPR_OK, 0
    kind = SP_PLAIN
    for h in range(1, N_NAMES):
        off = offs[h] if fast else -1
        if off >= 0:
            v = load_i64(sp + off)
            if v == 0:
                return SPR_MISSING, h
            st = _read_field(h, v, tp, list_type, dict_type, fs, ints, i)
        else:
            v, exc = getattr_held(sp, names[h])
            if v == 0:
                _drop(exc)
                return SPR_MISSING, h
            st = _read_field(h, v, tp, list_type, dict_type, fs, ints, i)
            decref(v)  # (read: the params object holds it, or it was computed for us)
        if st == -1:
            kind = SP_SPECIAL
        elif st != SPR_OK:
            return st, h
    ints[i * I_COLS + I_KIND] = kind
    return SPR_OK, 0


@jit
def _read_field(h, v, tp, list_type, dict_type, fs, ints, i):
    """Field ``h``'s value into the stash: a status, or -1 where the request
    needs the engine's own add_request."""
    base = i * I_COLS
    for c in range(F_COLS):
        if F_FIELDS[c] == h:
            x, st = _number(v, tp)
            if st == SPR_OK or (st == SPR_NOT_FINITE and h != 1):  # (only temperature must be finite)
                fs[i * F_COLS + c] = x
                return SPR_OK
            return st
    if h == 2:  # top_k
        k, st = _integer(v, tp, -(2**63))
        ints[base + I_TOP_K] = k
        return st
    if h == 5:  # seed: None, or an int64
        s, st = _integer(v, tp, 0)
        ints[base + I_SEED_SET] = 0 if v == tp[2] else 1
        ints[base + I_SEED] = s
        return st
    if h == 6:  # logprobs: None (-2 here), -1, or up to int32
        lp, st = _integer(v, tp, -2)
        if st == SPR_OK and v != tp[2] and (lp < -1 or lp > _INT32_MAX):
            return SPR_RANGE
        ints[base + I_LOGPROBS] = lp
        return st
    if h == 12:  # min_tokens: the engine's processor does anything but 0
        m, st = _integer(v, tp, -(2**63))
        if st != SPR_OK:
            return st
        return SPR_OK if m == 0 else -1
    # allowed_token_ids, logit_bias, bad_words_token_ids, logprob_token_ids
    return SPR_OK if _empty(v, tp, list_type, dict_type) else -1


@jit
def sp_write(rows, sps, k, start, cursor, n_read, ctx_addr, next_u64, bitgen):
    """Write the noted requests ``start..k`` (lists: ``rows`` of ints,
    ``sps`` of their params objects, in the order the engine's add loop
    called ``add_request``) from the stash into the targets. The stash is
    in ``sp_read``'s order, which is the add loop's less the requests
    without params: ``cursor`` walks it. Stops at a request it does not
    write: a ``SP_SPECIAL`` one, or params other than the ones read (the
    engine's own add_request then runs for it). Returns ``(next, penalty
    rows, cursor)``: ``next`` is k when all are written; the rows that use
    penalties, in order, at ``C_PEN``."""
    ctx = view_i64(ctx_addr, C_SIZE)
    a = ctx[C_TARGETS : C_TARGETS + N_TARGETS]
    R, vocab = ctx[C_R], ctx[C_VOCAB]
    kinds = view_i64(ctx[C_I], n_read * I_COLS)
    read_sps = view_i64(ctx[C_SP], n_read)
    pen = view_i64(ctx[C_PEN], R)
    row_items, sp_items = load_i64(rows + 24), load_i64(sps + 24)  # (exact lists)
    n_pen = 0
    for j in range(start, k):
        while cursor < n_read and kinds[cursor * I_COLS + I_KIND] == SP_NONE:
            cursor += 1
        sp = load_i64(sp_items + 8 * j)
        if cursor >= n_read or read_sps[cursor] != sp or kinds[cursor * I_COLS + I_KIND] != SP_PLAIN:
            if cursor < n_read and read_sps[cursor] == sp:
                cursor += 1  # (a special one: its place in the order is taken)
            return j, n_pen, cursor
        row_obj = load_i64(row_items + 8 * j)
        if load_i64(row_obj + OFF_TYPE) != ctx[C_INT]:
            return j, n_pen, cursor
        r, ok = int_value(row_obj)
        if not ok or r < 0 or r >= R:
            return j, n_pen, cursor  # (the engine's add_request says what is wrong)
        if _write_row(r, cursor, ctx[C_F], ctx[C_I], a, R, vocab, next_u64, bitgen):
            pen[n_pen] = r
            n_pen += 1
        cursor += 1
    return k, n_pen, cursor


@jit
def _write_row(r, s, f_addr, i_addr, a, R, vocab, next_u64, bitgen):
    """Stash row ``s`` into row ``r``, as vLLM's add_request writes it;
    True if the request uses penalties."""
    f = view_f64(f_addr + 8 * s * F_COLS, F_COLS)
    iv = view_i64(i_addr + 8 * s * I_COLS, I_COLS)
    temp, top_p, min_p, rep, freq, pres = f[0], f[1], f[2], f[3], f[4], f[5]
    k = iv[I_TOP_K]
    if k <= 0 or k > vocab:
        k = vocab
    seed = iv[I_SEED]
    if iv[I_SEED_SET] == 0:
        seed = _draw_seed(next_u64, bitgen)
    lp = iv[I_LOGPROBS]
    lp = -1 if lp == -2 else (vocab if lp == -1 else lp)
    # SamplingStates
    t32, p32, m32 = np.float32(temp), np.float32(top_p), np.float32(min_p)
    view_f32(a[0], R)[r] = t32
    view_i32(a[1], R)[r] = k
    view_f32(a[2], R)[r] = p32
    view_f32(a[3], R)[r] = m32
    view_u8(a[4], R)[r] = iv[I_SEED_SET]
    view_i64(a[5], R)[r] = seed
    view_i32(a[6], R)[r] = lp
    # Sampler: needs_processing from the params, may_mask from the stored values
    needs = temp != 0.0 and (temp != 1.0 or min_p != 0.0 or k != vocab or top_p != 1.0)
    may_mask = t32 != 0.0 and (m32 != 0.0 or k != vocab or p32 != 1.0)
    # PenaltiesState
    use_penalty = rep != 1.0 or freq != 0.0 or pres != 0.0
    view_f32(a[9], R)[r] = np.float32(rep)
    view_f32(a[10], R)[r] = np.float32(freq)
    view_f32(a[11], R)[r] = np.float32(pres)
    view_u8(a[12], R)[r] = 1 if use_penalty else 0
    may_mask = may_mask or use_penalty
    view_u8(a[7], R)[r] = 1 if (needs or may_mask) else 0
    view_u8(a[8], R)[r] = 1 if may_mask else 0
    # the logit-bias processor (none of its inputs set, min_tokens 0)
    view_i32(a[13], R)[r] = 0
    view_i32(a[14], R)[r] = 0
    view_i32(a[15], R)[r] = view_i32(a[21], R)[r]  # min_lens = prompt_len + 0
    view_i32(a[16], R)[r] = 0
    view_i32(a[17], R)[r] = 0
    view_u8(a[18], R)[r] = 0
    # bad words, logprob token ids: none
    view_i32(a[19], R)[r] = 0
    view_i32(a[20], R)[r] = 0
    return use_penalty


@jit(signature="int64(int64, int64)")
def _draw_seed(next_u64, bitgen):
    """``RandomState.randint(INT64_MIN, INT64_MAX)``: INT64_MIN + a 64-bit
    draw, rejecting 2**64 - 1 (the range holds 2**64 - 1 values)."""
    v = call_u64(next_u64, bitgen)
    while v == np.uint64(0xFFFFFFFFFFFFFFFF):
        v = call_u64(next_u64, bitgen)
    half = np.uint64(2**63)
    if v >= half:
        return np.int64(v - half)  # [0, 2**63 - 1)
    if v == np.uint64(0):
        return _INT64_MIN
    return -np.int64(half - v)  # [-2**63 + 1, 0)


# ----------------------------------------------------------------------------
# uploads: the written arrays' rows into the engine's round-robin pinned
# buffers (vLLM's UvaBufferPool, D slots that the device reads in place), only
# the rows written since a slot was last filled, all arrays in one call

# the upload context (int64): then, per array, its source, element size and
# its D slots' addresses; per slot, its dirty-row count, a "copy it all"
# flag and its dirty rows' buffer ([R] each)
U_T, U_D, U_R, U_CURR, U_PENDING, U_INT = range(6)  # (U_INT: the int type's address)
U_HEAD = 6


@jit
def sp_mark(u_addr, rows, k):
    """Rows ``rows`` (an exact list of ``k`` rows) were written: dirty in
    every slot. A row that is not an exact int in [0, R) makes every row
    dirty."""
    if k == 0:
        return
    head = view_i64(u_addr, U_HEAD)
    T, D, R = head[U_T], head[U_D], head[U_R]
    o_src, o_size, o_slots, o_count, o_full, o_rows, total = _layout(T, D)
    u = view_i64(u_addr, total)
    items = load_i64(rows + 24)
    for b in range(D):
        if u[o_full + b] != 0:
            continue
        n = u[o_count + b]
        if n + k > R:
            u[o_full + b] = 1
            continue
        dirty = view_i64(u[o_rows + b], R)
        for j in range(k):
            obj = load_i64(items + 8 * j)
            if load_i64(obj + OFF_TYPE) != head[U_INT]:
                u[o_full + b] = 1
                break
            r, ok = int_value(obj)
            if not ok or r < 0 or r >= R:
                u[o_full + b] = 1
                break
            dirty[n] = r
            n += 1
        u[o_count + b] = n
    u[U_PENDING] = 1


@jit
def sp_upload(u_addr):
    """Fill the next slot of every array: the rows dirty for it (or all),
    then it is current. Returns the slot."""
    head = view_i64(u_addr, U_HEAD)
    T, D, R = head[U_T], head[U_D], head[U_R]
    o_src, o_size, o_slots, o_count, o_full, o_rows, total = _layout(T, D)
    u = view_i64(u_addr, total)
    b = (u[U_CURR] + 1) % D
    n, full = u[o_count + b], u[o_full + b]
    dirty = view_i64(u[o_rows + b], R)
    for t in range(T):
        src, dst, size = u[o_src + t], u[o_slots + t * D + b], u[o_size + t]
        if full != 0:
            view_u8(dst, R * size)[:] = view_u8(src, R * size)
        elif size == 4:
            s4, d4 = view_i32(src, R), view_i32(dst, R)
            for i in range(n):
                d4[dirty[i]] = s4[dirty[i]]
        else:
            s8, d8 = view_i64(src, R), view_i64(dst, R)
            for i in range(n):
                d8[dirty[i]] = s8[dirty[i]]
    u[o_count + b] = 0
    u[o_full + b] = 0
    u[U_CURR] = b
    # (the other slots keep their dirty rows: filled when their turn comes;
    # until the next write, slot b is current and nothing needs uploading)
    u[U_PENDING] = 0
    return b


@jit(signature="UniTuple(int64, 7)(int64, int64)")
def _layout(T, D):
    """Offsets in the upload context: (src, size, slots, count, full, rows, total)."""
    src = U_HEAD
    size = src + T
    slots = size + T
    count = slots + T * D
    full = count + D
    rows = full + D
    return src, size, slots, count, full, rows, rows + D
