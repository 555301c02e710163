"""mtpstate against vLLM 0.34.0's own code, on CPU.

vLLM's real ``Scheduler`` / ``AsyncScheduler`` (batch queue depth 2, as the
engine core runs it) is driven by a fake model (no token for a partial prefill
chunk; 1 + accepted tokens after drafts, with rejections; drafts fed back).
Every step it emits goes, as the worker receives it (and also as a pickled
copy), to

- the reference: vLLM's real ``RequestState`` (states.py), ``BlockTables``
  (block_table.py), staging (buffer_utils.py) and the real
  ``GPUModelRunner.finish_requests / add_requests / update_requests``, run on
  CPU (UVA buffers replaced by CPU tensors, the one Triton write kernel
  emulated in numpy);
- ``mtpstate.RequestTable`` (and, as a negative control,
  ``LegacyRequestTable``, which must disagree under speculative decoding).

After every step both are compared per request id (rows differ by design:
vLLM's free list is LIFO). Needs vLLM's source on ``sys.path`` (``make
test-vllm`` sets it up; nothing is built and no model is downloaded).

Run: ``python integrations/vllm/harness.py [--workload NAME] [--bench]``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import math
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

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

    torch_utils.PIN_MEMORY = False  # async_tensor_h2d: no pinned staging without an accelerator
    if not hasattr(triton, "next_power_of_2"):  # vLLM's placeholder module (no Triton installed)
        triton.next_power_of_2 = next_power_of_2
    for mod, names in ((input_batch, INPUT_KERNELS), (block_table, ATTN_KERNELS)):
        for name in names:
            setattr(mod, name, _NoLaunch())


# the Triton kernels of prepare_inputs (input_batch.py) and prepare_attn
# (block_table.py), replaced by no-ops on both sides
INPUT_KERNELS = (
    "_prepare_prefill_inputs_kernel",
    "_prepare_pos_seq_lens_kernel",
    "_combine_sampled_and_draft_tokens_kernel",
    "_expand_idx_mapping_kernel",
)
ATTN_KERNELS = ("_gather_block_tables_kernel", "_compute_slot_mappings_kernel")


class _NoLaunch:
    """``kernel[grid](...)`` that launches nothing (and counts the launch:
    on a GPU each is one, which the torch-op counter does not see)."""

    launches = 0

    def __getitem__(self, grid):
        _NoLaunch.launches += 1
        return _no_launch


def _no_launch(*args, **kwargs):
    return None


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
# model and scheduler configs (hand-written: nothing from a model hub)

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# DeepSeek-V3 shape with one MTP layer, so that SpeculativeConfig(method="mtp") is real
TINY_DEEPSEEK_MTP = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "routed_scaling_factor": 1.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
}
VOCAB = TINY_LLAMA["vocab_size"]


@dataclass(frozen=True)
class Workload:
    name: str
    steps: int = 400
    async_scheduling: bool = False
    num_spec: int = 0  # draft tokens per step (0: no speculative decoding)
    accept: float = 0.7  # per-draft acceptance probability
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int = 4000  # small -> preemptions
    sliding_window: int = 0  # > 0: a second KV group (sliding window)
    prefix_caching: bool = False
    arrivals: float = 1.0  # mean new requests per step
    prompt_len: tuple[int, int] = (8, 300)
    max_tokens: tuple[int, int] = (4, 120)
    abort: float = 0.02  # per step: abort one running or waiting request
    shared_prefix: float = 0.0  # fraction of prompts starting with a shared prefix
    unicode_ids: bool = False
    prompt_embeds: float = 0.0  # fraction of requests sent as prompt embeddings (no prompt token ids)
    initial: int = 0  # requests added before the first step (a burst)
    seed: int = 0


WORKLOADS = {
    w.name: w
    for w in (
        Workload("sync-spec3-chunked", num_spec=3),
        Workload("async-spec3", async_scheduling=True, num_spec=3, seed=1),
        Workload("sync-preempt", num_spec=2, num_blocks=180, arrivals=1.5, seed=2),
        Workload("async-preempt", async_scheduling=True, num_spec=1, num_blocks=180, arrivals=1.5, seed=3),
        # table sizes that are not a multiple of 4: the mirror pads its device rows
        Workload(
            "sync-prefix-two-groups",
            num_spec=4,
            sliding_window=64,
            prefix_caching=True,
            shared_prefix=0.6,
            max_num_seqs=33,
            seed=4,
        ),
        Workload("async-unicode-no-spec", async_scheduling=True, unicode_ids=True, max_num_seqs=30, seed=5),
        Workload("sync-prompt-embeds", num_spec=2, prompt_embeds=0.5, seed=7),
        Workload(
            "sync-256-running",
            steps=250,
            num_spec=3,
            max_num_seqs=320,
            max_num_batched_tokens=4096,
            arrivals=12.0,
            prompt_len=(8, 120),
            max_tokens=(60, 200),
            num_blocks=20000,
            seed=6,
        ),
        Workload(
            "sync-1024-running",
            steps=60,
            num_spec=3,
            max_num_seqs=1100,
            max_num_batched_tokens=16384,
            arrivals=20.0,
            initial=1024,
            prompt_len=(8, 64),
            max_tokens=(30, 120),
            num_blocks=60000,
            seed=8,
        ),
    )
}

BENCH_SIZES = (1, 16, 256, 1024, 4096)
# timing only (make bench-vllm): N running, steady decode (a burst, then no
# arrivals; only steps with nothing added or finished are timed) and busy
# (arrivals and finishes every step), MTP k=3
BENCH_WORKLOADS = {
    w.name: w
    for n in BENCH_SIZES
    for w in (
        Workload(
            f"steady-{n}",
            steps=60,
            num_spec=3,
            max_num_seqs=n,
            max_num_batched_tokens=max(16384, 8 * n),
            arrivals=0.0,
            initial=n,
            prompt_len=(8, 64),
            max_tokens=(400, 500),
            abort=0.0,
            num_blocks=n * 40,
            seed=11,
        ),
        Workload(
            f"busy-{n}",
            steps=60,
            num_spec=3,
            max_num_seqs=n,
            max_num_batched_tokens=max(16384, 8 * n),
            arrivals=max(n / 24, 0.5),
            initial=n,
            prompt_len=(8, 200),
            max_tokens=(10, 80),
            abort=0.2,
            num_blocks=n * 40,
            seed=12,
        ),
    )
}


def make_scheduler(w: Workload, model_dir: str):
    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    # speculative workloads: the DeepSeek-V3-style model and its MTP layer as the drafter
    model = os.path.join(model_dir, "deepseek-mtp" if w.num_spec else "llama")
    mc = ModelConfig(
        model=model,
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=w.max_model_len,
        enable_prompt_embeds=w.prompt_embeds > 0,
    )
    sc = SchedulerConfig(
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        enable_chunked_prefill=True,
        async_scheduling=w.async_scheduling,
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cc = CacheConfig(block_size=w.block_size, cache_dtype="auto", enable_prefix_caching=w.prefix_caching)
    spec = None
    if w.num_spec:
        spec = SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=w.num_spec,
            target_model_config=mc,
            target_parallel_config=ParallelConfig(),
        )
    vc = VllmConfig(
        scheduler_config=sc, model_config=mc, cache_config=cc, parallel_config=ParallelConfig(), speculative_config=spec
    )
    full = FullAttentionSpec(block_size=w.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], full)]
    if w.sliding_window:
        sw = SlidingWindowSpec(
            block_size=w.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=w.sliding_window
        )
        groups.append(KVCacheGroupSpec(["sliding"], sw))
    kvc = KVCacheConfig(num_blocks=w.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    cc.num_gpu_blocks = w.num_blocks
    register_all_kvcache_specs(vc)
    cls = AsyncScheduler if w.async_scheduling else Scheduler
    sched = cls(
        vllm_config=vc,
        kv_cache_config=kvc,
        block_size=w.block_size,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vc),
    )
    return sched, [g.kv_cache_spec.block_size for g in groups]


# ----------------------------------------------------------------------------
# the reference: Model Runner V2's own state code and runner methods


class _Null:
    """Per-request hooks of the runner that hold no state this comparison
    covers (model state, LoRA, draft-token handler)."""

    def __getattr__(self, name):
        return lambda *a, **k: None


class _ModelState(_Null):
    """The runner's ``model_state`` as ``prepare_inputs`` reads it: one bonus
    token per step (a plain decoder); its hooks hold nothing compared."""

    num_new_sampled_tokens_per_step = 1


def load_plugin() -> None:
    """What every vLLM process does at start-up, with VLLM_USE_MTPSTATE=1:
    vLLM's own ``load_general_plugins()``, which finds mtpstate's entry point
    and patches Model Runner V2 (checked: the guard must have applied it)."""
    os.environ["VLLM_USE_MTPSTATE"] = "1"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm.v1.worker.gpu.model_runner  # noqa: F401  (patched on import)

    from mtpstate.integrations.vllm import plugin

    v = plugin.check()
    if not (v.applied and v.ok):
        raise RuntimeError(f"mtpstate's vLLM plugin did not apply: {v.problems or 'entry point not loaded'}")


def vllm_methods(cls):
    """vLLM's own methods of the runner class (the originals where the
    plugin patched them), as a namespace to call with a runner object."""
    from types import SimpleNamespace

    out = {}
    for name, fn in vars(cls).items():
        out[name] = getattr(fn, "__mtpstate_original__", fn)
    return SimpleNamespace(**out)


class MRV2Reference:
    """The host side of vLLM 0.34's GPUModelRunner for one step: the real
    ``finish_requests``, ``add_requests`` and ``update_requests`` methods,
    bound to an object holding the real ``RequestState`` and ``BlockTables``."""

    def __init__(
        self, max_num_reqs, max_model_len, max_num_batched_tokens, block_sizes, num_spec, use_mtpstate=False, ops=None
    ):
        import torch
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        from vllm.v1.worker.gpu.states import RequestState

        cpu = torch.device("cpu")
        self.req_states = RequestState(max_num_reqs, max_model_len, max_num_batched_tokens, num_spec, VOCAB, cpu)
        widths = [math.ceil(max_model_len / b) for b in block_sizes]
        self.block_tables = BlockTables(block_sizes, max_num_reqs, max_num_batched_tokens, widths, cpu)
        for name in ("pooling_runner", "speculator", "encoder_cache", "adaptive_verification", "sampler"):
            setattr(self, name, None)
        self.prompt_logprobs_worker = self.pp_handler = self.kv_block_zeroer = None
        self.lora_state = self.draft_tokens_handler = _Null()
        self.model_state = _ModelState()
        self.is_last_pp_rank = False  # the sampler's per-request state is not compared
        # the runner's methods: as the plugin patched them (on), or vLLM's own (off)
        self._runner = GPUModelRunner if use_mtpstate else vllm_methods(GPUModelRunner)
        # what prepare_inputs / prepare_attn read besides the request state
        from types import SimpleNamespace

        from vllm.v1.worker.gpu.input_batch import InputBuffers

        self.max_num_reqs = max_num_reqs
        self.device = cpu
        self.input_buffers = InputBuffers(max_num_reqs, max_num_batched_tokens, cpu)
        self.fast_prefill = None
        self.model_config = SimpleNamespace(rswa_window=None)
        # what gather_batch_req_state reads besides the request state
        self.decode_query_len = num_spec + 1
        self.use_pp = False
        self.adaptive_verification = None
        self.pcp_manager = None
        # what the patched initialize_kv_cache sets (mtpstate's mrv2.patch)
        self.mtpstate = None
        if use_mtpstate:
            from mtpstate.integrations.vllm import ModelRunnerV2State

            if not getattr(GPUModelRunner.add_requests, "__mtpstate_patched__", False):
                raise RuntimeError("the runner is not patched: call load_plugin() first")
            if ops is None:
                self.mtpstate = ModelRunnerV2State.for_runner(self)
            else:  # a model of a GPU's asynchrony (mtpstate.devices.DeferredOps)
                self.mtpstate = ModelRunnerV2State(self, ring_depth=2, ops=ops)

    def apply(self, so) -> None:
        R = self._runner
        R.finish_requests(self, so)
        R.free_states(self, so)
        R.add_requests(self, so)
        R.update_requests(self, so)
        self.block_tables.apply_staged_writes()

    def _remove_request(self, req_id):
        return self._runner._remove_request(self, req_id)

    def gather(self, so):
        """vLLM's own ``gather_batch_req_state`` for the step just applied."""
        return self._runner.gather_batch_req_state(self, so, False)[0]

    def inputs(self, so, batch):
        """The runner's ``prepare_inputs`` for the gathered batch (eager, no
        request padding: ``cudagraph`` dispatch is the same on both sides and
        is left out). Returns the InputBatch."""
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=batch.num_tokens, num_reqs=None)
        return self._runner.prepare_inputs(self, so, batch, desc, 0)

    def prepare(self, so, batch):
        """``inputs`` and the runner's ``prepare_attn``. Returns the InputBatch."""
        ib = self.inputs(so, batch)
        self._runner.prepare_attn(self, ib)
        return ib

    def host_step(self, so):
        """``execute_model``'s host part up to the forward: finish ..
        update_requests, ``block_tables.apply_staged_writes``,
        ``gather_batch_req_state``, ``prepare_inputs``, ``prepare_attn``.
        Returns the InputBatch."""
        self.apply(so)
        return self.prepare(so, self.gather(so))

    def state(self, device: bool = False) -> dict:
        """Per request id: every field the comparison covers; ``device``:
        also vLLM's device-side tensors as its kernels read them (the
        patched runner writes them through mtpstate's mirror)."""
        rs, bt = self.req_states, self.block_tables
        tokens = rs.all_token_ids.gpu.numpy()
        tables = [t.gpu.numpy() for t in bt.block_tables]
        out = {}
        for rid, r in rs.req_id_to_index.items():
            pl = int(rs.prefill_len.np[r])
            nb = [int(bt.num_blocks.np[g, r]) for g in range(len(tables))]
            out[rid] = {
                "num_computed_tokens": int(rs.num_computed_tokens_np[r]),
                "num_computed_prefill_tokens": int(rs.num_computed_prefill_tokens[r]),
                "prefill_len": pl,
                "prompt_len": int(rs.prompt_len.np[r]),
                "max_seq_len": int(rs.max_seq_len[r]),
                "num_blocks": nb,
                "blocks": [tables[g][r, : nb[g]].tolist() for g in range(len(tables))],
                "prefill_token_ids": tokens[r, :pl].tolist(),
                "is_prefilling": int(rs.num_computed_prefill_tokens[r]) < pl,
            }
            if device:
                out[rid].update(
                    {
                        "total_len.gpu": int(rs.total_len.gpu[r]),
                        "num_computed_tokens.gpu": int(rs.num_computed_tokens.gpu[r]),
                        "prefill_len.gpu": int(rs.prefill_len.gpu[r]),
                        "prompt_len.gpu": int(rs.prompt_len.gpu[r]),
                        "num_blocks.gpu": [int(bt.num_blocks.gpu[g, r]) for g in range(len(tables))],
                    }
                )
        return out


