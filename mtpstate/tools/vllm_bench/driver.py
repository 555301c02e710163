"""The driver: vLLM's scheduler stepped with a fake model (no token for a
partial prefill chunk; 1 + accepted tokens after drafts, with rejections;
drafts fed back), emitting each step as a worker receives it."""

from __future__ import annotations

import random
from collections import deque

import numpy as np

from mtpstate.tools.vllm_bench.workloads import TINY_LLAMA, VOCAB, Workload, make_scheduler, sampling_kwargs

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
        self.sampling_rng = random.Random(w.seed * 7919 + 17)  # the params mix's own stream

    def _new_request(self):
        from vllm.v1.request import Request

        w, rng = self.w, self.rng
        burst = self.n < w.initial
        plen = rng.randint(*(w.prompt_len if burst or w.arrival_prompt_len is None else w.arrival_prompt_len))
        max_tokens = w.max_tokens if burst or w.arrival_max_tokens is None else w.arrival_max_tokens
        prompt = [rng.randrange(3, VOCAB) for _ in range(plen)]
        if rng.random() < w.shared_prefix:
            prompt = self.prefix[: min(plen, len(self.prefix))] + prompt[len(self.prefix) :]
        suffix = f"{rng.getrandbits(32):08x}"
        rid = f"cmpl-{self.n}-{suffix}" if not w.unicode_ids else f"請求-{self.n}-é-{suffix}"
        if self.n == w.long_request_id:
            rid += "-" + "x" * 70_000
        self.n += 1
        mix = sampling_kwargs(self.sampling_rng, self.n)
        n_max = rng.randint(*max_tokens)
        if "min_tokens" in mix:  # (vLLM requires min_tokens <= max_tokens)
            mix["min_tokens"] = min(mix["min_tokens"], n_max)
        bad_words = mix.pop("_bad_words_token_ids", None)
        sp = self.SamplingParams(max_tokens=n_max, ignore_eos=True, **mix)
        if bad_words is not None:
            sp._bad_words_token_ids = bad_words
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
        extra = {}
        if "req_id_to_index" in getattr(ModelRunnerOutput, "__dataclass_fields__", {}):  # (a field until 0.33)
            extra["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)
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
