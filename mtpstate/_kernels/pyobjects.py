"""Python objects read in place by the kernels: the builtin types' addresses
(``_pytypes``), a request id's UTF-8 bytes, an exact list or tuple, an int,
an int vector (a list, an ``array.array``, a raw buffer), a list of int31
ids (token ids, block ids), a dict's entries.
Built on the primitives of ``native.py`` and ``cpython.py``; every reader checks the exact type
before it relies on a layout, and says so in its status."""

from __future__ import annotations

import numpy as np

from mtpstate._kernels.cpython import (
    DICT_MA_KEYS,
    DICT_MA_VALUES,
    DK_INDICES,
    DK_KIND,
    DK_LOG2_INDEX_BYTES,
    DK_NENTRIES,
    OFF_ITEMS,
    OFF_SIZE,
    OFF_TYPE,
    STR_STATE_OFFSET,
    bytes_data,
    dict_next,
    int_value,
    str_utf8,
)
from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import ld64, load_i32, load_i64, load_u8, load_u32, load_u64
from mtpstate._kernels.slots import (
    IX_ASCII_OFF,
    IX_FALSE,
    IX_NONE,
    IX_T_BYTES,
    IX_T_DICT,
    IX_T_INT,
    IX_T_LIST,
    IX_T_STR,
    IX_T_TUPLE,
    IX_TRUE,
)
from mtpstate._kernels.status import (
    E_INT_RANGE,
    E_NOT_CANONICAL,
    INT32_MAX,
    OK,
    V_ARRAY,
    V_I32,
    V_I64,
    V_OBJ,
    V_U32,
    V_U64,
)


@jit
def _pytypes(ctx):
    return (
        ctx[IX_T_LIST],
        ctx[IX_T_TUPLE],
        ctx[IX_T_STR],
        ctx[IX_T_BYTES],
        ctx[IX_T_INT],
        ctx[IX_NONE],
        ctx[IX_TRUE],
        ctx[IX_FALSE],
        ctx[IX_ASCII_OFF],
        ctx[IX_T_DICT],
    )


@jit
def _key_of(obj, allow_bytes, tp):
    """(UTF-8 address, length, status) of a request id object."""
    t = load_i64(obj + OFF_TYPE)
    if t == tp[2]:
        if tp[8] != 0 and (load_u32(obj + STR_STATE_OFFSET) & np.uint64(0x60)) == np.uint64(0x60):
            # compact ASCII: the bytes follow the header, no call needed
            return obj + tp[8], load_i64(obj + OFF_SIZE), OK
        ptr, n = str_utf8(obj)
        if ptr == 0:
            return 0, 0, E_NOT_CANONICAL
        return ptr, n, OK
    if allow_bytes != 0 and t == tp[3]:
        return bytes_data(obj), load_i64(obj + OFF_SIZE), OK
    return 0, 0, E_NOT_CANONICAL


@jit(signature="Tuple((int64, int64, boolean))(int64, UniTuple(int64, 10))")
def _seq(obj, tp):
    """(item pointer array, length, ok) of an exact list or tuple."""
    t = load_i64(obj + OFF_TYPE)
    if t == tp[0]:
        return load_i64(obj + OFF_ITEMS), load_i64(obj + OFF_SIZE), True
    if t == tp[1]:
        return obj + OFF_ITEMS, load_i64(obj + OFF_SIZE), True
    return 0, 0, False


# the i-th object address of an item pointer array (a list's ob_item, a tuple's
# inline items): an intrinsic, so the 30-odd call sites cost no inlining pass
_item = ld64


# what read_int found (its second result)
INT_OK = 0  # an exact int within int64: the value
INT_NONE = 1  # None
INT_NOT_INT = 2  # anything but an exact int or None
INT_RANGE = 3  # an exact int outside int64


