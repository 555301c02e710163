"""Benchmark workloads: precomputed scheduler steps, identical for every
implementation."""

from __future__ import annotations

import array
import copy
import pickle
from dataclasses import dataclass

import numpy as np

from mtpstate.tools.sim import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, Simulator

MAX_MODEL_LEN = 16384
BLOCK_SIZE = 16


def _ids(n, start=0):
    return [f"cmpl-{i:032x}-0" for i in range(start, start + n)]


def steady_decode(
    n: int, steps: int = 8, num_spec: int = 2, seed: int = 0, fresh_ids: bool = False, block_fraction: float = 0.25
):
    """N running requests, every one scheduled each step; num_computed_tokens
    advances by accepted drafts + 1; a new block for about a quarter of them.

    Returns (setup_steps, timed_steps): the setup adds the N requests."""
    rng = np.random.default_rng(seed)
    ids = _ids(n)
    prompt = [1] * 64
    nct = rng.integers(64, 4096, size=n)
    nblocks = (nct + num_spec + 1) // BLOCK_SIZE + 1
    nxt = int(nblocks.sum())
    setup = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(r, prompt, SamplingParams(8192), (list(range(int(b))),), 64) for r, b in zip(ids, nblocks)
        ]
    )
    timed = []
    for _ in range(steps):
        step_nct = nct.tolist()
        blocks = []
        for _ in range(n):
            if rng.random() < block_fraction:
                blocks.append(([nxt],))
                nxt += 1
            else:
                blocks.append(None)
        cached = CachedRequestData(req_ids=list(ids), num_computed_tokens=step_nct, new_block_ids=blocks)
        timed.append(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={}))
        nct = nct + 1 + rng.integers(0, num_spec + 1, size=n)
    if fresh_ids:
        timed = [pickle.loads(pickle.dumps(so)) for so in timed]
    else:  # the same str objects every step, as an in-process engine passes them
        for so in timed:
            so.scheduled_cached_reqs.req_ids = ids
    return [setup], timed


def _busy_simulator(n: int, seed: int, **knobs) -> Simulator:
    """A simulator at about N running requests with arrivals, chunked
    prefill, MTP with rejections, preemptions, aborts and prefix/remote-KV
    hits every step (``knobs`` set the rest)."""
    return Simulator(
        max_num_reqs=n,
        max_model_len=MAX_MODEL_LEN,
        block_sizes=(BLOCK_SIZE,),
        prompt_len=(16, 256),
        output_len=(32, 512),
        accept=0.7,
        preempt_prob=0.2,
        abort_prob=0.2,
        abort_waiting_prob=0.1,
        prefix_hit_prob=0.2,
        remote_kv_prob=0.1,
        seed=seed,
        **knobs,
    )


def _warm_then_time(sim: Simulator, n: int, steps: int, shape=lambda so: so):
    """Steps until ~90% of N run (the setup), then ``steps`` timed steps."""
    warm = []
    while len(sim.running) < int(0.9 * n) and len(warm) < 4000:
        warm.append(shape(sim.step()))
    return warm, [shape(sim.step()) for _ in range(steps)]


def mixed(n: int, steps: int = 8, seed: int = 0):
    """A simulator trace at about N running requests: arrivals, chunked
    prefill, MTP with rejections, preemptions, aborts, prefix/remote-KV hits."""
    sim = _busy_simulator(
        n, seed, max_num_batched_tokens=max(8192, 4 * n), arrivals_per_step=max(1.0, n / 16), num_spec=2
    )
    return _warm_then_time(sim, n, steps)


def clone(steps):
    return copy.deepcopy(steps)


# ----------------------------------------------------------------------------
# steps shaped exactly like vLLM 0.34's SchedulerOutput


class TokenBuffer(array.array):
    """Like vLLM 0.34's ``TokenBuffer``: an ``array('i')`` subclass."""

    def __new__(cls, values=()):
        return super().__new__(cls, "i", values)

    def __reduce__(self):
        return (TokenBuffer, (list(self),))


