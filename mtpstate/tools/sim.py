"""A continuous-batching scheduler simulator that emits vLLM-shaped steps.

Its objects carry the attribute names of vLLM's ``SchedulerOutput``,
``NewRequestData`` and ``CachedRequestData`` (small dataclasses of its own), so
a ``RequestTable`` cannot tell them from the real thing. It models arrivals,
chunked prefill under a token budget, speculative decoding (MTP: k drafts per
step, accepted with a probability; the scheduler's ``num_computed_tokens``
advances by accepted + 1), preemption (re-sent as a new request whose
``prefill_token_ids`` are prompt + output so far, or resumed in place),
aborts (also of requests never scheduled), prefix-cache and remote-KV hits
(new requests with ``0 < num_computed_tokens <= prefill length``), several
KV-cache groups, and a seed. ``truth`` holds the scheduler's own
``num_computed_tokens`` of every request scheduled in the last step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "SamplingParams",
    "NewRequestData",
    "CachedRequestData",
    "SchedulerOutput",
    "SimConfig",
    "Simulator",
]


@dataclass
class SamplingParams:
    max_tokens: int | None = 16


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    sampling_params: SamplingParams | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    prefill_token_ids: list[int] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else 0


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None


@dataclass
class SimConfig:
    """Knobs of the simulated workload. Lengths are drawn uniformly from the
    (low, high) ranges."""

    max_num_reqs: int = 64
    max_model_len: int = 4096
    max_num_batched_tokens: int = 8192
    block_sizes: tuple[int, ...] = (16,)
    arrivals_per_step: float = 2.0
    prompt_len: tuple[int, int] = (16, 512)
    output_len: tuple[int, int] = (8, 256)
    num_spec: int = 0  # MTP draft tokens per decode step
    accept: float = 0.7  # per-draft acceptance probability
    preempt_prob: float = 0.0  # per step: preempt one running request
    abort_prob: float = 0.0  # per step: abort one running request
    abort_waiting_prob: float = 0.0  # per step: abort a request never scheduled
    prefix_hit_prob: float = 0.0  # new request hits the prefix cache
    remote_kv_prob: float = 0.0  # new request arrives with remote KV
    resume_mode: str = "new"  # "new" (Model Runner V2) or "cached" (resumed_req_ids)
    fresh_ids: bool = False  # unused by the simulator; replay may re-create id strings
    seed: int = 0

    def __post_init__(self):
        """Reject knobs the simulator cannot honour, naming the field (a
        ``ValueError``, before any step is simulated)."""

        def bad(name, why):
            raise ValueError(f"SimConfig.{name}: {why}, got {getattr(self, name)!r}")

        for name in ("max_num_reqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        if self.num_spec < 0:
            bad("num_spec", "must be >= 0")
        if self.max_model_len < self.num_spec + 3:
            bad("max_model_len", f"must leave room for a prompt and {self.num_spec} drafts")
        if not self.block_sizes or any(b < 1 for b in self.block_sizes):
            bad("block_sizes", "needs one size >= 1 per KV-cache group")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                bad(name, "must be (low, high) with 1 <= low <= high")
        if not self.arrivals_per_step >= 0:
            bad("arrivals_per_step", "must be >= 0")
        for name in ("accept", "preempt_prob", "abort_prob", "abort_waiting_prob", "prefix_hit_prob", "remote_kv_prob"):
            if not 0 <= getattr(self, name) <= 1:
                bad(name, "must be a probability in [0, 1]")
        if self.resume_mode not in ("new", "cached"):
            bad("resume_mode", 'must be "new" or "cached"')


class _Req:
    __slots__ = (
        "req_id",
        "prompt",
        "output",
        "max_tokens",
        "nct",
        "blocks",
        "sent",
        "preempted",
        "ever_scheduled",
        "prefill_target",
    )

    def __init__(self, req_id, prompt, max_tokens, num_groups):
        self.req_id = req_id
        self.prompt = prompt
        self.output: list[int] = []
        self.max_tokens = max_tokens
        self.nct = 0
        self.blocks = [[] for _ in range(num_groups)]
        self.sent = False  # the runner knows it
        self.preempted = False
        self.ever_scheduled = False
        self.prefill_target = len(prompt)  # tokens to prefill when (re)scheduled

    @property
    def prefill(self):
        return self.prompt + self.output


class Simulator:
    """Emits one ``SchedulerOutput`` per ``step()``.

    Parameters
    ----------
    config : SimConfig
    """

    def __init__(self, config: SimConfig | None = None, **overrides):
        cfg = config or SimConfig()
        if overrides:
            cfg = SimConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.truth: dict[str, int] = {}
        self.step_index = 0
        self._next_id = 0
        self._next_block = 0
        self._finished_next: set[str] = set()
        self._max_width = [math.ceil(cfg.max_model_len / b) for b in cfg.block_sizes]

    def _new_id(self) -> str:
        self._next_id += 1
        return f"cmpl-{self.rng.bytes(16).hex()}-{self._next_id % 10}"

    def _arrive(self):
        cfg = self.config
        for _ in range(self.rng.poisson(cfg.arrivals_per_step)):
            plen = int(self.rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1))
            plen = min(plen, cfg.max_model_len - cfg.num_spec - 2)
            max_out = cfg.max_model_len - plen - cfg.num_spec - 1
            out = max(1, min(int(self.rng.integers(cfg.output_len[0], cfg.output_len[1] + 1)), max_out))
            prompt = self.rng.integers(0, 50000, size=plen).tolist()
            self.waiting.append(_Req(self._new_id(), prompt, out, len(cfg.block_sizes)))

    def _grow_blocks(self, req: _Req, upto_tokens: int):
        """Give ``req`` blocks for ``upto_tokens`` tokens; the new ones per group."""
        new = []
        for g, bs in enumerate(self.config.block_sizes):
            need = min(math.ceil(upto_tokens / bs), self._max_width[g]) - len(req.blocks[g])
            ids = list(range(self._next_block, self._next_block + max(need, 0)))
            self._next_block += len(ids)
            req.blocks[g].extend(ids)
            new.append(ids)
        return new

    def step(self) -> SchedulerOutput:
        cfg = self.config
        rng = self.rng
        out = SchedulerOutput()
        out.finished_req_ids = set(self._finished_next)
        self._finished_next = set()
        self._arrive()
        # aborts: a waiting request that was never scheduled, a running one
        if self.waiting and rng.random() < cfg.abort_waiting_prob:
            req = self.waiting.pop()
            if not req.ever_scheduled:
                out.finished_req_ids.add(req.req_id)
            else:
                self.waiting.append(req)
        if self.running and rng.random() < cfg.abort_prob:
            req = self.running.pop(int(rng.integers(len(self.running))))
            out.finished_req_ids.add(req.req_id)
            self.truth.pop(req.req_id, None)
        preempted: set[str] = set()
        if self.running and rng.random() < cfg.preempt_prob:
            req = self.running.pop(int(rng.integers(len(self.running))))
            req.nct = 0
            req.blocks = [[] for _ in cfg.block_sizes]
            req.preempted = True
            self.truth.pop(req.req_id, None)
            if cfg.resume_mode == "new":
                preempted.add(req.req_id)
                req.sent = False
            self.waiting.appendleft(req)
        out.preempted_req_ids = preempted or None

        budget = cfg.max_num_batched_tokens
        cached = out.scheduled_cached_reqs
        outcomes = []
        for req in self.running:
            prefill_left = req.prefill_target - req.nct
            if prefill_left > 0:
                n = min(prefill_left, budget)
                drafts = 0
            else:
                drafts = cfg.num_spec
                n = 1 + drafts
            if n <= 0 or n > budget:
                continue
            budget -= n
            new_blocks = self._grow_blocks(req, req.nct + n)
            cached.req_ids.append(req.req_id)
            cached.num_computed_tokens.append(req.nct)
            cached.new_block_ids.append(tuple(new_blocks) if any(new_blocks) else None)
            cached.num_output_tokens.append(len(req.output))
            cached.new_token_ids.append([])
            out.num_scheduled_tokens[req.req_id] = n
            if drafts:
                out.scheduled_spec_decode_tokens[req.req_id] = rng.integers(0, 50000, drafts).tolist()
            outcomes.append((req, n, drafts, prefill_left))
        while self.waiting and len(self.running) < cfg.max_num_reqs and budget > 0:
            req = self.waiting[0]
            prefill = req.prefill
            req.prefill_target = len(prefill)
            if not req.sent:
                nct0 = 0
                r = rng.random()
                if r < cfg.prefix_hit_prob:
                    bs = cfg.block_sizes[0]
                    nct0 = ((len(prefill) - 1) // bs) * bs
                    nct0 = int(rng.integers(0, nct0 // bs + 1)) * bs
                elif r < cfg.prefix_hit_prob + cfg.remote_kv_prob:
                    nct0 = int(rng.integers(1, len(prefill) + 1))
                req.nct = nct0
            left = len(prefill) - req.nct
            n = min(left, budget) if left > 0 else 1
            if n > budget:
                break
            budget -= n
            self.waiting.popleft()
            self.running.append(req)
            req.ever_scheduled = True
            new_blocks = self._grow_blocks(req, req.nct + n)
            if not req.sent:
                out.scheduled_new_reqs.append(
                    NewRequestData(
                        req_id=req.req_id,
                        prompt_token_ids=list(req.prompt),
                        sampling_params=SamplingParams(req.max_tokens),
                        block_ids=tuple(list(b) for b in req.blocks),
                        num_computed_tokens=req.nct,
                        prefill_token_ids=list(prefill) if req.output else None,
                    )
                )
                req.sent = True
            else:  # resumed in place (resume_mode="cached")
                cached.req_ids.append(req.req_id)
                cached.resumed_req_ids.add(req.req_id)
                cached.num_computed_tokens.append(req.nct)
                cached.new_block_ids.append(tuple(list(b) for b in req.blocks))
                cached.num_output_tokens.append(len(req.output))
                cached.new_token_ids.append([])
            req.preempted = False
            out.num_scheduled_tokens[req.req_id] = n
            outcomes.append((req, n, 0, left))
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        # what the runner must hold for every request scheduled in this step
        self.truth = {req.req_id: req.nct for req, _, _, _ in outcomes}

        # the model ran: advance the scheduler's view for the next step
        for req, n, drafts, prefill_left in outcomes:
            if prefill_left > n:
                req.nct += n  # a prefill chunk
                continue
            if prefill_left > 0:
                req.nct += n  # prefill completes, one token sampled
                req.output.append(int(rng.integers(0, 50000)))
            else:
                accepted = 0
                while accepted < drafts and rng.random() < cfg.accept:
                    accepted += 1
                req.nct += 1 + accepted  # rejected drafts are rewound
                req.output.extend(rng.integers(0, 50000, 1 + accepted).tolist())
            if len(req.output) >= req.max_tokens:
                self.running.remove(req)
                self._finished_next.add(req.req_id)
        self.step_index += 1
        return out

    def run(self, steps: int):
        """Yield ``steps`` scheduler outputs."""
        for _ in range(steps):
            yield self.step()


_STEP_FIELDS = (
    "finished_req_ids",
    "preempted_req_ids",
    "num_scheduled_tokens",
    "total_num_scheduled_tokens",
    "scheduled_spec_decode_tokens",
)
_NEW_FIELDS = ("req_id", "prompt_token_ids", "prefill_token_ids", "num_computed_tokens")
_CACHED_FIELDS = ("req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens")


def _norm(x):
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return set(x)
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items()}
    return x


def step_differences(a, b) -> list[str]:
    """Compare two scheduler outputs by vLLM's attribute names (ours, or a
    real ``vllm.v1.core.sched.output.SchedulerOutput``, or any object with the
    same attributes); returns the attributes that differ, empty if none.
    Containers compare by value (a tuple equals a list with the same items)."""
    diffs = []
    for f in _STEP_FIELDS:
        x, y = getattr(a, f, None), getattr(b, f, None)
        if f == "preempted_req_ids":
            x, y = x or set(), y or set()
        if _norm(x) != _norm(y):
            diffs.append(f)
    na, nb = a.scheduled_new_reqs, b.scheduled_new_reqs
    if len(na) != len(nb):
        diffs.append("scheduled_new_reqs")
    else:
        for i, (x, y) in enumerate(zip(na, nb)):
            for f in _NEW_FIELDS:
                if _norm(getattr(x, f)) != _norm(getattr(y, f)):
                    diffs.append(f"scheduled_new_reqs[{i}].{f}")
            if _norm(list(x.block_ids)) != _norm(list(y.block_ids)):
                diffs.append(f"scheduled_new_reqs[{i}].block_ids")
            mx = getattr(x.sampling_params, "max_tokens", None)
            my = getattr(y.sampling_params, "max_tokens", None)
            if mx != my:
                diffs.append(f"scheduled_new_reqs[{i}].sampling_params.max_tokens")
    for f in _CACHED_FIELDS:
        if _norm(getattr(a.scheduled_cached_reqs, f)) != _norm(getattr(b.scheduled_cached_reqs, f)):
            diffs.append(f"scheduled_cached_reqs.{f}")
    return diffs