@jit
def read_int(obj, int_type, none):
    """The one reading of an int the kernels take from a Python object:
    ``(value, INT_*)``. ``int_type``, ``none``: the addresses of ``int`` and
    ``None``. Each caller maps the kind to its own status."""
    if obj == none:
        return 0, INT_NONE
    if load_i64(obj + OFF_TYPE) != int_type:
        return 0, INT_NOT_INT
    v, ok = int_value(obj)
    if not ok:
        return 0, INT_RANGE
    return v, INT_OK


@jit
def _int_of(obj, tp):
    """(value, status) of an exact int (``tp``: the step's type addresses);
    E_INT_RANGE outside int64, E_NOT_CANONICAL for anything else (None
    too)."""
    v, kind = read_int(obj, tp[4], tp[5])
    if kind == INT_OK:
        return v, OK
    return 0, (E_INT_RANGE if kind == INT_RANGE else E_NOT_CANONICAL)


@jit
def _vec(kind, addr, n, tp, array_ok):
    """(kind, base, length, status) of an int vector given as (kind, addr,
    n): for V_OBJ the base is the item pointer array, for V_ARRAY the raw
    kind of the array's data; raw kinds pass through."""
    if kind == V_OBJ:
        items, m, ok = _seq(addr, tp)
        return V_OBJ, items, m, (OK if ok else E_NOT_CANONICAL)
    if kind == V_ARRAY:
        if array_ok == 0:
            return V_OBJ, 0, 0, E_NOT_CANONICAL
        # arrayobject: ob_size @16, ob_item @24, ob_descr @40 -> {char typecode; int itemsize}
        data = load_i64(addr + OFF_ITEMS)
        m = load_i64(addr + OFF_SIZE)
        descr = load_i64(addr + 40)
        code = np.int64(load_u8(descr))
        size = np.int64(load_u32(descr + 4))
        if code == 105 or code == 108 or code == 113:  # 'i', 'l', 'q'
            if size == 4:
                return V_I32, data, m, OK
            if size == 8:
                return V_I64, data, m, OK
        if code == 73 or code == 76 or code == 81:  # 'I', 'L', 'Q'
            if size == 4:
                return V_U32, data, m, OK
            if size == 8:
                return V_U64, data, m, OK
        return V_OBJ, 0, 0, E_NOT_CANONICAL
    return kind, addr, n, OK


@jit(inline="always")
def _vget(kind, base, j, tp):
    """(value, status) of element j of a vector from ``_vec``."""
    if kind == V_OBJ:
        return _int_of(_item(base, j), tp)
    if kind == V_I32:
        return np.int64(load_i32(base + 4 * j)), OK
    if kind == V_I64:
        return load_i64(base + 8 * j), OK
    if kind == V_U32:
        return np.int64(load_u32(base + 4 * j)), OK
    u = load_u64(base + 8 * j)
    if u > np.uint64(9223372036854775807):
        return 0, E_INT_RANGE
    return np.int64(u), OK


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


@jit
def _dict_open(d, dict_ok):
    """(direct, entries, entry size, entry count) of an exact dict: its
    entries are read in place when the layout was verified at import and
    the table is combined; otherwise (0, ...) and PyDict_Next is used."""
    if dict_ok != 0 and load_i64(d + DICT_MA_VALUES) == 0:
        dk = load_i64(d + DICT_MA_KEYS)
        kind = load_u8(dk + DK_KIND)
        if kind == 0 or kind == 1:
            stride = 16 if kind == 1 else 24
            entries = dk + DK_INDICES + (np.int64(1) << np.int64(load_u8(dk + DK_LOG2_INDEX_BYTES)))
            return 1, entries, stride, load_i64(dk + DK_NENTRIES)
    return 0, 0, 0, 0


@jit(inline="always")
def _dict_item(d, direct, base, stride, nent, j):
    """(found, next j, key, value) of the first item at entry >= j (the
    ``ppos`` of PyDict_Next); borrowed references."""
    if direct != 0:
        while j < nent:
            e = base + stride * j
            j += 1
            v = load_i64(e + stride - 8)
            if v != 0:
                return 1, j, load_i64(e + stride - 16), v
        return 0, j, 0, 0
    return dict_next(d, j)
