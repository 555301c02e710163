"""The reference: Model Runner V2's own state code and runner methods bound
to an object holding vLLM's real ``RequestState`` and ``BlockTables``, run
off (vLLM's own methods) or on (as mtpstate's plugin patched them)."""

from __future__ import annotations

import math
import os

from mtpstate.tools.vllm_bench.workloads import VOCAB

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


def load_plugin(mode: str = "on") -> None:
    """What every vLLM process does at start-up, with VLLM_USE_MTPSTATE=1
    (``mode="shadow"``: ``=shadow``): vLLM's own ``load_general_plugins()``,
    which finds mtpstate's entry point and patches Model Runner V2 (checked:
    the guard must have applied it), or sets up shadow mode (checked: its
    wrappers are set, the methods are vLLM's own)."""
    os.environ["VLLM_USE_MTPSTATE"] = {"on": "1", "shadow": "shadow"}[mode]
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm.v1.worker.gpu.model_runner as runner_module  # (patched on import)

    from mtpstate.integrations.vllm import plugin

    v = plugin.check()
    if mode == "shadow":
        marked = getattr(vars(runner_module.GPUModelRunner)["update_requests"], "__mtpstate_shadow__", False)
        if not (marked and v.ok and not v.applied):
            raise RuntimeError(f"mtpstate's shadow mode is not set up: {v.problems or 'entry point not loaded'}")
    elif not (v.applied and v.ok):
        raise RuntimeError(f"mtpstate's vLLM plugin did not apply: {v.problems or 'entry point not loaded'}")


def cache_envs() -> None:
    """What a serving vLLM process does once it has started (its engine
    core and each multiprocess worker call ``vllm.envs.enable_envs_cache()``):
    ``envs.X`` is read from the environment once, not by ``os.getenv`` on
    every access. The benchmarks call it so that a timed step pays what a
    serving step pays (``prepare_inputs`` reads ``envs.VLLM_MOE_SKIP_PADDING``
    every step, on both sides). Lasts for the process."""
    import vllm.envs

    enable = getattr(vllm.envs, "enable_envs_cache", None)
    if enable is not None:
        enable()


def vllm_methods(cls):
    """vLLM's own methods of the runner class (the originals where the
    plugin patched them), as a namespace to call with a runner object."""
    from types import SimpleNamespace

    out = {}
    for name, fn in vars(cls).items():
        if getattr(fn, "__mtpstate_shadow__", False):  # (shadow mode's wrapper of vLLM's own)
            fn = fn.__wrapped__
        out[name] = getattr(fn, "__mtpstate_original__", fn)
    return SimpleNamespace(**out)


def ask_top_k_top_p(ss, expanded_idx_mapping, idx_mapping_np, vocab_size: int) -> tuple:
    """``SamplingStates.get_top_k_top_p`` as vLLM's Sampler asks it: with
    the vocab size where the release's method takes it (0.33 on), else
    without (0.32: its answer has no ``has_topp_only_rows``, given as None).
    Always ``(top_k, top_p, has_topp_only_rows)``."""
    from mtpstate.integrations.vllm.sampler.objects import top_k_top_p_takes_vocab

    if top_k_top_p_takes_vocab(ss):
        return tuple(ss.get_top_k_top_p(expanded_idx_mapping, idx_mapping_np, vocab_size))
    return (*ss.get_top_k_top_p(expanded_idx_mapping, idx_mapping_np), None)


