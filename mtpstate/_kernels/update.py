"""numba kernels for a step's running (cached) requests and the prediction
of their rows.

The scheduler lists the running requests in much the same order, with the
very same id objects, step after step: the row of position i is predicted
from the previous update's order (``TB_PREV_*`` buffers: objects, rows,
row -> position), verified by identity or by bytes, and only then looked up
by hash (``_predict_miss``). The general step (step.py) calls pass 1
(``_check_cached``: rows, counts, block ids) and pass 2 (``_apply_cached``:
num_computed_tokens overwritten from the scheduler, block appends, the
prediction for the next step); the update-only step (decode.py) shares the
helpers.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.add import _new_keys, _table_add, _table_find
from mtpstate._kernels.cpython import OFF_TYPE, decref, incref
from mtpstate._kernels.index import _hash_key, _ix_arrays, _ix_params, _key_matches_row, _probe
from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import ld32, ld64, load_i64, prefetch, st32, st64, view_i32, view_i64
from mtpstate._kernels.pyobjects import _check_int31_list, _item, _key_of, _seq, _vec, _vget
from mtpstate._kernels.slots import (
    F_NB,
    F_NCPT,
    F_NCT,
    F_PREFILL,
    IX_ARRAY_OK,
    S_FLAGS,
    S_FREE,
    S_MISS,
    S_NB0,
    S_NCT,
    S_NEW,
    S_NEWPOS,
    S_NEWROW,
    S_REDIRECT,
    S_ROWS,
    S_SEEN,
    SC_HITS,
    SC_NC,
    SC_NFREED,
    SC_NMISS,
    SC_NN,
    SC_NSTAGE,
    SC_STAMP,
    TB_BT_ADDR,
    TB_BT_W,
    TB_FLAT_BT,
    TB_L,
    TB_NG,
    TB_PREV_CUR,
    TB_PREV_N,
    TB_PREV_OBJ,
    TB_PREV_OWNED,
    TB_PREV_ROW,
    TB_R,
    TB_RES,
    TB_ROW_PREV_POS,
    TB_SCR,
    TB_STATE,
    TB_STG_DUPS,
    TB_STG_FIELDS,
    TB_STG_ON,
    TB_STG_POS,
    TB_STG_STRIDE,
    TB_STG_VAL,
    _err,
)
from mtpstate._kernels.status import (
    E_BLOCK_OVERFLOW,
    E_BLOCK_VALUE,
    E_DUPLICATE,
    E_GROUPS,
    E_INT_RANGE,
    E_LENGTHS,
    E_NCT_RANGE,
    E_NOT_CANONICAL,
    E_UNKNOWN,
    FLD_BLOCKS,
    FLD_NCT,
    FLD_REQ_ID,
    OK,
    PH_CACHED,
    PH_RESUMED,
)
from mtpstate._kernels.writes import _put, _write_group

# ---------------------------------------------------------------------------
# the prediction of rows from the previous update


@jit
def _prediction_buffers(tb, R, cur):
    """Addresses of the current and the next prediction buffers: objects,
    rows, row -> position."""
    nxt = 1 - cur
    return (
        tb[TB_PREV_OBJ] + 8 * R * cur,
        tb[TB_PREV_ROW] + 4 * R * cur,
        tb[TB_ROW_PREV_POS] + 4 * R * cur,
        tb[TB_PREV_OBJ] + 8 * R * nxt,
        tb[TB_PREV_ROW] + 4 * R * nxt,
        tb[TB_ROW_PREV_POS] + 4 * R * nxt,
    )


@jit(inline="always")
def _predict_miss(obj, j, prev_n, a_prev_row, a_rpp, slots, mask, keys, kw, seed, hmask, allow, tp):
    """Row of the cached id ``obj`` at predicted position ``j`` of the
    previous update: (row or -1, next j, status, hash, key address, length).

    1. the very object of the previous step at j (kept alive by the table):
       the same id, no hashing or compare needed;
    2. else the id's bytes compared with the key of the row predicted at j;
    3. else a hash probe, and the prediction re-synchronized on its result.
    """
    # (1. is inlined by the callers: a call costs more than the check)
    ptr, klen, st = _key_of(obj, allow, tp)
    if st != OK:
        return -1, j, st, np.uint64(0), 0, 0
    pr = ld32(a_prev_row, j) if j < prev_n else -1
    if pr >= 0 and _key_matches_row(keys, kw, pr, ptr, klen):
        return pr, j + 1, OK, np.uint64(0), ptr, klen
    h = _hash_key(ptr, klen, seed, hmask)
    row = _probe(slots, mask, keys, kw, h, ptr, klen)
    if row >= 0:
        pp = ld32(a_rpp, row)
        if 0 <= pp < prev_n and ld32(a_prev_row, pp) == row:
            j = pp + 1
    return row, j, OK, h, ptr, klen


@jit(inline="always")
def _owned_obj(obj, tp):
    """The id object to remember for identity prediction: only exact str
    (releasing one runs no Python code; a str subclass could run a
    ``__del__`` inside the kernel), else 0 (predicted by bytes)."""
    return obj if load_i64(obj + OFF_TYPE) == tp[2] else 0


@jit(signature="void(int64[::1], int64, int64, int64, int64, int64, int64, int64, int64, int64)")
def _commit_prediction(tb, a_scr, R, stamp, nc, hits, nmiss, a_prev_obj, prev_n, a_prev_obj_next):
    """Make the next prediction buffer current, with references.

    Identity prediction needs the table to own a reference to each id object
    it remembers (else an address could be reused by another object). When
    ids are fresh objects every step (the scheduler runs in another process)
    identity never hits, and owning them would only move their deallocation
    into the next step; then the buffer keeps rows but no objects (address
    0), except on every 16th update, which checks whether identity hits again.
    Only the speed depends on this choice, never the result.

    Each identity hit consumed a distinct current position (a repeated object
    would have been rejected as a duplicate), so ``hits == prev_n`` means
    every current reference moved to the next buffer: then only the misses
    need a new reference, and nothing is released (the steady state).
    """
    cur_owned = tb[TB_PREV_OWNED] != 0
    if prev_n == 0:
        own_next = True  # no evidence yet
    elif cur_owned:
        own_next = 2 * hits >= min(nc, prev_n)  # did identity pay off?
    else:
        own_next = (stamp & 15) == 0  # try again now and then
    o_miss = S_MISS * R
    if own_next and cur_owned and hits == prev_n:
        for k in range(nmiss):
            obj = ld64(a_prev_obj_next, ld32(a_scr, o_miss + k))
            if obj != 0:
                incref(obj)
    else:
        # +1 for every remembered object, -1 for every forgotten one
        for i in range(nc):
            if own_next:
                obj = ld64(a_prev_obj_next, i)
                if obj != 0:
                    incref(obj)
            else:
                st64(a_prev_obj_next, i, 0)
        if cur_owned:
            for j in range(prev_n):
                obj = ld64(a_prev_obj, j)
                if obj != 0:
                    decref(obj)
    tb[TB_PREV_OWNED] = 1 if own_next else 0
    tb[TB_PREV_N] = nc
    tb[TB_PREV_CUR] = 1 - tb[TB_PREV_CUR]


@jit
def _forget_freed(tb, freed, has_update):
    """Pass 2 of finish, in the prediction: the rows ``freed`` are forgotten
    (a row the index reuses must not be predicted for its old id)."""
    R = tb[TB_R]
    a_prev_obj, a_prev_row, a_rpp, _o, _r, _p = _prediction_buffers(tb, R, tb[TB_PREV_CUR])
    prev_n = tb[TB_PREV_N]
    for f in range(freed.shape[0]):
        r = freed[f]
        pp = ld32(a_rpp, r)
        if 0 <= pp < prev_n and ld32(a_prev_row, pp) == r:
            st32(a_prev_row, pp, -1)
            if not has_update and tb[TB_PREV_OWNED] != 0:
                # no update follows in this call to hand the prediction's
                # references on (see _commit_prediction): release the freed
                # id's now, so that a finished id is not kept alive
                obj = ld64(a_prev_obj, pp)
                if obj != 0:
                    st64(a_prev_obj, pp, 0)
                    decref(obj)


# ---------------------------------------------------------------------------
# pass 1: validate


@jit
def _open_cached(tb, tp, cid, cnct_kind, cnct, cnct_n, cblk, array_ok, R):
    """(req_ids items, count, num_computed_tokens vector kind and base,
    new_block_ids items, status) of the cached requests' three lists,
    checked for type and equal length."""
    i_cid, nc, ok = _seq(cid, tp)
    if not ok:
        return 0, 0, 0, 0, 0, _err(tb, E_NOT_CANONICAL, -1, 0, PH_CACHED, FLD_REQ_ID)
    vk, vb, n1, st1 = _vec(cnct_kind, cnct, cnct_n, tp, array_ok)
    if st1 != OK:
        return 0, 0, 0, 0, 0, _err(tb, st1, -1, 0, PH_CACHED, FLD_NCT)
    i_cblk, n2, ok2 = _seq(cblk, tp)
    if not ok2:
        return 0, 0, 0, 0, 0, _err(tb, E_NOT_CANONICAL, -1, 0, PH_CACHED, FLD_BLOCKS)
    if n1 != nc:
        return 0, 0, 0, 0, 0, _err(tb, E_LENGTHS, -1, n1, PH_CACHED, FLD_NCT)
    if n2 != nc:
        return 0, 0, 0, 0, 0, _err(tb, E_LENGTHS, -1, n2, PH_CACHED, FLD_BLOCKS)
    if nc > R:
        return 0, 0, 0, 0, 0, _err(tb, E_DUPLICATE, -1, nc, PH_CACHED, FLD_REQ_ID)
    return i_cid, nc, vk, vb, i_cblk, OK


@jit
def _resumed_keys(ix, tb, tp, cres):
    """(resumed ids as a small hash table like ``_new_keys``, count, status)
    of resumed_req_ids (older schedulers): their new blocks replace the
    row's."""
    mask, kw, seed, hmask, allow = _ix_params(ix)
    nres = 0
    i_res = 0
    if cres != 0:
        i_res, nres, ok = _seq(cres, tp)
        if not ok:
            return _new_keys(0), 0, _err(tb, E_NOT_CANONICAL, -1, 0, PH_RESUMED, FLD_REQ_ID)
    rk = _new_keys(nres)
    res_ptr, res_len, res_hash, res_tab, rtab_mask = rk
    for k in range(nres):
        ptr, klen, st = _key_of(_item(i_res, k), allow, tp)
        if st != OK:
            return rk, 0, _err(tb, st, k, 0, PH_RESUMED, FLD_REQ_ID)
        h = _hash_key(ptr, klen, seed, hmask)
        res_ptr[k] = ptr
        res_len[k] = klen
        res_hash[k] = h
        if _table_find(res_tab, rtab_mask, res_hash, res_ptr, res_len, h, ptr, klen) < 0:
            _table_add(res_tab, rtab_mask, h, k)
    return rk, nres, OK


