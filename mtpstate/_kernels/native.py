"""Low-level memory primitives the kernels are built from: loads and stores
at an address, numpy views of raw memory, calls by address, hashing and
prefetch. The CPython object access built on them is ``_kernels.cpython``.

Every primitive exists twice: a plain-Python version (ctypes), used when the
kernels run as Python under ``NUMBA_DISABLE_JIT=1`` so tests and coverage reach
them, and a numba intrinsic (or overload) that compiles to a load, a store or a
direct call. ``_pick`` binds the public name to one or the other at import.
"""

from __future__ import annotations

import ctypes

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from mtpstate._kernels.jit import JIT_DISABLED

_MASK64 = (1 << 64) - 1

_I8P = ir.IntType(8).as_pointer()
_I64 = ir.IntType(64)


def _pick(py_fn, make_intrinsic):
    """The primitive the kernels call: the numba intrinsic, which lowers to a
    few LLVM instructions at each call site with no inlining pass (overloads
    with ``inline="always"`` cost seconds of first compile), or the Python
    version when the kernels run as Python under ``NUMBA_DISABLE_JIT=1``."""
    return py_fn if JIT_DISABLED else make_intrinsic()


# ----------------------------------------------------------------------------
# pointer loads


def _py_load_i64(addr):
    return ctypes.c_int64.from_address(int(addr)).value


def _py_load_i32(addr):
    return ctypes.c_int32.from_address(int(addr)).value


def _py_load_u64(addr):
    return ctypes.c_uint64.from_address(int(addr)).value


def _py_load_u32(addr):
    return ctypes.c_uint32.from_address(int(addr)).value


def _py_load_u8(addr):
    return ctypes.c_uint8.from_address(int(addr)).value


def _as_uint64(load):
    # the kernels' unsigned loads give uint64, as the intrinsics do: the same
    # arithmetic under numpy 1.x's casting rules as under numpy 2's
    return lambda addr: np.uint64(load(addr))


def _make_load_intrinsic(bits, signed):
    # narrower loads widen to 64 bits: kernels compute in int64 / uint64
    ret = types.int64 if signed else types.uint64

    @intrinsic
    def _load(typingctx, addr):
        sig = ret(types.int64)

        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            val = builder.load(ptr, align=1)
            if bits < 64:
                val = builder.sext(val, _I64) if signed else builder.zext(val, _I64)
            return val

        return sig, codegen

    return _load


load_i64 = _pick(_py_load_i64, lambda: _make_load_intrinsic(64, True))
load_i32 = _pick(_py_load_i32, lambda: _make_load_intrinsic(32, True))
load_u64 = _pick(_as_uint64(_py_load_u64), lambda: _make_load_intrinsic(64, False))
load_u32 = _pick(_as_uint64(_py_load_u32), lambda: _make_load_intrinsic(32, False))
load_u8 = _pick(_as_uint64(_py_load_u8), lambda: _make_load_intrinsic(8, False))


# ----------------------------------------------------------------------------
# numpy views over raw addresses (state arrays are passed as addresses: a numba
# dispatch costs ~100 ns per array argument and ~20 ns per int argument)


def _py_view(ctype, addr, n):
    n = int(n)
    if n == 0:
        return np.empty(0, dtype=np.dtype(ctype))
    return np.ctypeslib.as_array((ctype * n).from_address(int(addr)))


def view_i32(addr, n):
    return _py_view(ctypes.c_int32, addr, n)


def view_i64(addr, n):
    return _py_view(ctypes.c_int64, addr, n)


def view_u64(addr, n):
    return _py_view(ctypes.c_uint64, addr, n)


def view_f32(addr, n):
    return _py_view(ctypes.c_float, addr, n)


def view_f64(addr, n):
    return _py_view(ctypes.c_double, addr, n)


def view_u8(addr, n):
    # numpy bool arrays are one byte per element, 0 or 1
    return _py_view(ctypes.c_uint8, addr, n)


def _make_ptr_intrinsic(nbtype, lltype):
    @intrinsic
    def _ptr(typingctx, addr):
        sig = types.CPointer(nbtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], lltype.as_pointer())

        return sig, codegen

    return _ptr


_ptr_i32 = _make_ptr_intrinsic(types.int32, ir.IntType(32))
_ptr_i64 = _make_ptr_intrinsic(types.int64, ir.IntType(64))
_ptr_u64 = _make_ptr_intrinsic(types.uint64, ir.IntType(64))
_ptr_u8 = _make_ptr_intrinsic(types.uint8, ir.IntType(8))
_ptr_f32 = _make_ptr_intrinsic(types.float32, ir.FloatType())
_ptr_f64 = _make_ptr_intrinsic(types.float64, ir.DoubleType())


@overload(view_i32)
def _ov_view_i32(addr, n):
    return lambda addr, n: numba.carray(_ptr_i32(addr), n)


@overload(view_i64)
def _ov_view_i64(addr, n):
    return lambda addr, n: numba.carray(_ptr_i64(addr), n)


@overload(view_u64)
def _ov_view_u64(addr, n):
    return lambda addr, n: numba.carray(_ptr_u64(addr), n)


@overload(view_f32)
def _ov_view_f32(addr, n):
    return lambda addr, n: numba.carray(_ptr_f32(addr), n)


