"""`make test-vllm`, ``mtpstate bench-vllm`` as a user runs it: the venv's
own ``mtpstate`` command, from a directory outside the repository, on the
tier's vLLM release (the newest: with no PYTHONPATH, vLLM found as installed,
through the venv's .pth; an older one: on the tier's PYTHONPATH). Its JSON
must hold both levels of every workload, paired ratios and the device and
shim fields; what it cannot run is refused."""

import json
import math
import os
import subprocess
import sys

import pytest

from mtpstate.integrations.vllm import plugin
from mtpstate.tools import bench_vllm
from mtpstate.tools.vllm_bench.workloads import BENCH_KINDS

MTPSTATE = os.path.join(os.path.dirname(sys.executable), "mtpstate")


RELEASE = plugin.installed_release()  # the tier's
# the release the venv's .pth puts on the path: found as installed
AS_INSTALLED = RELEASE == max(plugin.SUPPORTED, key=plugin._version_key)


def _user_env():
    drop = ("PYTHONPATH", "VLLM_USE_MTPSTATE") if AS_INSTALLED else ("VLLM_USE_MTPSTATE",)
    return {k: v for k, v in os.environ.items() if k not in drop}


def _bench_vllm(cwd, *args, timeout=600):
    return subprocess.run(
        [MTPSTATE, "bench-vllm", *args], cwd=cwd, env=_user_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("user")
    p = _bench_vllm(cwd, "--quick", "--json", "out.json")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    with open(cwd / "out.json") as f:
        return p, json.load(f)


def test_quick_json_has_both_levels_of_every_workload(quick):
    p, doc = quick
    assert doc["device"] == "cpu" and doc["quick"] is True
    assert doc["shims"] == list(bench_vllm.CPU_SHIMS) and doc["note"] == bench_vllm.CPU_NOTE
    assert doc["vllm"]["version"] == RELEASE and os.path.isfile(os.path.join(doc["vllm"]["path"], "version.py"))
    assert ("PYTHONPATH" not in _user_env()) == AS_INSTALLED
    got = {(r["level"], r["workload"]) for r in doc["results"]}
    want = {(lv, f"{k}-{n}") for lv in bench_vllm.LEVELS for k in BENCH_KINDS for n in bench_vllm.QUICK_SIZES}
    assert got == want and len(doc["results"]) == len(want)
    for r in doc["results"]:
        assert r["device"] == "cpu" and r["timed_steps"] > 0 and r["repeats"] == bench_vllm.QUICK_REPEATS, r
        assert 0 < r["paired_p10"] <= r["paired_median"] <= r["paired_p90"] < math.inf, r
        assert r["mtpstate_median_us"] > 0
        if r["level"] == "runner":
            ops = r["torch_ops"]
            for side in ("vllm", "mtpstate"):
                assert ops[side]["without_new"] > 0 and "no_op_launches" in ops[side], ops
            # vLLM's Sampler attached on both sides, its questions timed
            assert r["sampler"] is True and r["phases_us"]["vllm"]["sample"] > 0, r
            sq = r["sample_questions"]
            assert sq["vllm_median_us"] > 0 and sq["mtpstate_median_us"] > 0 and sq["paired_median"] > 0, sq
        else:
            assert r["mrv2_median_us"] > 0 and r["apply_alone_ns_per_request"] > 0


def test_quick_report_names_what_it_measures(quick):
    p, doc = quick
    lines = p.stdout.splitlines()
    assert lines[0].startswith("mtpstate ") and f"vLLM {RELEASE}" in lines[0] and doc["vllm"]["path"] in lines[0]
    assert "device: cpu" in lines[1]
    for shim in bench_vllm.CPU_SHIMS:
        assert f"  - {shim}" in lines
    rows = [ln for ln in lines if ln.split()[:1] in (["bookkeeping"], ["runner"])]
    assert len(rows) == len(doc["results"])
    assert "wrote out.json" in p.stdout


def test_cuda_without_cuda_is_refused(tmp_path):
    """torch here is a CPU build: one line, status 2, no JSON, nothing run."""
    p = _bench_vllm(tmp_path, "--device", "cuda", "--quick", "--json", "out.json", timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda" in lines[0] and "sees no CUDA device" in lines[0], p.stderr
    assert p.stdout == "" and not (tmp_path / "out.json").exists()


def test_source_cuda_shims_replace_only_the_compiled_ops():
    """vLLM's source without its compiled ops (this tier): the CUDA set-up
    stubs the extension module the CUDA platform imports and routes the UVA
    view past ``torch.ops._C``; its view refuses memory the GPU cannot map."""
    code = (
        "import json, torch\n"
        "from mtpstate.tools.vllm_bench import shims\n"
        "applied = shims.install_source_cuda_shims()\n"
        "import vllm.platforms.cuda\n"  # loads: the stub stands for vllm._C_stable_libtorch
        "from vllm.v1.worker.gpu import buffer_utils\n"
        "routed = buffer_utils.get_accelerator_view_from_cpu_tensor is shims.uva_view\n"
        "try:\n"
        "    shims.uva_view(torch.zeros(4))\n"
        "    refused = ''\n"
        "except ValueError as e:\n"
        "    refused = str(e)\n"
        "print(json.dumps([list(applied), routed, refused]))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_user_env())
    assert p.returncode == 0, p.stderr[-3000:]
    applied, routed, refused = json.loads(p.stdout.splitlines()[-1])
    assert applied == list(shims_lines()) and routed and "pinned" in refused


def shims_lines():
    from mtpstate.tools.vllm_bench.shims import CUDA_SOURCE_SHIMS

    return CUDA_SOURCE_SHIMS["platform"], CUDA_SOURCE_SHIMS["uva"]
