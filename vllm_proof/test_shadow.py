"""`make test-vllm`, shadow mode (``VLLM_USE_MTPSTATE=shadow``), set up by
vLLM's own ``load_general_plugins()``: vLLM's own runner methods observed by
mtpstate's shadow (its mirror on the deferred model of a GPU). vLLM's state,
batch, every InputBatch field, sampler values and numpy's RNG must hash the
same every step with the shadow as without it; the shadow must agree with
vLLM on every workload, report each known mutant within
MTPSTATE_SHADOW_EVERY steps of the step it first shows in, and end with a
WARNING, vLLM untouched, on a request mtpstate refuses or an error of its own."""

import json
import os
import subprocess
import sys

import pytest

from mtpstate.tools.vllm_bench.workloads import WORKLOADS
from mtpstate.tools.vllm_verify.sabotage import MUTANTS

# the mutants this release's tier runs (MTPSTATE_VLLM_MUTANTS, comma-separated: the
# Makefile gives the older releases a subset; default every one)
TIER_MUTANTS = [m for m in os.environ.get("MTPSTATE_VLLM_MUTANTS", ",".join(MUTANTS)).split(",") if m]
assert set(TIER_MUTANTS) <= set(MUTANTS), TIER_MUTANTS

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = os.environ.get("MTPSTATE_VLLM_STEPS", "800")
EVERY = 4


def _harness(*args, timeout=1800):
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env.pop("VLLM_USE_MTPSTATE", None)  # the harness sets it, then loads vLLM's plugins
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, "harness.py"), "--shadow", "--deferred", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    return p, [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def test_vllm_identical_with_the_shadow_and_the_shadow_agrees():
    p, results = _harness("--scale-steps", str(int(STEPS) // 2), "--every", str(EVERY))
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(r["workload"] for r in results) == sorted(WORKLOADS)
    for r in results:
        sh = r["shadow"]
        assert r["identical"], r
        assert sh["active"] and sh["stopped"] is None and sh["disagreements"] == 0, r
        assert sh["steps"] == sh["batches"] == r["steps"] > 0, r
        assert sh["device_checks"] == r["steps"] // EVERY and sh["values"] > 1000, r


@pytest.mark.parametrize("mutant", TIER_MUTANTS)
def test_each_mutant_is_reported_within_every_steps(mutant):
    """Reported with a device check every step, and with one every EVERY
    steps no more than EVERY - 1 steps later; vLLM's results unchanged."""
    args = ("--sabotage", mutant, "--workload", "sync-spec3-chunked", "--steps", "30")
    p, results = _harness(*args, "--every", "1", "--every", str(EVERY))
    assert [r["every"] for r in results] == [1, EVERY], p.stderr[-3000:]
    every_step, every_k = results
    for r in (every_step, every_k):
        sh = r["shadow"]
        assert r["identical"], r
        assert sh["disagreements"] == 1 and not sh["active"] and sh["first"], r
        assert "mtpstate shadow: disagreement at step" in sh["stopped"], r
    found, found_k = every_step["shadow"]["first_step"], every_k["shadow"]["first_step"]
    assert found <= found_k < found + EVERY, (found, found_k)
    # the WARNING, in full, on vLLM's logger
    assert every_k["shadow"]["first"] in p.stderr


def _ended(*args):
    """A 40-step shadowed run of async-preempt that something ends: vLLM's
    results identical throughout, the shadow stopped without a disagreement,
    one WARNING. Returns the shadow's report."""
    p, results = _harness("--workload", "async-preempt", "--steps", "40", "--every", str(EVERY), *args)
    assert p.returncode == 0 and len(results) == 1, p.stderr[-3000:]
    r = results[0]
    sh = r["shadow"]
    assert r["identical"] and r["steps"] == 40, r
    assert not sh["active"] and sh["disagreements"] == 0, r
    assert p.stderr.count("mtpstate shadow: stopped") == 1, p.stderr[-3000:]
    return sh


def test_an_error_of_the_shadows_own_ends_it_and_vllm_serves_on():
    sh = _ended("--fault-at", "7")
    assert sh["steps"] == 7 and "stopped at step 8 in update_requests: RuntimeError" in sh["stopped"], sh


def test_a_request_mtpstate_refuses_ends_the_shadow_and_vllm_serves_on():
    sh = _ended("--long-id-at", "5")
    assert "InvalidStepError: new request id of 70016 bytes exceeds max_id_bytes" in sh["stopped"], sh
    assert "with VLLM_USE_MTPSTATE=1 this step would fail" in sh["stopped"], sh
