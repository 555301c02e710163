"""CPython objects read and made in place by the kernels: object layouts
(checked on this interpreter at import), and CPython's C API called directly
from compiled code. The kernels read the scheduler's Python lists in place
through these, which is what makes a step cheap: no per-element conversion to
numpy in Python. Each primitive has a plain-Python twin for
``NUMBA_DISABLE_JIT=1`` (see ``_kernels.native``).

Safety contract (the callers in ``_kernels`` keep it):
- kernels that use these never release the GIL (no ``nogil``);
- an object address is only dereferenced while the caller holds a reference
  to the object (the Python wrapper keeps its arguments alive for the call);
- the type of every object is checked (exact ``list``/``tuple``/``str``/
  ``int``) before its layout is relied on.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from mtpstate._kernels.native import _I8P, _I64, _pick, _py_load_i64, _py_load_u8, _py_load_u32, load_i64, load_u32

# Addresses compared against ``ob_type`` (and the singletons). Never use them
# as compile-time constants: cached machine code outlives the process.
PY_ADDRESSES = (id(list), id(tuple), id(str), id(bytes), id(int), id(None), id(True), id(False), id(dict))

# Object layout of the (GIL-enabled) CPython builds we support. ``ob_type`` is
# at 8, ``ob_size`` of variable-size objects at 16, a list's item pointer
# array at 24 and a tuple's items inline from 24.
OFF_TYPE = 8
OFF_SIZE = 16
OFF_ITEMS = 24
# Python <= 3.11 stores an int as ob_size (signed digit count) + 30-bit digits;
# 3.12 changed the layout, so newer versions use PyLong_AsLongLong instead.
INT_DIRECT = sys.version_info < (3, 12)


# ----------------------------------------------------------------------------
# CPython C API, called directly from the kernels (the GIL is held)

_api = ctypes.pythonapi
_api.PyUnicode_AsUTF8AndSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ssize_t)]
_api.PyUnicode_AsUTF8AndSize.restype = ctypes.c_void_p
_api.PyLong_AsLongLong.argtypes = [ctypes.c_void_p]
_api.PyLong_AsLongLong.restype = ctypes.c_longlong
_api.PyBytes_AsString.argtypes = [ctypes.c_void_p]
_api.PyBytes_AsString.restype = ctypes.c_void_p
_api.PyErr_Clear.argtypes = []
_api.PyErr_Clear.restype = None


def str_utf8(obj):
    """(address of the UTF-8 bytes, length) of an exact str; (0, 0) if it has
    no UTF-8 form (lone surrogates). The bytes are cached on the object by
    CPython and live as long as it does."""
    size = ctypes.c_ssize_t(0)
    try:
        ptr = _api.PyUnicode_AsUTF8AndSize(int(obj), ctypes.byref(size))
    except UnicodeEncodeError:
        return 0, 0
    return (ptr or 0), size.value


def _py_bytes_data(obj):
    """Address of an exact bytes object's data."""
    return _api.PyBytes_AsString(int(obj))


def int_value(obj):
    """Value of an exact int as int64; (value, False) when out of range."""
    if INT_DIRECT:
        size = _py_load_i64(obj + OFF_SIZE)
        if size == 0:
            return 0, True
        if size == 1:
            return _py_load_u32(obj + OFF_ITEMS), True
        if size == -1:
            return -_py_load_u32(obj + OFF_ITEMS), True
        if size == 2:
            return _py_load_u32(obj + OFF_ITEMS) | (_py_load_u32(obj + OFF_ITEMS + 4) << 30), True
    try:
        return _api.PyLong_AsLongLong(int(obj)), True
    except OverflowError:
        return 0, False


@intrinsic
def _capi_utf8(typingctx, obj):
    sig = types.UniTuple(types.int64, 2)(types.int64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I8P, [_I8P, _I64.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "PyUnicode_AsUTF8AndSize")
        size = cgutils.alloca_once_value(builder, ir.Constant(_I64, 0))
        res = builder.call(fn, [builder.inttoptr(args[0], _I8P), size])
        tup = [builder.ptrtoint(res, _I64), builder.load(size)]
        return context.make_tuple(builder, signature.return_type, tup)

    return sig, codegen


@intrinsic
def _capi_bytes(typingctx, obj):
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I8P, [_I8P])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "PyBytes_AsString")
        return builder.ptrtoint(builder.call(fn, [builder.inttoptr(args[0], _I8P)]), _I64)

    return sig, codegen


@intrinsic
def _capi_aslonglong(typingctx, obj):
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I64, [_I8P])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "PyLong_AsLongLong")
        return builder.call(fn, [builder.inttoptr(args[0], _I8P)])

    return sig, codegen