def table_state(t) -> dict:
    """The same fields from an mtpstate table (RequestTable or a loop table)."""
    out = {}
    if hasattr(t, "index"):
        pairs = [(t.index.req_id(int(r)), int(r)) for r in t.index.live_rows()]
    else:
        pairs = list(t.req_id_to_index.items())
    for rid, r in pairs:
        pl = int(t.prefill_len[r])
        nb = [int(t.num_blocks[g, r]) for g in range(t.num_groups)]
        out[rid] = {
            "num_computed_tokens": int(t.num_computed_tokens[r]),
            "num_computed_prefill_tokens": int(t.num_computed_prefill_tokens[r]),
            "prefill_len": pl,
            "prompt_len": int(t.prompt_len[r]),
            "max_seq_len": int(t.max_seq_len[r]),
            "num_blocks": nb,
            "blocks": [t.block_tables[g][r, : nb[g]].tolist() for g in range(t.num_groups)],
            "prefill_token_ids": t.token_ids[r, :pl].tolist(),
            "is_prefilling": bool(t.is_prefilling(np.array([r]))[0]),
        }
    return out


def diff_states(ref: dict, got: dict, limit: int = 5) -> list[str]:
    """Disagreements, per request id and field (empty: they agree)."""
    out = []
    if set(ref) != set(got):
        a, b = sorted(set(ref) - set(got))[:3], sorted(set(got) - set(ref))[:3]
        out.append(f"live ids: only in vLLM {a}, only here {b}")
    for rid in sorted(set(ref) & set(got)):
        for k, v in ref[rid].items():
            if got[rid][k] != v:
                out.append(f"{rid!r}.{k}: vLLM {str(v)[:60]} vs {str(got[rid][k])[:60]}")
                if len(out) >= limit:
                    return out
    return out


