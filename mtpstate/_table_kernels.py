"""numba kernel that applies one scheduler step to a RequestTable.

Private; launched by ``RequestTable`` (table.py) with integer arguments only:
the addresses of the index and table contexts and of the scheduler's Python
lists (0 = absent). Pass 1 reads everything and validates it against the state
as the step would leave it; pass 2 mutates, and also appends every changed
element (flat position, value) to the staging buffers of the device mirror
when that is on. Nothing is written before pass 1 has accepted the whole step.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import (
    E_BLOCK_OVERFLOW,
    E_BLOCK_VALUE,
    E_CAPACITY,
    E_DUPLICATE,
    E_FALLBACK,
    E_GROUPS,
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
    INT32_MAX,
    IX_FREE_HINT,
    IX_NUM_LIVE,
    IX_SIZE,
    OK,
    PH_CACHED,
    PH_FINISH,
    PH_NEW,
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
    _raw_equal,
    _seq,
    _slot_insert,
    _write_key,
)
from mtpstate._native import decref, incref, jit, ld32, ld64, prefetch, st32, st64, view_i32, view_i64

# per-row int32 fields of the state array, [NUM_FIELDS, max_num_reqs]
F_NCT = 0  # num_computed_tokens
F_NCPT = 1  # num_computed_prefill_tokens
F_PREFILL = 2  # prefill_len
F_PROMPT = 3  # prompt_len
F_MAXSEQ = 4  # max_seq_len
F_NB = 5  # num_blocks of group g at F_NB + g

# table context slots
TB_STATE = 0  # addr int32[F_NB + ng, R]
TB_R = 1
TB_NG = 2
TB_BT_ADDR = 3  # addr int64[ng]: address of each group's block table [R, W_g]
TB_BT_W = 4  # addr int64[ng]: W_g
TB_TOK = 5  # addr int32[R, L]
TB_L = 6
# The prediction state is double-buffered ([2, R] each): a step reads buffer
# TB_PREV_CUR and writes the other, which becomes current only if the step
# is accepted, so a rejected step leaves the prediction as it was.
TB_PREV_OBJ = 7  # addr int64[2, R]: id objects of the previous update, by position
TB_PREV_ROW = 8  # addr int32[2, R]: their rows (-1 once freed)
TB_ROW_PREV_POS = 9  # addr int32[2, R]: position of each row (valid where prev_row points back)
TB_PREV_N = 10
TB_SCR = 11  # addr int32[NUM_SCR, R] scratch
TB_STAMP = 12
TB_ERR_POS = 13
TB_ERR_ARG = 14
TB_ERR_PHASE = 15
TB_STG_POS = 16  # addr int64[cap]: flat positions of changed elements
TB_STG_VAL = 17  # addr int32[cap]: their values
TB_STG_CAP = 18
TB_STG_N = 19
TB_STG_ON = 20
TB_FLAT_BT = 21  # addr int64[ng]: flat offset of each block table
TB_FLAT_TOK = 22  # flat offset of token_ids; -1: not mirrored
TB_VALIDATE_ONLY = 23  # 1: stop after pass 1 (dry run: validation only)
TB_PREV_CUR = 24  # which prediction buffer is current
TB_PREV_OWNED = 25  # 1: the table holds a reference to each object of the current buffer
TB_STG_DUPS = 26  # 1: this step staged some element twice (a row added and updated by it)
TB_EXCLUDE_STAMP = 27  # tb_update: rows marked freed with this stamp must not be updated (0: none)
TB_SIZE = 32

# scratch rows
S_ROWS = 0  # cached position -> row
S_NCT = 1  # cached position -> num_computed_tokens
S_FREE = 2  # stamp: row freed by this step
S_SEEN = 3  # stamp: row updated by this step
S_REDIRECT = 4  # freed row -> row its id is re-added at, -1
S_NEW = 5  # stamp: row assigned to a new request by this step
S_NEWPOS = 6  # row -> index of that new request
S_FREED = 7  # list of freed rows
S_NEWROW = 8  # new request index -> row
S_PRIOR = 9  # new request index -> its live row before the step, -1
S_MISS = 10  # positions of this update that were not identity hits (a list)
S_NB0 = 11  # + g: per-new-request block counts of group g


def num_scratch_rows(ng):
    return S_NB0 + ng


@jit
def _err(tb, code, pos, arg, phase):
    tb[TB_ERR_POS] = pos
    tb[TB_ERR_ARG] = arg
    tb[TB_ERR_PHASE] = phase
    return code


@jit(inline="always")
def _check_int31_list(seq, tp, value_error):
    """(count, status) of a list of ints each in [0, 2**31) (token ids, block
    ids); ``value_error`` is the status for a value out of range."""
    items, n, ok = _seq(seq, tp)
    if not ok:
        return 0, E_NOT_CANONICAL
    for j in range(n):
        v, st = _int_of(_item(items, j), tp)
        if st != OK:
            return 0, st
        if v < 0 or v > INT32_MAX:
            return 0, value_error
    return n, OK


@jit(inline="always")
def _put(a_state, pos, v, staging, a_stg_pos, a_stg_val, ns):
    """state[pos] = v; stage it for the device only if the value changed
    (bytes shipped grow with what changed)."""
    old = ld32(a_state, pos)
    st32(a_state, pos, v)
    if staging and old != v:
        st64(a_stg_pos, ns, pos)
        st32(a_stg_val, ns, v)
        ns += 1
    return ns


@jit(inline="always")
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


@jit(inline="always")
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


@jit
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
            incref(ld64(a_prev_obj_next, ld32(a_scr, o_miss + k)))
    else:
        # +1 for every remembered object, -1 for every forgotten one
        for i in range(nc):
            if own_next:
                incref(ld64(a_prev_obj_next, i))
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
    row = -1
    if klen <= (kw - 1) * 8:
        row = _probe(slots, mask, keys, kw, h, ptr, klen)
    if row >= 0:
        pp = ld32(a_rpp, row)
        if 0 <= pp < prev_n and ld32(a_prev_row, pp) == row:
            j = pp + 1
    return row, j, OK, h, ptr, klen


@jit
def tb_step(ixc, tbc, fin, nid, nplen, npre, nblk, nnct, nmax, cid, cnct, cblk, cres):
    ix = view_i64(ixc, IX_SIZE)
    tb = view_i64(tbc, TB_SIZE)
    tp = _pytypes(ix)
    slots, row_hash, keys, key_len = _ix_arrays(ix)
    mask, kw, seed, hmask, allow = _ix_params(ix)
    R, ng, L = tb[TB_R], tb[TB_NG], tb[TB_L]
    state = view_i32(tb[TB_STATE], (F_NB + ng) * R)
    bt_addr = view_i64(tb[TB_BT_ADDR], ng)
    bt_w = view_i64(tb[TB_BT_W], ng)
    tok = view_i32(tb[TB_TOK], R * L)
    cur = tb[TB_PREV_CUR]
    prev_n = tb[TB_PREV_N]
    scr = view_i32(tb[TB_SCR], (S_NB0 + ng) * R)
    staging = tb[TB_STG_ON] != 0
    stg_cap = tb[TB_STG_CAP]
    stg_pos = view_i64(tb[TB_STG_POS], stg_cap)
    stg_val = view_i32(tb[TB_STG_VAL], stg_cap)
    flat_bt = view_i64(tb[TB_FLAT_BT], ng)
    flat_tok = tb[TB_FLAT_TOK]
    a_state = tb[TB_STATE]
    a_scr = tb[TB_SCR]
    a_prev_obj, a_prev_row, a_rpp, a_prev_obj_next, a_prev_row_next, a_rpp_next = _prediction_buffers(tb, R, cur)
    a_stg_pos = tb[TB_STG_POS]
    a_stg_val = tb[TB_STG_VAL]
    stamp = tb[TB_STAMP] + 1
    tb[TB_STAMP] = stamp
    tb[TB_STG_DUPS] = 0
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
    O_NB = S_NB0 * R
    need_bytes = 0
    nstage = 0

    # ---------------- pass 1: read and validate, write nothing -------------
    # finish: finished_req_ids | preempted_req_ids; unknown ids are ignored
    nfreed = 0
    min_freed = R
    if fin != 0:
        items, n, ok = _seq(fin, tp)
        if not ok:
            return _err(tb, E_NOT_CANONICAL, -1, 0, PH_FINISH)
        for i in range(n):
            ptr, klen, st = _key_of(_item(items, i), allow, tp)
            if st != OK:
                return _err(tb, st, i, 0, PH_FINISH)
            if klen > (kw - 1) * 8:
                continue
            h = _hash_key(ptr, klen, seed, hmask)
            r = _probe(slots, mask, keys, kw, h, ptr, klen)
            if r >= 0 and scr[O_FREE + r] != stamp:
                scr[O_FREE + r] = stamp
                scr[O_RED + r] = -1
                scr[O_FREED + nfreed] = r
                nfreed += 1
                min_freed = min(min_freed, r)

    # new requests: a live id is removed first (re-sent request)
    nn = 0
    new_ptr = np.empty(0, np.int64)
    new_len = np.empty(0, np.int64)
    new_hash = np.empty(0, np.uint64)
    new_tab = np.empty(0, np.int64)
    ntab_mask = 0
    if nid != 0:
        items, nn, ok = _seq(nid, tp)
        i_plen, n1, ok1 = _seq(nplen, tp)
        i_pre, n2, ok2 = _seq(npre, tp)
        i_blk, n3, ok3 = _seq(nblk, tp)
        i_nct, n4, ok4 = _seq(nnct, tp)
        i_max, n5, ok5 = _seq(nmax, tp)
        if not (ok and ok1 and ok2 and ok3 and ok4 and ok5):
            return _err(tb, E_NOT_CANONICAL, -1, 0, PH_NEW)
        if n1 != nn or n2 != nn or n3 != nn or n4 != nn or n5 != nn:
            return _err(tb, E_LENGTHS, -1, 0, PH_NEW)
        if nn > R:
            return _err(tb, E_CAPACITY, -1, nn, PH_NEW)
        new_ptr = np.empty(nn, np.int64)
        new_len = np.empty(nn, np.int64)
        new_hash = np.empty(nn, np.uint64)
        tsize = 8
        while tsize < 2 * nn:
            tsize *= 2
        ntab_mask = tsize - 1
        new_tab = np.full(tsize, -1, np.int64)
        for k in range(nn):
            ptr, klen, st = _key_of(_item(items, k), allow, tp)
            if st != OK:
                return _err(tb, st, k, 0, PH_NEW)
            h = _hash_key(ptr, klen, seed, hmask)
            s = np.int64(h & np.uint64(ntab_mask))
            while new_tab[s] >= 0:
                j = new_tab[s]
                if new_hash[j] == h and _raw_equal(new_ptr[j], new_len[j], ptr, klen):
                    return _err(tb, E_DUPLICATE, k, j, PH_NEW)
                s = (s + 1) & ntab_mask
            new_tab[s] = k
            new_ptr[k] = ptr
            new_len[k] = klen
            new_hash[k] = h
            prior = -1
            if klen > (kw - 1) * 8:
                need_bytes = max(need_bytes, klen)
            else:
                prior = _probe(slots, mask, keys, kw, h, ptr, klen)
            scr[O_PRIOR + k] = prior
            if prior >= 0 and scr[O_FREE + prior] != stamp:
                scr[O_FREE + prior] = stamp
                scr[O_RED + prior] = -1
                scr[O_FREED + nfreed] = prior
                nfreed += 1
                min_freed = min(min_freed, prior)
            # payload
            plen, st = _int_of(_item(i_plen, k), tp)
            if st != OK:
                return _err(tb, st, k, 0, PH_NEW)
            npf, st = _check_int31_list(_item(i_pre, k), tp, E_TOKEN_VALUE)
            if st != OK:
                return _err(tb, st, k, 0, PH_NEW)
            if plen < 0 or plen > L or npf > L:
                return _err(tb, E_TOO_LONG, k, max(plen, npf), PH_NEW)
            nct, st = _int_of(_item(i_nct, k), tp)
            if st != OK:
                return _err(tb, st, k, 0, PH_NEW)
            if nct < 0 or nct > npf:
                return _err(tb, E_NEW_NCT_RANGE, k, nct, PH_NEW)
            mt, st = _int_of(_item(i_max, k), tp)
            if st != OK:
                return _err(tb, st, k, 0, PH_NEW)
            if mt < 0 or plen + mt > INT32_MAX:
                return _err(tb, E_MAX_TOKENS, k, mt, PH_NEW)
            b_items, b_n, ok = _seq(_item(i_blk, k), tp)
            if not ok:
                return _err(tb, E_NOT_CANONICAL, k, 0, PH_NEW)
            if b_n != ng:
                return _err(tb, E_GROUPS, k, b_n, PH_NEW)
            nstage += F_NB + ng
            if flat_tok >= 0:
                nstage += npf
            for g in range(ng):
                c, st = _check_int31_list(_item(b_items, g), tp, E_BLOCK_VALUE)
                if st != OK:
                    return _err(tb, st, k, g, PH_NEW)
                if c > bt_w[g]:
                    return _err(tb, E_BLOCK_OVERFLOW, k, g, PH_NEW)
                scr[O_NB + g * R + k] = c
                nstage += c
        # rows: the lowest free rows (freed by this step included), in order
        cursor = min(ix[IX_FREE_HINT], min_freed)
        for k in range(nn):
            while cursor < R and not (key_len[cursor] < 0 or scr[O_FREE + cursor] == stamp):
                cursor += 1
            if cursor >= R:
                return _err(tb, E_CAPACITY, k, nn, PH_NEW)
            scr[O_NEWROW + k] = cursor
            scr[O_NEW + cursor] = stamp
            scr[O_NEWPOS + cursor] = k
            cursor += 1
        for k in range(nn):
            prior = scr[O_PRIOR + k]
            if prior >= 0:
                scr[O_RED + prior] = scr[O_NEWROW + k]

    # cached requests: predicted from the previous update's order, verified
    nc = 0
    i_cid = 0
    i_cblk = 0
    i_cres = 0
    if cid != 0:
        i_cid, nc, ok = _seq(cid, tp)
        i_cnct, n1, ok1 = _seq(cnct, tp)
        i_cblk, n2, ok2 = _seq(cblk, tp)
        ok3 = True
        n3 = nc
        if cres != 0:
            i_cres, n3, ok3 = _seq(cres, tp)
        if not (ok and ok1 and ok2 and ok3):
            return _err(tb, E_NOT_CANONICAL, -1, 0, PH_CACHED)
        if n1 != nc or n2 != nc or n3 != nc:
            return _err(tb, E_LENGTHS, -1, 0, PH_CACHED)
        if nc > R:
            return _err(tb, E_DUPLICATE, -1, nc, PH_CACHED)
        none = tp[5]
        true_ = tp[6]
        j = 0
        hits = 0
        nmiss = 0
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
                return _err(tb, st, i, 0, PH_CACHED)
            via_new = False
            if row < 0 and nn > 0:
                # not live before this step: maybe added by it
                s = np.int64(h & np.uint64(ntab_mask))
                while new_tab[s] >= 0:
                    k = new_tab[s]
                    if new_hash[k] == h and _raw_equal(new_ptr[k], new_len[k], ptr, klen):
                        row = scr[O_NEWROW + k]
                        via_new = True
                        break
                    s = (s + 1) & ntab_mask
            if row < 0:
                return _err(tb, E_UNKNOWN, i, 0, PH_CACHED)
            if nfreed > 0 and not via_new and ld32(a_scr, O_FREE + row) == stamp:
                row = ld32(a_scr, O_RED + row)
                if row < 0:
                    return _err(tb, E_UNKNOWN, i, 1, PH_CACHED)
            if nn > 0 and ld32(a_scr, O_NEW + row) == stamp:
                tb[TB_STG_DUPS] = 1
            if ld32(a_scr, O_SEEN + row) == stamp:
                return _err(tb, E_DUPLICATE, i, 0, PH_CACHED)
            st32(a_scr, O_SEEN + row, stamp)
            v, st = _int_of(_item(i_cnct, i), tp)
            if st != OK:
                return _err(tb, st, i, 0, PH_CACHED)
            if v < 0 or v > L:
                return _err(tb, E_NCT_RANGE, i, v, PH_CACHED)
            st32(a_scr, O_ROWS + i, row)
            st32(a_scr, O_NCT + i, v)
            nstage += 2
            b = _item(i_cblk, i)
            if b != none:
                b_items, b_n, ok = _seq(b, tp)
                if not ok:
                    return _err(tb, E_NOT_CANONICAL, i, 0, PH_CACHED)
                if b_n != ng:
                    return _err(tb, E_GROUPS, i, b_n, PH_CACHED)
                resumed = False
                if cres != 0:
                    f = _item(i_cres, i)
                    if f == true_:
                        resumed = True
                    elif f != tp[7]:
                        return _err(tb, E_NOT_CANONICAL, i, 0, PH_CACHED)
                for g in range(ng):
                    c, st = _check_int31_list(_item(b_items, g), tp, E_BLOCK_VALUE)
                    if st != OK:
                        return _err(tb, st, i, g, PH_CACHED)
                    base = 0
                    if not resumed:
                        if nn > 0 and ld32(a_scr, O_NEW + row) == stamp:
                            base = ld32(a_scr, O_NB + g * R + ld32(a_scr, O_NEWPOS + row))
                        else:
                            base = ld32(a_state, (F_NB + g) * R + row)
                    if base + c > bt_w[g]:
                        return _err(tb, E_BLOCK_OVERFLOW, i, g, PH_CACHED)
                    nstage += 1 + c
                    if c > 0:
                        prefetch(bt_addr[g] + 4 * (np.int64(row) * bt_w[g] + base))
    if need_bytes > 0:
        return _err(tb, E_KEY_TOO_LONG, -1, need_bytes, PH_NEW)
    if staging and nstage > stg_cap:
        return _err(tb, E_STAGE_FULL, -1, nstage, 0)

    if tb[TB_VALIDATE_ONLY] != 0:
        return OK

    # ---------------- pass 2: apply ----------------------------------------
    ns = 0
    for f in range(nfreed):
        r = scr[O_FREED + f]
        _ix_free_row(ix, slots, row_hash, key_len, r)
        pp = ld32(a_rpp, r)
        if 0 <= pp < prev_n and ld32(a_prev_row, pp) == r:
            st32(a_prev_row, pp, -1)
    if nn > 0:
        i_pre, n2, ok2 = _seq(npre, tp)
        i_blk, n3, ok3 = _seq(nblk, tp)
        i_plen, n1, ok1 = _seq(nplen, tp)
        i_nct, n4, ok4 = _seq(nnct, tp)
        i_max, n5, ok5 = _seq(nmax, tp)
        for k in range(nn):
            r = scr[O_NEWROW + k]
            _write_key(keys, kw, key_len, row_hash, r, new_ptr[k], new_len[k], new_hash[k])
            _slot_insert(slots, mask, new_hash[k], r)
            ix[IX_NUM_LIVE] += 1
            plen, st = _int_of(_item(i_plen, k), tp)
            nct, st = _int_of(_item(i_nct, k), tp)
            mt, st = _int_of(_item(i_max, k), tp)
            p_items, npf, ok = _seq(_item(i_pre, k), tp)
            tbase = np.int64(r) * L
            for t in range(npf):
                v, st = _int_of(_item(p_items, t), tp)
                tok[tbase + t] = v
                if staging and flat_tok >= 0:
                    stg_pos[ns] = flat_tok + tbase + t
                    stg_val[ns] = v
                    ns += 1
            state[F_NCT * R + r] = nct
            state[F_NCPT * R + r] = min(nct, npf)
            state[F_PREFILL * R + r] = npf
            state[F_PROMPT * R + r] = plen
            state[F_MAXSEQ * R + r] = plen + mt
            b_items, b_n, ok = _seq(_item(i_blk, k), tp)
            for g in range(ng):
                c = scr[O_NB + g * R + k]
                state[(F_NB + g) * R + r] = c
                ns = _write_group(
                    _item(b_items, g),
                    tp,
                    bt_addr[g],
                    bt_w[g],
                    r,
                    0,
                    staging,
                    a_stg_pos,
                    a_stg_val,
                    ns,
                    flat_bt[g],
                )
            if staging:
                for f in range(F_NB + ng):
                    stg_pos[ns] = f * R + r
                    stg_val[ns] = state[f * R + r]
                    ns += 1
        if min_freed < ix[IX_FREE_HINT]:
            ix[IX_FREE_HINT] = min_freed
    elif min_freed < ix[IX_FREE_HINT]:
        ix[IX_FREE_HINT] = min_freed
    if cid != 0:
        i_cid, nc, ok = _seq(cid, tp)
        none = tp[5]
        for i in range(nc):
            r = ld32(a_scr, O_ROWS + i)
            v = ld32(a_scr, O_NCT + i)
            ns = _put(a_state, F_NCT * R + r, v, staging, a_stg_pos, a_stg_val, ns)
            m = min(v, ld32(a_state, F_PREFILL * R + r))
            ns = _put(a_state, F_NCPT * R + r, m, staging, a_stg_pos, a_stg_val, ns)
            b = _item(i_cblk, i)
            if b != none:
                resumed = cres != 0 and _item(i_cres, i) == tp[6]
                b_items, b_n, ok = _seq(b, tp)
                for g in range(ng):
                    nbpos = (F_NB + g) * R + r
                    start = 0 if resumed else ld32(a_state, nbpos)
                    gi, c, ok = _seq(_item(b_items, g), tp)
                    ns = _write_group(
                        _item(b_items, g),
                        tp,
                        bt_addr[g],
                        bt_w[g],
                        r,
                        start,
                        staging,
                        a_stg_pos,
                        a_stg_val,
                        ns,
                        flat_bt[g],
                    )
                    st32(a_state, nbpos, start + c)
                    if staging:
                        st64(a_stg_pos, ns, nbpos)
                        st32(a_stg_val, ns, start + c)
                        ns += 1
            # remember this update's order and objects for the next prediction
            # (row_prev_pos[r] is trusted only where prev_row points back at r)
            st64(a_prev_obj_next, i, _item(i_cid, i))
            st32(a_prev_row_next, i, r)
            st32(a_rpp_next, r, i)
        _commit_prediction(tb, a_scr, R, stamp, nc, hits, nmiss, a_prev_obj, prev_n, a_prev_obj_next)
    tb[TB_STG_N] = ns
    return OK


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


@jit
def tb_update(ixc, tbc, cid, cnct, cblk, cres):
    """The running requests' update in a single pass: an update-only step
    (the steady state of decoding), or the update part of a step whose
    finish and add touch none of its rows (``TB_EXCLUDE_STAMP``, see
    ``RequestTable._apply_split``).

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
    cur = tb[TB_PREV_CUR]
    prev_n = tb[TB_PREV_N]
    a_prev_obj, a_prev_row, a_rpp, a_prev_obj_next, a_prev_row_next, a_rpp_next = _prediction_buffers(tb, R, cur)
    staging = tb[TB_STG_ON] != 0
    stg_cap = tb[TB_STG_CAP]
    a_stg_pos = tb[TB_STG_POS]
    a_stg_val = tb[TB_STG_VAL]
    excl = tb[TB_EXCLUDE_STAMP]
    stamp = tb[TB_STAMP] + 1
    tb[TB_STAMP] = stamp
    O_NCT = S_NCT * R
    O_ROWS = S_ROWS * R
    O_MISS = S_MISS * R
    i_cid, nc, ok = _seq(cid, tp)
    i_cnct, n1, ok1 = _seq(cnct, tp)
    i_cblk, n2, ok2 = _seq(cblk, tp)
    i_cres = 0
    ok3 = True
    n3 = nc
    if cres != 0:
        i_cres, n3, ok3 = _seq(cres, tp)
    if not (ok and ok1 and ok2 and ok3):
        return _err(tb, E_NOT_CANONICAL, -1, 0, PH_CACHED)
    if n1 != nc or n2 != nc or n3 != nc:
        return _err(tb, E_LENGTHS, -1, 0, PH_CACHED)
    if nc > R:
        return _err(tb, E_DUPLICATE, -1, nc, PH_CACHED)
    if staging and 2 * nc > stg_cap:
        return _err(tb, E_STAGE_FULL, -1, 2 * nc, 0)
    none = tp[5]
    true_ = tp[6]
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
        if st != OK:
            code = st
        elif row < 0:
            code = E_UNKNOWN
        elif dup:
            code = E_DUPLICATE
        elif excl != 0 and ld32(a_scr, S_FREE * R + row) == excl:
            code = E_FALLBACK  # finished or re-sent by this step
        else:
            v, st = _int_of(_item(i_cnct, i), tp)
            if st != OK:
                code = st
            elif v < 0 or v > L:
                code = E_NCT_RANGE
                arg = v
            else:
                b = _item(i_cblk, i)
                if b != none:
                    b_items, b_n, ok = _seq(b, tp)
                    resumed = False
                    if cres != 0:
                        f = _item(i_cres, i)
                        if f == true_:
                            resumed = True
                        elif f != tp[7]:
                            ok = False
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
                            base = 0 if resumed else ld32(a_state, (F_NB + g) * R + row)
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
            return _err(tb, code, i, arg, PH_CACHED)
        st32(a_scr, O_NCT + i, ld32(a_state, F_NCT * R + row))  # undo log
        ns = _put(a_state, F_NCT * R + row, v, staging, a_stg_pos, a_stg_val, ns)
        m = min(v, ld32(a_state, F_PREFILL * R + row))
        ns = _put(a_state, F_NCPT * R + row, m, staging, a_stg_pos, a_stg_val, ns)
        if not sync:
            st64(a_prev_obj_next, i, obj)
            st32(a_prev_row_next, i, row)
            st32(a_rpp_next, row, i)
    if staging and ns + nstage_blocks > stg_cap:
        _undo_update(a_state, a_scr, a_prev_row if sync else a_prev_row_next, R, nc)
        return _err(tb, E_STAGE_FULL, -1, ns + nstage_blocks, 0)
    unchanged = sync and nc == prev_n  # the same objects in the same order: keep the prediction
    if sync and not unchanged:
        _materialize(a_prev_obj, a_prev_row, a_prev_obj_next, a_prev_row_next, a_rpp_next, nc)
    a_rows = a_prev_row if unchanged else a_prev_row_next
    # accepted: block appends, then the prediction buffer becomes current
    for k in range(nblk):
        i = ld32(a_scr, O_ROWS + k)
        r = ld32(a_rows, i)
        resumed = cres != 0 and _item(i_cres, i) == true_
        b_items, b_n, ok = _seq(_item(i_cblk, i), tp)
        for g in range(ng):
            nbpos = (F_NB + g) * R + r
            start = 0 if resumed else ld32(a_state, nbpos)
            gi, c, ok = _seq(_item(b_items, g), tp)
            ns = _write_group(
                _item(b_items, g), tp, bt_addr[g], bt_w[g], r, start, staging, a_stg_pos, a_stg_val, ns, flat_bt[g]
            )
            st32(a_state, nbpos, start + c)
            if staging:
                st64(a_stg_pos, ns, nbpos)
                st32(a_stg_val, ns, start + c)
                ns += 1
    if not unchanged:
        _commit_prediction(tb, a_scr, R, stamp, nc, hits, nmiss, a_prev_obj, prev_n, a_prev_obj_next)
    tb[TB_STG_N] = ns
    return OK