class MRV2Reference:
    """The host side of vLLM 0.34's GPUModelRunner for one step: the real
    ``finish_requests``, ``add_requests`` and ``update_requests`` methods,
    bound to an object holding the real ``RequestState`` and ``BlockTables``."""

    def __init__(
        self,
        max_num_reqs,
        max_model_len,
        max_num_batched_tokens,
        block_sizes,
        num_spec,
        use_mtpstate=False,
        ops=None,
        device="cpu",
        sampler=False,
        shadowed=False,
        fallback=False,
    ):
        import torch
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        from vllm.v1.worker.gpu.states import RequestState

        dev = torch.device(device)
        self.req_states = RequestState(max_num_reqs, max_model_len, max_num_batched_tokens, num_spec, VOCAB, dev)
        widths = [math.ceil(max_model_len / b) for b in block_sizes]
        self.block_tables = BlockTables(block_sizes, max_num_reqs, max_num_batched_tokens, widths, dev)
        for name in ("pooling_runner", "speculator", "encoder_cache", "adaptive_verification", "sampler"):
            setattr(self, name, None)
        self.prompt_logprobs_worker = self.pp_handler = self.kv_block_zeroer = None
        self.lora_state = self.draft_tokens_handler = _Null()
        self.model_state = _ModelState()
        # sampler: vLLM's real Sampler (and prompt-logprobs worker) on the
        # last pipeline stage, as a serving runner has them; else none
        self.is_last_pp_rank = bool(sampler)
        if sampler:
            from vllm.config import VllmConfig
            from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker
            from vllm.v1.worker.gpu.sample.sampler import Sampler

            self.vllm_config = VllmConfig()
            self.sampler = Sampler(self.vllm_config, max_num_reqs, VOCAB, dev, self.req_states)
            self.prompt_logprobs_worker = PromptLogprobsWorker(max_num_reqs, dev)
        # the runner's methods: as the plugin patched them (on), as shadow
        # mode observes vLLM's own (shadowed), or vLLM's own (off)
        self._runner = GPUModelRunner if use_mtpstate or shadowed else vllm_methods(GPUModelRunner)
        if shadowed and not getattr(vars(GPUModelRunner)["update_requests"], "__mtpstate_shadow__", False):
            raise RuntimeError("shadow mode is not set up: call load_plugin(mode='shadow') first")
        # what prepare_inputs / prepare_attn read besides the request state
        from types import SimpleNamespace

        from vllm.v1.worker.gpu.input_batch import InputBuffers

        self.max_num_reqs = max_num_reqs
        self.device = dev
        self.input_buffers = InputBuffers(max_num_reqs, max_num_batched_tokens, dev)
        self.fast_prefill = None
        self.model_config = SimpleNamespace(rswa_window=None)
        # what gather_batch_req_state reads besides the request state
        self.decode_query_len = num_spec + 1
        self.max_num_tokens = max_num_batched_tokens
        self.use_pp = False
        self.adaptive_verification = None
        self.pcp_manager = None
        # what the patched initialize_kv_cache sets (mtpstate's mrv2.patch)
        self.mtpstate = None
        if use_mtpstate:
            from mtpstate.integrations.vllm import ModelRunnerV2State

            if not getattr(GPUModelRunner.add_requests, "__mtpstate_patched__", False):
                raise RuntimeError("the runner is not patched: call load_plugin() first")
            # fallback False: an error of mtpstate's raises (compared, never
            # handed back to vLLM); True: as the engine runs it
            if ops is None:
                self.mtpstate = ModelRunnerV2State.for_runner(self, fallback=fallback)
            else:  # a model of a GPU's asynchrony (mtpstate.devices.DeferredOps)
                self.mtpstate = ModelRunnerV2State(self, ring_depth=2, ops=ops, fallback=fallback)

    def apply(self, so) -> None:
        self.finish(so)
        self.add(so)
        self.update(so)

    # apply's phases (the runner benchmark times them one by one)
    def finish(self, so) -> None:
        self._runner.finish_requests(self, so)
        self._runner.free_states(self, so)

    def add(self, so) -> None:
        self._runner.add_requests(self, so)

    def update(self, so) -> None:
        self._runner.update_requests(self, so)
        self.block_tables.apply_staged_writes()

    def _remove_request(self, req_id):
        return self._runner._remove_request(self, req_id)

    def gather(self, so):
        """vLLM's own ``gather_batch_req_state`` for the step just applied."""
        return self._runner.gather_batch_req_state(self, so, False)[0]

    def inputs(self, so, batch, padded: tuple[int, int] | None = None):
        """The runner's ``prepare_inputs`` for the gathered batch (eager, no
        request padding: ``cudagraph`` dispatch is the same on both sides and
        is left out; ``padded``: (requests, tokens) of a full CUDA graph's
        batch it is padded to instead). Returns the InputBatch."""
        return self._runner.prepare_inputs(self, so, batch, self.descriptor(batch, padded), 0)

    @staticmethod
    def descriptor(batch, padded: tuple[int, int] | None = None):
        """The ``BatchExecutionDescriptor`` :meth:`inputs` runs ``batch`` with."""
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        if padded is None:
            return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=batch.num_tokens, num_reqs=None)
        return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=padded[1], num_reqs=padded[0])

    def prepare(self, so, batch, padded=None):
        """``inputs`` and the runner's ``prepare_attn``. Returns the InputBatch."""
        ib = self.inputs(so, batch, padded)
        self.attn(ib)
        return ib

    def attn(self, ib) -> None:
        """The runner's ``prepare_attn`` for an InputBatch."""
        self._runner.prepare_attn(self, ib)

    def host_step(self, so):
        """``execute_model``'s host part up to the forward: finish ..
        update_requests, ``block_tables.apply_staged_writes``,
        ``gather_batch_req_state``, ``prepare_inputs``, ``prepare_attn``.
        Returns the InputBatch."""
        self.apply(so)
        return self.prepare(so, self.gather(so))

    def sample_questions(self, ib):
        """What vLLM's ``Sampler.__call__`` asks on the host for the batch
        of InputBatch ``ib`` before it samples, in its order and through the
        sampler's own methods: ``get_logprobs_dims``, ``apply_sampling_params``
        (its processors' checks; their launches are the shims' no-ops, on
        logits one column wide: the logits' copy is device work), then
        ``sample``'s ``get_top_k_top_p`` (with its device gathers) and the
        fused-sampler checks. Returns ``(logprobs_dims, top_k, top_p,
        has_topp_only_rows, fused_sampler_eligible)`` (``has_topp_only_rows``
        None on a release whose ``get_top_k_top_p`` has none)."""
        import torch

        s = self.sampler
        ss = s.sampling_states
        idx = ib.idx_mapping_np
        # (vLLM gathers these at logits_indices, which its no-op kernels left
        # unwritten here: the same number of rows, sliced)
        n_logits = ib.expanded_idx_mapping.shape[0]
        pos, input_ids = ib.positions[:n_logits], ib.input_ids[:n_logits]
        dims = s.get_logprobs_dims(idx)
        logits = torch.zeros(n_logits, 1)
        s.apply_sampling_params(
            logits,
            ib.expanded_idx_mapping,
            ib.idx_mapping,
            idx,
            pos,
            input_ids,
            ib.expanded_local_pos,
            ib.seq_lens_cpu_upper_bound.numpy(),
            skip_top_k_top_p=True,
        )
        top_k, top_p, topp_only = ask_top_k_top_p(ss, ib.expanded_idx_mapping, idx, VOCAB)
        fused = not ((top_k is None and top_p is None) or ss.any_greedy(idx) or ss.any_explicit_seed(idx))
        return dims, top_k, top_p, topp_only, fused

    def sampler_state(self) -> dict:
        """Per request id: the sampler's per-row values (host arrays and the
        UVA tensors' device side) as vLLM's sampler holds them."""
        from mtpstate.integrations.vllm.shadow.columns import sampler_columns

        cols = {}
        for name, (host, dev) in sampler_columns(self.sampler).items():
            cols[name] = host
            if dev is not None:  # (as vLLM's kernels read it)
                cols[f"{name}.gpu"] = dev.cpu().numpy()
        return {rid: {k: v[r].item() for k, v in cols.items()} for rid, r in self.req_states.req_id_to_index.items()}

    def state(self, device: bool = False) -> dict:
        """Per request id: every field the comparison covers; ``device``:
        also vLLM's device-side tensors as its kernels read them (the
        patched runner writes them through mtpstate's mirror)."""
        rs, bt = self.req_states, self.block_tables
        tokens = rs.all_token_ids.gpu.cpu().numpy()
        tables = [t.gpu.cpu().numpy() for t in bt.block_tables]
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
