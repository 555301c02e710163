"""numba helpers that build the step's batch (vLLM's ``BatchReqState``).

Private; called by the step kernel (step.py) in two phases, so that a
rejected batch leaves the step unapplied like any other bad input:

- ``resolve_batch`` (with the step's validation, before anything is
  written): reads ``num_scheduled_tokens`` and ``scheduled_spec_decode_tokens``
  in place (``PyDict_Next``), finds each scheduled id's row, checks every
  count, and orders the batch as vLLM's ``sort_batch_req_ids`` does;
- ``write_batch`` (after the step is applied): gathers the per-request state
  of the batch in that order and permutes the Python list of ids into it.

Rows are found the way the update finds them: the scheduler lists
``num_scheduled_tokens`` in the order of the cached then the new requests, with
the very same str objects, so position i is checked against the i-th
scheduled id by identity, then by bytes, and only then by a hash probe.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.add import _table_find
from mtpstate._kernels.cpython import (
    DICT_MA_USED,
    OFF_ITEMS,
    OFF_SIZE,
    OFF_TYPE,
    err_clear,
    incref,
    list_new,
    list_set_item,
)
from mtpstate._kernels.index import _hash_key, _ix_arrays, _ix_params, _probe, _raw_equal
from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import ld32, ld64, load_i64, st8, st32, st64, view_i64
from mtpstate._kernels.pyobjects import _dict_item, _dict_open, _int_of, _item, _key_of
from mtpstate._kernels.slots import (
    B_DRAFTS,
    B_MAXSEQ,
    B_NCPT,
    B_NUM_SCHED,
    B_PERM,
    B_POS_DRAFTS,
    B_POS_NUM,
    B_POS_ROW,
    B_PREFILL,
    B_ROW_POS,
    B_ROW_STAMP,
    BB_PREFILLING,
    BB_RUNS_AS_DECODE,
    BI_CU_LOGITS,
    BI_NCT,
    BI_QSL,
    BI_ROWS,
    BI_SEQ_UB,
    BO_KEYS,
    BO_SORT,
    F_MAXSEQ,
    F_NCPT,
    F_NCT,
    F_PREFILL,
    IX_DICT_OK,
    N_KEY,
    NEW_STRIDE,
    S_FREE,
    TB_B_EXP_CAP,
    TB_B_EXP_OK,
    TB_B_GRAPH_OK,
    TB_B_HAS_DRAFTS,
    TB_B_HAS_PREFILL,
    TB_B_HOLDER,
    TB_B_LOGITS_FIT,
    TB_B_MAX_QUERY,
    TB_B_N,
    TB_B_NEXT_N,
    TB_B_NUM_DRAFTS,
    TB_B_NUM_LOGITS,
    TB_B_NUM_TOKENS,
    TB_B_STAMP,
    TB_BATCH,
    TB_BATCH_BOOL,
    TB_BATCH_IDX,
    TB_BATCH_OBJ,
    TB_BEXP,
    TB_BIN,
    TB_BONUS,
    TB_DQL,
    TB_R,
    TB_SCR,
    TB_STATE,
    _err,
)
from mtpstate._kernels.status import (
    E_BATCH_SIZE,
    E_CHANGED,
    E_COUNT_VALUE,
    E_DUPLICATE,
    E_INT_RANGE,
    E_NOT_CANONICAL,
    E_TOTAL,
    E_UNKNOWN,
    FLD_COUNT,
    FLD_DRAFTS,
    FLD_REQ_ID,
    FLD_TOTAL,
    INT32_MAX,
    OK,
    PH_BATCH,
    PH_SPEC,
)


@jit
def _row_of_key(ptr, klen, lookup):
    """Row an id will have once the step is applied, or -1: added by this
    step (its new row), else live before it and not freed by it. ``lookup``:
    the index arrays, this step's new-id table and its freed-row stamps, as
    ``resolve_batch`` packs them."""
    (ix_slots, mask, keys, kw, seed, hmask, new_tab, ntab_mask, new_hash, new_ptr, new_len, nn, a_rows_n, a_scr, R,
     stamp, nfreed) = lookup  # fmt: skip
    h = _hash_key(ptr, klen, seed, hmask)
    if nn > 0:
        k = _table_find(new_tab, ntab_mask, new_hash, new_ptr, new_len, h, ptr, klen)
        if k >= 0:
            return ld32(a_rows_n, k)
    r = _probe(ix_slots, mask, keys, kw, h, ptr, klen)
    if r >= 0 and nfreed > 0 and ld32(a_scr, S_FREE * R + r) == stamp:
        return -1  # freed by this step (a re-sent id was found among the new ones above)
    return r


@jit
def _same_key(a, b, allow, tp):
    pa, na, sa = _key_of(a, allow, tp)
    pb, nb, sb = _key_of(b, allow, tp)
    return sa == OK and sb == OK and _raw_equal(pa, na, pb, nb)


@jit(signature="void(int64[::1], int64, int64, int64)")
def _sift64(a, lo, i, n):
    v = a[lo + i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and a[lo + c + 1] > a[lo + c]:
            c += 1
        if a[lo + c] <= v:
            break
        a[lo + i] = a[lo + c]
        i = c
    a[lo + i] = v


@jit(signature="void(int64[::1], int64, int64)")
def _int64_heapsort(a, lo, n):
    """Sort a[lo:lo + n] ascending in place (keys are distinct)."""
    for start in range(n // 2 - 1, -1, -1):
        _sift64(a, lo, start, n)
    for end in range(n - 1, 0, -1):
        a[lo], a[lo + end] = a[lo + end], a[lo]
        _sift64(a, lo, 0, end)


# (the step's new ids as _new_keys builds them: addresses, lengths, hashes, table, mask)
_NEW_KEYS = "Tuple((int64[::1], int64[::1], uint64[::1], int64[::1], int64))"
_TP = "UniTuple(int64, 10)"


@jit
def _scheduled_rows(tb, tp, allow, dict_ok, R, nst, total, i_cid, nc, a_rows_c, new_desc, nn, a_rows_n, lookup):
    """Phase 1: each entry of num_scheduled_tokens, in dict order: its row
    (the usual owner of position i checked first), its count; the sum
    checked against total_num_scheduled_tokens. Returns (entries, status)."""
    a_b = tb[TB_BATCH]
    a_bo = tb[TB_BATCH_OBJ]
    bstamp = tb[TB_B_STAMP] + 1
    tb[TB_B_STAMP] = bstamp
    n = load_i64(nst + DICT_MA_USED)
    if n > R:
        return 0, _err(tb, E_BATCH_SIZE, -1, n, PH_BATCH, FLD_REQ_ID)
    O_ROW = B_POS_ROW * R
    O_NUM = B_POS_NUM * R
    O_DR = B_POS_DRAFTS * R
    O_STAMP = B_ROW_STAMP * R
    O_RPOS = B_ROW_POS * R
    O_KEYS = BO_KEYS * R
    sum_tokens = np.int64(0)
    direct, base, stride, nent = _dict_open(nst, dict_ok)
    pos = 0
    for i in range(n + 1):
        found, pos, k, val = _dict_item(nst, direct, base, stride, nent, pos)
        if i == n or found == 0:
            if (i == n) == (found == 0):
                break
            return 0, _err(tb, E_CHANGED, -1, 0, PH_BATCH, FLD_REQ_ID)  # pragma: no cover - GIL held
        v, st = _int_of(val, tp)
        if st == E_INT_RANGE or (st == OK and (v < 0 or v > INT32_MAX)):
            return 0, _err(tb, E_COUNT_VALUE, i, v if st == OK else -1, PH_BATCH, FLD_COUNT)
        if st != OK:
            return 0, _err(tb, st, i, 0, PH_BATCH, FLD_COUNT)
        # the i-th scheduled id (cached, then new) is the usual owner of position i
        e = 0
        erow = -1
        if i < nc:
            e = _item(i_cid, i)
            erow = ld32(a_rows_c, i)
        elif i < nc + nn:
            e = new_desc[(i - nc) * NEW_STRIDE + N_KEY]
            erow = ld32(a_rows_n, i - nc)
        row = erow if (e != 0 and k == e) else -1
        if row < 0:
            ptr, klen, st = _key_of(k, allow, tp)
            if st != OK:
                return 0, _err(tb, st, i, 0, PH_BATCH, FLD_REQ_ID)
            if e != 0 and _same_key(e, k, allow, tp):
                row = erow
            else:
                row = _row_of_key(ptr, klen, lookup)
            if row < 0:
                return 0, _err(tb, E_UNKNOWN, i, 0, PH_BATCH, FLD_REQ_ID)
        if ld32(a_b, O_STAMP + row) == bstamp:
            return 0, _err(tb, E_DUPLICATE, i, 0, PH_BATCH, FLD_REQ_ID)
        st32(a_b, O_STAMP + row, bstamp)
        st32(a_b, O_RPOS + row, i)
        st32(a_b, O_ROW + i, row)
        st32(a_b, O_NUM + i, v)
        st32(a_b, O_DR + i, 0)
        st64(a_bo, O_KEYS + i, k)
        sum_tokens += v
    if total != 0:
        t, st = _int_of(total, tp)
        if st != OK or t != sum_tokens:
            return 0, _err(tb, E_TOTAL, -1, sum_tokens, PH_BATCH, FLD_TOTAL)
    tb[TB_B_NUM_TOKENS] = sum_tokens
    tb[TB_B_NEXT_N] = n
    return n, OK


@jit
def _draft_counts(tb, tp, allow, dict_ok, R, spec, n, lookup):
    """Phase 2: each entry of scheduled_spec_decode_tokens (the same ids in
    the same order, usually) gives its id's draft count; an id that is not
    scheduled is ignored, as vLLM does."""
    a_b = tb[TB_BATCH]
    a_bo = tb[TB_BATCH_OBJ]
    bstamp = tb[TB_B_STAMP]
    O_DR = B_POS_DRAFTS * R
    O_STAMP = B_ROW_STAMP * R
    O_RPOS = B_ROW_POS * R
    O_KEYS = BO_KEYS * R
    has_drafts = 0
    direct, base, stride, nent = _dict_open(spec, dict_ok)
    pos = 0
    c = 0  # the position the next entry is predicted at
    j = 0
    while True:
        found, pos, k, val = _dict_item(spec, direct, base, stride, nent, pos)
        if found == 0:
            break
        has_drafts = 1
        t = load_i64(val + OFF_TYPE)
        if t != tp[0] and t != tp[1]:
            return _err(tb, E_NOT_CANONICAL, j, 0, PH_SPEC, FLD_DRAFTS)
        cnt = load_i64(val + OFF_SIZE)
        p = -1
        if c < n and ld64(a_bo, O_KEYS + c) == k:
            p = c
        else:
            ptr, klen, st = _key_of(k, allow, tp)
            if st != OK:
                return _err(tb, st, j, 0, PH_SPEC, FLD_REQ_ID)
            if c < n and _same_key(ld64(a_bo, O_KEYS + c), k, allow, tp):
                p = c
            else:
                row = _row_of_key(ptr, klen, lookup)
                if row >= 0 and ld32(a_b, O_STAMP + row) == bstamp:
                    p = ld32(a_b, O_RPOS + row)
        # an entry for an id that is not scheduled is ignored, as vLLM does
        if p >= 0:
            st32(a_b, O_DR + p, min(cnt, INT32_MAX))
            c = p + 1
        j += 1
    tb[TB_B_HAS_DRAFTS] = has_drafts
    return OK


@jit(signature="void(int64[::1], int64, int64)")
def _batch_order(tb, R, n):
    """Phase 3: the batch order (``B_PERM``) of sort_batch_req_ids: key (no
    drafts, tokens != dql, tokens), stable; classes 0 and 2 hold one token
    count (dql) and keep dict order."""
    a_b = tb[TB_BATCH]
    dql = tb[TB_DQL]
    O_NUM = B_POS_NUM * R
    O_DR = B_POS_DRAFTS * R
    O_PERM = B_PERM * R
    c0 = 0
    c1 = 0
    c2 = 0
    for i in range(n):
        cls = (2 if ld32(a_b, O_DR + i) == 0 else 0) + (1 if ld32(a_b, O_NUM + i) != dql else 0)
        if cls == 0:
            c0 += 1
        elif cls == 1:
            c1 += 1
        elif cls == 2:
            c2 += 1
    if c0 == n or c2 == n:
        for i in range(n):
            st32(a_b, O_PERM + i, i)
        return
    sort = tb[TB_BATCH_OBJ] + 8 * BO_SORT * R
    start1 = c0
    start2 = c0 + c1
    start3 = c0 + c1 + c2
    w0 = 0
    w1 = start1
    w2 = start2
    w3 = start3
    for i in range(n):
        num = ld32(a_b, O_NUM + i)
        cls = (2 if ld32(a_b, O_DR + i) == 0 else 0) + (1 if num != dql else 0)
        if cls == 0:
            st32(a_b, O_PERM + w0, i)
            w0 += 1
        elif cls == 2:
            st32(a_b, O_PERM + w2, i)
            w2 += 1
        elif cls == 1:
            st64(sort, w1, (np.int64(num) << 32) | i)
            w1 += 1
        else:
            st64(sort, w3, (np.int64(num) << 32) | i)
            w3 += 1
    sort_view = view_i64(sort, n)
    _int64_heapsort(sort_view, start1, c1)
    _int64_heapsort(sort_view, start3, n - start3)
    for p in range(start1, start2):
        st32(a_b, O_PERM + p, np.int32(ld64(sort, p) & 0xFFFFFFFF))
    for p in range(start3, n):
        st32(a_b, O_PERM + p, np.int32(ld64(sort, p) & 0xFFFFFFFF))


@jit(
    signature=f"int64(int64[::1], int64[::1], {_TP}, int64, int64, int64, int64, int64, int64, int64[::1], "
    f"{_NEW_KEYS}, int64, int64, int64)"
)
def resolve_batch(ix, tb, tp, nst, spec, total, i_cid, nc, a_rows_c, new_desc, nk, a_rows_n, stamp, nfreed):
    """Pass 1 of the batch: rows, counts and draft counts of every scheduled
    id, validated, and the batch order (``B_PERM``). Writes only the batch
    scratch. ``nst``/``spec``: exact dicts (``spec`` 0 when absent), read
    only here, once, under the GIL; ``total``: the int object of
    ``total_num_scheduled_tokens`` or 0. The step's ids: the cached ones
    (``i_cid``, rows ``a_rows_c``), the new ones (descriptors ``new_desc``,
    key table ``nk``, rows ``a_rows_n``); ``stamp``/``nfreed``: this step's
    marks of freed rows. Returns a status."""
    slots, row_hash, keys, key_len = _ix_arrays(ix)
    mask, kw, seed, hmask, allow = _ix_params(ix)
    new_ptr, new_len, new_hash, new_tab, ntab_mask = nk
    R = tb[TB_R]
    nn = len(new_ptr)
    lookup = (slots, mask, keys, kw, seed, hmask, new_tab, ntab_mask, new_hash, new_ptr, new_len, nn, a_rows_n,
              tb[TB_SCR], R, stamp, nfreed)  # fmt: skip
    dict_ok = ix[IX_DICT_OK]
    n, st = _scheduled_rows(tb, tp, allow, dict_ok, R, nst, total, i_cid, nc, a_rows_c, new_desc, nn, a_rows_n, lookup)
    if st != OK:
        return st
    if spec != 0:
        st = _draft_counts(tb, tp, allow, dict_ok, R, spec, n, lookup)
        if st != OK:
            return st
    else:
        tb[TB_B_HAS_DRAFTS] = 0
    _batch_order(tb, R, n)
    return OK


@jit(inline="always")
def _st_bool(base, i, v):
    st8(base, i, np.uint8(1) if v else np.uint8(0))


@jit(inline="always")
def _write_position(a_b, a_idx, a_bb, a_state, R, p, row, v, d):
    """Batch position p's outputs from its row's state after the step;
    returns (prefilling, runs as a decode)."""
    pl = ld32(a_state, F_PREFILL * R + row)
    ncpt = ld32(a_state, F_NCPT * R + row)
    st32(a_b, B_NUM_SCHED * R + p, v)
    st32(a_b, B_DRAFTS * R + p, d)
    st32(a_b, B_PREFILL * R + p, pl)
    st32(a_b, B_NCPT * R + p, ncpt)
    st32(a_b, B_MAXSEQ * R + p, ld32(a_state, F_MAXSEQ * R + row))
    st64(a_idx, p, row)
    prefilling = ncpt < pl
    # one new prompt token over existing context runs as a decode
    as_decode = prefilling and v - d == 1 and ncpt > 0
    _st_bool(a_bb, BB_PREFILLING * R + p, prefilling)
    _st_bool(a_bb, BB_RUNS_AS_DECODE * R + p, as_decode)
    return prefilling, as_decode


@jit(signature="int64(int64[::1], int64, int64, int64, int64)")
def _write_expanded(tb, R, n, a_pos, num_logits):
    """vLLM's ``expand_idx_mapping`` over the batch: for batch position p
    with k = drafts + bonus logits, k entries of its row (``TB_BEXP``,
    int64) and 0..k-1 (``a_pos``, int32), at cu_num_logits[p]. vLLM's kernel
    writes at most next_power_of_2(decode_query_len) entries a request, so
    a request with more than decode_query_len, or more logits than the
    arrays hold, leaves them to vLLM's kernel: returns 0 (nothing used)."""
    a_exp = tb[TB_BEXP]
    if a_exp == 0 or num_logits > tb[TB_B_EXP_CAP]:
        return 0
    a_b = tb[TB_BATCH]
    a_idx = tb[TB_BATCH_IDX]
    bonus = tb[TB_BONUS]
    dql = tb[TB_DQL]
    c = np.int64(0)
    for p in range(n):
        k = ld32(a_b, B_DRAFTS * R + p) + bonus
        if k > dql:
            return 0
        row = ld64(a_idx, p)
        for j in range(k):
            st64(a_exp, c + j, row)
            st32(a_pos, c + j, j)
        c += k
    return 1


