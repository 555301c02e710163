"""gpu_acceptance/run.sh and the bundle it installs, without a GPU and
without the bundle: usage, a missing bundle said in one line, the bundle's
requirement pins, and the parts' order and caps within the one budget. CI
runs the whole thing on a CPU stand-in of the GPU image (make
test-gpu-bundle, gpu_acceptance/test_run_on_cpu.py)."""

import importlib.util
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RUN = os.path.join(ROOT, "gpu_acceptance", "run.sh")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "gpu_acceptance", f"{name}.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_usage():
    p = subprocess.run(["bash", RUN], capture_output=True, text=True)
    assert p.returncode == 2 and "usage: gpu_acceptance/run.sh OUT [BUNDLE]" in p.stderr


def test_a_missing_bundle_is_said_in_one_line(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run(["bash", RUN, str(tmp_path / "out"), str(tmp_path)], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "no bundle at" in p.stderr and "make gpu-bundle" in p.stderr, p.stderr


def test_bundle_requirements_are_pinned_wheels_for_the_image():
    b = _load("bundle")
    with open(os.path.join(ROOT, "gpu_acceptance", "bundle-requirements.txt")) as f:
        reqs = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert reqs and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", r) for r in reqs), reqs
    assert b.MAX_BYTES == 60 * 2**20 and b.RELEASES[0] == max(b.RELEASES, key=lambda v: tuple(map(int, v.split("."))))
    # none of what the image has (its list in ../shared/context.md): torch and numpy stay the image's
    names = {r.split("==")[0].lower() for r in reqs}
    assert not names & {"torch", "numpy", "numba", "triton", "transformers", "tokenizers", "huggingface-hub"}


def test_every_part_has_a_cap_within_the_budget():
    a = _load("acceptance")
    assert a.BUDGET_S == 8 * 60
    assert set(a.CAPS) == {"vllm-verify", "cuda-tests", "mutant", "bench-runner", "bench-device", "bench-bookkeeping"}
    assert all(0 < cap < a.BUDGET_S for cap in a.CAPS.values())