@overload(view_f64)
def _ov_view_f64(addr, n):
    return lambda addr, n: numba.carray(_ptr_f64(addr), n)


@overload(view_u8)
def _ov_view_u8(addr, n):
    return lambda addr, n: numba.carray(_ptr_u8(addr), n)


# ----------------------------------------------------------------------------
# a C function ``uint64_t f(void *)`` called by address (numpy's bit
# generators' ``next_uint64``; the caller holds the generator's lock)


def _py_call_u64(fn, arg):
    f = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p)(int(fn))
    return np.uint64(f(int(arg)))


@intrinsic
def _call_u64(typingctx, fn, arg):
    sig = types.uint64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I64, [_I8P])
        ptr = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(ptr, [builder.inttoptr(args[1], _I8P)])

    return sig, codegen


call_u64 = _pick(_py_call_u64, lambda: _call_u64)


# ----------------------------------------------------------------------------
# 64-bit hashing of key bytes (our own hash: independent of PYTHONHASHSEED and
# of whether Python has cached the str's hash)

_M1 = 0x9E3779B97F4A7C15
_M2 = 0xBF58476D1CE4E5B9


def _py_mix(h, w):
    h = ((int(h) ^ int(w)) * _M1) & _MASK64
    return np.uint64(h ^ (h >> 29))


def _py_fmix(h):
    h = int(h)
    h = ((h ^ (h >> 31)) * _M2) & _MASK64
    return np.uint64(h ^ (h >> 32))


def _xorshift(builder, x, k):
    return builder.xor(x, builder.lshr(x, ir.Constant(_I64, k)))


def _make_mix():
    @intrinsic
    def _mix(typingctx, h, w):
        sig = types.uint64(types.uint64, types.uint64)

        def codegen(context, builder, signature, args):
            x = builder.mul(builder.xor(args[0], args[1]), ir.Constant(_I64, _M1))
            return _xorshift(builder, x, 29)

        return sig, codegen

    return _mix


def _make_fmix():
    @intrinsic
    def _fmix(typingctx, h):
        sig = types.uint64(types.uint64)

        def codegen(context, builder, signature, args):
            x = builder.mul(_xorshift(builder, args[0], 31), ir.Constant(_I64, _M2))
            return _xorshift(builder, x, 32)

        return sig, codegen

    return _fmix


mix = _pick(_py_mix, _make_mix)
fmix = _pick(_py_fmix, _make_fmix)


# ----------------------------------------------------------------------------
# software prefetch: block-table rows are one 4 KiB page apart, so each
# append is a cache and TLB miss; pass 1 prefetches the lines pass 2 will write


def _py_prefetch(addr):
    return None


def _make_prefetch(for_write: int):
    @intrinsic
    def _prefetch(typingctx, addr):
        sig = types.void(types.int64)

        def codegen(context, builder, signature, args):
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
            # (address, read 0 / write 1, locality 3: keep in all levels, data cache)
            builder.call(fn, [builder.inttoptr(args[0], i8p), i32(for_write), i32(3), i32(1)])
            return context.get_dummy_value()

        return sig, codegen

    return _prefetch


prefetch = _pick(_py_prefetch, lambda: _make_prefetch(1))


# ----------------------------------------------------------------------------
# element loads/stores at base address + index: no negative-index wraparound
# branch (numba adds one to every signed array index), for the hot loops


def _py_ld32(base, i):
    return ctypes.c_int32.from_address(int(base) + 4 * int(i)).value


def _py_st32(base, i, v):
    ctypes.c_int32.from_address(int(base) + 4 * int(i)).value = int(v)


def _py_ld64(base, i):
    return ctypes.c_int64.from_address(int(base) + 8 * int(i)).value


def _py_st64(base, i, v):
    ctypes.c_int64.from_address(int(base) + 8 * int(i)).value = int(v)


def _py_st8(base, i, v):
    ctypes.c_uint8.from_address(int(base) + int(i)).value = int(v)


def _make_elem_intrinsics(bits):
    ity = ir.IntType(bits)
    nbty = {8: types.uint8, 32: types.int32, 64: types.int64}[bits]

    @intrinsic
    def _ld(typingctx, base, i):
        sig = nbty(types.int64, types.int64)

        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ity.as_pointer())
            return builder.load(builder.gep(ptr, [args[1]]), align=bits // 8)

        return sig, codegen

    @intrinsic
    def _st(typingctx, base, i, v):
        sig = types.void(types.int64, types.int64, nbty)

        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ity.as_pointer())
            builder.store(args[2], builder.gep(ptr, [args[1]]), align=bits // 8)
            return context.get_dummy_value()

        return sig, codegen

    return _ld, _st


_ld32, _st32 = _make_elem_intrinsics(32)
_ld64, _st64 = _make_elem_intrinsics(64)
_ld8, _st8 = _make_elem_intrinsics(8)


ld32 = _pick(_py_ld32, lambda: _ld32)
st32 = _pick(_py_st32, lambda: _st32)
ld64 = _pick(_py_ld64, lambda: _ld64)
st64 = _pick(_py_st64, lambda: _st64)
st8 = _pick(_py_st8, lambda: _st8)