BATCH_FIELDS = (
    "num_scheduled_tokens",
    "num_tokens",
    "num_draft_tokens_np",
    "prefill_len_np",
    "num_computed_prefill_tokens_np",
    "is_prefilling_np",
    "has_prefill",
    "prefill_runs_as_decode_np",
    "decode_graph_eligible",
)


def diff_batches(ref, ref_ids_of_rows, got, got_ids_of_rows) -> list[str]:
    """Disagreements between vLLM's ``BatchReqState`` and mtpstate's batch,
    field by field; ``idx_mapping_np`` through each side's own rows."""
    if got is None:
        return ["batch: None"]
    out = []
    if list(got.req_ids) != list(ref.req_ids):
        out.append(f"batch.req_ids: vLLM {list(ref.req_ids)[:4]} vs {list(got.req_ids)[:4]}")
    for f in BATCH_FIELDS:
        a, b = getattr(ref, f), getattr(got, f)
        if a is None or b is None or not isinstance(a, np.ndarray):
            same = (a is None) == (b is None) and (a is None or a == b)
        else:
            same = a.dtype == b.dtype and np.array_equal(a, b)
        if not same:
            out.append(f"batch.{f}: vLLM {str(a)[:60]} vs {str(b)[:60]}")
    if ref_ids_of_rows(ref.idx_mapping_np) != got_ids_of_rows(got.idx_mapping_np):
        out.append("batch.idx_mapping_np: rows map to other ids")
    if got.idx_mapping_np.dtype != ref.idx_mapping_np.dtype:
        out.append(f"batch.idx_mapping_np dtype {got.idx_mapping_np.dtype}")
    return out


