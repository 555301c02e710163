"""CPU shims for vLLM's Model Runner V2 code: a platform that lets the
config load on x86 without Triton, the staged-write kernel of buffer_utils in
numpy, and no-op launches (counted) for the Triton kernels of
``prepare_inputs`` / ``prepare_attn``. Used only where there is no GPU."""

from __future__ import annotations

import ctypes

import numpy as np

# ----------------------------------------------------------------------------
# CPU shims: a platform that lets the config load on x86 without triton, and
# the Triton write kernel of buffer_utils in numpy


def install_cpu_shims() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    class HarnessPlatform(UnspecifiedPlatform):
        device_type = "cpu"
        device_name = "cpu"

    platforms._current_platform = HarnessPlatform()
    # A GPU has Triton, so its config selects Model Runner V2. 0.33 on take
    # the unspecified platform without Triton; 0.32's config asks for Triton
    # (none of its kernels is launched here: see below).
    import vllm.config.vllm as config_module

    config_module.HAS_TRITON = True

    import vllm.v1.worker.cpu.buffer_utils as cpu_buffer_utils
    from vllm.v1.worker.gpu import buffer_utils

    # what vllm/v1/worker/cpu/shm.py does for the CPU runner: "UVA" = the CPU tensor
    buffer_utils.UvaBuffer = cpu_buffer_utils.UvaBuffer
    buffer_utils._apply_write_kernel = _NumpyWriteKernel()
    buffer_utils._num_write_chunks = lambda max_len: 1

    # prepare_inputs / prepare_attn: their Triton kernels are launches on a
    # GPU (asynchronous, the host only pays the launch); here no-ops on both
    # sides, everything around them (numpy, torch allocations, copies) real
    import vllm.utils.torch_utils as torch_utils
    from vllm.triton_utils import triton
    from vllm.utils.math_utils import next_power_of_2
    from vllm.v1.worker.gpu import block_table, input_batch

    # async_tensor_h2d: no pinned staging without an accelerator (0.33 on
    # read PIN_MEMORY; 0.32 asks is_pin_memory_available on every copy). The
    # platform's own answer stays yes: the UVA buffers are the CPU tensors.
    torch_utils.PIN_MEMORY = False
    torch_utils.is_pin_memory_available = lambda: False
    if not hasattr(triton, "next_power_of_2"):  # vLLM's placeholder module (no Triton installed)
        triton.next_power_of_2 = next_power_of_2
    for mod, names in ((input_batch, INPUT_KERNELS), (block_table, ATTN_KERNELS)):
        for name in names:
            setattr(mod, name, _NoLaunch())
    # (its outputs are read by the sampler's device gathers: written, untimed)
    input_batch._expand_idx_mapping_kernel = _NumpyExpandKernel()
    # the sampler's launchers (Triton on a GPU): no-ops on both sides
    import importlib

    for mod_name, names in SAMPLER_LAUNCHERS.items():
        mod = importlib.import_module(mod_name)
        for name in names:
            setattr(mod, name, _NoLaunchCall())


# the Triton kernels of prepare_inputs (input_batch.py) and prepare_attn
# (block_table.py), replaced by no-ops on both sides
INPUT_KERNELS = (
    "_prepare_prefill_inputs_kernel",
    "_prepare_pos_seq_lens_kernel",
    "_combine_sampled_and_draft_tokens_kernel",
    "_expand_idx_mapping_kernel",
)
ATTN_KERNELS = ("_gather_block_tables_kernel", "_compute_slot_mappings_kernel")
# the functions vLLM's sampler calls that launch its Triton kernels, by module
SAMPLER_LAUNCHERS = {
    "vllm.v1.worker.gpu.sample.states": ("apply_temperature", "apply_min_p"),
    "vllm.v1.worker.gpu.sample.penalties": ("apply_penalties", "bincount"),
    "vllm.v1.worker.gpu.sample.logit_bias": ("apply_logit_bias",),
    "vllm.v1.worker.gpu.sample.bad_words": ("apply_bad_words",),
    "vllm.v1.worker.gpu.sample.thinking_budget": ("apply_thinking_budget",),
}


class _NoLaunch:
    """``kernel[grid](...)`` that launches nothing (and counts the launch:
    on a GPU each is one, which the torch-op counter does not see)."""

    launches = 0

    def __getitem__(self, grid):
        _NoLaunch.launches += 1
        return _no_launch


def _no_launch(*args, **kwargs):
    return None


class _NoLaunchCall:
    """A launcher function (``apply_min_p(logits, ...)``) that launches
    nothing; counted with the kernels' launches. ``calls`` and ``last``
    (its arguments) are what the differential compares."""

    def __init__(self):
        self.calls = 0
        self.last = None

    def __call__(self, *args, **kwargs):
        _NoLaunch.launches += 1
        self.calls += 1
        self.last = (args, kwargs)
        return None


def sampler_launchers() -> dict:
    """The sampler's launchers as the CPU shims replaced them, by name
    (``module.function``)."""
    import importlib

    out = {}
    for mod_name, names in SAMPLER_LAUNCHERS.items():
        mod = importlib.import_module(mod_name)
        for name in names:
            f = getattr(mod, name)
            if isinstance(f, _NoLaunchCall):
                out[f"{mod_name.rsplit('.', 1)[1]}.{name}"] = f
    return out