@jit(signature="void(int64[::1], int64, int64)")
def _write_inputs(tb, R, n):
    """The step's inputs for the forward, from the batch just written (what
    vLLM's ``prepare_inputs`` computes on the host): ``query_start_loc``
    padded with ``num_tokens`` to R + 1 entries (as for a full CUDA graph),
    ``cu_num_logits``, ``seq_lens_cpu_upper_bound`` (0 past the batch) and
    the rows' ``num_computed_tokens``; the totals, and whether every request
    is scheduled its logits' tokens (vLLM asserts it). Then the logits
    expanded (``_write_expanded``)."""
    a_in = tb[TB_BIN]
    if a_in == 0:
        return
    a_b = tb[TB_BATCH]
    a_idx = tb[TB_BATCH_IDX]
    a_state = tb[TB_STATE]
    bonus = tb[TB_BONUS]
    S = R + 1  # row stride
    q = np.int64(0)
    cu = np.int64(0)
    drafts = np.int64(0)
    fit = 1
    st32(a_in, BI_QSL * S, 0)
    st32(a_in, BI_CU_LOGITS * S, 0)
    for p in range(n):
        v = ld32(a_b, B_NUM_SCHED * R + p)
        d = ld32(a_b, B_DRAFTS * R + p)
        nct = ld32(a_state, F_NCT * R + ld64(a_idx, p))
        q += v
        cu += d + bonus
        drafts += d
        if v < d + bonus:
            fit = 0
        st32(a_in, BI_QSL * S + p + 1, q)
        st32(a_in, BI_CU_LOGITS * S + p + 1, cu)
        st32(a_in, BI_SEQ_UB * S + p, nct + v)
        st32(a_in, BI_NCT * S + p, nct)
    for p in range(n + 1, S):
        st32(a_in, BI_QSL * S + p, q)
    for p in range(n, S):
        st32(a_in, BI_SEQ_UB * S + p, 0)
    tb[TB_B_NUM_LOGITS] = cu
    tb[TB_B_NUM_DRAFTS] = drafts
    tb[TB_B_LOGITS_FIT] = fit
    tb[TB_B_EXP_OK] = _write_expanded(tb, R, n, a_in + 4 * BI_ROWS * S, cu)


