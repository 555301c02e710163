"""`make test-vllm`, the runner: the tier's vLLM release's unpatched source with mtpstate
applied by its plugin, through vLLM's own ``load_general_plugins()``. The
runner's own finish/add/update_requests, gather_batch_req_state and
prepare_inputs with mtpstate on must agree with vLLM's own methods on every
step (mtpstate.tools.vllm_verify.runs.run_runner_differential, the code
`mtpstate vllm-verify` runs: its mutants are caught in test_vllm_verify.py)."""

import json
import os
import subprocess
import sys

from mtpstate.tools.vllm_bench.workloads import WORKLOADS

HERE = os.path.dirname(os.path.abspath(__file__))

STEPS = os.environ.get("MTPSTATE_VLLM_STEPS", "800")


def _harness(*args, timeout=1800):
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    env.pop("VLLM_USE_MTPSTATE", None)  # the harness turns it on through the plugin loader
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, "harness.py"), "--runner", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    return p, [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def test_runner_through_plugin_agrees():
    p, results = _harness("--scale-steps", STEPS)
    print(p.stdout)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(results) == len(WORKLOADS)
    for r in results:
        assert r["steps"] > 0 and r["disagreements"] == 0, r
    # the sampler's answers from the counts over the live rows, as well as by
    # the pass (the async workloads' batches leave a live request out)
    assert all(r["sampler_from_counts"] > 0 for r in results), results
    assert any(r["sampler_from_counts"] < r["sampler_batches"] for r in results), results


def test_runner_on_a_deferred_device_one_replay_per_step():
    """The adapter's device work on the deferred model of a GPU (its graph
    path): every step, with or without arrivals, issues exactly one replay
    and one event record from mtpstate (the state, token ids, lengths, the
    batch's idx_mapping and the new rows' draft zeroing all in it), and the
    runner still agrees with vLLM's own methods on every step."""
    names = ["sync-spec3-chunked", "async-preempt"]
    p, results = _harness(*(a for n in names for a in ("--workload", n)), "--deferred", "--steps", "120")
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(results) == len(names)
    for r in results:
        assert r["steps"] == 120 and r["disagreements"] == 0, r
        assert r["ops_per_step"] == {json.dumps({"record": 1, "replay": 1}): 120}, r["ops_per_step"]


def test_patch_applies_to_pristine_source():
    src = os.environ["PYTHONPATH"].split(os.pathsep)[0]
    from mtpstate.integrations.vllm import plugin
    from mtpstate.integrations.vllm.releases import RELEASES

    patch = RELEASES[plugin.installed_release()].patch_path
    p = subprocess.run(["patch", "-p1", "--dry-run", "-d", src, "-i", patch], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
