"""numba kernels for a step's new requests: read, validate, write.

A new request reaches the general step (step.py) as one descriptor of
NEW_STRIDE int64 (``N_*``: the id object, prompt_len, num_computed_tokens,
max_tokens, the token vector, the block_ids object), made one of two ways:

- ``read_new_requests``: from the scheduler's NewRequestData objects, read
  in place (the usual path). Attribute reads may run Python code (a
  property), so they come first in the step, before anything else is read,
  and every object read is held in a list the table owns (``H_*`` slots)
  until the step returns. An attribute of a type the kernel does not read
  (a generator, a numpy array, prompt embeddings, ...) sends the step to the
  Python reader (``E_NEW_SLOW``), which takes what was read from that list:
  each attribute is read once.
- ``descriptors_from_list``: from the flat list of ints table.py builds on
  that path.

Then ``check_new_request`` (pass 1: validate one request against the
table's shape) and ``write_new_request`` (pass 2: its row's fields, tokens
and block table, staged for the device mirror).
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import (
    OFF_SIZE,
    OFF_TYPE,
    err_clear,
    getattr_held,
    incref,
    is_subtype,
    ld32,
    list_new,
    list_set_item,
    load_i64,
    st32,
    st64,
    view_i64,
)
from mtpstate._kernels.pyobjects import _int_of, _item, _seq, _vec, _vget
from mtpstate._kernels.slots import (
    ENG_NCT,
    ENG_TOTAL_LEN,
    F_MAXSEQ,
    F_NB,
    F_NCPT,
    F_NCT,
    F_PREFILL,
    F_PROMPT,
    H_BLOCKS,
    H_MAX_TOKENS,
    H_NCT,
    H_PREFILL,
    H_PROMPT,
    H_REQ,
    H_REQ_ID,
    H_SP,
    H_STRIDE,
    N_BLK,
    N_KEY,
    N_MAXT,
    N_NCT,
    N_PLEN,
    N_TOK,
    N_TOK_KIND,
    N_TOK_N,
    NEW_STRIDE,
    TB_BT_ADDR,
    TB_BT_W,
    TB_FLAT_BT,
    TB_FLAT_ENG,
    TB_FLAT_TOK,
    TB_L,
    TB_NEW_HOLDER,
    TB_NEW_NAMES,
    TB_NG,
    TB_R,
    TB_STATE,
    TB_STG_FIELDS,
    TB_STG_ON,
    TB_STG_POS,
    TB_STG_STRIDE,
    TB_STG_VAL,
    TB_TOK,
    TB_TOK_EXT,
    _err,
)
from mtpstate._kernels.status import (
    E_BLOCK_OVERFLOW,
    E_BLOCK_VALUE,
    E_CHANGED,
    E_GROUPS,
    E_INT_RANGE,
    E_MAX_TOKENS,
    E_NEW_NCT_RANGE,
    E_NEW_READ,
    E_NEW_SLOW,
    E_NOT_CANONICAL,
    E_TOKEN_VALUE,
    E_TOO_LONG,
    FLD_BLOCKS,
    FLD_MAX_TOKENS,
    FLD_NCT,
    FLD_NONE,
    FLD_PROMPT_LEN,
    FLD_TOKENS,
    INT32_MAX,
    OK,
    PH_NEW,
    V_ARRAY,
    V_I32,
    V_OBJ,
)
from mtpstate._kernels.writes import _check_int31_list, _write_group

# ---------------------------------------------------------------------------
# descriptors


@jit(signature="int64(int64, int64, int64, int64)")
def _hold(holder, slot, obj, name):
    """``getattr(obj, name)`` into slot ``slot`` of the holder list (which
    owns it from then on); the value's address, or 0 when the read raised
    (the slot then holds the exception)."""
    v, exc = getattr_held(obj, name)
    if v == 0 and exc == 0:  # pragma: no cover - CPython always sets one
        err_clear()
        return 0
    list_set_item(holder, slot, v if v != 0 else exc)
    return v


@jit(signature="int64(int64, UniTuple(int64, 10), int64, int64)")
def _token_kind(obj, tp, array_type, array_ok):
    """V_* kind of a token container read in place (exact list or tuple, an
    array.array or a subclass such as vLLM's TokenBuffer), -1 otherwise."""
    t = load_i64(obj + OFF_TYPE)
    if t == tp[0] or t == tp[1]:
        return V_OBJ
    if array_ok != 0 and (t == array_type or is_subtype(t, array_type) != 0):
        return V_ARRAY
    return -1


@jit(signature="Tuple((int64, boolean))(int64, UniTuple(int64, 10), int64, int64)")
def _exact_int_or(obj, tp, default, out_of_range):
    """(value, ok) of an exact int (``out_of_range`` outside int64, which
    pass 1 rejects), ``default`` for None; ok False for any other type."""
    if obj == tp[5]:
        return default, True
    if load_i64(obj + OFF_TYPE) != tp[4]:
        return 0, False
    v, st = _int_of(obj, tp)
    return (v if st == OK else out_of_range), True


@jit
def _describe_read(nd, k, got, tp, array_type, array_ok):
    """Descriptor k from the attributes read (``got``, by H_* slot); False
    when one of them is of a type only the Python reader takes."""
    none = tp[5]
    rid = got[H_REQ_ID]
    if load_i64(rid + OFF_TYPE) != tp[2]:
        return False
    prompt = got[H_PROMPT]
    if prompt == none:  # prompt embeddings: prompt_len from the request
        return False
    tokens = got[H_PREFILL] if got[H_PREFILL] != none else prompt
    tkind = _token_kind(tokens, tp, array_type, array_ok)
    if tokens != prompt and _token_kind(prompt, tp, array_type, array_ok) < 0:
        return False  # (its length is read in place too)
    blocks = got[H_BLOCKS]
    t_blocks = load_i64(blocks + OFF_TYPE)
    if tkind < 0 or not (t_blocks == tp[0] or t_blocks == tp[1]) or got[H_NCT] == none:
        return False
    nct, ok1 = _exact_int_or(got[H_NCT], tp, -1, -1)
    mt, ok2 = _exact_int_or(got[H_MAX_TOKENS], tp, 1, -1)
    if not (ok1 and ok2):
        return False
    d = k * NEW_STRIDE
    nd[d + N_KEY] = rid
    nd[d + N_PLEN] = load_i64(prompt + OFF_SIZE)  # item count (list, tuple, array)
    nd[d + N_NCT] = nct
    nd[d + N_MAXT] = mt
    nd[d + N_TOK_KIND] = tkind
    nd[d + N_TOK] = tokens
    nd[d + N_TOK_N] = 0
    nd[d + N_BLK] = blocks
    return True


@jit
def read_new_requests(tb, tp, reqs, nd, array_ok):
    """Fill the descriptors ``nd`` [nn * NEW_STRIDE] from the scheduler's
    NewRequestData objects (``reqs``: an exact list or tuple) read in place:
    req_id, prompt_token_ids, prefill_token_ids, block_ids,
    num_computed_tokens, sampling_params and its max_tokens (a missing
    sampling_params counts as max_tokens 1). Returns OK; E_NEW_READ (at the
    request and H_* slot) when a read raised; E_NEW_SLOW when a value's type
    is one the kernel does not read; E_CHANGED when a property changed the
    list. Nothing of the table is touched."""
    none = tp[5]
    items, nn, ok = _seq(reqs, tp)
    names = view_i64(tb[TB_NEW_NAMES], H_STRIDE)  # array.array, then the attribute names
    array_type = names[H_REQ]
    holder = list_new(nn * H_STRIDE)
    if holder == 0:  # no memory: let the Python reader fail the same way
        err_clear()
        return _err(tb, E_NEW_SLOW, -1, 0, PH_NEW, FLD_NONE)
    for s in range(nn * H_STRIDE):
        incref(none)
        list_set_item(holder, s, none)
    list_set_item(tb[TB_NEW_HOLDER], 0, holder)  # (the table's 1-item list owns it now)
    got = np.empty(H_STRIDE, np.int64)
    slow = False
    for k in range(nn):
        items, n_now, ok = _seq(reqs, tp)  # a property may have changed the list
        if n_now != nn:
            return _err(tb, E_CHANGED, k, n_now, PH_NEW, FLD_NONE)
        r = _item(items, k)
        base = k * H_STRIDE
        incref(r)
        list_set_item(holder, base + H_REQ, r)
        for h in range(H_REQ_ID, H_MAX_TOKENS):  # req_id .. sampling_params
            got[h] = _hold(holder, base + h, r, names[h])
            if got[h] == 0:
                return _err(tb, E_NEW_READ, k, h, PH_NEW, FLD_NONE)
        got[H_MAX_TOKENS] = none
        if got[H_SP] != none:
            got[H_MAX_TOKENS] = _hold(holder, base + H_MAX_TOKENS, got[H_SP], names[H_MAX_TOKENS])
            if got[H_MAX_TOKENS] == 0:
                return _err(tb, E_NEW_READ, k, H_MAX_TOKENS, PH_NEW, FLD_NONE)
        if not _describe_read(nd, k, got, tp, array_type, array_ok):
            slow = True
    if slow:
        return _err(tb, E_NEW_SLOW, -1, nn, PH_NEW, FLD_NONE)
    return OK


@jit
def descriptors_from_list(tb, tp, lst, nd, nn):
    """Fill the descriptors ``nd`` from the flat list of ints table.py built
    (the Python reader's path). An int outside int64 becomes -1, which pass 1
    rejects with the field's error."""
    items, n, ok = _seq(lst, tp)
    for i in range(nn * NEW_STRIDE):
        v, st = _int_of(_item(items, i), tp)
        if st == E_INT_RANGE:
            v = -1
        elif st != OK:  # pragma: no cover - built by table.py
            return _err(tb, E_NOT_CANONICAL, i // NEW_STRIDE, 0, PH_NEW, FLD_NONE)
        nd[i] = v
    return OK


# ---------------------------------------------------------------------------
# pass 1 and pass 2 of one request


@jit
def check_new_request(tb, tp, nd, k, L, ng, bt_w, array_ok, nb_counts):
    """Pass 1 of new request k: its lengths, token ids, counts and block ids
    against the table's shape. Returns (status, token elements); the block
    count of each group goes to ``nb_counts[g]``."""
    d = k * NEW_STRIDE
    plen = nd[d + N_PLEN]
    nct = nd[d + N_NCT]
    mt = nd[d + N_MAXT]
    vk, vb, npf, st = _vec(nd[d + N_TOK_KIND], nd[d + N_TOK], nd[d + N_TOK_N], tp, array_ok)
    if st != OK:
        return _err(tb, st, k, 0, PH_NEW, FLD_TOKENS), 0
    if plen < 0 or plen > L:
        return _err(tb, E_TOO_LONG, k, plen if plen > L else -1, PH_NEW, FLD_PROMPT_LEN), 0
    if npf > L:
        return _err(tb, E_TOO_LONG, k, npf, PH_NEW, FLD_TOKENS), 0
    for t in range(npf):
        v, st = _vget(vk, vb, t, tp)
        if st == OK and (v < 0 or v > INT32_MAX):
            st = E_TOKEN_VALUE
        if st != OK:
            return _err(tb, E_TOKEN_VALUE if st == E_INT_RANGE else st, k, t, PH_NEW, FLD_TOKENS), 0
    if nct < 0 or nct > npf:
        return _err(tb, E_NEW_NCT_RANGE, k, nct, PH_NEW, FLD_NCT), 0
    if mt < 0 or plen + mt > INT32_MAX:
        return _err(tb, E_MAX_TOKENS, k, mt, PH_NEW, FLD_MAX_TOKENS), 0
    b_items, b_n, ok = _seq(nd[d + N_BLK], tp)
    if not ok:
        return _err(tb, E_NOT_CANONICAL, k, 0, PH_NEW, FLD_BLOCKS), 0
    if b_n != ng:
        return _err(tb, E_GROUPS, k, b_n, PH_NEW, FLD_BLOCKS), 0
    for g in range(ng):
        c, st = _check_int31_list(_item(b_items, g), tp, E_BLOCK_VALUE)
        if st != OK:
            return _err(tb, st, k, g, PH_NEW, FLD_BLOCKS), 0
        if c > bt_w[g]:
            return _err(tb, E_BLOCK_OVERFLOW, k, g, PH_NEW, FLD_BLOCKS), 0
        nb_counts[g] = c
    return OK, npf


@jit(signature="void(int64, int64, int64, UniTuple(int64, 10), int64, int64)")
def _copy_tokens(vk, vb, n, tp, a_dst, at):
    """int32 ``dst[at:at + n]`` = the token vector (``_vec``), validated."""
    if vk == V_I32:  # int32 tokens (vLLM's TokenBuffer): a plain copy
        for t in range(n):
            st32(a_dst, at + t, ld32(vb, t))
        return
    for t in range(n):
        v, st = _vget(vk, vb, t, tp)
        st32(a_dst, at + t, v)


@jit
def write_new_request(tb, tp, nd, k, r, nb_counts, array_ok, ns, nt):
    """Pass 2 of new request k at row r: the state fields, the token ids
    (host copy and/or staged), the block tables (``nb_counts``: the counts
    pass 1 found), each staged. Returns (staged, staged token elements)."""
    a_state, R, L, ng = tb[TB_STATE], tb[TB_R], tb[TB_L], tb[TB_NG]
    SR = tb[TB_STG_STRIDE]  # the device's row stride for staged positions
    bt_addr = view_i64(tb[TB_BT_ADDR], ng)
    bt_w = view_i64(tb[TB_BT_W], ng)
    flat_bt = view_i64(tb[TB_FLAT_BT], ng)
    a_tok = tb[TB_TOK]  # 0: no host copy (the mirror's token target is the only one)
    flat_tok, eng, fields = tb[TB_FLAT_TOK], tb[TB_FLAT_ENG], tb[TB_STG_FIELDS]
    staging = tb[TB_STG_ON] != 0
    tok_ext = tb[TB_TOK_EXT] != 0
    a_pos, a_val = tb[TB_STG_POS], tb[TB_STG_VAL]
    d = k * NEW_STRIDE
    nct = nd[d + N_NCT]
    plen = nd[d + N_PLEN]
    vk, vb, npf, st = _vec(nd[d + N_TOK_KIND], nd[d + N_TOK], nd[d + N_TOK_N], tp, array_ok)
    tbase = np.int64(r) * L
    if a_tok != 0:
        _copy_tokens(vk, vb, npf, tp, a_tok, tbase)
    if staging and flat_tok >= 0:
        for t in range(npf):
            st64(a_pos, ns, flat_tok + tbase + t)
            st32(a_val, ns, ld32(a_tok, tbase + t))
            ns += 1
    elif staging and tok_ext:
        # an external target is the only copy (no host one): from the
        # request's own tokens, validated in pass 1
        _copy_tokens(vk, vb, npf, tp, a_val, nt)
        for t in range(npf):
            st64(a_pos, nt + t, tbase + t)
        nt += npf
    st32(a_state, F_NCT * R + r, nct)
    st32(a_state, F_NCPT * R + r, min(nct, npf))
    st32(a_state, F_PREFILL * R + r, npf)
    st32(a_state, F_PROMPT * R + r, plen)
    st32(a_state, F_MAXSEQ * R + r, plen + nd[d + N_MAXT])
    b_items, b_n, ok = _seq(nd[d + N_BLK], tp)
    for g in range(ng):
        st32(a_state, (F_NB + g) * R + r, nb_counts[g])
        ns = _write_group(_item(b_items, g), tp, bt_addr[g], bt_w[g], r, 0, staging, a_pos, a_val, ns, flat_bt[g])
    if staging:
        for f in range(F_NB + ng):
            if (fields >> f) & 1:
                st64(a_pos, ns, f * SR + r)
                st32(a_val, ns, ld32(a_state, f * R + r))
                ns += 1
        if eng >= 0:  # the engine's own copies, seeded once per added row
            st64(a_pos, ns, eng + ENG_TOTAL_LEN * SR + r)
            st32(a_val, ns, npf)
            st64(a_pos, ns + 1, eng + ENG_NCT * SR + r)
            st32(a_val, ns + 1, nct)
            ns += 2
    return ns, nt
