"""The shadow's own runner: built from a live ``GPUModelRunner``'s sizes,
holding its own ``RequestState``, ``BlockTables``, ``InputBuffers`` and
``Sampler`` (vLLM's classes, so the same layouts and dtypes), kept by
mtpstate exactly as ``VLLM_USE_MTPSTATE=1`` keeps a runner: the runner
methods the patch changes, compiled from the patched text, are called on it.

It shares no object with the live runner that anything writes: its
per-request hooks (model state, LoRA, speculator, encoder cache, KV-cache
zeroing) are no-ops, so feeding it a step changes nothing of vLLM's.
"""

from __future__ import annotations

import types


class _Null:
    """A runner part whose per-request hooks hold nothing the shadow compares."""

    def __getattr__(self, name):
        return _nothing


def _nothing(*args, **kwargs):
    return None


class _ModelState(_Null):
    """``model_state`` as the batch reads it: the live runner's sampled tokens per step."""

    def __init__(self, num_new_sampled_tokens_per_step: int):
        self.num_new_sampled_tokens_per_step = num_new_sampled_tokens_per_step


def sampler_reason(live) -> str | None:
    """Why the shadow keeps no sampler of its own for ``live`` (None: it does)."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    s = getattr(live, "sampler", None)
    if s is None or not getattr(live, "is_last_pp_rank", True):
        return "no sampler on this runner"
    if type(s) is not Sampler:
        return f"the sampler is a {type(s).__qualname__}, not vLLM's Sampler"
    if len(s.logits_processors) != 3:
        return "custom logits processors (their per-request state is theirs alone)"
    return None


class ShadowRunner:
    """What the patched runner methods read, for a live runner's sizes.

    Parameters
    ----------
    live
        vLLM's ``GPUModelRunner`` (after its KV cache is initialized).
    methods
        ``(class, method)`` -> function: the patched methods
        (:func:`mtpstate.integrations.vllm.plugin.compile_patched`).
    runner_class
        vLLM's ``GPUModelRunner`` class (its own ``_remove_request``).
    """

    def __init__(self, live, methods: dict, runner_class):
        import torch
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.input_batch import InputBuffers
        from vllm.v1.worker.gpu.states import RequestState

        rs, bt = live.req_states, live.block_tables
        dev = rs.device
        self.device = dev
        self.max_num_reqs = rs.max_num_reqs
        self.req_states = RequestState(
            rs.max_num_reqs,
            rs.max_model_len,
            rs.max_num_batched_tokens,
            rs.num_speculative_steps,
            rs.vocab_size,
            dev,
            num_prefill_lookahead=rs.next_prefill_tokens.shape[0],
            use_dense_all_token_ids=not hasattr(rs.all_token_ids, "_uva_buf"),
        )
        # (sliding-window reach: 0.33 on; 0.32's BlockTables has none)
        reach = {"sliding_window_reach": bt._sliding_window_reach} if hasattr(bt, "_sliding_window_reach") else {}
        self.block_tables = BlockTables(
            block_sizes=list(bt.block_sizes),
            max_num_reqs=bt.max_num_reqs,
            max_num_batched_tokens=bt.max_num_batched_tokens,
            max_num_blocks_per_group=[t.gpu.shape[1] for t in bt.block_tables],
            device=dev,
            cp_size=getattr(bt, "cp_size", 1),
            cp_rank=getattr(bt, "cp_rank", 0),
            cp_interleave=getattr(bt, "cp_interleave", 1),
            slot_mapping_enabled=getattr(bt, "_slot_mapping_enabled", None),
            dcp_sharded=bt.dcp_sharded.tolist() if isinstance(getattr(bt, "dcp_sharded", None), torch.Tensor) else None,
            **reach,
        )
        self.input_buffers = InputBuffers(rs.max_num_reqs, live.input_buffers.input_ids.shape[0], dev)
        # what the patched methods read besides the state
        self.decode_query_len = live.decode_query_len
        self.max_num_tokens = getattr(live, "max_num_tokens", rs.max_num_batched_tokens)
        self.use_pp = getattr(live, "use_pp", False)
        self.vllm_config = types.SimpleNamespace(
            max_concurrent_batches=getattr(getattr(live, "vllm_config", None), "max_concurrent_batches", 2)
        )
        bonus = getattr(getattr(live, "model_state", None), "num_new_sampled_tokens_per_step", 1)
        self.model_state = _ModelState(bonus)
        self.lora_state = self.draft_tokens_handler = self.kv_block_zeroer = _Null()
        self.pooling_runner = self.speculator = self.encoder_cache = self.adaptive_verification = None
        self.pp_handler = self.pcp_manager = self.fast_prefill = None
        self.prompt_logprobs_worker = _Null()
        self.is_pooling_model = self.is_encoder_decoder = False
        self.sampler = None
        self.sampler_reason = sampler_reason(live)
        self.is_last_pp_rank = self.sampler_reason is None
        if self.sampler_reason is None:
            from vllm.v1.worker.gpu.sample.sampler import Sampler

            s = live.sampler
            self.sampler = Sampler(
                live.vllm_config,
                rs.max_num_reqs,
                s.sampling_states.vocab_size,
                dev,
                self.req_states,
                logprobs_mode=s.logprobs_mode,
                num_speculative_tokens=s.num_speculative_tokens,
                use_fp64_gumbel=s.use_fp64_gumbel,
                enable_trace_replay=s.trace_replay_state is not None,
                return_sampling_mask=s.return_sampling_mask,
            )
        self.mtpstate = None
        # the runner's methods as mtpstate's patch has them, on this object
        name = runner_class.__name__
        self._finish_requests = types.MethodType(methods[(name, "finish_requests")], self)
        self._add_requests = types.MethodType(methods[(name, "add_requests")], self)
        self._gather = types.MethodType(methods[(name, "gather_batch_req_state")], self)
        own = vars(runner_class)
        for hook in ("_remove_request", "free_states"):
            fn = own[hook]
            setattr(self, hook, types.MethodType(getattr(fn, "__wrapped__", fn), self))

    def apply(self, scheduler_output) -> None:
        """The step's finish and add (mtpstate applies the update with them)."""
        self._finish_requests(scheduler_output)
        self._add_requests(scheduler_output)

    def gather(self, scheduler_output):
        """The step's ``BatchReqState``, as the patched runner hands it out."""
        return self._gather(scheduler_output, False)[0]