@jit
def _check_cached(ix, tb, tp, sc, cid, cnct_kind, cnct, cnct_n, cblk, nk, rk, nres):
    """Pass 1 of update: each cached request's row (predicted from the
    previous update's order, verified; a row freed or added by this step is
    followed), its num_computed_tokens and new block ids. Returns (req_ids
    items, new_block_ids items, status); rows and counts go to the scratch
    rows for pass 2."""
    if cid == 0:
        return 0, 0, OK
    slots, row_hash, keys, key_len = _ix_arrays(ix)
    mask, kw, seed, hmask, allow = _ix_params(ix)
    R, ng, L = tb[TB_R], tb[TB_NG], tb[TB_L]
    bt_addr = view_i64(tb[TB_BT_ADDR], ng)
    bt_w = view_i64(tb[TB_BT_W], ng)
    a_state = tb[TB_STATE]
    a_scr = tb[TB_SCR]
    stamp, nn, nfreed = sc[SC_STAMP], sc[SC_NN], sc[SC_NFREED]
    new_ptr, new_len, new_hash, new_tab, ntab_mask = nk
    res_ptr, res_len, res_hash, res_tab, rtab_mask = rk
    a_prev_obj, a_prev_row, a_rpp, a_prev_obj_next, a_prev_row_next, a_rpp_next = _prediction_buffers(
        tb, R, tb[TB_PREV_CUR]
    )
    prev_n = tb[TB_PREV_N]
    O_FREE, O_RED, O_NEW, O_SEEN = S_FREE * R, S_REDIRECT * R, S_NEW * R, S_SEEN * R
    i_cid, nc, vk, vb, i_cblk, st = _open_cached(tb, tp, cid, cnct_kind, cnct, cnct_n, cblk, ix[IX_ARRAY_OK], R)
    if st != OK:
        return 0, 0, st
    none = tp[5]
    j = 0
    hits = 0
    nmiss = 0
    nstage = 0
    for i in range(nc):
        obj = _item(i_cid, i)
        row = ld32(a_prev_row, j) if j < prev_n and ld64(a_prev_obj, j) == obj else -1
        st = OK
        h = np.uint64(0)
        ptr = 0
        klen = 0
        if row >= 0:
            hits += 1
            j += 1
        else:
            st32(a_scr, S_MISS * R + nmiss, i)
            nmiss += 1
            row, j, st, h, ptr, klen = _predict_miss(
                obj, j, prev_n, a_prev_row, a_rpp, slots, mask, keys, kw, seed, hmask, allow, tp
            )
        if st != OK:
            return 0, 0, _err(tb, st, i, 0, PH_CACHED, FLD_REQ_ID)
        via_new = False
        if row < 0 and nn > 0:
            # not live before this step: maybe added by it
            k = _table_find(new_tab, ntab_mask, new_hash, new_ptr, new_len, h, ptr, klen)
            if k >= 0:
                row = ld32(a_scr, S_NEWROW * R + k)
                via_new = True
        if row < 0:
            return 0, 0, _err(tb, E_UNKNOWN, i, 0, PH_CACHED, FLD_REQ_ID)
        if nfreed > 0 and not via_new and ld32(a_scr, O_FREE + row) == stamp:
            row = ld32(a_scr, O_RED + row)
            if row < 0:
                return 0, 0, _err(tb, E_UNKNOWN, i, 1, PH_CACHED, FLD_REQ_ID)
        if nn > 0 and ld32(a_scr, O_NEW + row) == stamp:
            tb[TB_STG_DUPS] = 1
        if ld32(a_scr, O_SEEN + row) == stamp:
            return 0, 0, _err(tb, E_DUPLICATE, i, 0, PH_CACHED, FLD_REQ_ID)
        st32(a_scr, O_SEEN + row, stamp)
        v, st = _vget(vk, vb, i, tp)
        if st != OK:
            return 0, 0, _err(tb, E_NCT_RANGE if st == E_INT_RANGE else st, i, 0, PH_CACHED, FLD_NCT)
        if v < 0 or v > L:
            return 0, 0, _err(tb, E_NCT_RANGE, i, v, PH_CACHED, FLD_NCT)
        st32(a_scr, S_ROWS * R + i, row)
        st32(a_scr, S_NCT * R + i, v)
        nstage += 2
        b = _item(i_cblk, i)
        st32(a_scr, S_FLAGS * R + i, 0)
        if b == none:
            continue
        b_items, b_n, ok = _seq(b, tp)
        if not ok:
            return 0, 0, _err(tb, E_NOT_CANONICAL, i, 0, PH_CACHED, FLD_BLOCKS)
        if b_n != ng:
            return 0, 0, _err(tb, E_GROUPS, i, b_n, PH_CACHED, FLD_BLOCKS)
        resumed = False
        if nres > 0:
            if ptr == 0:  # an identity hit: its bytes are needed for the lookup
                ptr, klen, st = _key_of(obj, allow, tp)
            h = _hash_key(ptr, klen, seed, hmask)  # (a prediction hit computed none)
            resumed = _table_find(res_tab, rtab_mask, res_hash, res_ptr, res_len, h, ptr, klen) >= 0
        if resumed:
            st32(a_scr, S_FLAGS * R + i, 1)
        for g in range(ng):
            c, st = _check_int31_list(_item(b_items, g), tp, E_BLOCK_VALUE)
            if st != OK:
                return 0, 0, _err(tb, st, i, g, PH_CACHED, FLD_BLOCKS)
            base = 0
            if not resumed:
                if nn > 0 and ld32(a_scr, O_NEW + row) == stamp:
                    base = ld32(a_scr, (S_NB0 + g) * R + ld32(a_scr, S_NEWPOS * R + row))
                else:
                    base = ld32(a_state, (F_NB + g) * R + row)
            if base + c > bt_w[g]:
                return 0, 0, _err(tb, E_BLOCK_OVERFLOW, i, g, PH_CACHED, FLD_BLOCKS)
            nstage += 1 + c
            if c > 0:
                prefetch(bt_addr[g] + 4 * (np.int64(row) * bt_w[g] + base))
    sc[SC_NC] = nc
    sc[SC_HITS] = hits
    sc[SC_NMISS] = nmiss
    sc[SC_NSTAGE] += nstage
    return i_cid, i_cblk, OK