@intrinsic
def _capi_err_occurred_clear(typingctx):
    """Clear a pending exception; returns 1 if one was set."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        occ = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I8P, []), "PyErr_Occurred")
        clr = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "PyErr_Clear")
        res = builder.call(occ, [])
        isset = builder.icmp_unsigned("!=", res, ir.Constant(_I8P, None))
        with builder.if_then(isset):
            builder.call(clr, [])
        return builder.zext(isset, _I64)

    return sig, codegen


@overload(str_utf8)
def _ov_str_utf8(obj):
    def impl(obj):
        ptr, size = _capi_utf8(obj)
        if ptr == 0:
            _capi_err_occurred_clear()
            return 0, 0
        return ptr, size

    return impl


bytes_data = _pick(_py_bytes_data, lambda: _capi_bytes)


@overload(int_value)
def _ov_int_value(obj):
    if INT_DIRECT:

        def impl(obj):
            size = load_i64(obj + OFF_SIZE)
            if size == 1:
                return np.int64(load_u32(obj + OFF_ITEMS)), True
            if size == 0:
                return np.int64(0), True
            if size == -1:
                return -np.int64(load_u32(obj + OFF_ITEMS)), True
            if size == 2:
                lo = np.int64(load_u32(obj + OFF_ITEMS))
                hi = np.int64(load_u32(obj + OFF_ITEMS + 4))
                return lo | (hi << 30), True
            v = _capi_aslonglong(obj)
            if v == -1 and _capi_err_occurred_clear() == 1:
                return np.int64(0), False
            return v, True

        return impl

    def impl_api(obj):
        v = _capi_aslonglong(obj)
        if v == -1 and _capi_err_occurred_clear() == 1:
            return np.int64(0), False
        return v, True

    return impl_api


# dict iteration: PyDict_Next hands out borrowed references to the key and
# value of the next item; the GIL is held throughout, so the dict cannot
# change between two calls of one kernel

_api.PyDict_Next.argtypes = [
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_ssize_t),
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_void_p),
]
_api.PyDict_Next.restype = ctypes.c_int


def _py_dict_next(d, pos):
    """(found, next pos, key address, value address) of an exact dict's item
    after ``pos`` (0 to start)."""
    p = ctypes.c_ssize_t(int(pos))
    k = ctypes.c_void_p(0)
    v = ctypes.c_void_p(0)
    ok = _api.PyDict_Next(int(d), ctypes.byref(p), ctypes.byref(k), ctypes.byref(v))
    return int(ok), p.value, (k.value or 0), (v.value or 0)


@intrinsic
def _capi_dict_next(typingctx, d, pos):
    sig = types.UniTuple(types.int64, 4)(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(i32, [_I8P, _I64.as_pointer(), _I8P.as_pointer(), _I8P.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "PyDict_Next")
        p = cgutils.alloca_once_value(builder, args[1])
        k = cgutils.alloca_once_value(builder, ir.Constant(_I8P, None))
        v = cgutils.alloca_once_value(builder, ir.Constant(_I8P, None))
        ok = builder.call(fn, [builder.inttoptr(args[0], _I8P), p, k, v])
        tup = [
            builder.sext(ok, _I64),
            builder.load(p),
            builder.ptrtoint(builder.load(k), _I64),
            builder.ptrtoint(builder.load(v), _I64),
        ]
        return context.make_tuple(builder, signature.return_type, tup)

    return sig, codegen


dict_next = _pick(_py_dict_next, lambda: _capi_dict_next)


# dict entries read in place (what PyDict_Next does, without a call per
# item). CPython >= 3.11, GIL builds: PyDictObject has ma_keys at 32 and
# ma_values at 40 (NULL for a combined table); the keys object has
# dk_log2_index_bytes at 9, dk_kind at 10, dk_nentries at 24 and the index
# array at 32, followed by the entries: {key, value} for all-str keys
# (dk_kind 1), {hash, key, value} otherwise (dk_kind 0). Checked here, on
# this interpreter; 0 = iterate with PyDict_Next.

DICT_MA_USED = 16  # the number of items (every CPython 3)
DICT_MA_KEYS = 32
DICT_MA_VALUES = 40
# the keys object: uint8 dk_log2_index_bytes and dk_kind (0 general, 1 all
# str keys), Py_ssize_t dk_nentries, then the index array and the entries
DK_LOG2_INDEX_BYTES = 9
DK_KIND = 10
DK_NENTRIES = 24
DK_INDICES = 32


def _probe_dict_layout() -> int:
    if sys.version_info < (3, 11) or sys.version_info >= (3, 15):
        return 0
    if hasattr(sys, "_is_gil_enabled"):
        try:
            if not sys._is_gil_enabled():
                return 0
        except Exception:  # pragma: no cover
            return 0
    try:
        for keys in (["a", "bb", "cmpl-0123456789abcdef-0", "x" * 40], [1, "b", 3.5, "d"]):
            d = {k: [i] for i, k in enumerate(keys)}
            del d[keys[1]]
            want = [(id(k), id(v)) for k, v in d.items()]
            if _py_load_i64(id(d) + DICT_MA_VALUES) != 0:
                return 0
            dk = _py_load_i64(id(d) + DICT_MA_KEYS)
            kind = _py_load_u8(dk + DK_KIND)
            if kind not in (0, 1) or kind != (1 if all(type(k) is str for k in keys) else 0):
                return 0
            stride = 16 if kind == 1 else 24
            base = dk + DK_INDICES + (1 << _py_load_u8(dk + DK_LOG2_INDEX_BYTES))
            got = []
            for j in range(_py_load_i64(dk + DK_NENTRIES)):
                k = _py_load_i64(base + stride * j + stride - 16)
                v = _py_load_i64(base + stride * j + stride - 8)
                if v:
                    got.append((k, v))
            if got != want:
                return 0
    except Exception:  # pragma: no cover
        return 0
    return 1


DICT_LAYOUT_OK = _probe_dict_layout()


# ----------------------------------------------------------------------------
# a new list, made by a kernel: PyList_New, then its items stored directly
# (each with a reference); PyList_SetItem hands it to a holder list, which
# releases the list it held before (only lists of exact str: no Python code)

_api.PyList_New.argtypes = [ctypes.c_ssize_t]
_api.PyList_New.restype = ctypes.c_void_p
_api.PyList_SetItem.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_void_p]
_api.PyList_SetItem.restype = ctypes.c_int


def _py_list_new(n):
    return _api.PyList_New(int(n)) or 0


def _py_list_set_item(lst, i, obj):
    return _api.PyList_SetItem(int(lst), int(i), int(obj))


@intrinsic
def _capi_list_new(typingctx, n):
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I8P, [_I64]), "PyList_New")
        return builder.ptrtoint(builder.call(fn, [args[0]]), _I64)

    return sig, codegen


@intrinsic
def _capi_list_set_item(typingctx, lst, i, obj):
    sig = types.int64(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [_I8P, _I64, _I8P]), "PyList_SetItem")
        res = builder.call(fn, [builder.inttoptr(args[0], _I8P), args[1], builder.inttoptr(args[2], _I8P)])
        return builder.sext(res, _I64)

    return sig, codegen


list_new = _pick(_py_list_new, lambda: _capi_list_new)


# ----------------------------------------------------------------------------
# attribute reads: the only primitives that may run Python code (a property,
# __getattr__). A kernel calls them before it reads anything else of the
# step, holds every result it gets in a list it owns, and reads nothing
# through a borrowed pointer across such a call.


def _py_getattr_held(obj, name):
    """(value, 0) or (0, the exception raised), each a new reference: the
    caller owns it (it goes into a list with ``list_set_item``, which steals
    it)."""
    o = ctypes.cast(int(obj), ctypes.py_object).value
    n = ctypes.cast(int(name), ctypes.py_object).value
    try:
        v = getattr(o, n)
    except BaseException as e:  # noqa: BLE001 - handed to the caller, as the C path does
        _api.Py_IncRef(id(e))
        return 0, id(e)
    _api.Py_IncRef(id(v))
    return id(v), 0


def _py_is_subtype(t, base):
    a = ctypes.cast(int(t), ctypes.py_object).value
    b = ctypes.cast(int(base), ctypes.py_object).value
    return 1 if issubclass(a, b) else 0


# Python >= 3.12 hands a pending exception over in one call; older versions
# as (type, value, traceback), normalized so that the value is an instance
RAISED_IN_ONE = sys.version_info >= (3, 12)


@intrinsic
def _capi_getattr(typingctx, obj, name):
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I8P, [_I8P, _I8P]), "PyObject_GetAttr")
        res = builder.call(fn, [builder.inttoptr(args[0], _I8P), builder.inttoptr(args[1], _I8P)])
        return builder.ptrtoint(res, _I64)

    return sig, codegen


@intrinsic
def _capi_take_raised(typingctx):
    """The pending exception (a new reference; cleared), 0 if none."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        if RAISED_IN_ONE:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I8P, []), "PyErr_GetRaisedException")
            return builder.ptrtoint(builder.call(fn, []), _I64)
        pp = _I8P.as_pointer()
        fetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [pp] * 3), "PyErr_Fetch")
        norm = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [pp] * 3), "PyErr_NormalizeException"
        )
        xdec = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [_I8P]), "Py_DecRef")
        t = cgutils.alloca_once_value(builder, ir.Constant(_I8P, None))
        v = cgutils.alloca_once_value(builder, ir.Constant(_I8P, None))
        tb = cgutils.alloca_once_value(builder, ir.Constant(_I8P, None))
        builder.call(fetch, [t, v, tb])
        builder.call(norm, [t, v, tb])
        # keep the value; drop the type and the traceback (Py_DecRef takes NULL)
        builder.call(xdec, [builder.load(t)])
        builder.call(xdec, [builder.load(tb)])
        return builder.ptrtoint(builder.load(v), _I64)

    return sig, codegen