@jit(signature="void(int64[::1], int64, int64, int64, int64, int64, boolean)")
def _publish(tb, R, n, has_prefill, graph_ok, max_query, in_order):
    """A new list of the batch's ids (``BO_KEYS`` through ``B_PERM``, or in
    order) into the table's holder list, which releases the previous one;
    then the batch's scalars, the size last (the Python side reads it)."""
    a_bo = tb[TB_BATCH_OBJ]
    a_b = tb[TB_BATCH]
    lst = list_new(n)
    if lst == 0:  # out of memory: no batch this step (the Python side raises)
        err_clear()
        tb[TB_B_N] = -2
        return
    i_lst = load_i64(lst + OFF_ITEMS)
    for p in range(n):
        q = p if in_order else ld32(a_b, B_PERM * R + p)
        k = ld64(a_bo, BO_KEYS * R + q)
        incref(k)
        st64(i_lst, p, k)
    list_set_item(tb[TB_B_HOLDER], 0, lst)  # steals lst
    _write_inputs(tb, R, n)
    tb[TB_B_MAX_QUERY] = max_query
    tb[TB_B_HAS_PREFILL] = has_prefill
    tb[TB_B_GRAPH_OK] = graph_ok
    tb[TB_B_N] = n


@jit(signature="void(int64[::1], int64, int64)")
def write_batch(tb, R, a_state):
    """Pass 2 of the batch, once the step is applied: the batch's arrays in
    batch order, its scalars and its list of ids (``_publish``)."""
    a_b = tb[TB_BATCH]
    a_idx = tb[TB_BATCH_IDX]
    a_bb = tb[TB_BATCH_BOOL]
    n = tb[TB_B_NEXT_N]
    has_prefill = 0
    graph_ok = 1
    max_query = 0
    for p in range(n):
        q = ld32(a_b, B_PERM * R + p)
        v = ld32(a_b, B_POS_NUM * R + q)
        prefilling, as_decode = _write_position(
            a_b, a_idx, a_bb, a_state, R, p, ld32(a_b, B_POS_ROW * R + q), v, ld32(a_b, B_POS_DRAFTS * R + q)
        )
        if prefilling:
            has_prefill = 1
            if not as_decode:
                graph_ok = 0
        max_query = max(max_query, v)
    _publish(tb, R, n, has_prefill, graph_ok, max_query, False)