# ---------------------------------------------------------------------------
# pass 2: write


@jit
def _apply_cached(tb, tp, sc, i_cid, i_cblk, ns):
    """Pass 2 of update: num_computed_tokens (overwritten from the
    scheduler) and the prefill counter derived from it, block appends, the
    prediction for the next step. Returns the staged count."""
    R, ng = tb[TB_R], tb[TB_NG]
    bt_addr = view_i64(tb[TB_BT_ADDR], ng)
    bt_w = view_i64(tb[TB_BT_W], ng)
    flat_bt = view_i64(tb[TB_FLAT_BT], ng)
    a_state = tb[TB_STATE]
    a_scr = tb[TB_SCR]
    SR = tb[TB_STG_STRIDE]
    staging = tb[TB_STG_ON] != 0
    fields = tb[TB_STG_FIELDS]
    stg_nct = staging and (fields >> F_NCT) & 1 != 0
    stg_ncpt = staging and (fields >> F_NCPT) & 1 != 0
    a_stg_pos = tb[TB_STG_POS]
    a_stg_val = tb[TB_STG_VAL]
    res = view_i32(tb[TB_RES], 3 * R)
    a_prev_obj, a_prev_row, a_rpp, a_prev_obj_next, a_prev_row_next, a_rpp_next = _prediction_buffers(
        tb, R, tb[TB_PREV_CUR]
    )
    none = tp[5]
    nc = sc[SC_NC]
    for i in range(nc):
        r = ld32(a_scr, S_ROWS * R + i)
        v = ld32(a_scr, S_NCT * R + i)
        res[i] = r
        ns = _put(a_state, F_NCT * R + r, F_NCT * SR + r, v, stg_nct, a_stg_pos, a_stg_val, ns)
        m = min(v, ld32(a_state, F_PREFILL * R + r))
        ns = _put(a_state, F_NCPT * R + r, F_NCPT * SR + r, m, stg_ncpt, a_stg_pos, a_stg_val, ns)
        b = _item(i_cblk, i)
        if b != none:
            resumed = ld32(a_scr, S_FLAGS * R + i) == 1
            ns = _append_blocks(
                b, resumed, tp, a_state, R, SR, ng, r, bt_addr, bt_w, flat_bt, staging, fields, a_stg_pos, a_stg_val, ns
            )
        # remember this update's order and objects for the next prediction
        # (row_prev_pos[r] is trusted only where prev_row points back at r)
        st64(a_prev_obj_next, i, _owned_obj(_item(i_cid, i), tp))
        st32(a_prev_row_next, i, r)
        st32(a_rpp_next, r, i)
    _commit_prediction(
        tb, a_scr, R, sc[SC_STAMP], nc, sc[SC_HITS], sc[SC_NMISS], a_prev_obj, tb[TB_PREV_N], a_prev_obj_next
    )
    return ns


@jit(inline="always")
def _append_blocks(
    blocks, replace, tp, a_state, R, SR, ng, r, bt_addr, bt_w, flat_bt, staging, fields, a_stg_pos, a_stg_val, ns
):
    """Append (or, for a resumed request, write from 0) one cached request's
    validated new block ids, one list per group, to row ``r``; update
    num_blocks; stage both. Returns the new number of staged elements."""
    b_items, b_n, ok = _seq(blocks, tp)
    for g in range(ng):
        nbpos = (F_NB + g) * R + r
        start = 0 if replace else ld32(a_state, nbpos)
        gi, c, ok = _seq(_item(b_items, g), tp)
        ns = _write_group(
            _item(b_items, g), tp, bt_addr[g], bt_w[g], r, start, staging, a_stg_pos, a_stg_val, ns, flat_bt[g]
        )
        st32(a_state, nbpos, start + c)
        if staging and (fields >> (F_NB + g)) & 1:
            st64(a_stg_pos, ns, (F_NB + g) * SR + r)
            st32(a_stg_val, ns, start + c)
            ns += 1
    return ns