@intrinsic
def _capi_is_subtype(typingctx, t, base):
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [_I8P, _I8P]), "PyType_IsSubtype")
        res = builder.call(fn, [builder.inttoptr(args[0], _I8P), builder.inttoptr(args[1], _I8P)])
        return builder.sext(res, _I64)

    return sig, codegen


def getattr_held(obj, name):
    """(value, 0) or (0, exception) of ``getattr(obj, name)``, new references."""
    return _py_getattr_held(obj, name)


@overload(getattr_held)
def _ov_getattr_held(obj, name):
    def impl(obj, name):
        v = _capi_getattr(obj, name)
        if v != 0:
            return v, 0
        return 0, _capi_take_raised()

    return impl


is_subtype = _pick(_py_is_subtype, lambda: _capi_is_subtype)
err_clear = _pick(lambda: _api.PyErr_Clear(), lambda: _capi_err_occurred_clear)
list_set_item = _pick(_py_list_set_item, lambda: _capi_list_set_item)


# ----------------------------------------------------------------------------
# reference counts: the table owns one reference to each id object of the
# current prediction buffer, so their addresses cannot be reused while the
# kernel compares against them


_api.Py_IncRef.argtypes = [ctypes.c_void_p]
_api.Py_IncRef.restype = None
_api.Py_DecRef.argtypes = [ctypes.c_void_p]
_api.Py_DecRef.restype = None


