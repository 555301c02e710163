"""The written sampler arrays' device side (vLLM's UVA pools) kept current by
rows (``_kernels.sampling_params`` ``sp_mark`` / ``sp_upload``)."""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import sampling_params as _P

_UVA_BUFFERS = {("vllm.v1.worker.gpu.buffer_utils", "UvaBuffer"), ("vllm.v1.worker.cpu.buffer_utils", "UvaBuffer")}


def _uploads_reason(uvas, R: int) -> str | None:
    depths = set()
    for u in uvas:
        pool = getattr(u, "pool", None)
        bufs = getattr(pool, "_uva_bufs", None)
        if not isinstance(bufs, list) or not bufs or not isinstance(getattr(u, "np", None), np.ndarray):
            return "a sampler array without vLLM's UvaBufferPool"
        depths.add(len(bufs))
        for b in bufs:
            if (type(b).__module__, type(b).__qualname__) not in _UVA_BUFFERS:
                return f"the sampler's buffers are {type(b).__qualname__}s (explicit copies), not UVA buffers"
            if b.np.shape != (R,) or b.np.dtype != u.np.dtype or u.np.shape != (R,) or not u.np.flags.c_contiguous:
                return "a sampler array's buffers are not of its size"
    if len(depths) != 1:
        return "the sampler's arrays have pools of different depths"
    return None


class SamplerUploads:
    """The written sampler arrays' device side (vLLM's UVA buffers, read in
    place by its kernels) kept current by rows: ``copy_to_uva`` of each (one
    whole-array copy per array in vLLM's ``apply_staged_writes``) becomes one
    kernel call for all of them that copies, into each array's next pool
    slot, only the rows written since that slot was last filled (and
    nothing when no row was written). The slots rotate as vLLM's pool
    rotates them, so a step in flight keeps reading its own."""

    def __init__(self, uvas, R: int):
        D = len(uvas[0].pool._uva_bufs)
        T = len(uvas)
        self._uvas = uvas
        self._pools = [u.pool for u in uvas]
        self._views = [[b.uva() for b in u.pool._uva_bufs] for u in uvas]  # [T][D]: each slot's device view
        o_src, o_size, o_slots, o_count, o_full, o_rows, total = _P._layout(T, D)
        self._rows = np.zeros((D, R), np.int64)  # per slot: the rows written since it was filled
        ctx = np.zeros(total, np.int64)
        ctx[_P.U_T], ctx[_P.U_D], ctx[_P.U_R], ctx[_P.U_INT] = T, D, R, id(int)
        ctx[o_src : o_src + T] = [u.np.ctypes.data for u in uvas]
        ctx[o_size : o_size + T] = [u.np.itemsize for u in uvas]
        ctx[o_slots : o_slots + T * D] = [b.np.ctypes.data for u in uvas for b in u.pool._uva_bufs]
        ctx[o_rows : o_rows + D] = [self._rows[b].ctypes.data for b in range(D)]
        self._ctx = ctx
        self._addr = ctx.ctypes.data
        # every slot holds the arrays now (nothing is in flight yet); slot 0 is current
        for t, u in enumerate(uvas):
            for b in u.pool._uva_bufs:
                b.np[:] = u.np
            u.pool._curr = 0
            u.gpu = self._views[t][0]
            u.copy_to_uva = _Uploaded(self, u)
        self.uploads = 0  # slots filled (stats, tests)

    def detach(self) -> None:
        """vLLM's ``copy_to_uva`` again, after one whole-array copy of each
        array (its device side current whatever was marked)."""
        for u in self._uvas:
            u.__dict__.pop("copy_to_uva", None)
            u.copy_to_uva()

    def mark(self, rows: list) -> None:
        """These rows (a list of ints) were written."""
        _P.sp_mark(self._addr, id(rows), len(rows))

    def upload(self) -> None:
        """Every array's device side current (nothing to do where no row was
        written since the last upload)."""
        if not self._ctx[_P.U_PENDING]:
            return
        b = _P.sp_upload(self._addr)
        for t, u in enumerate(self._uvas):
            self._pools[t]._curr = b  # (as vLLM's pool rotates)
            u.gpu = self._views[t][b]
        self.uploads += 1


class _Uploaded:
    """``UvaBackedTensor.copy_to_uva`` of an array :class:`SamplerUploads`
    keeps current: the upload (if any row was written), then its device
    side."""

    __slots__ = ("_uploads", "_uva")

    def __init__(self, uploads, uva):
        self._uploads = uploads
        self._uva = uva

    def __call__(self, n=None):
        self._uploads.upload()
        gpu = self._uva.gpu
        return gpu if n is None else gpu[:n]
