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
    E_BLOCK_OVERFLOW,
    E_BLOCK_VALUE,
    E_CAPACITY,
    E_DUPLICATE,
    E_GROUPS,
    E_ID_TOO_LONG,
    E_INT_RANGE,
    E_KEY_TOO_LONG,
    E_LENGTHS,
    E_MAX_TOKENS,
    E_NCT_RANGE,
    E_NEW_NCT_RANGE,
    E_NOT_CANONICAL,
    E_STAGE_FULL,
    E_TOKEN_VALUE,
    E_TOO_LONG,
    E_UNKNOWN,
    FLD_BLOCKS,
    FLD_MAX_TOKENS,
    FLD_NCT,
    FLD_NONE,
    FLD_PROMPT_LEN,
    FLD_REQ_ID,
    FLD_TOKENS,
    INT32_MAX,
    IX_ARRAY_OK,
    IX_DICT_OK,
    IX_FREE_HINT,
    IX_MAX_KEY,
    IX_NUM_LIVE,
    IX_SIZE,
    OK,
    PH_CACHED,
    PH_FINISH,
    PH_NEW,
    PH_PREEMPT,
    PH_RESUMED,
    V_I32,
    _arena_short,
    _hash_key,
    _int_of,
    _item,
    _ix_arrays,
    _ix_free_row,
    _ix_params,
    _key_matches_row,
    _key_of,
    _probe,
    _pytypes,
    _seq,
    _slot_insert,
    _small_table,
    _table_add,
    _table_find,
    _vec,
    _vget,
    _write_key,
    key_arena_words,
)
from mtpstate._kernels.native import (
    OFF_ITEMS,
    OFF_TYPE,
    decref,
    incref,
    jit,
    ld32,
    ld64,
    load_i64,
    prefetch,
    st32,
    st64,
    view_i32,
    view_i64,
)
from mtpstate._kernels.slots import (
    A_CBLK,
    A_CID,
    A_CNCT,
    A_CNCT_KIND,
    A_CNCT_N,
    A_CRES,
    A_FIN,
    A_NEW,
    A_NST,
    A_PRE,
    A_SPEC,
    A_TOTAL,
    ENG_NCT,
    ENG_ROWS,
    ENG_TOTAL_LEN,
    F_MAXSEQ,
    F_NB,
    F_NCPT,
    F_NCT,
    F_PREFILL,
    F_PROMPT,
    N_BLK,
    N_KEY,
    N_MAXT,
    N_NCT,
    N_PLEN,
    N_TOK,
    N_TOK_KIND,
    N_TOK_N,
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
    TB_B_N,
    TB_BT_ADDR,
    TB_BT_W,
    TB_DQL,
    TB_FLAT_BT,
    TB_FLAT_ENG,
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
    TB_TOK,
    TB_TOK_EXT,
    _err,
)


@jit
def _check_int31_list(seq, tp, value_error):
    """(count, status) of a list of ints each in [0, 2**31) (token ids, block
    ids); ``value_error`` is the status for a value out of range."""
    items, n, ok = _seq(seq, tp)
    if not ok:
        return 0, E_NOT_CANONICAL
    for j in range(n):
        v, st = _int_of(_item(items, j), tp)
        if st == E_INT_RANGE:
            return 0, value_error
        if st != OK:
            return 0, st
        if v < 0 or v > INT32_MAX:
            return 0, value_error
    return n, OK


@jit(signature="int64(int64, int64, int64, int64, boolean, int64, int64, int64)")
def _put(a_state, pos, dpos, v, staging, a_stg_pos, a_stg_val, ns):
    """state[pos] = v; stage it (at the device position ``dpos``) only if
    the value changed (bytes shipped grow with what changed)."""
    old = ld32(a_state, pos)
    st32(a_state, pos, v)
    if staging and old != v:
        st64(a_stg_pos, ns, dpos)
        st32(a_stg_val, ns, v)
        ns += 1
    return ns


