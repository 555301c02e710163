"""The array entry point: update running requests from arrays an engine
already holds (rows or ids, counts, CSR block ids). Vectorized numpy; every
check runs before the first write."""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import slots as T
from mtpstate.errors import DuplicateRequestError, InvalidStepError, UnknownRequestError


def update_from_arrays(table, req_ids, num_computed_tokens, new_block_offsets=None, new_block_ids=None):
    R = table.max_num_reqs
    if isinstance(req_ids, np.ndarray) and req_ids.dtype.kind in "iu":
        rows = req_ids.astype(np.int64, copy=False)
        bad = (rows < 0) | (rows >= R)
        if bad.any():
            raise UnknownRequestError(f"row {int(rows[bad][0])}", "out of range")
        dead = table._index._key_len[rows] < 0
        if dead.any():
            raise UnknownRequestError(f"row {int(rows[dead][0])}", "not live")
    else:
        rows = table._index.lookup(req_ids).astype(np.int64)
    n = len(rows)
    nct = np.asarray(num_computed_tokens)
    if nct.dtype.kind not in "iu" or nct.shape != (n,):
        raise InvalidStepError(f"num_computed_tokens must be an int array of shape ({n},), got {nct.dtype} {nct.shape}")
    if n and (nct.min() < 0 or nct.max() > table.max_model_len):
        raise InvalidStepError(f"num_computed_tokens outside [0, max_model_len={table.max_model_len}]")
    if len(np.unique(rows)) != n:
        raise DuplicateRequestError("a request is listed twice")
    ng = table.num_groups
    plans = []
    if (new_block_offsets is None) != (new_block_ids is None):
        raise InvalidStepError("give both new_block_offsets and new_block_ids, or neither")
    if new_block_offsets is not None:
        if len(new_block_offsets) != ng or len(new_block_ids) != ng:
            raise InvalidStepError(f"block arrays for {len(new_block_offsets)} KV-cache groups, the table has {ng}")
        for g in range(ng):
            off = np.asarray(new_block_offsets[g])
            vals = np.asarray(new_block_ids[g])
            if off.shape != (n + 1,) or off.dtype.kind not in "iu" or (n >= 0 and off[0] != 0):
                raise InvalidStepError(f"group {g}: offsets must be an int array [n + 1] starting at 0")
            counts = np.diff(off)
            if (counts < 0).any() or off[-1] != len(vals):
                raise InvalidStepError(f"group {g}: offsets must be non-decreasing and end at len(new_block_ids)")
            if len(vals) and (vals.dtype.kind not in "iu" or vals.min() < 0 or vals.max() > np.iinfo(np.int32).max):
                raise InvalidStepError(f"group {g}: block ids must be ints in [0, 2**31)")
            start = table.num_blocks[g][rows].astype(np.int64)
            width = table.max_num_blocks_per_group[g]
            over = start + counts > width
            if over.any():
                i = int(np.flatnonzero(over)[0])
                raise InvalidStepError(f"row {int(rows[i])}: block table of group {g} overflows its {width} blocks")
            pos = np.repeat(rows * width + start - off[:-1], counts) + np.arange(len(vals))
            plans.append((g, counts, pos, vals))
    if table._mirror is not None:  # (before the first write: a refusal changes nothing)
        table._mirror.check_staged(2 * n + sum(n + len(vals) for _, _, _, vals in plans), "update_arrays")
    # all checks passed: write
    state = table._state
    state[T.F_NCT, rows] = nct
    ncpt = np.minimum(nct, state[T.F_PREFILL, rows])
    state[T.F_NCPT, rows] = ncpt
    SR = int(table._ctx[T.TB_STG_STRIDE])  # the device's row stride
    staged = [(T.F_NCT * SR + rows, nct), (T.F_NCPT * SR + rows, ncpt)]
    for g, counts, pos, vals in plans:
        table.block_tables[g].reshape(-1)[pos] = vals
        nb = state[T.F_NB + g, rows] + counts
        state[T.F_NB + g, rows] = nb
        staged += [(table._flat_bt[g] + pos, vals), ((T.F_NB + g) * SR + rows, nb)]
    if table._mirror is not None:
        table._mirror.stage_arrays(staged)
    return rows.astype(np.int32)