INPUT_FIELDS = ("num_reqs", "num_tokens", "num_draft_tokens", "query_start_loc_np", "cu_num_logits_np")


def diff_inputs(ref, ref_ids_of_rows, got, got_ids_of_rows) -> list[str]:
    """Disagreements between two ``InputBatch``es of ``prepare_inputs``: the
    host-computed fields, and ``idx_mapping`` (the tensor) through each side's
    own rows."""
    out = []
    for f in INPUT_FIELDS:
        a, b = getattr(ref, f), getattr(got, f)
        same = np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
        if not same:
            out.append(f"input_batch.{f}: vLLM {str(a)[:60]} vs {str(b)[:60]}")
    for f in ("num_computed_tokens_np", "seq_lens_cpu_upper_bound"):
        a, b = np.asarray(getattr(ref, f)), np.asarray(getattr(got, f))
        if not np.array_equal(a, b):
            out.append(f"input_batch.{f}: vLLM {a[:6]} vs {b[:6]}")
    if ref_ids_of_rows(ref.idx_mapping.tolist()) != got_ids_of_rows(got.idx_mapping.tolist()):
        out.append("input_batch.idx_mapping: rows map to other ids")
    if ref.idx_mapping.dtype != got.idx_mapping.dtype:
        out.append(f"input_batch.idx_mapping dtype {got.idx_mapping.dtype}")
    return out


# ----------------------------------------------------------------------------
# the driver: vLLM's scheduler with a fake model


class Driver:
    """Runs a workload through vLLM's scheduler, yielding each
    SchedulerOutput in the order a worker receives it."""

    def __init__(self, w: Workload, model_dir: str):
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.w = w
        self.sched, self.block_sizes = make_scheduler(w, model_dir)
        self.rng = random.Random(w.seed)
        self.SamplingParams = SamplingParams
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(w.block_size, sha256) if w.prefix_caching else None
        self.prefix = [self.rng.randrange(3, VOCAB) for _ in range(96)]
        self.n = 0

    def _new_request(self):
        from vllm.v1.request import Request

        w, rng = self.w, self.rng
        plen = rng.randint(*w.prompt_len)
        prompt = [rng.randrange(3, VOCAB) for _ in range(plen)]
        if rng.random() < w.shared_prefix:
            prompt = self.prefix[: min(plen, len(self.prefix))] + prompt[len(self.prefix) :]
        suffix = f"{rng.getrandbits(32):08x}"
        rid = f"cmpl-{self.n}-{suffix}" if not w.unicode_ids else f"請求-{self.n}-é-{suffix}"
        self.n += 1
        sp = self.SamplingParams(max_tokens=rng.randint(*w.max_tokens), ignore_eos=True)
        if rng.random() < w.prompt_embeds:
            import torch

            embeds = torch.zeros(plen, TINY_LLAMA["hidden_size"], dtype=torch.float16)
            return Request(rid, None, sp, None, prompt_embeds=embeds, block_hasher=self.hasher)
        return Request(rid, prompt, sp, None, block_hasher=self.hasher)

    def _fake_output(self, so):
        """The model's output for ``so``, decided when it is scheduled: no
        token for a partial prefill chunk; 1 + accepted drafts otherwise."""
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

        req_ids, sampled, drafts = [], [], []
        spec = so.scheduled_spec_decode_tokens
        for rid in so.num_scheduled_tokens:
            req = self.sched.requests.get(rid)
            req_ids.append(rid)
            if req is None or req.is_prefill_chunk:
                sampled.append([])
                continue
            n = 1
            for _ in spec.get(rid, ()):
                if self.rng.random() >= self.w.accept:
                    break
                n += 1
            sampled.append([self.rng.randrange(3, VOCAB) for _ in range(n)])
            drafts.append((rid, [self.rng.randrange(3, VOCAB) for _ in range(self.w.num_spec)]))
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        d = DraftTokenIds([r for r, _ in drafts], [t for _, t in drafts]) if self.w.num_spec and drafts else None
        return out, d

    def _abort_some(self):
        from vllm.v1.request import RequestStatus

        if self.sched.requests and self.rng.random() < self.w.abort:
            rid = self.rng.choice(sorted(self.sched.requests))
            self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    def steps(self):
        """SchedulerOutputs, in the order the engine core emits them."""
        depth = 2 if self.w.async_scheduling else 1
        queue: deque = deque()
        emitted = 0
        for _ in range(self.w.initial):
            self.sched.add_request(self._new_request())
        while emitted < self.w.steps:
            k = np.random.default_rng(self.rng.getrandbits(32)).poisson(self.w.arrivals)
            for _ in range(k):
                self.sched.add_request(self._new_request())
            self._abort_some()
            if self.sched.has_requests():
                so = self.sched.schedule()
                out, drafts = self._fake_output(so)
                queue.appendleft((so, out, drafts))
                emitted += 1
                yield so
                if len(queue) < depth:
                    continue
            if not queue:
                continue
            so, out, drafts = queue.pop()
            self.sched.update_from_output(so, out)
            if drafts is not None and not self.w.async_scheduling:
                self.sched.update_draft_token_ids(drafts)