def _py_incref(obj):
    _api.Py_IncRef(int(obj))


def py_decref(obj):
    _api.Py_DecRef(int(obj))


def _make_refcount_intrinsic(name):
    @intrinsic
    def _rc(typingctx, obj):
        sig = types.void(types.int64)

        def codegen(context, builder, signature, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [_I8P]), name)
            builder.call(fn, [builder.inttoptr(args[0], _I8P)])
            return context.get_dummy_value()

        return sig, codegen

    return _rc


_incref = _make_refcount_intrinsic("Py_IncRef")
_decref = _make_refcount_intrinsic("Py_DecRef")


incref = _pick(_py_incref, lambda: _incref)
decref = _pick(py_decref, lambda: _decref)


# ----------------------------------------------------------------------------
# compact ASCII str: its bytes follow the object header, so a kernel can read
# them without a C call. Layout checked here, on this interpreter; 0 = off.


def _probe_ascii_offset() -> int:
    if hasattr(sys, "_is_gil_enabled"):  # free-threaded builds: other header
        try:
            if not sys._is_gil_enabled():
                return 0
        except Exception:  # pragma: no cover
            return 0
    off = sys.getsizeof("") - 1  # sizeof(PyASCIIObject)
    try:
        for s in ("cmpl-0123456789abcdef-0", "".join(["x", "y" * 70]), "a"):
            st = ctypes.c_uint32.from_address(id(s) + 32).value
            if st & 0x60 != 0x60 or ctypes.c_int64.from_address(id(s) + OFF_SIZE).value != len(s):
                return 0
            if ctypes.string_at(id(s) + off, len(s)) != s.encode():
                return 0
        for s in ("é", "日本語", "\ud800x"):
            if ctypes.c_uint32.from_address(id(s) + 32).value & 0x40:
                return 0
    except Exception:  # pragma: no cover
        return 0
    return off


ASCII_DATA_OFFSET = _probe_ascii_offset()
STR_STATE_OFFSET = 32


# ----------------------------------------------------------------------------
# array.array: a kernel reads ob_size (16), ob_item (24) and ob_descr (40) ->
# {char typecode; int itemsize} of an array it is handed. Checked here, on
# this interpreter; False = such arrays take the Python conversion path.


def _probe_array_layout() -> bool:
    import array

    try:
        for code, values in (("i", [1, -2, 3]), ("q", [2**40, 5]), ("I", [7])):
            a = array.array(code, values)
            data, n = a.buffer_info()
            if _py_load_i64(id(a) + OFF_ITEMS) != data or _py_load_i64(id(a) + OFF_SIZE) != n:
                return False
            descr = _py_load_i64(id(a) + 40)
            if chr(_py_load_u8(descr)) != code or _py_load_u32(descr + 4) != a.itemsize:
                return False
    except Exception:  # pragma: no cover
        return False
    return True


ARRAY_LAYOUT_OK = _probe_array_layout()
