"""Applying scheduler steps: RequestTable (and its device mirror) against the
per-request loop, on identical steps.

Run: ``pytest benchmarks -k table`` (``--benchmark-disable`` for a smoke run).
Each round rebuilds the table (untimed) and times one ``apply``.
"""

import pickle
from functools import partial

import pytest

from mtpstate import RequestTable
from mtpstate.tools.bench import mirror_device
from mtpstate.tools.reference import LoopMirroredRequestTable, LoopRequestTable
from mtpstate.tools.sim import NewRequestData, SamplingParams, SchedulerOutput
from mtpstate.tools.workloads import BLOCK_SIZE, MAX_MODEL_LEN, mixed, steady_decode

SIZES = [1, 16, 64, 256, 1024, 4096, 16384]
IMPLS = {"loop": LoopRequestTable, "vectorized": RequestTable}
DEVICE = mirror_device()
MIRROR_IMPLS = {}
if DEVICE is not None:
    MIRROR_IMPLS = {
        "mirror": partial(RequestTable, device=DEVICE),
        "loop-mirror": partial(LoopMirroredRequestTable, device=DEVICE),
    }


def _run(benchmark, cls, n, setup_steps, timed_step, rounds=None):
    blob = pickle.dumps(timed_step)

    def setup():
        t = cls(max_num_reqs=n, max_model_len=MAX_MODEL_LEN, block_sizes=[BLOCK_SIZE])
        for so in setup_steps:
            t.apply(so)
        return (t, pickle.loads(blob)), {}

    rounds = rounds or max(5, min(200, 20000 // max(n, 1)))
    benchmark.pedantic(lambda t, so: t.apply(so), setup=setup, rounds=rounds, warmup_rounds=1)


@pytest.mark.parametrize("impl", [*IMPLS, *MIRROR_IMPLS])
@pytest.mark.parametrize("n", SIZES)
def test_apply_steady_decode(benchmark, n, impl):
    benchmark.group = f"apply-steady-decode-N{n}"
    setup, timed = steady_decode(n, steps=2)
    _run(benchmark, {**IMPLS, **MIRROR_IMPLS}[impl], n, [*setup, timed[0]], timed[1])


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("n", [256, 1024, 4096])
def test_apply_mixed(benchmark, n, impl):
    benchmark.group = f"apply-mixed-N{n}"
    setup, timed = mixed(n, steps=1)
    _run(benchmark, IMPLS[impl], n, setup, timed[0], rounds=5)


def _new_requests(n, prompt_len, start=0):
    prompt = list(range(1000, 1000 + prompt_len))
    nb = -(-prompt_len // BLOCK_SIZE)
    return [
        NewRequestData(f"cmpl-{i:032x}-0", prompt, SamplingParams(256), (list(range(i * nb, (i + 1) * nb)),), 0)
        for i in range(start, start + n)
    ]


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("n", [16, 256, 1024])
def test_apply_add_heavy(benchmark, n, impl):
    """n new requests with 2000-token prompts in one step."""
    benchmark.group = f"apply-add-heavy-N{n}"
    _run(benchmark, IMPLS[impl], n, [], SchedulerOutput(scheduled_new_reqs=_new_requests(n, 2000)), rounds=5)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("n", [256, 1024, 4096])
def test_apply_finish_heavy(benchmark, n, impl):
    """Half of n running requests finish (and a quarter are preempted) in one step."""
    benchmark.group = f"apply-finish-heavy-N{n}"
    reqs = _new_requests(n, 16)
    ids = [r.req_id for r in reqs]
    step = SchedulerOutput(finished_req_ids=set(ids[: n // 2]), preempted_req_ids=set(ids[n // 2 : 3 * n // 4]))
    _run(benchmark, IMPLS[impl], n, [SchedulerOutput(scheduled_new_reqs=reqs)], step)


@pytest.mark.skipif(DEVICE is None, reason="needs torch")
@pytest.mark.parametrize("impl", list(MIRROR_IMPLS))
@pytest.mark.parametrize("n", [256, 1024, 4096, 16384])
def test_mirror_staging(benchmark, n, impl):
    """Host time of a steady decode step with the device mirror on."""
    benchmark.group = f"mirror-staging-N{n}"
    setup, timed = steady_decode(n, steps=2)
    _run(benchmark, MIRROR_IMPLS[impl], n, [*setup, timed[0]], timed[1])


@pytest.mark.parametrize("impl", [*IMPLS, *MIRROR_IMPLS])
def test_quick_table_smoke(benchmark, impl):
    setup, timed = steady_decode(64, steps=2)
    _run(benchmark, {**IMPLS, **MIRROR_IMPLS}[impl], 64, [*setup, timed[0]], timed[1], rounds=3)