# ----------------------------------------------------------------------------
# one differential run


def write_model_dir() -> str:
    """Hand-written config.json files of two tiny models (no weights: only
    the configs are read)."""
    d = tempfile.mkdtemp(prefix="mtpstate-vllm-models-")
    for name, cfg in (("llama", TINY_LLAMA), ("deepseek-mtp", TINY_DEEPSEEK_MTP)):
        os.makedirs(os.path.join(d, name))
        with open(os.path.join(d, name, "config.json"), "w") as f:
            json.dump(cfg, f)
    return d


def run_workload(w: Workload, model_dir: str, check_pickled: bool = True, control: bool = True) -> dict:
    """Drive ``w``; compare mtpstate (and a pickled copy of each step) with the
    reference after every step. Returns counts of steps and disagreements."""
    import mtpstate
    from mtpstate.tools.reference import LegacyRequestTable

    drv = Driver(w, model_dir)
    kw = dict(max_num_reqs=w.max_num_seqs, max_model_len=w.max_model_len, block_sizes=drv.block_sizes)
    ref = MRV2Reference(w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, drv.block_sizes, w.num_spec)
    ours = mtpstate.RequestTable(**kw, decode_query_len=w.num_spec + 1)
    ours_pickled = mtpstate.RequestTable(**kw, decode_query_len=w.num_spec + 1) if check_pickled else None
    legacy = LegacyRequestTable(**kw) if control else None
    ref_ids = lambda rows: [ref.req_states.index_to_req_id[int(r)] for r in rows]  # noqa: E731
    res = {"workload": w.name, "steps": 0, "disagreements": 0, "control_disagreements": 0, "first": []}
    kinds = {
        "new": 0,
        "cached": 0,
        "finished": 0,
        "preempted": 0,
        "spec_tokens": 0,
        "max_running": 0,
        "prefix_hits": 0,
        "prompt_embeds": 0,
    }
    for so in drv.steps():
        blob = pickle.dumps(so)
        ref.apply(so)
        got = ours.apply(so).batch
        expect = ref.state()
        bad = diff_states(expect, table_state(ours))
        vbatch = ref.gather(so)
        bad += diff_batches(vbatch, ref_ids, got, lambda rows: [ours.index.req_id(int(r)) for r in rows])
        if ours_pickled is not None:
            got = ours_pickled.apply(pickle.loads(blob)).batch
            bad += [f"(pickled) {b}" for b in diff_states(expect, table_state(ours_pickled))]
            ids_p = lambda rows: [ours_pickled.index.req_id(int(r)) for r in rows]  # noqa: E731
            bad += [f"(pickled) {b}" for b in diff_batches(vbatch, ref_ids, got, ids_p)]
        res["batch_steps"] = res.get("batch_steps", 0) + 1
        if legacy is not None:
            legacy.apply(pickle.loads(blob))
            if diff_states(expect, table_state(legacy), limit=1):
                res["control_disagreements"] += 1
        res["steps"] += 1
        if bad:
            res["disagreements"] += 1
            if len(res["first"]) < 3:
                res["first"].append((res["steps"], bad[:5]))
        kinds["new"] += len(so.scheduled_new_reqs)
        kinds["prefix_hits"] += sum(1 for r in so.scheduled_new_reqs if r.num_computed_tokens > 0)
        kinds["prompt_embeds"] += sum(1 for r in so.scheduled_new_reqs if r.prompt_token_ids is None)
        kinds["cached"] += len(so.scheduled_cached_reqs.req_ids)
        kinds["finished"] += len(so.finished_req_ids)
        kinds["preempted"] += len(so.preempted_req_ids or ())
        kinds["spec_tokens"] += sum(len(v) for v in so.scheduled_spec_decode_tokens.values())
        kinds["max_running"] = max(kinds["max_running"], len(so.num_scheduled_tokens))
    res["kinds"] = kinds
    res["python_path_steps"] = ours.python_path_steps  # steps that needed a Python conversion (0 expected)
    return res


def _zero_token_values(mirror, slot, n, n_tok):
    slot.val_np[:n_tok] = 0


def _zero_engine_lengths(mirror, slot, n, n_tok):
    from mtpstate._kernels import slots

    eng = int(mirror.table._ctx[slots.TB_FLAT_ENG])
    pos = slot.pos_np[n_tok:n]
    slot.val_np[n_tok:n][(pos >= eng) & (pos < eng + slots.ENG_ROWS * mirror._row_stride)] = 0


def _drop_length_rows(mirror, slot, n, n_tok):
    from mtpstate._kernels import slots

    R = mirror._row_stride  # the device's row stride of the per-request rows
    pos = slot.pos_np[n_tok:n]
    lengths = (pos >= slots.F_PREFILL * R) & (pos < (slots.F_PROMPT + 1) * R)
    slot.pos_np[n_tok:n][lengths] = slots.F_MAXSEQ * R  # (a row vLLM does not read)


# negative controls of the patched differential: each corrupts one kind of
# element the mirror ships, just before the copy
SABOTAGE = {"tokens": _zero_token_values, "engine-lengths": _zero_engine_lengths, "lengths": _drop_length_rows}


def sabotage(kind: str) -> None:
    from mtpstate.mirror import DeviceMirror

    ship, corrupt = DeviceMirror._ship, SABOTAGE[kind]

    def corrupted(mirror, slot, n, n_tok):
        corrupt(mirror, slot, n, n_tok)
        ship(mirror, slot, n, n_tok)

    DeviceMirror._ship = corrupted


