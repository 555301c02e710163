"""`mtpstate vllm-verify` as an operator runs it, in vLLM's environment: it
passes on mtpstate as it is (every workload, 0 disagreements, exit 0), and
fails on every known mutant (exit 1, the first disagreement named in full).
The differential it runs is the one the rest of this tier runs."""

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


def _verify(*args, timeout=900):
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    env.pop("VLLM_USE_MTPSTATE", None)  # the command turns it on through vLLM's plugin loader
    return subprocess.run(
        [sys.executable, "-m", "mtpstate", "vllm-verify", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_quick_passes_on_every_workload(tmp_path):
    out = tmp_path / "verify.json"
    p = _verify("--quick", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[-1] == f"wrote {out}"
    verdict = next(line for line in lines if line.startswith(("PASS", "FAIL")))
    assert verdict.startswith("PASS: mtpstate agrees with vLLM's own runner") and "0 disagreements" in verdict
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["first_disagreement"] is None and doc["device"] == "cpu"
    assert [r["workload"] for r in doc["results"]] == sorted(WORKLOADS)
    for r in doc["results"]:
        assert r["steps"] > 0 and r["values"] > 1000 and r["disagreements"] == 0, r
        assert any(line.startswith(r["workload"]) and "0 disagreements" in line for line in lines)


@pytest.mark.parametrize("mutant", TIER_MUTANTS)
def test_each_mutant_is_caught(mutant, tmp_path):
    out = tmp_path / "verify.json"
    p = _verify("--sabotage", mutant, "--workload", "sync-spec3-chunked", "--steps", "30", "--json", str(out))
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    assert f"mutant injected: {mutant}" in p.stdout
    assert "FAIL: mtpstate disagrees with vLLM's own runner" in p.stdout
    doc = json.loads(out.read_text())
    first = doc["first_disagreement"]
    assert not doc["passed"] and doc["sabotage"] == mutant and first["workload"] == "sync-spec3-chunked"
    assert f"first disagreement: workload sync-spec3-chunked, step {first['step']}: {first['text']}" in p.stdout
    assert first["vllm"] != first["mtpstate"]


def test_an_unknown_mutant_is_a_usage_error():
    p = _verify("--sabotage", "no-such-mutant")
    assert p.returncode == 2 and "invalid choice" in p.stderr
