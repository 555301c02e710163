"""numba kernel that applies one scheduler step to a RequestTable: its
entry, and the general step's two passes in order.

Private; launched by ``RequestTable`` (table.py) through one entry,
``tb_apply``, with integer arguments only: the addresses of the index and
table contexts and of the step's argument tuple (``A_*`` slots, built by
table.py from what binding.py bound). Every kind of step goes through it:

- an update-only step (the steady state of decoding) goes to decode.py's
  single pass, with an undo log;
- any other step (finished, preempted, new or resumed requests) takes two
  passes here (``_general``): pass 1 reads everything and validates it
  against the state as the step would leave it, pass 2 mutates. Phase by
  phase: the new requests read in place (new_requests.py), then pass 1:
  finished and preempted ids (here), new requests (add.py), cached requests
  (update.py), the batch (batch.py), the key arena; pass 2: the index
  (index.py), the new rows (add.py), the cached rows (update.py), the batch.

Either way, nothing is left changed by a rejected step. Every changed
element of a mirrored field (``TB_STG_FIELDS``) is also appended (flat
position, value) to the staging buffers of the device mirror when that is
on (new requests' token ids apart, as runs: tokens.py; added rows also seed
the engine's lengths, ``TB_FLAT_ENG``), and the rows of the step (cached,
new, freed) are written to the result array the Python side exposes.
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.add import _apply_new, _check_new, _new_keys
from mtpstate._kernels.batch import resolve_batch, write_batch
from mtpstate._kernels.cpython import OFF_ITEMS
from mtpstate._kernels.decode import _update_only
from mtpstate._kernels.index import _arena_short, _hash_key, _ix_arrays, _ix_commit, _ix_params, _probe
from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import view_i32, view_i64
from mtpstate._kernels.new_requests import descriptors_from_list, read_new_requests
from mtpstate._kernels.pyobjects import _int_of, _item, _key_of, _pytypes, _seq
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
    IX_ARRAY_OK,
    IX_SIZE,
    NEW_STRIDE,
    S_FREE,
    S_FREED,
    S_NB0,
    S_NEWROW,
    S_REDIRECT,
    S_ROWS,
    SC_NC,
    SC_NFREED,
    SC_NN,
    SC_NSTAGE,
    SC_SIZE,
    SC_STAMP,
    TB_B_N,
    TB_DQL,
    TB_NG,
    TB_R,
    TB_RES,
    TB_RES_NC,
    TB_RES_NF,
    TB_RES_NN,
    TB_SCR,
    TB_SIZE,
    TB_STAMP,
    TB_STATE,
    TB_STG_CAP,
    TB_STG_DUPS,
    TB_STG_N,
    TB_STG_ON,
    TB_STG_TOK_N,
    _err,
)
from mtpstate._kernels.status import (
    E_CAPACITY,
    E_KEY_TOO_LONG,
    E_NOT_CANONICAL,
    E_STAGE_FULL,
    FLD_NONE,
    FLD_REQ_ID,
    OK,
    PH_FINISH,
    PH_NEW,
    PH_PREEMPT,
)
from mtpstate._kernels.update import _apply_cached, _check_cached, _forget_freed, _resumed_keys


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
def _general(ixc, tbc, fin, pre, new_desc, new_reqs, cid, cnct_kind, cnct, cnct_n, cblk, cres, nst, spec, total):
    """Any step that is not update-only: finish, add, update (see the
    module docstring), in two passes, phase by phase."""
    ix = view_i64(ixc, IX_SIZE)
    tb = view_i64(tbc, TB_SIZE)
    tp = _pytypes(ix)
    R = tb[TB_R]
    a_scr = tb[TB_SCR]
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
        st = resolve_batch(
            ix, tb, tp, nst, spec, total, i_cid, sc[SC_NC], a_scr + 4 * S_ROWS * R, nd, nk,
            a_scr + 4 * S_NEWROW * R, sc[SC_STAMP], sc[SC_NFREED],
        )  # fmt: skip
        if st != OK:
            return st
    # the freed rows lowest first: the result's order, and the order the
    # index frees them in
    freed = view_i32(a_scr + 4 * S_FREED * R, sc[SC_NFREED])
    _heapsort(freed, sc[SC_NFREED])
    # the arena grows (in Python) only for a step that is valid otherwise
    new_ptr, new_len, new_hash, _tab, _mask = nk
    short = _arena_short(ix, new_len, nn)
    if short > 0:
        return _err(tb, E_KEY_TOO_LONG, -1, short, PH_NEW, FLD_REQ_ID)

    # ---------------- pass 2: apply ----------------------------------------
    _ix_commit(ix, freed, view_i32(a_scr + 4 * S_NEWROW * R, nn), new_ptr, new_len, new_hash)
    # (freeing lowered the free-row hint; rows below it are still all live)
    res = view_i32(tb[TB_RES], 3 * R)
    for f in range(sc[SC_NFREED]):
        res[2 * R + f] = freed[f]
    ns, nt = _apply_new(tb, tp, sc, nd, array_ok, 0, 0)
    _forget_freed(tb, freed, cid != 0)
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