def run_runner_differential(w: Workload, model_dir: str, deferred: bool = False) -> dict:
    """vLLM's unpatched source, mtpstate applied by its plugin through vLLM's
    own ``load_general_plugins()``: the runner's methods as the plugin
    patched them, mtpstate on (``ModelRunnerV2State``), against vLLM's own
    methods, compared after every step:
    the state, and the whole ``BatchReqState`` of ``gather_batch_req_state``
    (on: built from ``StepResult.batch``), plus ``idx_mapping``.
    ``deferred``: mtpstate's device work on a model of a GPU's asynchrony
    (its graph path), counted per step (``ops_per_step``: each distinct
    count and how many steps had it), then run before the comparison (vLLM's
    own code reads the tensors at once on the CPU)."""
    load_plugin()
    drv = Driver(w, model_dir)
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, drv.block_sizes, w.num_spec)
    ops = None
    if deferred:
        import torch

        from mtpstate.devices import DeferredOps

        ops = DeferredOps(torch, graphs=True)
    ref, patched = MRV2Reference(*args), MRV2Reference(*args, use_mtpstate=True, ops=ops)
    res = {"workload": w.name, "steps": 0, "disagreements": 0, "first": []}
    per_step = collections.Counter()
    ids_ref = lambda rows: [ref.req_states.index_to_req_id[int(r)] for r in rows]  # noqa: E731
    ids_pat = lambda rows: [patched.req_states.index_to_req_id[int(r)] for r in rows]  # noqa: E731
    for so in drv.steps():
        blob = pickle.dumps(so)
        so2 = pickle.loads(blob)
        ref.apply(so)
        if ops is not None:
            before = dict(ops.issued)
        patched.apply(so2)
        if ops is not None:
            issued = {k: v - before.get(k, 0) for k, v in ops.issued.items() if v != before.get(k, 0)}
            per_step[json.dumps(issued, sort_keys=True)] += 1
            ops.synchronize()
        bad = diff_states(ref.state(device=True), patched.state(device=True))
        # the whole BatchReqState: vLLM's gather (off) against StepResult.batch (on)
        bad += diff_batches(ref.gather(so), ids_ref, patched.gather(so2), ids_pat)
        rows = patched.gather(so2).idx_mapping_np
        if patched.mtpstate.idx_mapping(rows).tolist() != rows.tolist():
            bad.append("idx_mapping: the tensor differs from the batch's idx_mapping_np")
        # prepare_inputs' host results (its Triton kernels are no-ops here)
        bad += diff_inputs(ref.prepare(so, ref.gather(so)), ids_ref, patched.prepare(so2, patched.gather(so2)), ids_pat)
        res["steps"] += 1
        if bad:
            res["disagreements"] += 1
            if len(res["first"]) < 3:
                res["first"].append((res["steps"], bad[:5]))
    if ops is not None:
        res["ops_per_step"] = dict(per_step)
    return res


# ----------------------------------------------------------------------------
# paired timing on the real steps


def bench_workload(w: Workload, model_dir: str, repeats: int = 5, runner: bool = False) -> dict:
    """Record the workload's steps once, then time, per step and interleaved,
    MRV2's host path (finish/add/update, then the batch -> row mapping of
    ``gather_batch_req_state``) against ``RequestTable.apply`` + ``rows`` for
    the same batch order, each on a freshly unpickled step (as a worker
    process receives it). The batch order (vLLM's ``sort_batch_req_ids``) is
    computed outside the timed region: both sides need it. ``runner``: the
    runner as the plugin patches it, mtpstate on, against vLLM's own
    methods, over the host part of ``execute_model`` up to the forward
    (``_bench_runner``)."""
    with _staging_launches_as_no_ops():
        return _bench_runner(w, model_dir, repeats) if runner else _bench(w, model_dir, repeats)


@contextlib.contextmanager
def _staging_launches_as_no_ops():
    """The device step of the state staging is a launch on a GPU, on both
    sides: vLLM's Triton write kernel, and the mirror's device work (one
    graph replay). Both are no-ops inside (counted as launches); what is timed
    is everything up to them (vLLM's UVA staging, mtpstate's kernel
    staging)."""
    from vllm.v1.worker.gpu import buffer_utils

    from mtpstate.mirror import DeviceMirror

    emulated = buffer_utils._apply_write_kernel
    shipped = DeviceMirror._ship
    buffer_utils._apply_write_kernel = _NoLaunch()
    DeviceMirror._ship = _no_ship
    try:
        yield
    finally:
        buffer_utils._apply_write_kernel = emulated
        DeviceMirror._ship = shipped


def _no_ship(mirror, slot, n, n_tok):
    """``DeviceMirror._ship`` launching nothing: the step's one graph replay
    on a GPU, counted."""
    _NoLaunch.launches += 1


def _quiet(so) -> bool:
    return not so.scheduled_new_reqs and not so.finished_req_ids and not so.preempted_req_ids


def _recorded(w, model_dir):
    """The workload's steps, recorded once from vLLM's scheduler: (pickled
    steps, which of them are timed, the KV-cache groups' block sizes). A
    ``steady-*`` workload times only the steps that add and finish nothing."""
    drv = Driver(w, model_dir)
    steps = list(drv.steps())
    timed = [not w.name.startswith("steady") or _quiet(so) for so in steps]
    return [pickle.dumps(so) for so in steps], timed, drv.block_sizes