@jit(
    signature="boolean(int64[::1], UniTuple(int64, 10), int64, int64, int64, int64, int64, int64, int64, int64, int64)"
)
def steady_batch(tb, tp, dict_ok, R, nst, spec, total, i_cid, nc, a_res, a_state):
    """The batch of an update-only step in one pass, after its update: when
    ``num_scheduled_tokens`` (and ``scheduled_spec_decode_tokens``) list
    exactly the cached ids in order, as the same objects, all in one
    decode/verify class (no sort), read in place. Returns False, having
    written only batch outputs, for anything else: then ``resolve_batch``
    and ``write_batch`` (which validate and report) run instead."""
    n = load_i64(nst + DICT_MA_USED)
    if n != nc or dict_ok == 0:
        return False
    direct, base, stride, nent = _dict_open(nst, dict_ok)
    if direct == 0:
        return False
    ns = load_i64(spec + DICT_MA_USED) if spec != 0 else 0
    sbase = 0
    sstride = 0
    snent = 0
    if ns != 0:
        if ns != n:
            return False
        sdirect, sbase, sstride, snent = _dict_open(spec, dict_ok)
        if sdirect == 0:
            return False
    a_b = tb[TB_BATCH]
    a_bo = tb[TB_BATCH_OBJ]
    a_idx = tb[TB_BATCH_IDX]
    a_bb = tb[TB_BATCH_BOOL]
    dql = tb[TB_DQL]
    sum_tokens = np.int64(0)
    cls0 = -1
    has_prefill = 0
    graph_ok = 1
    max_query = 0
    pos = 0
    spos = 0
    for i in range(n):
        found, pos, k, val = _dict_item(nst, 1, base, stride, nent, pos)
        if found == 0 or k != _item(i_cid, i):
            return False
        v, st = _int_of(val, tp)
        if st != OK or v < 0 or v > INT32_MAX:
            return False
        d = 0
        if ns != 0:
            found, spos, k2, val2 = _dict_item(spec, 1, sbase, sstride, snent, spos)
            if found == 0 or k2 != k:
                return False
            t = load_i64(val2 + OFF_TYPE)
            if t != tp[0] and t != tp[1]:
                return False
            d = min(load_i64(val2 + OFF_SIZE), INT32_MAX)
        cls = (2 if d == 0 else 0) + (1 if v != dql else 0)
        if cls != cls0:
            if cls0 >= 0 or (cls != 0 and cls != 2):
                return False  # more than one class, or extends/prefills: sorted by the two phases
            cls0 = cls
        prefilling, as_decode = _write_position(a_b, a_idx, a_bb, a_state, R, i, ld32(a_res, i), v, d)
        if prefilling:
            has_prefill = 1
            if not as_decode:
                graph_ok = 0
        max_query = max(max_query, v)
        st64(a_bo, BO_KEYS * R + i, k)
        sum_tokens += v
    if total != 0:
        t_total, st = _int_of(total, tp)
        if st != OK or t_total != sum_tokens:
            return False
    tb[TB_B_HAS_DRAFTS] = 1 if ns != 0 else 0
    tb[TB_B_NUM_TOKENS] = sum_tokens
    tb[TB_B_NEXT_N] = n
    tb[TB_B_MAX_QUERY] = max_query
    tb[TB_B_HAS_PREFILL] = has_prefill
    tb[TB_B_GRAPH_OK] = graph_ok
    return True


@jit(signature="void(int64[::1], int64)")
def publish_steady_batch(tb, R):
    """The list and size of a batch ``steady_batch`` built, once the step is
    committed."""
    _publish(tb, R, tb[TB_B_NEXT_N], tb[TB_B_HAS_PREFILL], tb[TB_B_GRAPH_OK], tb[TB_B_MAX_QUERY], True)
