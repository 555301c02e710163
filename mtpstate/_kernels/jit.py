"""The one jit helper that fixes every kernel's decorator options, the key
of the kernels' on-disk cache, and the notice printed when the kernels are
compiled instead of loaded from numba's on-disk cache."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import numba
import numba.core.event
from numba.core.caching import CompileResultCacheImpl, FunctionCache
from numba.core.registry import CPUDispatcher

__all__ = ["COMPILE_NOTICE", "ENTRY_KERNELS", "JIT_DISABLED", "KERNEL_SOURCE_KEY", "jit", "kernel_source_key"]

JIT_DISABLED = os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")

# the kernels the Python side calls; every other kernel is called by kernels only
ENTRY_KERNELS = frozenset(
    {
        "tb_apply",
        "ix_find",
        "ix_insert",
        "ix_remove",
        "ix_rehash",
        "tok_fill",
        "sp_answers",
        "sp_rows_changed",
        "sp_row_written",
        "sp_read",
        "sp_write",
        "sp_mark",
        "sp_upload",
        "_layout",
    }
)


def kernel_source_key(version: str | None = None, folder: Path | None = None) -> str:
    """The key of every kernel's on-disk cache: a digest of mtpstate's
    version and of every kernel source file (``mtpstate/_kernels/*.py``).

    numba keys an entry kernel's cache to its own file only, while the
    helpers it calls from other files are compiled into it: a changed
    helper would otherwise leave the old machine code running."""
    if version is None:
        from mtpstate import __version__ as version
    folder = Path(__file__).parent if folder is None else folder
    h = hashlib.sha256(f"mtpstate {version}\n".encode())
    for path in sorted(folder.glob("*.py")):
        h.update(f"{path.name}\n".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:32]


KERNEL_SOURCE_KEY = kernel_source_key()


class _KeyedLocator:
    """numba's cache locator for a kernel, with :data:`KERNEL_SOURCE_KEY` in
    its source stamp: a cache written by other kernel sources (or another
    mtpstate) is stale, and the kernel is compiled again."""

    def __init__(self, inner):
        self._inner = inner

    def get_source_stamp(self):
        return (self._inner.get_source_stamp(), KERNEL_SOURCE_KEY)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _KeyedCacheImpl(CompileResultCacheImpl):
    def __init__(self, py_func):
        super().__init__(py_func)
        self._locator = _KeyedLocator(self._locator)


class _KeyedFunctionCache(FunctionCache):
    _impl_class = _KeyedCacheImpl


def jit(fn=None, *, signature: str | None = None, **kwargs):
    """The one place that fixes the decorator options of every kernel.

    ``cache=True`` so that a serving process loads compiled kernels from disk
    (milliseconds) instead of compiling them on its first scheduler step.

    ``inline="always"`` (numba IR inlining) is kept for the few helpers on the
    per-request path of the update-only kernel, where it measurably pays: each
    inlined call site re-types the callee, so it multiplies first-compile time
    (43 s -> 17 s when dropped elsewhere; LLVM still inlines small callees).

    ``signature`` (explicit types) pays for small helpers called from many
    sites with constant arguments: numba would otherwise compile one
    specialization per combination of literal argument values (``_err`` had
    46); with a signature it compiles once, at import, and casts.
    """
    options = {"cache": True, "nogil": False, "boundscheck": False, "error_model": "numpy"}
    options.update(kwargs)
    args = () if signature is None else (signature,)

    # only the entry kernels are called from Python: the others need no
    # CPython wrapper (one less function per kernel to generate and compile),
    # and refuse a call from Python, which would otherwise crash the process
    def decorate(f):
        opts = dict(options)
        entry = f.__name__ in ENTRY_KERNELS
        if not entry:
            opts.update(no_cpython_wrapper=True, no_cfunc_wrapper=True)
        cache = opts.pop("cache")
        if JIT_DISABLED:
            return numba.njit(*args, **opts)(f)
        # (numba's njit(signature, cache=True) would compile, and cache under
        # numba's own key, right here: the keyed cache goes in first)
        kernel = numba.njit(**opts)(f)
        if cache:
            kernel._cache = _KeyedFunctionCache(f)
        if signature is not None:
            kernel.compile(signature)
            kernel.disable_compile()
        if not entry and isinstance(kernel, CPUDispatcher):
            kernel.__class__ = _KernelOnly
        return kernel

    if fn is None:
        return decorate
    return decorate(fn)


class _KernelOnly(CPUDispatcher):
    """A kernel that only other kernels call: compiled without a CPython
    wrapper, so a call from Python is refused (it would jump into code that
    does not exist). Kernels call it as any dispatcher."""

    def __call__(self, *args, **kwargs):
        f = self.py_func
        raise TypeError(
            f"mtpstate: {f.__module__}.{f.__qualname__} is a kernel that only other kernels call (compiled "
            "without a CPython wrapper): call it from a kernel, or list it in "
            "mtpstate._kernels.jit.ENTRY_KERNELS to call it from Python"
        )


class _CompileNotice(numba.core.event.Listener):
    """One line on stderr when mtpstate's kernels are compiled rather than
    loaded from numba's on-disk cache: the first ``apply`` in a fresh
    environment otherwise waits ~20 s in silence. Printed once per process,
    when the first compile of an entry kernel (``entries``: the step kernel,
    the index's) ends, with the time of every mtpstate compile so far (the
    helpers with explicit signatures compile at import).
    ``MTPSTATE_COMPILE_NOTICE=0`` silences it."""

    entries = frozenset({"tb_apply", "ix_find", "ix_insert", "ix_remove", "ix_rehash"})

    def __init__(self):
        self.depth = 0
        self.t0 = 0.0
        self.printed = False
        self.total_s = 0.0  # seconds spent compiling mtpstate kernels in this process

    @staticmethod
    def _ours(event) -> str | None:
        fn = getattr(event.data.get("dispatcher"), "py_func", None)
        mod = getattr(fn, "__module__", "") or ""
        return fn.__name__ if mod.startswith("mtpstate.") else None

    def on_start(self, event):
        if self._ours(event) is None:
            return
        self.depth += 1
        if self.depth == 1:
            self.t0 = time.perf_counter()

    def on_end(self, event):
        name = self._ours(event)
        if name is None:
            return
        self.depth -= 1
        if self.depth == 0:
            dt = time.perf_counter() - self.t0
            self.total_s += dt
            if name in self.entries and not self.printed and _notice_on():
                self.printed = True
                print(
                    f"mtpstate: compiled its kernels in {self.total_s:.1f} s ({name} and its helpers; first use "
                    "in this environment: numba caches them on disk for later processes; `mtpstate warmup` "
                    "does this ahead of time)",
                    file=sys.stderr,
                    flush=True,
                )


def _notice_on() -> bool:
    return os.environ.get("MTPSTATE_COMPILE_NOTICE", "1") not in ("0", "")


COMPILE_NOTICE = _CompileNotice()
numba.core.event.register("numba:compile", COMPILE_NOTICE)