def _bench(w, model_dir, repeats):
    """Per step, interleaved: vLLM (finish/free_states/add/update_requests,
    apply_staged_writes, then gather_batch_req_state) against
    ``RequestTable(decode_query_len=...).apply(so).batch``, and
    ``RequestTable.apply`` alone (no batch) for the apply-only figure. A
    ``steady-*`` workload times only the steps that add and finish nothing."""
    import mtpstate

    blobs, timed, block_sizes = _recorded(w, model_dir)
    kw = dict(max_num_reqs=w.max_num_seqs, max_model_len=w.max_model_len, block_sizes=block_sizes)
    dq = 1 + w.num_spec
    t_ref, t_ours, t_apply, running = [], [], [], []
    for _ in range(repeats):
        args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, block_sizes, w.num_spec)
        ref = MRV2Reference(*args)
        ours = mtpstate.RequestTable(**kw, decode_query_len=dq)
        alone = mtpstate.RequestTable(**kw)
        for b, keep in zip(blobs, timed):
            s1, s2, s3 = pickle.loads(b), pickle.loads(b), pickle.loads(b)
            t0 = time.perf_counter()
            ref.apply(s1)
            vb = ref.gather(s1)
            t1 = time.perf_counter()
            m2 = ours.apply(s2).batch.idx_mapping_np
            t2 = time.perf_counter()
            alone.apply(s3)
            t3 = time.perf_counter()
            assert len(m2) == len(vb.idx_mapping_np)
            if keep:
                t_ref.append(t1 - t0)
                t_ours.append(t2 - t1)
                t_apply.append(t3 - t2)
                running.append(len(s1.num_scheduled_tokens))
    ratios = np.array(t_ref) / np.array(t_ours)
    n_med = statistics.median(running)
    return {
        "workload": w.name,
        "subject": "RequestTable.apply(so).batch",
        "steps": len(blobs),
        "timed_steps": len(t_ref),
        "repeats": repeats,
        "median_running": n_med,
        "mrv2_median_us": statistics.median(t_ref) * 1e6,
        "mtpstate_median_us": statistics.median(t_ours) * 1e6,
        "apply_alone_median_us": statistics.median(t_apply) * 1e6,
        "apply_alone_ns_per_request": statistics.median(t_apply) * 1e9 / max(n_med, 1),
        "speedup": statistics.median(t_ref) / statistics.median(t_ours),
        "paired_median": float(np.median(ratios)),
        "paired_p10": float(np.percentile(ratios, 10)),
        "paired_p90": float(np.percentile(ratios, 90)),
    }


PHASES = ("update", "gather", "prepare")


def _timed_host_step(sub, so, out):
    """``MRV2Reference.host_step`` with a clock between its phases: finish ..
    update_requests + apply_staged_writes; gather_batch_req_state;
    prepare_inputs + prepare_attn. Appends the three durations to ``out``."""
    t0 = time.perf_counter()
    sub.apply(so)
    t1 = time.perf_counter()
    batch = sub.gather(so)
    t2 = time.perf_counter()
    sub.prepare(so, batch)
    t3 = time.perf_counter()
    out.append((t1 - t0, t2 - t1, t3 - t2))


def _bench_runner(w, model_dir, repeats):
    """The patched runner with mtpstate on against itself off (vLLM's own
    code paths), per step and interleaved (which side goes first alternates
    by repeat), on freshly unpickled steps: the host part of
    ``execute_model`` up to the forward (``MRV2Reference.host_step``). A
    ``steady-*`` workload times only the steps that add and finish nothing.
    Also counts the torch operator calls per step on each side."""
    blobs, timed, block_sizes = _recorded(w, model_dir)
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, block_sizes, w.num_spec)
    times = {False: [], True: []}
    running, with_new = [], []
    for rep in range(repeats):
        sides = {False: MRV2Reference(*args), True: MRV2Reference(*args, use_mtpstate=True)}
        order = (False, True) if rep % 2 == 0 else (True, False)
        for b, keep in zip(blobs, timed):
            sos = {on: pickle.loads(b) for on in order}
            mark = {on: len(times[on]) for on in order}
            for on in order:
                _timed_host_step(sides[on], sos[on], times[on])
            if not keep:
                for on in order:
                    del times[on][mark[on] :]
            elif rep == 0:
                running.append(len(sos[False].num_scheduled_tokens))
                with_new.append(bool(sos[False].scheduled_new_reqs))
    off = np.array(times[False])  # [timed steps x repeats, phases]
    on = np.array(times[True])
    t_off, t_on = off.sum(axis=1), on.sum(axis=1)
    ratios = t_off / t_on
    ops = _torch_op_counts(w, block_sizes, blobs, timed)
    med = lambda a: float(np.median(a)) * 1e6  # noqa: E731  (us)
    return {
        "workload": w.name,
        "subject": "runner via mtpstate's vLLM plugin vs vLLM's own methods (execute_model's host part to the forward)",
        "max_running": int(max(running)),
        "median_running": float(statistics.median(running)),
        "steps": len(blobs),
        "timed_steps": len(running),
        "timed_steps_with_new_requests": int(sum(with_new)),
        "repeats": repeats,
        "vllm_median_us": med(t_off),
        "mtpstate_median_us": med(t_on),
        "speedup": float(np.median(t_off) / np.median(t_on)),
        "paired_median": float(np.median(ratios)),
        "paired_p10": float(np.percentile(ratios, 10)),
        "paired_p90": float(np.percentile(ratios, 90)),
        "phases_us": {
            "vllm": {p: med(off[:, k]) for k, p in enumerate(PHASES)},
            "mtpstate": {p: med(on[:, k]) for k, p in enumerate(PHASES)},
        },
        "torch_ops": ops,
    }


