"""What CI checks of `make test-gpu-bundle`'s run of gpu_acceptance/run.sh on
a CPU stand-in of the GPU image (GPU_ACCEPTANCE_OUT: its OUT): the bundle
installed offline, vllm-verify --quick passed on every bundled release,
every CUDA part skipped saying why, and each result where the summary says."""

import json
import os

import pytest

OUT = os.environ.get("GPU_ACCEPTANCE_OUT")
pytestmark = pytest.mark.skipif(not OUT, reason="GPU_ACCEPTANCE_OUT is not set (make test-gpu-bundle sets it)")


def _summary():
    with open(os.path.join(OUT, "summary.json")) as f:
        return json.load(f)


def test_installed_offline_and_every_release_verified():
    s = _summary()
    parts = {p["part"]: p for p in s["parts"]}
    assert parts["install"]["status"] == "PASS"
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu-bundle",
                           "manifest.json")) as f:  # fmt: skip
        releases = json.load(f)["releases"]
    assert releases
    for r in releases:
        p = parts[f"vllm-verify-{r}"]
        assert p["status"] == "PASS", p
        with open(os.path.join(OUT, p["result"])) as f:
            doc = json.load(f)
        assert doc["passed"] and f"vLLM {r}," in doc["verdict"], doc["verdict"]
        assert sum(w["disagreements"] for w in doc["results"]) == 0
        assert sum(w["values"] for w in doc["results"]) > 0


def test_cuda_parts_skip_saying_why():
    s = _summary()
    assert "gpu" not in s["machine"]
    skipped = [p for p in s["parts"] if p["status"] == "SKIP"]
    names = {p["part"] for p in skipped}
    assert {"cuda-tests", "bench-runner", "bench-device", "bench-bookkeeping"} <= names
    assert any(n.startswith("mutant-") for n in names)
    assert all(p["detail"].startswith("no CUDA device") for p in skipped), skipped
    assert s["passed"] and not [p for p in s["parts"] if p["status"] == "FAIL"]


def test_results_and_logs_under_out():
    s = _summary()
    assert os.path.exists(os.path.join(OUT, "summary.txt")) and os.path.exists(os.path.join(OUT, "machine.json"))
    for p in s["parts"]:
        if p["status"] != "SKIP" and p["part"] != "install":
            assert os.path.exists(os.path.join(OUT, "logs", f"{p['part']}.log")), p
            assert os.path.exists(os.path.join(OUT, p["result"])), p
