"""numba kernels that add a step's new requests: this step's ids as a
small hash table (duplicates within the step, lookups of ids the step adds),
pass 1 (each id, each request's payload against the table's shape, the rows
they get) and pass 2 (each row's fields, tokens and block tables, staged for
the device mirror).

Private; called by the general step (step.py) on the descriptors that
new_requests.py read. The keys enter the index with the step's other index
changes (``_ix_commit``), not here.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.index import _hash_key, _ix_arrays, _ix_params, _probe, _raw_equal
from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import ld32, st32, st64, view_i32, view_i64
from mtpstate._kernels.pyobjects import _check_int31_list, _item, _key_of, _seq, _vec, _vget
from mtpstate._kernels.slots import (
    ENG_NCT,
    ENG_ROWS,
    ENG_TOTAL_LEN,
    F_MAXSEQ,
    F_NB,
    F_NCPT,
    F_NCT,
    F_PREFILL,
    F_PROMPT,
    IX_FREE_HINT,
    IX_MAX_KEY,
    N_BLK,
    N_KEY,
    N_MAXT,
    N_NCT,
    N_PLEN,
    N_TOK,
    N_TOK_KIND,
    N_TOK_N,
    NEW_STRIDE,
    S_FREE,
    S_FREED,
    S_NB0,
    S_NEW,
    S_NEWPOS,
    S_NEWROW,
    S_PRIOR,
    S_REDIRECT,
    SC_NC,
    SC_NFREED,
    SC_NN,
    SC_NSTAGE,
    SC_NTOK,
    SC_STAMP,
    TB_BT_ADDR,
    TB_BT_W,
    TB_FLAT_BT,
    TB_FLAT_ENG,
    TB_FLAT_TOK,
    TB_L,
    TB_NG,
    TB_R,
    TB_RES,
    TB_SCR,
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
    E_CAPACITY,
    E_DUPLICATE,
    E_GROUPS,
    E_ID_TOO_LONG,
    E_INT_RANGE,
    E_MAX_TOKENS,
    E_NEW_NCT_RANGE,
    E_NOT_CANONICAL,
    E_TOKEN_VALUE,
    E_TOO_LONG,
    FLD_BLOCKS,
    FLD_MAX_TOKENS,
    FLD_NCT,
    FLD_NONE,
    FLD_PROMPT_LEN,
    FLD_REQ_ID,
    FLD_TOKENS,
    INT32_MAX,
    OK,
    PH_NEW,
    V_I32,
)
from mtpstate._kernels.tokens import stage_token_run
from mtpstate._kernels.writes import _write_group

# ---------------------------------------------------------------------------
# this step's own ids (new, resumed): a small open-addressing table


@jit
def _small_table(n):
    tsize = 8
    while tsize < 2 * n:
        tsize *= 2
    return np.full(tsize, -1, np.int64), tsize - 1


@jit
def _table_find(tab, tmask, t_hash, t_ptr, t_len, h, ptr, klen):
    """Index of the key in a small table of this step's keys, or -1;
    compared by bytes."""
    s = np.int64(h & np.uint64(tmask))
    while tab[s] >= 0:
        k = tab[s]
        if t_hash[k] == h and _raw_equal(t_ptr[k], t_len[k], ptr, klen):
            return k
        s = (s + 1) & tmask
    return -1


@jit
def _table_add(tab, tmask, h, k):
    s = np.int64(h & np.uint64(tmask))
    while tab[s] >= 0:
        s = (s + 1) & tmask
    tab[s] = k


@jit(signature="Tuple((int64[::1], int64[::1], uint64[::1], int64[::1], int64))(int64)")
def _new_keys(nn):
    """The step's new ids as a small hash table: (key addresses, lengths,
    hashes, table, table mask)."""
    tab, tmask = _small_table(nn)
    return np.empty(nn, np.int64), np.empty(nn, np.int64), np.empty(nn, np.uint64), tab, tmask


# ---------------------------------------------------------------------------
# pass 1: validate, assign rows


@jit
def _check_new(ix, tb, tp, sc, nd, nk, array_ok):
    """Pass 1 of add: each new id (well formed, not twice in the step; a live
    one is freed first: a re-sent request), each request's payload, then the
    rows: the lowest free rows (freed by this step included), in order."""
    nn = sc[SC_NN]
    if nn == 0:
        return OK
    new_ptr, new_len, new_hash, new_tab, ntab_mask = nk
    slots, row_hash, keys, key_len = _ix_arrays(ix)
    mask, kw, seed, hmask, allow = _ix_params(ix)
    max_key = ix[IX_MAX_KEY]
    R, ng, L = tb[TB_R], tb[TB_NG], tb[TB_L]
    bt_w = view_i64(tb[TB_BT_W], ng)
    scr = view_i32(tb[TB_SCR], (S_NB0 + ng) * R)
    stamp = sc[SC_STAMP]
    O_FREE, O_RED, O_FREED, O_PRIOR, O_NB = S_FREE * R, S_REDIRECT * R, S_FREED * R, S_PRIOR * R, S_NB0 * R
    flat_tok = tb[TB_FLAT_TOK]
    tok_ext = tb[TB_TOK_EXT] != 0
    nfreed = sc[SC_NFREED]
    nstage = 0
    ntok = 0
    nb_counts = np.empty(ng, np.int64)
    for k in range(nn):
        ptr, klen, st = _key_of(nd[k * NEW_STRIDE + N_KEY], allow, tp)
        if st != OK:
            return _err(tb, st, k, 0, PH_NEW, FLD_REQ_ID)
        if klen > max_key:
            return _err(tb, E_ID_TOO_LONG, k, klen, PH_NEW, FLD_REQ_ID)
        h = _hash_key(ptr, klen, seed, hmask)
        j = _table_find(new_tab, ntab_mask, new_hash, new_ptr, new_len, h, ptr, klen)
        if j >= 0:
            return _err(tb, E_DUPLICATE, k, j, PH_NEW, FLD_REQ_ID)
        _table_add(new_tab, ntab_mask, h, k)
        new_ptr[k] = ptr
        new_len[k] = klen
        new_hash[k] = h
        prior = _probe(slots, mask, keys, kw, h, ptr, klen)
        scr[O_PRIOR + k] = prior
        if prior >= 0 and scr[O_FREE + prior] != stamp:
            scr[O_FREE + prior] = stamp
            scr[O_RED + prior] = -1
            scr[O_FREED + nfreed] = prior
            nfreed += 1
        st, npf = check_new_request(tb, tp, nd, k, L, ng, bt_w, array_ok, nb_counts)
        if st != OK:
            return st
        nstage += F_NB + ng + ENG_ROWS
        if flat_tok >= 0 or tok_ext:  # (staged apart: _kernels/tokens.py)
            ntok += npf
        for g in range(ng):
            scr[O_NB + g * R + k] = nb_counts[g]
            nstage += nb_counts[g]
    sc[SC_NFREED] = nfreed
    sc[SC_NSTAGE] += nstage
    sc[SC_NTOK] = ntok
    return _assign_new_rows(ix, tb, sc, scr, key_len)


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


@jit
def _assign_new_rows(ix, tb, sc, scr, key_len):
    """Each new request's row: the lowest rows free after this step's
    frees, in order; a freed re-sent id redirects to its new row."""
    R, nn, nfreed, stamp = tb[TB_R], sc[SC_NN], sc[SC_NFREED], sc[SC_STAMP]
    O_FREE, O_FREED, O_NEWROW = S_FREE * R, S_FREED * R, S_NEWROW * R
    cursor = ix[IX_FREE_HINT]
    for f in range(nfreed):
        cursor = min(cursor, scr[O_FREED + f])
    for k in range(nn):
        while cursor < R and not (key_len[cursor] < 0 or scr[O_FREE + cursor] == stamp):
            cursor += 1
        if cursor >= R:
            return _err(tb, E_CAPACITY, k, nn, PH_NEW, FLD_NONE)
        scr[O_NEWROW + k] = cursor
        scr[S_NEW * R + cursor] = stamp
        scr[S_NEWPOS * R + cursor] = k
        cursor += 1
    for k in range(nn):
        prior = scr[S_PRIOR * R + k]
        if prior >= 0:
            scr[S_REDIRECT * R + prior] = scr[O_NEWROW + k]
    return OK


# ---------------------------------------------------------------------------
# pass 2: write the rows


@jit
def _apply_new(tb, tp, sc, nd, array_ok, ns, nt):
    """Pass 2 of add: each new request's row written (its key went into the
    index with the step's other index changes, ``_ix_commit``). Returns
    (staged, staged token elements)."""
    R, ng = tb[TB_R], tb[TB_NG]
    a_scr = tb[TB_SCR]
    res = view_i32(tb[TB_RES], 3 * R)
    nc = sc[SC_NC]
    nb_counts = np.empty(ng, np.int64)
    for k in range(sc[SC_NN]):
        r = ld32(a_scr, S_NEWROW * R + k)
        res[nc + k] = r
        for g in range(ng):
            nb_counts[g] = ld32(a_scr, (S_NB0 + g) * R + k)
        ns, nt = write_new_request(tb, tp, nd, k, r, nb_counts, array_ok, ns, nt)
    return ns, nt


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
    if staging and (flat_tok >= 0 or tok_ext):
        if a_tok != 0:  # from the host copy, which outlives the call
            vk, vb = V_I32, a_tok + 4 * tbase
        # (an external target is the only copy: from the request's own
        # tokens, validated in pass 1 and held until apply returns)
        nt = stage_token_run(tb, tp, k, max(flat_tok, 0) + tbase, vk, vb, npf, nt)
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