# seconds the shims spent doing a GPU kernel's work on the host, which a
# timed region subtracts (on a GPU that work is the device's)
UNTIMED = [0.0]


class _NumpyExpandKernel(_NoLaunch):
    """``_expand_idx_mapping_kernel[grid](...)`` of input_batch.py: counted
    as a launch, and its outputs written in numpy (the sampler gathers by
    ``expanded_idx_mapping``), the time it takes added to ``UNTIMED``."""

    def __getitem__(self, grid):
        _NoLaunch.launches += 1
        return self._run

    @staticmethod
    def _run(idx_mapping, expanded_idx_mapping, expanded_local_pos, cu_num_logits, BLOCK_SIZE):  # noqa: N803
        import time

        t0 = time.perf_counter()
        idx, cu = idx_mapping.numpy(), cu_num_logits.numpy()[: len(idx_mapping) + 1]
        n = np.diff(cu)
        expanded_idx_mapping.numpy()[:] = np.repeat(idx, n)
        starts = np.repeat(cu[:-1], n)
        expanded_local_pos.numpy()[:] = np.arange(int(cu[-1])) - starts
        UNTIMED[0] += time.perf_counter() - t0


class _NumpyWriteKernel:
    """``_apply_write_kernel[grid](...)`` of buffer_utils.py, in numpy: write
    ``contents[cu_lens[w-1]:cu_lens[w]]`` to row ``indices[w]`` of the output
    from column ``starts[w]``; MULTI_GROUP: the output of write ``w`` is the
    tensor at address ``output_ptr[group_ids[w]]`` with that group's stride."""

    def __getitem__(self, grid):
        return self._run

    @staticmethod
    def _run(out, stride, indices, starts, contents, cu_lens, group_ids, BLOCK_SIZE, MULTI_GROUP):  # noqa: N803
        idx, st, cu = indices.numpy(), starts.numpy(), cu_lens.numpy()
        c = contents.numpy()
        for w in range(len(idx)):
            lo = int(cu[w - 1]) if w else 0
            hi = int(cu[w])
            if MULTI_GROUP:
                g = int(group_ids.numpy()[w])
                base, rs = int(out.numpy()[g]), int(stride.numpy()[g])
                n = hi - lo
                addr = base + c.itemsize * (int(idx[w]) * rs + int(st[w]))
                dst = np.frombuffer((ctypes.c_int32 * n).from_address(addr), dtype=np.int32) if n else None
                if n:
                    dst[:] = c[lo:hi]
            else:
                flat = out.view(-1).numpy()
                pos = int(idx[w]) * int(stride) + int(st[w])
                flat[pos : pos + hi - lo] = c[lo:hi]


# ----------------------------------------------------------------------------
# CUDA from vLLM's source alone: where its compiled ops (``vllm._C*``) are
# missing, only what needs them is replaced; everything else runs on the GPU

# what install_source_cuda_shims() may replace, as the report names it
CUDA_SOURCE_SHIMS = {
    "platform": "vllm._C_stable_libtorch missing: an empty module, so that vLLM's CUDA platform loads",
    "uva": "UVA views: torch.ops._C.get_cuda_view_from_cpu_tensor missing: the pinned buffer's device view "
    "through __cuda_array_interface__",
}


def install_source_cuda_shims() -> tuple[str, ...]:
    """Make vLLM's CUDA path usable when its compiled extension is not
    built (its source tree on ``sys.path``, as on a machine it cannot be
    pip-installed on). Returns the shims applied (``CUDA_SOURCE_SHIMS``'
    lines): none where vLLM is a normal install."""
    import importlib
    import sys
    import types

    applied = []
    try:
        importlib.import_module("vllm._C_stable_libtorch")
    except ImportError:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
        applied.append(CUDA_SOURCE_SHIMS["platform"])
    import torch

    if not hasattr(torch.ops._C, "get_cuda_view_from_cpu_tensor"):
        from vllm.utils import torch_utils
        from vllm.v1.worker.gpu import buffer_utils

        torch_utils.get_accelerator_view_from_cpu_tensor = uva_view
        buffer_utils.get_accelerator_view_from_cpu_tensor = uva_view
        applied.append(CUDA_SOURCE_SHIMS["uva"])
    return tuple(applied)


class _DeviceView:
    """A pinned host tensor's memory as the GPU addresses it (under UVA, the
    host address itself), described for ``torch.as_tensor``."""

    def __init__(self, cpu):
        self.cpu = cpu  # keeps the host memory alive as long as the view
        self.__cuda_array_interface__ = {
            "shape": tuple(cpu.shape),
            "strides": tuple(s * cpu.element_size() for s in cpu.stride()),
            "typestr": cpu.numpy().__array_interface__["typestr"],
            "data": (cpu.data_ptr(), False),
            "version": 3,
        }


def uva_view(cpu_tensor):
    """What ``torch.ops._C.get_cuda_view_from_cpu_tensor`` returns: a CUDA
    tensor over a pinned CPU tensor's memory (writes on the host are seen
    by kernels that read it, as vLLM's UVA buffers rely on)."""
    import torch

    if not cpu_tensor.is_pinned():
        raise ValueError("a UVA view needs a pinned CPU tensor")
    view = _DeviceView(cpu_tensor)
    out = torch.as_tensor(view, device="cuda")
    out._mtpstate_host = view  # the host tensor outlives every view of it
    return out
