"""Benchmark workloads: precomputed scheduler steps, identical for every
implementation."""

from __future__ import annotations

import copy
import pickle

import numpy as np

from mtpstate.sim import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, Simulator

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


def mixed(n: int, steps: int = 8, seed: int = 0):
    """A simulator trace at about N running requests: arrivals, chunked
    prefill, MTP with rejections, preemptions, aborts, prefix/remote-KV hits."""
    sim = Simulator(
        max_num_reqs=n,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=max(8192, 4 * n),
        block_sizes=(BLOCK_SIZE,),
        arrivals_per_step=max(1.0, n / 16),
        prompt_len=(16, 256),
        output_len=(32, 512),
        num_spec=2,
        accept=0.7,
        preempt_prob=0.2,
        abort_prob=0.2,
        abort_waiting_prob=0.1,
        prefix_hit_prob=0.2,
        remote_kv_prob=0.1,
        seed=seed,
    )
    warm = []
    while len(sim.running) < int(0.9 * n) and len(warm) < 4000:
        warm.append(sim.step())
    timed = [sim.step() for _ in range(steps)]
    return warm, timed


def clone(steps):
    return copy.deepcopy(steps)
