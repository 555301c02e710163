"""`make gpu-check` (gpu_acceptance/gpu_check.py) must be right the first
time it meets a GPU: within its 8-minute budget, results only in its output
directory, and a clear verdict when something is missing."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "gpu_acceptance", "gpu_check.py")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_parts_fit_the_budget():
    m = _load()
    assert m.BUDGET_S <= 8 * 60 and m.TESTS_S + m.DEVICE_S + m.BENCH_S + m.VERIFY_S <= m.BUDGET_S


def _run(tmp_path, extra_path=None):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["MTPSTATE_GPU_OUT"] = str(tmp_path / "out")
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, also where there is one
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env, timeout=120)


def test_without_a_gpu_says_so_and_writes_only_results(tmp_path):
    p = _run(tmp_path)
    assert p.returncode == 2 and "no CUDA device visible" in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["machine.json"]  # no numba cache among the results


def test_a_failed_import_is_named(tmp_path):
    fake = tmp_path / "fake"
    (fake / "numba").mkdir(parents=True)
    (fake / "numba" / "__init__.py").write_text("raise ImportError('numba is broken here')\n")
    p = _run(tmp_path, str(fake))
    assert p.returncode == 2 and "cannot import" in p.stderr and "numba is broken here" in p.stderr, p.stderr
    assert "no CUDA device" not in p.stderr
