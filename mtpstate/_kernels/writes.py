"""Element writes of the step kernels: a state field, one group's block
ids, each staged for the device mirror as it is written (pass 2 of a step;
the lists were checked in pass 1)."""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import ld32, st32, st64
from mtpstate._kernels.pyobjects import _int_of, _item, _seq


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