@jit(signature="int64(int64, UniTuple(int64, 10), int64, int64, int64, int64, boolean, int64, int64, int64, int64)")
def _write_group(seq, tp, a_bt, w, row, start, staging, a_stg_pos, a_stg_val, ns, flat):
    """Write one group's block ids into ``bt[row, start:]`` (``a_bt``: the
    table's address); returns the new number of staged elements."""
    items, n, ok = _seq(seq, tp)
    base = np.int64(row) * w + start
    for j in range(n):
        v, st = _int_of(_item(items, j), tp)
        st32(a_bt, base + j, v)
        if staging:
            st64(a_stg_pos, ns, flat + base + j)
            st32(a_stg_val, ns, v)
            ns += 1
    return ns


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
    if fin == 0 and pre == 0 and new == 0 and cres == 0:
        return _update_only(ixc, tbc, cid, cnct_kind, cnct, cnct_n, cblk, nst, spec, total)
    return _general(ixc, tbc, fin, pre, new, cid, cnct_kind, cnct, cnct_n, cblk, cres, nst, spec, total)


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
        empty_i64 = np.empty(0, np.int64)  # (no new ids in this step)
        empty_u64 = np.empty(0, np.uint64)
        st = resolve_batch(
            tb,
            tp,
            allow,
            ix[IX_DICT_OK],
            R,
            nst,
            spec,
            total,
            i_cid,
            nc,
            a_res,
            0,
            0,
            a_res,
            slots,
            mask,
            keys,
            kw,
            seed,
            hmask,
            empty_i64,
            0,
            empty_u64,
            empty_i64,
            empty_i64,
            a_scr,
            stamp,
            0,
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


@jit(
    signature="UniTuple(int64, 2)(int64, int64, int64[::1], UniTuple(int64, 10), int64[::1], int64, uint64[::1], "
    "int64, int64, int64, int64, int32[::1], int64, int64, int64, int64, int64)"
)
def _free_ids(
    seq, phase, tb, tp, slots, mask, keys, kw, seed, hmask, allow, scr, O_FREE, O_RED, O_FREED, stamp, nfreed
):
    """Pass 1 of finish: mark the live rows of ``seq``'s ids freed (unknown
    ids are ignored). Returns (freed count, status)."""
    items, n, ok = _seq(seq, tp)
    if not ok:
        return nfreed, _err(tb, E_NOT_CANONICAL, -1, 0, phase, FLD_REQ_ID)
    for i in range(n):
        ptr, klen, st = _key_of(_item(items, i), allow, tp)
        if st != OK:
            return nfreed, _err(tb, st, i, 0, phase, FLD_REQ_ID)
        h = _hash_key(ptr, klen, seed, hmask)
        r = _probe(slots, mask, keys, kw, h, ptr, klen)
        if r >= 0 and scr[O_FREE + r] != stamp:
            scr[O_FREE + r] = stamp
            scr[O_RED + r] = -1
            scr[O_FREED + nfreed] = r
            nfreed += 1
    return nfreed, OK


@jit
def _desc(items, i, tp):
    """An address stored in the new-request descriptor list (an exact int
    table.py made with ``id()``)."""
    v, st = _int_of(_item(items, i), tp)
    return v


@jit
def _general(ixc, tbc, fin, pre, new, cid, cnct_kind, cnct, cnct_n, cblk, cres, nst, spec, total):
    ix = view_i64(ixc, IX_SIZE)
    tb = view_i64(tbc, TB_SIZE)
    tp = _pytypes(ix)
    slots, row_hash, keys, key_len = _ix_arrays(ix)
    mask, kw, seed, hmask, allow = _ix_params(ix)
    max_key = ix[IX_MAX_KEY]
    array_ok = ix[IX_ARRAY_OK]
    R, ng, L = tb[TB_R], tb[TB_NG], tb[TB_L]
    state = view_i32(tb[TB_STATE], (F_NB + ng) * R)
    bt_addr = view_i64(tb[TB_BT_ADDR], ng)
    bt_w = view_i64(tb[TB_BT_W], ng)
    tok_host = tb[TB_TOK] != 0  # 0: no host copy (the mirror's token target is the only one)
    tok = view_i32(tb[TB_TOK], R * L if tok_host else 0)
    cur = tb[TB_PREV_CUR]
    prev_n = tb[TB_PREV_N]
    scr = view_i32(tb[TB_SCR], (S_NB0 + ng) * R)
    res = view_i32(tb[TB_RES], 3 * R)
    staging = tb[TB_STG_ON] != 0
    stg_cap = tb[TB_STG_CAP]
    stg_pos = view_i64(tb[TB_STG_POS], stg_cap)
    stg_val = view_i32(tb[TB_STG_VAL], stg_cap)
    flat_bt = view_i64(tb[TB_FLAT_BT], ng)
    flat_tok = tb[TB_FLAT_TOK]
    tok_ext = tb[TB_TOK_EXT] != 0
    eng = tb[TB_FLAT_ENG]
    fields = tb[TB_STG_FIELDS]
    SR = tb[TB_STG_STRIDE]  # the device's row stride for staged positions
    stg_nct = staging and (fields >> F_NCT) & 1 != 0
    stg_ncpt = staging and (fields >> F_NCPT) & 1 != 0
    a_state = tb[TB_STATE]
    a_scr = tb[TB_SCR]
    a_prev_obj, a_prev_row, a_rpp, a_prev_obj_next, a_prev_row_next, a_rpp_next = _prediction_buffers(tb, R, cur)
    a_stg_pos = tb[TB_STG_POS]
    a_stg_val = tb[TB_STG_VAL]
    stamp = tb[TB_STAMP] + 1
    tb[TB_STAMP] = stamp
    O_ROWS = S_ROWS * R
    O_NCT = S_NCT * R
    O_FREE = S_FREE * R
    O_SEEN = S_SEEN * R
    O_RED = S_REDIRECT * R
    O_NEW = S_NEW * R
    O_NEWPOS = S_NEWPOS * R
    O_FREED = S_FREED * R
    O_NEWROW = S_NEWROW * R
    O_PRIOR = S_PRIOR * R
    O_FLAGS = S_FLAGS * R
    O_NB = S_NB0 * R
    need_words = 0
    nstage = 0
    ntok = 0  # token elements for the external target: staged first, [0, ntok)

    # ---------------- pass 1: read and validate, write nothing -------------
    # finish: finished_req_ids | preempted_req_ids; unknown ids are ignored
    nfreed = 0
    if fin != 0:
        nfreed, st = _free_ids(
            fin, PH_FINISH, tb, tp, slots, mask, keys, kw, seed, hmask, allow, scr, O_FREE, O_RED, O_FREED, stamp, 0
        )
        if st != OK:
            return st
    if pre != 0:
        nfreed, st = _free_ids(
            pre,
            PH_PREEMPT,
            tb,
            tp,
            slots,
            mask,
            keys,
            kw,
            seed,
            hmask,
            allow,
            scr,
            O_FREE,
            O_RED,
            O_FREED,
            stamp,
            nfreed,
        )
        if st != OK:
            return st

    # new requests: a live id is removed first (re-sent request)
    nn = 0
    new_ptr = np.empty(0, np.int64)
    new_len = np.empty(0, np.int64)
    new_hash = np.empty(0, np.uint64)
    new_tab = np.empty(0, np.int64)
    ntab_mask = 0
    i_new = 0
    if new != 0:
        i_new, nd, ok = _seq(new, tp)
        if not ok or nd % NEW_STRIDE != 0:  # pragma: no cover - built by table.py
            return _err(tb, E_NOT_CANONICAL, -1, 0, PH_NEW, FLD_NONE)
        nn = nd // NEW_STRIDE
        if nn > R:
            return _err(tb, E_CAPACITY, -1, nn, PH_NEW, FLD_NONE)
        new_ptr = np.empty(nn, np.int64)
        new_len = np.empty(nn, np.int64)
        new_hash = np.empty(nn, np.uint64)
        new_tab, ntab_mask = _small_table(nn)
        for k in range(nn):
            d = k * NEW_STRIDE
            ptr, klen, st = _key_of(_desc(i_new, d + N_KEY, tp), allow, tp)
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
            # payload (ints built by table.py from the request's attributes)
            plen, st1 = _int_of(_item(i_new, d + N_PLEN), tp)
            nct, st2 = _int_of(_item(i_new, d + N_NCT), tp)
            mt, st3 = _int_of(_item(i_new, d + N_MAXT), tp)
            tkind, st4 = _int_of(_item(i_new, d + N_TOK_KIND), tp)
            taddr, st5 = _int_of(_item(i_new, d + N_TOK), tp)
            tn, st6 = _int_of(_item(i_new, d + N_TOK_N), tp)
            if st1 != OK:
                return _err(tb, E_TOO_LONG, k, -1, PH_NEW, FLD_PROMPT_LEN)
            if st2 != OK:
                return _err(tb, E_NEW_NCT_RANGE, k, -1, PH_NEW, FLD_NCT)
            if st3 != OK:
                return _err(tb, E_MAX_TOKENS, k, -1, PH_NEW, FLD_MAX_TOKENS)
            if st4 != OK or st5 != OK or st6 != OK:  # pragma: no cover - built by table.py
                return _err(tb, E_NOT_CANONICAL, k, 0, PH_NEW, FLD_TOKENS)
            vk, vb, npf, st = _vec(tkind, taddr, tn, tp, array_ok)
            if st != OK:
                return _err(tb, st, k, 0, PH_NEW, FLD_TOKENS)
            if plen < 0 or plen > L or npf > L:
                return _err(tb, E_TOO_LONG, k, max(plen, npf), PH_NEW, FLD_TOKENS if npf > L else FLD_PROMPT_LEN)
            for t in range(npf):
                v, st = _vget(vk, vb, t, tp)
                if st == OK and (v < 0 or v > INT32_MAX):
                    st = E_TOKEN_VALUE
                if st != OK:
                    return _err(tb, E_TOKEN_VALUE if st == E_INT_RANGE else st, k, t, PH_NEW, FLD_TOKENS)
            if nct < 0 or nct > npf:
                return _err(tb, E_NEW_NCT_RANGE, k, nct, PH_NEW, FLD_NCT)
            if mt < 0 or plen + mt > INT32_MAX:
                return _err(tb, E_MAX_TOKENS, k, mt, PH_NEW, FLD_MAX_TOKENS)
            b_items, b_n, ok = _seq(_desc(i_new, d + N_BLK, tp), tp)
            if not ok:
                return _err(tb, E_NOT_CANONICAL, k, 0, PH_NEW, FLD_BLOCKS)
            if b_n != ng:
                return _err(tb, E_GROUPS, k, b_n, PH_NEW, FLD_BLOCKS)
            nstage += F_NB + ng + ENG_ROWS
            if flat_tok >= 0:
                nstage += npf
            elif tok_ext:
                ntok += npf
                nstage += npf
            for g in range(ng):
                c, st = _check_int31_list(_item(b_items, g), tp, E_BLOCK_VALUE)
                if st != OK:
                    return _err(tb, st, k, g, PH_NEW, FLD_BLOCKS)
                if c > bt_w[g]:
                    return _err(tb, E_BLOCK_OVERFLOW, k, g, PH_NEW, FLD_BLOCKS)
                scr[O_NB + g * R + k] = c
                nstage += c
        # rows: the lowest free rows (freed by this step included), in order
        cursor = ix[IX_FREE_HINT]
        for f in range(nfreed):
            cursor = min(cursor, scr[O_FREED + f])
        for k in range(nn):
            while cursor < R and not (key_len[cursor] < 0 or scr[O_FREE + cursor] == stamp):
                cursor += 1
            if cursor >= R:
                return _err(tb, E_CAPACITY, k, nn, PH_NEW, FLD_NONE)
            scr[O_NEWROW + k] = cursor
            scr[O_NEW + cursor] = stamp
            scr[O_NEWPOS + cursor] = k
            cursor += 1
        for k in range(nn):
            prior = scr[O_PRIOR + k]
            if prior >= 0:
                scr[O_RED + prior] = scr[O_NEWROW + k]

    # resumed ids (older schedulers): their new blocks replace the row's
    nres = 0
    res_ptr = np.empty(0, np.int64)
    res_len = np.empty(0, np.int64)
    res_hash = np.empty(0, np.uint64)
    res_tab = np.empty(0, np.int64)
    rtab_mask = 0
    if cres != 0:
        i_res, nres, ok = _seq(cres, tp)
        if not ok:
            return _err(tb, E_NOT_CANONICAL, -1, 0, PH_RESUMED, FLD_REQ_ID)
        res_ptr = np.empty(nres, np.int64)
        res_len = np.empty(nres, np.int64)
        res_hash = np.empty(nres, np.uint64)
        res_tab, rtab_mask = _small_table(nres)
        for k in range(nres):
            ptr, klen, st = _key_of(_item(i_res, k), allow, tp)
            if st != OK:
                return _err(tb, st, k, 0, PH_RESUMED, FLD_REQ_ID)
            h = _hash_key(ptr, klen, seed, hmask)
            res_ptr[k] = ptr
            res_len[k] = klen
            res_hash[k] = h
            if _table_find(res_tab, rtab_mask, res_hash, res_ptr, res_len, h, ptr, klen) < 0:
                _table_add(res_tab, rtab_mask, h, k)

    # cached requests: predicted from the previous update's order, verified
    nc = 0
    i_cid = 0
    i_cblk = 0
    hits = 0
    nmiss = 0
    if cid != 0:
        i_cid, nc, vk, vb, i_cblk, st = _open_cached(tb, tp, cid, cnct_kind, cnct, cnct_n, cblk, array_ok, R)
        if st != OK:
            return st
        none = tp[5]
        j = 0
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
                return _err(tb, st, i, 0, PH_CACHED, FLD_REQ_ID)
            via_new = False
            if row < 0 and nn > 0:
                # not live before this step: maybe added by it
                k = _table_find(new_tab, ntab_mask, new_hash, new_ptr, new_len, h, ptr, klen)
                if k >= 0:
                    row = scr[O_NEWROW + k]
                    via_new = True
            if row < 0:
                return _err(tb, E_UNKNOWN, i, 0, PH_CACHED, FLD_REQ_ID)
            if nfreed > 0 and not via_new and ld32(a_scr, O_FREE + row) == stamp:
                row = ld32(a_scr, O_RED + row)
                if row < 0:
                    return _err(tb, E_UNKNOWN, i, 1, PH_CACHED, FLD_REQ_ID)
            if nn > 0 and ld32(a_scr, O_NEW + row) == stamp:
                tb[TB_STG_DUPS] = 1
            if ld32(a_scr, O_SEEN + row) == stamp:
                return _err(tb, E_DUPLICATE, i, 0, PH_CACHED, FLD_REQ_ID)
            st32(a_scr, O_SEEN + row, stamp)
            v, st = _vget(vk, vb, i, tp)
            if st != OK:
                return _err(tb, E_NCT_RANGE if st == E_INT_RANGE else st, i, 0, PH_CACHED, FLD_NCT)
            if v < 0 or v > L:
                return _err(tb, E_NCT_RANGE, i, v, PH_CACHED, FLD_NCT)
            st32(a_scr, O_ROWS + i, row)
            st32(a_scr, O_NCT + i, v)
            nstage += 2
            b = _item(i_cblk, i)
            st32(a_scr, O_FLAGS + i, 0)
            if b != none:
                b_items, b_n, ok = _seq(b, tp)
                if not ok:
                    return _err(tb, E_NOT_CANONICAL, i, 0, PH_CACHED, FLD_BLOCKS)
                if b_n != ng:
                    return _err(tb, E_GROUPS, i, b_n, PH_CACHED, FLD_BLOCKS)
                resumed = False
                if nres > 0:
                    if ptr == 0:  # an identity hit: its bytes are needed for the lookup
                        ptr, klen, st = _key_of(obj, allow, tp)
                    h = _hash_key(ptr, klen, seed, hmask)  # (a prediction hit computed none)
                    resumed = _table_find(res_tab, rtab_mask, res_hash, res_ptr, res_len, h, ptr, klen) >= 0
                if resumed:
                    st32(a_scr, O_FLAGS + i, 1)
                for g in range(ng):
                    c, st = _check_int31_list(_item(b_items, g), tp, E_BLOCK_VALUE)
                    if st != OK:
                        return _err(tb, st, i, g, PH_CACHED, FLD_BLOCKS)
                    base = 0
                    if not resumed:
                        if nn > 0 and ld32(a_scr, O_NEW + row) == stamp:
                            base = ld32(a_scr, O_NB + g * R + ld32(a_scr, O_NEWPOS + row))
                        else:
                            base = ld32(a_state, (F_NB + g) * R + row)
                    if base + c > bt_w[g]:
                        return _err(tb, E_BLOCK_OVERFLOW, i, g, PH_CACHED, FLD_BLOCKS)
                    nstage += 1 + c
                    if c > 0:
                        prefetch(bt_addr[g] + 4 * (np.int64(row) * bt_w[g] + base))
    if staging and nstage > stg_cap:
        return _err(tb, E_STAGE_FULL, -1, nstage, 0, FLD_NONE)
    if nst != 0:
        st = resolve_batch(
            tb,
            tp,
            allow,
            ix[IX_DICT_OK],
            R,
            nst,
            spec,
            total,
            i_cid,
            nc,
            a_scr + 4 * O_ROWS,
            i_new,
            nn,
            a_scr + 4 * O_NEWROW,
            slots,
            mask,
            keys,
            kw,
            seed,
            hmask,
            new_tab,
            ntab_mask,
            new_hash,
            new_ptr,
            new_len,
            a_scr,
            stamp,
            nfreed,
        )
        if st != OK:
            return st
    # the arena grows (in Python) only for a step that is valid otherwise
    short = _arena_short(ix, need_words)
    if short > 0:
        return _err(tb, E_KEY_TOO_LONG, -1, short, PH_NEW, FLD_REQ_ID)

    # ---------------- pass 2: apply ----------------------------------------
    nt = 0
    ns = ntok if staging else 0
    # freed rows, ascending: the result's order, and the order they are freed in
    freed = res[2 * R : 2 * R + nfreed]
    for f in range(nfreed):
        freed[f] = scr[O_FREED + f]
    _heapsort(freed, nfreed)
    for f in range(nfreed):
        r = freed[f]
        _ix_free_row(ix, slots, row_hash, key_len, r)
        pp = ld32(a_rpp, r)
        if 0 <= pp < prev_n and ld32(a_prev_row, pp) == r:
            st32(a_prev_row, pp, -1)
            if cid == 0 and tb[TB_PREV_OWNED] != 0:
                # no update follows in this call to hand the prediction's
                # references on (see _commit_prediction): release the freed
                # id's now, so that a finished id is not kept alive
                obj = ld64(a_prev_obj, pp)
                if obj != 0:
                    st64(a_prev_obj, pp, 0)
                    decref(obj)
    for k in range(nn):
        d = k * NEW_STRIDE
        r = scr[O_NEWROW + k]
        res[nc + k] = r
        _write_key(ix, keys, kw, key_len, row_hash, r, new_ptr[k], new_len[k], new_hash[k])
        _slot_insert(slots, mask, new_hash[k], r)
        ix[IX_NUM_LIVE] += 1
        plen, st = _int_of(_item(i_new, d + N_PLEN), tp)
        nct, st = _int_of(_item(i_new, d + N_NCT), tp)
        mt, st = _int_of(_item(i_new, d + N_MAXT), tp)
        tkind, st = _int_of(_item(i_new, d + N_TOK_KIND), tp)
        taddr, st = _int_of(_item(i_new, d + N_TOK), tp)
        tn, st = _int_of(_item(i_new, d + N_TOK_N), tp)
        vk, vb, npf, st = _vec(tkind, taddr, tn, tp, array_ok)
        tbase = np.int64(r) * L
        if tok_host:
            if vk == V_I32:  # int32 tokens (vLLM's TokenBuffer): a plain copy
                for t in range(npf):
                    st32(tb[TB_TOK], tbase + t, ld32(vb, t))
            else:
                for t in range(npf):
                    v, st = _vget(vk, vb, t, tp)
                    tok[tbase + t] = v
        if staging and flat_tok >= 0:
            for t in range(npf):
                stg_pos[ns] = flat_tok + tbase + t
                stg_val[ns] = tok[tbase + t]
                ns += 1
        elif staging and tok_ext:
            # an external target is the only copy (no host one): from the
            # request's own tokens, validated in pass 1
            for t in range(npf):
                v, st = _vget(vk, vb, t, tp)
                stg_pos[nt] = tbase + t
                stg_val[nt] = v
                nt += 1
        state[F_NCT * R + r] = nct
        state[F_NCPT * R + r] = min(nct, npf)
        state[F_PREFILL * R + r] = npf
        state[F_PROMPT * R + r] = plen
        state[F_MAXSEQ * R + r] = plen + mt
        b_items, b_n, ok = _seq(_desc(i_new, d + N_BLK, tp), tp)
        for g in range(ng):
            c = scr[O_NB + g * R + k]
            state[(F_NB + g) * R + r] = c
            ns = _write_group(
                _item(b_items, g), tp, bt_addr[g], bt_w[g], r, 0, staging, a_stg_pos, a_stg_val, ns, flat_bt[g]
            )
        if staging:
            for f in range(F_NB + ng):
                if (fields >> f) & 1:
                    stg_pos[ns] = f * SR + r
                    stg_val[ns] = state[f * R + r]
                    ns += 1
            if eng >= 0:  # the engine's own copies, seeded once per added row
                stg_pos[ns] = eng + ENG_TOTAL_LEN * SR + r
                stg_val[ns] = npf
                stg_pos[ns + 1] = eng + ENG_NCT * SR + r
                stg_val[ns + 1] = nct
                ns += 2
    # (freeing lowered the free-row hint; rows below it are still all live)
    if cid != 0:
        none = tp[5]
        for i in range(nc):
            r = ld32(a_scr, O_ROWS + i)
            v = ld32(a_scr, O_NCT + i)
            res[i] = r
            ns = _put(a_state, F_NCT * R + r, F_NCT * SR + r, v, stg_nct, a_stg_pos, a_stg_val, ns)
            m = min(v, ld32(a_state, F_PREFILL * R + r))
            ns = _put(a_state, F_NCPT * R + r, F_NCPT * SR + r, m, stg_ncpt, a_stg_pos, a_stg_val, ns)
            b = _item(i_cblk, i)
            if b != none:
                resumed = ld32(a_scr, O_FLAGS + i) == 1
                ns = _append_blocks(
                    b,
                    resumed,
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
            # remember this update's order and objects for the next prediction
            # (row_prev_pos[r] is trusted only where prev_row points back at r)
            st64(a_prev_obj_next, i, _owned_obj(_item(i_cid, i), tp))
            st32(a_prev_row_next, i, r)
            st32(a_rpp_next, r, i)
        _commit_prediction(tb, a_scr, R, stamp, nc, hits, nmiss, a_prev_obj, prev_n, a_prev_obj_next)
    tb[TB_RES_NC] = nc
    tb[TB_RES_NN] = nn
    tb[TB_RES_NF] = nfreed
    tb[TB_STG_N] = ns
    tb[TB_STG_TOK_N] = nt
    if nst != 0:
        write_batch(tb, R, a_state)
    return OK