@dataclass
class VllmCachedRequestData:
    """vLLM 0.34's ``CachedRequestData``: no ``resumed_req_ids``."""

    req_ids: list
    new_token_ids: list
    new_block_ids: list
    num_computed_tokens: list
    num_output_tokens: list


def vllm_shaped(so: SchedulerOutput) -> SchedulerOutput:
    """One simulator step (``resume_mode="new"``) in vLLM 0.34's shape:
    TokenBuffer token ids (``prefill_token_ids`` the very object of
    ``prompt_token_ids`` unless the request was preempted and re-sent), a
    CachedRequestData without ``resumed_req_ids``, ``preempted_req_ids`` a set
    (possibly empty), ``num_scheduled_tokens`` listing the cached requests
    then the new ones, fresh lists."""
    c = so.scheduled_cached_reqs
    if c.resumed_req_ids:
        raise ValueError("vLLM 0.34 re-sends preempted requests as new: simulate with resume_mode='new'")
    new = []
    for r in so.scheduled_new_reqs:
        prompt = TokenBuffer(r.prompt_token_ids)
        prefill = prompt if r.prefill_token_ids is None else TokenBuffer(r.prefill_token_ids)
        new.append(NewRequestData(r.req_id, prompt, r.sampling_params, r.block_ids, r.num_computed_tokens, prefill))
    nst = so.num_scheduled_tokens
    order = [*c.req_ids, *(r.req_id for r in new)]
    nst = {r: nst.get(r, 1) for r in order}
    cached = VllmCachedRequestData(
        req_ids=list(c.req_ids),
        new_token_ids=[],
        new_block_ids=list(c.new_block_ids),
        num_computed_tokens=list(c.num_computed_tokens),
        num_output_tokens=[0] * len(c.req_ids),
    )
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=nst,
        total_num_scheduled_tokens=sum(nst.values()),
        scheduled_spec_decode_tokens=so.scheduled_spec_decode_tokens,
        finished_req_ids=set(so.finished_req_ids),
        preempted_req_ids=set(so.preempted_req_ids or ()),
    )


def vllm_busy(n: int, steps: int = 8, seed: int = 0):
    """vLLM-shaped busy-server steps at about N running requests: arrivals
    and finishes every step, chunked prefill, MTP k=3 with rejections,
    preemptions re-sent as new requests, aborts, prefix/remote-KV hits."""
    sim = _busy_simulator(
        n,
        seed,
        max_num_batched_tokens=max(8192, 5 * n),
        arrivals_per_step=max(1.0, n / 64),
        num_spec=3,
        resume_mode="new",
    )
    return _warm_then_time(sim, n, steps, vllm_shaped)


def vllm_steady_decode(n: int, steps: int = 8, seed: int = 0, fresh_ids: bool = False):
    """vLLM-shaped steady decode: N running requests (added with TokenBuffer
    prompts), MTP k=3, fresh lists every step; the same id objects every step
    (in-process engine) or fresh ones (``fresh_ids``: unpickled, as a worker
    process receives them)."""
    setup, timed = steady_decode(n, steps=steps, num_spec=3, seed=seed, fresh_ids=fresh_ids)
    setup = [vllm_shaped(so) for so in setup]
    out = []
    for so in timed:
        v = vllm_shaped(so)
        if not fresh_ids:  # the scheduler's own str objects, in a new list every step
            v.scheduled_cached_reqs.req_ids = list(so.scheduled_cached_reqs.req_ids)
        v.num_scheduled_tokens = {r: 4 for r in v.scheduled_cached_reqs.req_ids}
        v.total_num_scheduled_tokens = 4 * len(v.num_scheduled_tokens)
        v.scheduled_spec_decode_tokens = {r: [0, 0, 0] for r in v.num_scheduled_tokens}  # MTP k=3
        out.append(v)
    return setup, out
