"""numba kernel that applies one scheduler step to a RequestTable.

Private; launched by ``RequestTable`` (table.py) through one entry,
``tb_apply``, with integer arguments only: the addresses of the index and
table contexts, of the scheduler's Python lists (0 = absent) and of the int
vectors the Python side bound for the step. Every kind of step goes through
it:

- update-only steps (the steady state of decoding) take a single pass that
  validates and writes each running request, with an undo log, so a request
  rejected at position i rolls back positions < i;
- any other step (finished, preempted, new or resumed requests) takes two
  passes: pass 1 reads everything and validates it against the state as the
  step would leave it, pass 2 mutates.

Either way, nothing is left changed by a rejected step. Every changed
element of a mirrored field (``TB_STG_FIELDS``) is also appended (flat
position, value) to the staging buffers of the device mirror when that is
on (with an engine's token target, the step's new token ids go first, at
positions in that target, then everything else; added rows also seed the
engine's lengths, ``TB_FLAT_ENG``), and the rows of the step (cached, new,
freed) are written to the result array the Python side exposes.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.batch import publish_steady_batch, resolve_batch, steady_batch, write_batch
from mtpstate._kernels.index import (
    _arena_short,
    _hash_key,
    _ix_arrays,
    _ix_free_row,
    _ix_params,
    _key_matches_row,
    _probe,
    _slot_insert,
    _small_table,
    _table_add,
    _table_find,
    _write_key,
    key_arena_words,
)
from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import (
    OFF_ITEMS,
    OFF_TYPE,
    decref,
    incref,
    ld32,
    ld64,
    load_i64,
    prefetch,
    st32,
    st64,
    view_i32,
    view_i64,
)
from mtpstate._kernels.new_requests import (
    check_new_request,
    descriptors_from_list,
    read_new_requests,
    write_new_request,
)
from mtpstate._kernels.pyobjects import _int_of, _item, _key_of, _pytypes, _seq, _vec, _vget
from mtpstate._kernels.slots import (
    A_CBLK,
    A_CID,
    A_CNCT,
    A_CNCT_KIND,
    A_CNCT_N,
    A_CRES,
    A_FIN,
    A_NEW,
    A_NEW_REQS,
    A_NST,
    A_PRE,
    A_SPEC,
    A_TOTAL,
    ENG_ROWS,
    F_NB,
    F_NCPT,
    F_NCT,
    F_PREFILL,
    IX_ARRAY_OK,
    IX_DICT_OK,
    IX_FREE_HINT,
    IX_MAX_KEY,
    IX_NUM_LIVE,
    IX_SIZE,
    N_KEY,
    NEW_STRIDE,
    S_FLAGS,
    S_FREE,
    S_FREED,
    S_MISS,
    S_NB0,
    S_NCT,
    S_NEW,
    S_NEWPOS,
    S_NEWROW,
    S_PRIOR,
    S_REDIRECT,
    S_ROWS,
    S_SEEN,
    SC_HITS,
    SC_NC,
    SC_NEED_WORDS,
    SC_NFREED,
    SC_NMISS,
    SC_NN,
    SC_NSTAGE,
    SC_NTOK,
    SC_SIZE,
    SC_STAMP,
    TB_B_N,
    TB_BT_ADDR,
    TB_BT_W,
    TB_DQL,
    TB_FLAT_BT,
    TB_FLAT_TOK,
    TB_L,
    TB_NG,
    TB_PREV_CUR,
    TB_PREV_N,
    TB_PREV_OBJ,
    TB_PREV_OWNED,
    TB_PREV_ROW,
    TB_R,
    TB_RES,
    TB_RES_NC,
    TB_RES_NF,
    TB_RES_NN,
    TB_ROW_PREV_POS,
    TB_SCR,
    TB_SIZE,
    TB_STAMP,
    TB_STATE,
    TB_STG_CAP,
    TB_STG_DUPS,
    TB_STG_FIELDS,
    TB_STG_N,
    TB_STG_ON,
    TB_STG_POS,
    TB_STG_STRIDE,
    TB_STG_TOK_N,
    TB_STG_VAL,
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
    E_KEY_TOO_LONG,
    E_LENGTHS,
    E_NCT_RANGE,
    E_NOT_CANONICAL,
    E_STAGE_FULL,
    E_UNKNOWN,
    FLD_BLOCKS,
    FLD_NCT,
    FLD_NONE,
    FLD_REQ_ID,
    OK,
    PH_CACHED,
    PH_FINISH,
    PH_NEW,
    PH_PREEMPT,
    PH_RESUMED,
)
from mtpstate._kernels.writes import _check_int31_list, _put, _write_group


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


@jit(inline="always")
def _owned_obj(obj, tp):
    """The id object to remember for identity prediction: only exact str
    (releasing one runs no Python code; a str subclass could run a
    ``__del__`` inside the kernel), else 0 (predicted by bytes)."""
    return obj if load_i64(obj + OFF_TYPE) == tp[2] else 0


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


@jit(signature="void(int32[::1], int64, int64)")
def _sift_down(a, i, n):
    v = a[i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and a[c + 1] > a[c]:
            c += 1
        if a[c] <= v:
            break
        a[i] = a[c]
        i = c
    a[i] = v


@jit
def _heapsort(a, n):
    """Sort a[:n] ascending in place (numba's own sort costs ~2 s of first
    compile for one call site)."""
    for i in range(n // 2 - 1, -1, -1):
        _sift_down(a, i, n)
    for end in range(n - 1, 0, -1):
        a[0], a[end] = a[end], a[0]
        _sift_down(a, 0, end)


@jit
def _undo_update(a_state, a_scr, a_prev_row_next, R, count):
    """Restore num_computed_tokens (and the prefill counter derived from it)
    of the first ``count`` rows a rejected update already wrote."""
    for k in range(count):
        r = ld32(a_prev_row_next, k)
        old = ld32(a_scr, S_NCT * R + k)
        st32(a_state, F_NCT * R + r, old)
        st32(a_state, F_NCPT * R + r, min(old, ld32(a_state, F_PREFILL * R + r)))


@jit
def _materialize(a_obj, a_row, a_obj_next, a_row_next, a_rpp_next, n):
    """Copy the first n positions of the current prediction into the next."""
    for p in range(n):
        st64(a_obj_next, p, ld64(a_obj, p))
        r = ld32(a_row, p)
        st32(a_row_next, p, r)
        if r >= 0:  # (always: only identity hits, which have rows, are copied)
            st32(a_rpp_next, r, p)


@jit(inline="always")
def _seen_in_this_update(a_rpp_next, a_prev_row_next, row, i):
    # positions < i of the next prediction buffer are this update's; a row
    # whose recorded position points into them was listed already
    p = ld32(a_rpp_next, row)
    return 0 <= p < i and ld32(a_prev_row_next, p) == row


@jit(signature="int64(int64, int64, int64)")
def _arg(items, i, none):
    """Object address of slot i of the argument tuple; 0 for None."""
    o = _item(items, i)
    return 0 if o == none else o


@jit
def tb_apply(ixc, tbc, args):
    """Apply one step. ``args``: the address of the step's argument tuple
    (``A_*`` slots, built and held by table.py): finished/preempted ids, the
    flat list of new-request descriptors (``N_*``), the cached requests'
    req_ids, num_computed_tokens (as an int vector: kind, address, length),
    new_block_ids and resumed ids, and for the batch num_scheduled_tokens,
    scheduled_spec_decode_tokens and total_num_scheduled_tokens. Returns OK or an error status (detail in the
    context)."""
    tb = view_i64(tbc, TB_SIZE)
    ix = view_i64(ixc, IX_SIZE)
    tp = _pytypes(ix)
    none = tp[5]
    items = args + OFF_ITEMS  # a tuple's items are inline
    # what a step reports (result counts, staging, batch) starts empty, also when it is rejected
    tb[TB_STG_DUPS] = 0
    tb[TB_RES_NC] = 0
    tb[TB_RES_NN] = 0
    tb[TB_RES_NF] = 0
    tb[TB_STG_N] = 0
    tb[TB_STG_TOK_N] = 0
    tb[TB_B_N] = -1
    fin = _arg(items, A_FIN, none)
    pre = _arg(items, A_PRE, none)
    new = _arg(items, A_NEW, none)
    new_reqs = _arg(items, A_NEW_REQS, none)
    cid = _arg(items, A_CID, none)
    cnct_kind, st = _int_of(_item(items, A_CNCT_KIND), tp)
    cnct, st = _int_of(_item(items, A_CNCT), tp)
    cnct_n, st = _int_of(_item(items, A_CNCT_N), tp)
    cblk = _arg(items, A_CBLK, none)
    cres = _arg(items, A_CRES, none)
    nst = _arg(items, A_NST, none)
    if tb[TB_DQL] == 0:
        nst = 0
    spec = _arg(items, A_SPEC, none)
    total = _arg(items, A_TOTAL, none)
    if fin == 0 and pre == 0 and new == 0 and new_reqs == 0 and cres == 0:
        return _update_only(ixc, tbc, cid, cnct_kind, cnct, cnct_n, cblk, nst, spec, total)
    return _general(ixc, tbc, fin, pre, new, new_reqs, cid, cnct_kind, cnct, cnct_n, cblk, cres, nst, spec, total)


@jit
def _update_only(ixc, tbc, cid, cnct_kind, cnct, cnct_n, cblk, nst, spec, total):
    """The running requests' update in a single pass (the steady state of
    decoding).

    Each request is validated and written in the same pass; its previous
    ``num_computed_tokens`` goes to an undo log, so a request rejected at
    position i rolls back positions < i before returning. Block appends are
    validated in the pass and written after it. The prediction for the next
    step goes to the non-current buffer, which becomes current only on
    success.
    """
    ix = view_i64(ixc, IX_SIZE)
    tb = view_i64(tbc, TB_SIZE)
    tp = _pytypes(ix)
    slots, row_hash, keys, key_len = _ix_arrays(ix)
    mask, kw, seed, hmask, allow = _ix_params(ix)
    R, ng, L = tb[TB_R], tb[TB_NG], tb[TB_L]
    bt_addr = view_i64(tb[TB_BT_ADDR], ng)
    bt_w = view_i64(tb[TB_BT_W], ng)
    flat_bt = view_i64(tb[TB_FLAT_BT], ng)
    a_state = tb[TB_STATE]
    a_scr = tb[TB_SCR]
    a_res = tb[TB_RES]
    cur = tb[TB_PREV_CUR]
    prev_n = tb[TB_PREV_N]
    a_prev_obj, a_prev_row, a_rpp, a_prev_obj_next, a_prev_row_next, a_rpp_next = _prediction_buffers(tb, R, cur)
    staging = tb[TB_STG_ON] != 0
    fields = tb[TB_STG_FIELDS]
    SR = tb[TB_STG_STRIDE]  # the device's row stride for staged positions
    stg_nct = staging and (fields >> F_NCT) & 1 != 0
    stg_ncpt = staging and (fields >> F_NCPT) & 1 != 0
    stg_cap = tb[TB_STG_CAP]
    a_stg_pos = tb[TB_STG_POS]
    a_stg_val = tb[TB_STG_VAL]
    stamp = tb[TB_STAMP] + 1
    tb[TB_STAMP] = stamp
    if cid == 0:  # (finish() / add() with nothing to do: apply always passes the cached list)
        return OK
    O_NCT = S_NCT * R
    O_ROWS = S_ROWS * R
    O_MISS = S_MISS * R
    i_cid, nc, vk, vb, i_cblk, st = _open_cached(tb, tp, cid, cnct_kind, cnct, cnct_n, cblk, ix[IX_ARRAY_OK], R)
    if st != OK:
        return st
    if staging and 2 * nc > stg_cap:
        return _err(tb, E_STAGE_FULL, -1, 2 * nc, 0, FLD_NONE)
    none = tp[5]
    j = 0
    hits = 0
    nmiss = 0
    ns = 0
    nstage_blocks = 0
    nblk = 0  # requests with new blocks, listed in the O_ROWS scratch row
    # "in sync": every position so far held the very object at the same
    # position of the previous update. While in sync, the next prediction
    # would equal the current one, so it is not written at all, and no row
    # can repeat (the current buffer has distinct rows). The first deviation
    # copies the positions so far into the next buffer and leaves sync.
    sync = True
    for i in range(nc):
        obj = _item(i_cid, i)
        row = -1
        if sync:
            if i < prev_n and ld64(a_prev_obj, i) == obj:
                row = ld32(a_prev_row, i)
            if row >= 0:
                hits += 1
                j = i + 1
            else:
                _materialize(a_prev_obj, a_prev_row, a_prev_obj_next, a_prev_row_next, a_rpp_next, i)
                sync = False
        st = OK
        dup = False
        if not sync:
            row = ld32(a_prev_row, j) if j < prev_n and ld64(a_prev_obj, j) == obj else -1
            if row >= 0:
                # (the reference the table holds moves to the next buffer)
                hits += 1
                j += 1
            else:
                st32(a_scr, O_MISS + nmiss, i)
                nmiss += 1
                row, j, st, h, ptr, klen = _predict_miss(
                    obj, j, prev_n, a_prev_row, a_rpp, slots, mask, keys, kw, seed, hmask, allow, tp
                )
            dup = row >= 0 and _seen_in_this_update(a_rpp_next, a_prev_row_next, row, i)
        code = OK
        arg = 0
        field = FLD_REQ_ID
        v = 0
        if st != OK:
            code = st
        elif row < 0:
            code = E_UNKNOWN
        elif dup:
            code = E_DUPLICATE
        else:
            v, st = _vget(vk, vb, i, tp)
            if st != OK:
                code = E_NCT_RANGE if st == E_INT_RANGE else st
                field = FLD_NCT
            elif v < 0 or v > L:
                code = E_NCT_RANGE
                field = FLD_NCT
                arg = v
            else:
                b = _item(i_cblk, i)
                if b != none:
                    field = FLD_BLOCKS
                    b_items, b_n, ok = _seq(b, tp)
                    if not ok:
                        code = E_NOT_CANONICAL
                    elif b_n != ng:
                        code = E_GROUPS
                        arg = b_n
                    else:
                        for g in range(ng):
                            c, st = _check_int31_list(_item(b_items, g), tp, E_BLOCK_VALUE)
                            if st != OK:
                                code = st
                                arg = g
                                break
                            base = ld32(a_state, (F_NB + g) * R + row)
                            if base + c > bt_w[g]:
                                code = E_BLOCK_OVERFLOW
                                arg = g
                                break
                            nstage_blocks += 1 + c
                            if c > 0:
                                prefetch(bt_addr[g] + 4 * (np.int64(row) * bt_w[g] + base))
                        if code == OK:
                            st32(a_scr, O_ROWS + nblk, i)
                            nblk += 1
        if code != OK:
            _undo_update(a_state, a_scr, a_prev_row if sync else a_prev_row_next, R, i)
            return _err(tb, code, i, arg, PH_CACHED, field)
        st32(a_scr, O_NCT + i, ld32(a_state, F_NCT * R + row))  # undo log
        ns = _put(a_state, F_NCT * R + row, F_NCT * SR + row, v, stg_nct, a_stg_pos, a_stg_val, ns)
        m = min(v, ld32(a_state, F_PREFILL * R + row))
        ns = _put(a_state, F_NCPT * R + row, F_NCPT * SR + row, m, stg_ncpt, a_stg_pos, a_stg_val, ns)
        st32(a_res, i, row)
        if not sync:
            st64(a_prev_obj_next, i, _owned_obj(obj, tp))
            st32(a_prev_row_next, i, row)
            st32(a_rpp_next, row, i)
    if staging and ns + nstage_blocks > stg_cap:
        _undo_update(a_state, a_scr, a_prev_row if sync else a_prev_row_next, R, nc)
        return _err(tb, E_STAGE_FULL, -1, ns + nstage_blocks, 0, FLD_NONE)
    steady = False
    if nst != 0:
        steady = steady_batch(tb, tp, ix[IX_DICT_OK], R, nst, spec, total, i_cid, nc, a_res, a_state)
    if nst != 0 and not steady:
        # (no new ids in this step)
        st = resolve_batch(
            ix, tb, tp, nst, spec, total, i_cid, nc, a_res, np.empty(0, np.int64), _new_keys(0), a_res, 0, 0
        )
        if st != OK:
            _undo_update(a_state, a_scr, a_prev_row if sync else a_prev_row_next, R, nc)
            return st
    unchanged = sync and nc == prev_n  # the same objects in the same order: keep the prediction
    if sync and not unchanged:
        _materialize(a_prev_obj, a_prev_row, a_prev_obj_next, a_prev_row_next, a_rpp_next, nc)
    # accepted: block appends, then the prediction buffer becomes current
    for k in range(nblk):
        i = ld32(a_scr, O_ROWS + k)
        r = ld32(a_res, i)
        ns = _append_blocks(
            _item(i_cblk, i),
            False,
            tp,
            a_state,
            R,
            SR,
            ng,
            r,
            bt_addr,
            bt_w,
            flat_bt,
            staging,
            fields,
            a_stg_pos,
            a_stg_val,
            ns,
        )
    if not unchanged:
        _commit_prediction(tb, a_scr, R, stamp, nc, hits, nmiss, a_prev_obj, prev_n, a_prev_obj_next)
    tb[TB_RES_NC] = nc
    tb[TB_STG_N] = ns
    if steady:
        publish_steady_batch(tb, R)
    elif nst != 0:
        write_batch(tb, R, a_state)
    return OK


# ---------------------------------------------------------------------------
# the general step, phase by phase: the new requests' descriptors (read
# first: reading them may run Python code), then pass 1 (read and validate
# everything against the state as the step would leave it, write nothing:
# freed rows, new requests and their rows, resumed ids, cached requests, the
# batch, the key arena), then pass 2 (apply: free, add, update). The phases
# share the step's counters through one record, ``sc`` (``SC_*`` slots).


@jit
def _new_descriptors(tb, tp, new_desc, new_reqs, array_ok, R):
    """(descriptors [nn * NEW_STRIDE], nn, status) of the step's new
    requests: read in place from the scheduler's objects, or converted from
    the list table.py built."""
    if new_reqs == 0 and new_desc == 0:
        return np.empty(0, np.int64), 0, OK
    items, n, ok = _seq(new_reqs if new_reqs != 0 else new_desc, tp)
    nn = n if new_reqs != 0 else n // NEW_STRIDE
    if nn > R:
        return np.empty(0, np.int64), 0, _err(tb, E_CAPACITY, -1, nn, PH_NEW, FLD_NONE)
    nd = np.empty(nn * NEW_STRIDE, np.int64)
    if new_reqs != 0:
        return nd, nn, read_new_requests(tb, tp, new_reqs, nd, array_ok)
    return nd, nn, descriptors_from_list(tb, tp, new_desc, nd, nn)


@jit(signature="int64(int64, int64, int64[::1], int64[::1], UniTuple(int64, 10), int64[::1])")
def _check_freed(seq, phase, ix, tb, tp, sc):
    """Pass 1 of finish, for finished_req_ids or preempted_req_ids
    (``phase``): mark the live rows of ``seq``'s ids freed (unknown ids are
    ignored); the count goes to ``sc[SC_NFREED]``."""
    slots, row_hash, keys, key_len = _ix_arrays(ix)
    mask, kw, seed, hmask, allow = _ix_params(ix)
    R = tb[TB_R]
    scr = view_i32(tb[TB_SCR], (S_NB0 + tb[TB_NG]) * R)
    stamp = sc[SC_STAMP]
    O_FREE, O_RED, O_FREED = S_FREE * R, S_REDIRECT * R, S_FREED * R
    nfreed = sc[SC_NFREED]
    items, n, ok = _seq(seq, tp)
    if not ok:
        return _err(tb, E_NOT_CANONICAL, -1, 0, phase, FLD_REQ_ID)
    for i in range(n):
        ptr, klen, st = _key_of(_item(items, i), allow, tp)
        if st != OK:
            return _err(tb, st, i, 0, phase, FLD_REQ_ID)
        h = _hash_key(ptr, klen, seed, hmask)
        r = _probe(slots, mask, keys, kw, h, ptr, klen)
        if r >= 0 and scr[O_FREE + r] != stamp:
            scr[O_FREE + r] = stamp
            scr[O_RED + r] = -1
            scr[O_FREED + nfreed] = r
            nfreed += 1
    sc[SC_NFREED] = nfreed
    return OK


@jit(signature="Tuple((int64[::1], int64[::1], uint64[::1], int64[::1], int64))(int64)")
def _new_keys(nn):
    """The step's new ids as a small hash table: (key addresses, lengths,
    hashes, table, table mask)."""
    tab, tmask = _small_table(nn)
    return np.empty(nn, np.int64), np.empty(nn, np.int64), np.empty(nn, np.uint64), tab, tmask


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
    need_words = 0
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
        need_words += key_arena_words(klen)
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
        if flat_tok >= 0:
            nstage += npf
        elif tok_ext:
            ntok += npf
            nstage += npf
        for g in range(ng):
            scr[O_NB + g * R + k] = nb_counts[g]
            nstage += nb_counts[g]
    sc[SC_NFREED] = nfreed
    sc[SC_NSTAGE] += nstage
    sc[SC_NTOK] = ntok
    sc[SC_NEED_WORDS] = need_words
    return _assign_new_rows(ix, tb, sc, scr, key_len)


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


@jit
def _apply_freed(ix, tb, sc, has_update):
    """Pass 2 of finish: free the rows, ascending (the result's order, and
    the order they are freed in); forget them in the prediction."""
    slots, row_hash, keys, key_len = _ix_arrays(ix)
    R, nfreed = tb[TB_R], sc[SC_NFREED]
    scr = view_i32(tb[TB_SCR], (S_NB0 + tb[TB_NG]) * R)
    freed = view_i32(tb[TB_RES], 3 * R)[2 * R : 2 * R + nfreed]
    for f in range(nfreed):
        freed[f] = scr[S_FREED * R + f]
    _heapsort(freed, nfreed)
    a_prev_obj, a_prev_row, a_rpp, _o, _r, _p = _prediction_buffers(tb, R, tb[TB_PREV_CUR])
    prev_n = tb[TB_PREV_N]
    for f in range(nfreed):
        r = freed[f]
        _ix_free_row(ix, slots, row_hash, key_len, r)
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


@jit
def _apply_new(ix, tb, tp, sc, nd, nk, array_ok, ns, nt):
    """Pass 2 of add: each new request's key into the index, its row
    written. Returns (staged, staged token elements)."""
    slots, row_hash, keys, key_len = _ix_arrays(ix)
    mask, kw, seed, hmask, allow = _ix_params(ix)
    R, ng = tb[TB_R], tb[TB_NG]
    a_scr = tb[TB_SCR]
    new_ptr, new_len, new_hash, new_tab, ntab_mask = nk
    res = view_i32(tb[TB_RES], 3 * R)
    nc = sc[SC_NC]
    nb_counts = np.empty(ng, np.int64)
    for k in range(sc[SC_NN]):
        r = ld32(a_scr, S_NEWROW * R + k)
        res[nc + k] = r
        _write_key(ix, keys, kw, key_len, row_hash, r, new_ptr[k], new_len[k], new_hash[k])
        _slot_insert(slots, mask, new_hash[k], r)
        ix[IX_NUM_LIVE] += 1
        for g in range(ng):
            nb_counts[g] = ld32(a_scr, (S_NB0 + g) * R + k)
        ns, nt = write_new_request(tb, tp, nd, k, r, nb_counts, array_ok, ns, nt)
    return ns, nt


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


@jit
def _general(ixc, tbc, fin, pre, new_desc, new_reqs, cid, cnct_kind, cnct, cnct_n, cblk, cres, nst, spec, total):
    """Any step that is not update-only: finish, add, update (see the
    module docstring), in two passes."""
    ix = view_i64(ixc, IX_SIZE)
    tb = view_i64(tbc, TB_SIZE)
    tp = _pytypes(ix)
    R = tb[TB_R]
    array_ok = ix[IX_ARRAY_OK]
    sc = np.zeros(SC_SIZE, np.int64)
    sc[SC_STAMP] = tb[TB_STAMP] + 1
    tb[TB_STAMP] = sc[SC_STAMP]
    nd, nn, st = _new_descriptors(tb, tp, new_desc, new_reqs, array_ok, R)
    if st != OK:
        return st
    sc[SC_NN] = nn

    # ---------------- pass 1: read and validate, write nothing -------------
    if fin != 0:
        st = _check_freed(fin, PH_FINISH, ix, tb, tp, sc)
        if st != OK:
            return st
    if pre != 0:
        st = _check_freed(pre, PH_PREEMPT, ix, tb, tp, sc)
        if st != OK:
            return st
    nk = _new_keys(nn)
    st = _check_new(ix, tb, tp, sc, nd, nk, array_ok)
    if st != OK:
        return st
    rk, nres, st = _resumed_keys(ix, tb, tp, cres)
    if st != OK:
        return st
    i_cid, i_cblk, st = _check_cached(ix, tb, tp, sc, cid, cnct_kind, cnct, cnct_n, cblk, nk, rk, nres)
    if st != OK:
        return st
    if tb[TB_STG_ON] != 0 and sc[SC_NSTAGE] > tb[TB_STG_CAP]:
        return _err(tb, E_STAGE_FULL, -1, sc[SC_NSTAGE], 0, FLD_NONE)
    if nst != 0:
        a_scr = tb[TB_SCR]
        st = resolve_batch(
            ix, tb, tp, nst, spec, total, i_cid, sc[SC_NC], a_scr + 4 * S_ROWS * R, nd, nk,
            a_scr + 4 * S_NEWROW * R, sc[SC_STAMP], sc[SC_NFREED],
        )  # fmt: skip
        if st != OK:
            return st
    # the arena grows (in Python) only for a step that is valid otherwise
    short = _arena_short(ix, sc[SC_NEED_WORDS])
    if short > 0:
        return _err(tb, E_KEY_TOO_LONG, -1, short, PH_NEW, FLD_REQ_ID)

    # ---------------- pass 2: apply ----------------------------------------
    staging = tb[TB_STG_ON] != 0
    ns = sc[SC_NTOK] if staging else 0  # token elements for an external target go first
    _apply_freed(ix, tb, sc, cid != 0)
    ns, nt = _apply_new(ix, tb, tp, sc, nd, nk, array_ok, ns, 0)
    # (freeing lowered the free-row hint; rows below it are still all live)
    if cid != 0:
        ns = _apply_cached(tb, tp, sc, i_cid, i_cblk, ns)
    tb[TB_RES_NC] = sc[SC_NC]
    tb[TB_RES_NN] = nn
    tb[TB_RES_NF] = sc[SC_NFREED]
    tb[TB_STG_N] = ns
    tb[TB_STG_TOK_N] = nt
    if nst != 0:
        write_batch(tb, R, tb[TB_STATE])
    return OK
