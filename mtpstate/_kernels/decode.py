"""numba kernel for the update-only step (the steady state of decoding:
nothing finished, added or resumed): each running request validated and
written in one pass, with an undo log. Private; ``tb_apply`` (step.py) sends
such a step here; the rows are predicted as in update.py, whose helpers it
shares."""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.add import _new_keys
from mtpstate._kernels.batch import publish_steady_batch, resolve_batch, steady_batch, write_batch
from mtpstate._kernels.index import _ix_arrays, _ix_params
from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import ld32, ld64, prefetch, st32, st64, view_i64
from mtpstate._kernels.pyobjects import _check_int31_list, _item, _pytypes, _seq, _vget
from mtpstate._kernels.slots import (
    F_NB,
    F_NCPT,
    F_NCT,
    F_PREFILL,
    IX_ARRAY_OK,
    IX_DICT_OK,
    IX_SIZE,
    S_MISS,
    S_NCT,
    S_ROWS,
    TB_BT_ADDR,
    TB_BT_W,
    TB_FLAT_BT,
    TB_L,
    TB_NG,
    TB_PREV_CUR,
    TB_PREV_N,
    TB_R,
    TB_RES,
    TB_RES_NC,
    TB_SCR,
    TB_SIZE,
    TB_STAMP,
    TB_STATE,
    TB_STG_CAP,
    TB_STG_FIELDS,
    TB_STG_N,
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
)
from mtpstate._kernels.update import (
    _append_blocks,
    _commit_prediction,
    _open_cached,
    _owned_obj,
    _predict_miss,
    _prediction_buffers,
)
from mtpstate._kernels.writes import _put


@jit(inline="always")
def _seen_in_this_update(a_rpp_next, a_prev_row_next, row, i):
    # positions < i of the next prediction buffer are this update's; a row
    # whose recorded position points into them was listed already
    p = ld32(a_rpp_next, row)
    return 0 <= p < i and ld32(a_prev_row_next, p) == row


@jit
def _materialize(a_obj, a_row, a_obj_next, a_row_next, a_rpp_next, n):
    """Copy the first n positions of the current prediction into the next."""
    for p in range(n):
        st64(a_obj_next, p, ld64(a_obj, p))
        r = ld32(a_row, p)
        st32(a_row_next, p, r)
        if r >= 0:  # (always: only identity hits, which have rows, are copied)
            st32(a_rpp_next, r, p)


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