def breakdown_workload(w: Workload, model_dir: str, repeats: int = 3) -> dict:
    """Where the patched side's host time goes: the runner's methods one by
    one, and ``RequestTable.apply`` inside ``add_requests``, medians in us
    over the timed steps after a 10-step warm-up, with vLLM's side (off) run
    before each step as in the benchmark (the staging's device launches
    no-op'd, as there)."""
    blobs, timed, block_sizes = _recorded(w, model_dir)
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, block_sizes, w.num_spec)
    names = (
        "finish_requests",
        "add_requests",
        "update_requests+apply_staged_writes",
        "gather",
        "prepare_inputs",
        "prepare_attn",
    )
    out: dict = {}
    with _staging_launches_as_no_ops():
        for _ in range(repeats):
            off, on = MRV2Reference(*args), MRV2Reference(*args, use_mtpstate=True)
            R, table = on._runner, on.mtpstate.table
            inner = []

            def timed_apply(so, apply=table.apply, inner=inner):
                t0 = time.perf_counter()
                r = apply(so)
                inner.append(time.perf_counter() - t0)
                return r

            table.apply = timed_apply
            for i, (b, keep) in enumerate(zip(blobs, timed)):
                so_off, so = pickle.loads(b), pickle.loads(b)
                off.host_step(so_off)
                inner.clear()
                t = [time.perf_counter()]
                R.finish_requests(on, so)
                t.append(time.perf_counter())
                R.free_states(on, so)
                R.add_requests(on, so)
                t.append(time.perf_counter())
                R.update_requests(on, so)
                on.block_tables.apply_staged_writes()
                t.append(time.perf_counter())
                batch = on.gather(so)
                t.append(time.perf_counter())
                ib = on.inputs(so, batch)
                t.append(time.perf_counter())
                R.prepare_attn(on, ib)
                t.append(time.perf_counter())
                if i < 10 or not keep:
                    continue
                for k, name in enumerate(names):
                    out.setdefault(name, []).append(t[k + 1] - t[k])
                out.setdefault("  of add_requests: RequestTable.apply", []).extend(inner)
                out.setdefault("total", []).append(t[-1] - t[0])
    return {"workload": w.name, "breakdown_us": {k: statistics.median(v) * 1e6 for k, v in out.items()}}


def _torch_op_counts(w, block_sizes, blobs, timed) -> dict:
    """torch operator calls per step (a TorchDispatchMode counter, in a pass
    of its own: counting slows the calls) on each side, over the timed part
    (``MRV2Reference.host_step``): on a GPU each is a kernel launch, a copy
    or a view. The no-op'd launches (Triton kernels, the mirror's copies and
    scatters) are counted apart (``no_op_launches``). Split by steps with and
    without new requests, to show whether the count grows with them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    out = {}
    for side, on in (("vllm", False), ("mtpstate", True)):
        args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, block_sizes, w.num_spec)
        ref = MRV2Reference(*args, use_mtpstate=on)
        counts = {"with_new": [], "without_new": []}
        triton = {"with_new": [], "without_new": []}
        for b, keep in zip(blobs, timed):
            so = pickle.loads(b)
            Count.n = 0
            launched = _NoLaunch.launches
            with Count():
                ref.host_step(so)
            if keep:
                kind = "with_new" if so.scheduled_new_reqs else "without_new"
                counts[kind].append(Count.n)
                triton[kind].append(_NoLaunch.launches - launched)
        out[side] = {k: (statistics.median(v) if v else None) for k, v in counts.items()}
        out[side]["max"] = max(counts["with_new"] + counts["without_new"])
        # device launches no-op'd here (Triton kernels; the mirror's copies
        # and scatters), per step
        out[side]["no_op_launches"] = {k: (statistics.median(v) if v else None) for k, v in triton.items()}
    return out


def run_machine() -> dict:
    """The machine and versions of a benchmark run, for its JSON."""
    from vllm.version import __version__ as vllm_version

    from mtpstate.tools.bench import machine_info

    machine = dict(machine_info(), vllm=vllm_version)
    machine.pop("mirror_device", None)  # (the mirror's device work is counted, not run: see _no_ship)
    return machine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workload",
        choices=sorted({**WORKLOADS, **BENCH_WORKLOADS}),
        action="append",
        help="default: all (with --bench: the timing workloads)",
    )
    p.add_argument("--steps", type=int, help="override each workload's step count")
    p.add_argument(
        "--scale-steps",
        type=int,
        metavar="N",
        help="each workload's step count x N / 400, at most N (what make test-vllm runs)",
    )
    p.add_argument("--bench", action="store_true", help="paired timing instead of the differential")
    p.add_argument(
        "--runner",
        action="store_true",
        help="the runner as mtpstate's vLLM plugin patches it (on) against vLLM's own methods (off)",
    )
    p.add_argument(
        "--breakdown", action="store_true", help="with --bench --runner: the mtpstate side's time by runner method"
    )
    p.add_argument(
        "--sabotage",
        choices=sorted(SABOTAGE),
        help="with --runner: break what the mirror ships to vLLM's tensors (a negative control: must disagree)",
    )
    p.add_argument(
        "--deferred",
        action="store_true",
        help="with --runner: mtpstate's device work on a model of a GPU's asynchrony, counted per step",
    )
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    install_cpu_shims()
    if args.runner:
        load_plugin()  # through vLLM's own plugin loader, as every vLLM process
    if args.sabotage:
        sabotage(args.sabotage)
    model_dir = write_model_dir()
    table = {**WORKLOADS, **BENCH_WORKLOADS}
    names = args.workload or sorted(BENCH_WORKLOADS if args.bench else WORKLOADS)
    results, failed = [], False
    for name in names:
        w = table[name] if args.steps is None else replace(table[name], steps=args.steps)
        if args.scale_steps is not None:
            w = replace(w, steps=min(w.steps * args.scale_steps // 400, args.scale_steps))
        t0 = time.perf_counter()
        if args.bench and args.breakdown:
            r = breakdown_workload(w, model_dir)
        elif args.bench:
            r = bench_workload(w, model_dir, runner=args.runner)
        elif args.runner:
            r = run_runner_differential(w, model_dir, deferred=args.deferred)
        else:
            r = run_workload(w, model_dir)
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        print(json.dumps(r), flush=True)
        if not args.bench:
            failed |= r["disagreements"] > 0
            failed |= not args.runner and w.num_spec > 0 and r["control_disagreements"] == 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": run_machine(), "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
