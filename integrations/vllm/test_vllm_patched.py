"""`make test-vllm`, second part: the worked patch (mtpstate-mrv2.patch)
applied to vLLM 0.34.0's model_runner.py / states.py; the patched runner's
own finish/add/update_requests with mtpstate switched on must agree with the
same methods switched off (vLLM's original code paths) on every step."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402

PATCHED = os.environ.get("MTPSTATE_VLLM_PATCHED")
STEPS = os.environ.get("MTPSTATE_VLLM_STEPS", "800")


@pytest.mark.skipif(not PATCHED, reason="run through `make test-vllm` (it applies the patch)")
def test_patched_runner_agrees():
    env = dict(os.environ, PYTHONPATH=PATCHED, VLLM_LOGGING_LEVEL="ERROR")
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, "harness.py"), "--patched", "--scale-steps", STEPS],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    print(p.stdout)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(results) == len(harness.WORKLOADS)
    for r in results:
        assert r["steps"] > 0 and r["disagreements"] == 0, r


@pytest.mark.skipif(not PATCHED, reason="run through `make test-vllm` (it applies the patch)")
@pytest.mark.parametrize("kind", sorted(harness.SABOTAGE))
def test_patched_differential_can_fail(kind):
    """Negative controls: the mirror's copy corrupted (new requests' token
    ids zeroed; total_len / device num_computed_tokens zeroed; prefill/prompt
    lengths not shipped) must show up as disagreements with vLLM."""
    env = dict(os.environ, PYTHONPATH=PATCHED, VLLM_LOGGING_LEVEL="ERROR")
    cmd = [sys.executable, os.path.join(HERE, "harness.py"), "--patched", "--sabotage", kind]
    cmd += ["--workload", "sync-spec3-chunked", "--steps", "30"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 1 and results[0]["steps"] == 30, p.stderr[-3000:]
    assert results[0]["disagreements"] > 0, results
    assert p.returncode == 1


def test_patch_applies_to_pristine_source():
    src = os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0])
    p = subprocess.run(
        ["patch", "-p1", "--dry-run", "-d", src, "-i", os.path.join(HERE, "mtpstate-mrv2.patch")],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stdout + p.stderr
