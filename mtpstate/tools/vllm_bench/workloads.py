"""The vLLM-level workloads: tiny hand-written model configs (nothing from a
model hub), the differential and timing workloads, vLLM's real
``Scheduler`` / ``AsyncScheduler`` built for one, and the model directory
they read (written to a temporary directory)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

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


# The mix of sampling params every driven request gets (drawn from its own
# stream: the scheduler's steps are the same as without it): (share, kwargs).
# Every case vLLM's sampler normalizes or flags is in it: greedy, top-p,
# top-k with a seed, logprobs (and -1: the whole vocabulary), an out-of-range
# top_k (vLLM uses the vocabulary), min-p, penalties, logit bias, allowed
# token ids and min_tokens with and without stop tokens (vLLM's logit-bias
# processor), logprob token ids, bad words (as token ids, as vLLM's
# tokenizer step sets them).
SAMPLING_MIX = (
    (0.22, {"temperature": 0.0}),
    (0.02, {"logprob_token_ids": [3, 4]}),
    (0.02, {"temperature": 0.8, "_bad_words_token_ids": [[5, 6], [7]]}),  # (what vLLM's tokenizer step sets)
    (0.02, {"min_tokens": 3}),
    (0.02, {"min_tokens": 2, "stop_token_ids": [2]}),  # (2: EOS, which the fake model never samples)
    (0.03, {"logit_bias": {7: 2.0, 11: -1.0}}),
    (0.02, {"temperature": 0.6, "allowed_token_ids": [3, 4, 5, 6, 7, 8]}),
    (0.25, {"temperature": 0.7, "top_p": 0.9}),
    (0.15, {"temperature": 0.8, "top_k": 50, "seed": "n"}),
    (0.10, {"logprobs": 5}),
    (0.05, {"top_k": VOCAB + 1000, "min_p": 0.05}),
    (0.05, {"temperature": 0.9, "repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.3}),
    (0.05, {"temperature": 0.5, "top_k": -1, "logprobs": -1}),
)


def sampling_kwargs(rng, n: int) -> dict:
    """Request ``n``'s sampling params from :data:`SAMPLING_MIX` (``seed``
    "n": the request's number)."""
    x, acc, kw = rng.random(), 0.0, SAMPLING_MIX[-1][1]
    for share, case in SAMPLING_MIX:
        acc += share
        if x < acc:
            kw = case
            break
    return {k: (n if v == "n" else v) for k, v in kw.items()}


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
    # the n-th request's id made 70,000 bytes long: vLLM takes it, mtpstate
    # refuses it (over RequestIndex's max_id_bytes); -1: none
    long_request_id: int = -1
    prompt_embeds: float = 0.0  # fraction of requests sent as prompt embeddings (no prompt token ids)
    initial: int = 0  # requests added before the first step (a burst)
    # requests arriving after the burst: their own lengths (None: as above)
    arrival_prompt_len: tuple[int, int] | None = None
    arrival_max_tokens: tuple[int, int] | None = None
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
BENCH_KINDS = ("steady", "busy", "chunked")
# timing only (mtpstate bench-vllm), MTP k=3, N running: steady decode (a
# burst, then no arrivals; only steps with nothing added or finished are
# timed); busy (arrivals and finishes every step); chunked prefill (N
# decoding, and long prompts arriving whose prefill is split over steps by
# the token budget: 512 tokens a step beyond the decodes; timed from the
# first step that runs all N)


def sized_workload(kind: str, n: int) -> Workload:
    """The ``kind`` bench workload (``BENCH_KINDS``) with ``n`` requests running."""
    if kind not in BENCH_KINDS:
        raise ValueError(f"unknown bench workload kind {kind!r}; one of {', '.join(BENCH_KINDS)}")
    if kind == "steady":
        return Workload(
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
        )
    if kind == "busy":
        return Workload(
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
        )
    return Workload(  # chunked
        f"chunked-{n}",
        steps=60,
        num_spec=3,
        max_num_seqs=n + 4,
        max_num_batched_tokens=4 * n + 512,
        max_model_len=4096,
        arrivals=0.5,
        initial=n,
        prompt_len=(8, 64),
        max_tokens=(400, 500),
        arrival_prompt_len=(1024, 3072),
        arrival_max_tokens=(1, 4),
        abort=0.0,
        num_blocks=n * 40 + 2048,
        seed=13,
    )


BENCH_WORKLOADS = {w.name: w for n in BENCH_SIZES for w in (sized_workload(k, n) for k in BENCH_KINDS)}


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


def write_model_dir() -> str:
    """Hand-written config.json files of two tiny models (no weights: only
    the configs are read)."""
    d = tempfile.mkdtemp(prefix="mtpstate-vllm-models-")
    for name, cfg in (("llama", TINY_LLAMA), ("deepseek-mtp", TINY_DEEPSEEK_MTP)):
        os.makedirs(os.path.join(d, name))
        with open(os.path.join(d, name, "config.json"), "w") as f:
            json.dump(cfg, f)
    return d
