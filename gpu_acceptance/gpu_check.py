"""The one-command GPU check (``make gpu-check``): on a machine with CUDA,
torch, numba, pytest, pytest-benchmark and hypothesis installed and no
network, in under 8 minutes:

1. the ``cuda``-marked tests: device equality on the graph path; slots
   never refilled while a replay from them is in flight, checked in stream
   order after every step; apply returning before its work lands; the
   ring-reuse stress test at async depths 2 and 3, the consumer moving
   between streams; the row-upload ring under a held-back stream; work already
   queued on the consumer's stream reading the old state; the array entry
   point and same-step duplicate writes; the vLLM adapter's engine
   configuration under a held-back stream; one graph launch per step (the
   profiler's CUDA runtime calls); host token writes refused; the mirror's
   own stream-follow wait with the old stream held back; a UVA token
   target (pinned host memory mapped into the device); one step adding a
   20k-token prompt at R = 1024, L = 32768 (no allocation, no capture; its
   wall time in the XML report); calls during an engine's graph capture
   refused with the capture left valid; a target on another GPU refused;
2. the device benchmark (``mtpstate bench --only device``: at N = 1, 16,
   256, 1024, 4096, steady and mixed, apply without the mirror, with it
   (host time), until it lands, and the same step's upload done vLLM's
   way; ``--vllm-src DIR``: vLLM's own ``StagedWriteTensor`` from an
   unpacked sdist), then the mirror benchmark at N = 1024 and 4096
   (``mtpstate bench --only table``);
3. ``mtpstate vllm-verify --device cuda --quick``: mtpstate against
   vLLM's own runner on this GPU, nothing shimmed, every workload, every
   field, every step (where vLLM is importable: installed, or its source
   tree given with ``--vllm-src``; else the summary says it was skipped);
4. the machine: date, GPU, driver, CUDA, torch, numba, Python.

Results, and only results, go to files under ``$MTPSTATE_GPU_OUT`` (default
``gpu-check-out``): ``machine.json``, ``cuda-tests.txt`` / ``cuda-tests.xml``,
``bench-device.json`` / ``bench-device.txt`` (docs/benchmarks.md's GPU
table is generated from it, committed as ``docs/bench-device-gpu.json``, by
``python benchmarks/report.py --write``), ``bench.json`` / ``bench.txt``,
``summary.json`` (with ``vllm-verify``'s report and lines)
(numba's compile cache goes to a temporary directory unless
``NUMBA_CACHE_DIR`` is set). The whole run is bounded by one 8-minute budget
shared by its parts. Exit status 0 only if the tests, the benchmarks and
``vllm-verify`` (where it ran) passed.

Run from the repository root: ``python gpu_acceptance/gpu_check.py
[--vllm-src DIR]``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 8 * 60  # the whole run, all parts together
TESTS_S, DEVICE_S, BENCH_S, VERIFY_S = 200, 110, 60, 90  # each part's own cap, within what the budget leaves


def _run(cmd, out_txt, timeout, env):
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    with open(out_txt, "w") as f:
        f.write(text)
    return rc, time.perf_counter() - t0, text


def machine() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in ("torch", "numba"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:  # reported: the verdict says which import failed
            info.setdefault("import_errors", {})[name] = repr(e)
    if "torch" in info:
        import torch

        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    if shutil.which("nvidia-smi"):
        p = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        info["nvidia_smi"] = p.stdout.strip()
    return info


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    vllm_src = None
    if argv[:1] == ["--vllm-src"] and len(argv) == 2:
        vllm_src = os.path.abspath(argv[1])
    elif argv:
        print("usage: gpu_check.py [--vllm-src DIR]", file=sys.stderr)
        return 2
    t_end = time.monotonic() + BUDGET_S
    out = os.path.abspath(os.environ.get("MTPSTATE_GPU_OUT", "gpu-check-out"))
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if "NUMBA_CACHE_DIR" not in env:  # not a result: outside the output directory
        env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="mtpstate-gpu-check-numba-")
    info = machine()
    with open(os.path.join(out, "machine.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info), flush=True)
    if info.get("import_errors"):
        failed = ", ".join(f"{k}: {v}" for k, v in info["import_errors"].items())
        print(f"gpu-check: cannot import what the check needs ({failed})", file=sys.stderr)
        return 2
    if "gpu" not in info:
        print(f"gpu-check: no CUDA device visible to torch {info['torch']} (CUDA {info['cuda']})", file=sys.stderr)
        return 2
    summary = {"machine": info}
    xml = os.path.join(out, "cuda-tests.xml")
    rc, dt, text = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests/test_mirror.py",
         "tests/test_mirror_serving.py", f"--junitxml={xml}"],
        os.path.join(out, "cuda-tests.txt"),
        min(TESTS_S, t_end - time.monotonic() - 30),
        env,
    )  # fmt: skip
    summary["cuda_tests"] = {"rc": rc, "seconds": round(dt, 1), "tail": text.strip().splitlines()[-1:]}
    print(json.dumps(summary["cuda_tests"]), flush=True)
    cmd = [sys.executable, "-m", "mtpstate", "bench", "--only", "device"]
    cmd += ["--json", os.path.join(out, "bench-device.json")]
    if vllm_src:
        cmd += ["--vllm-src", vllm_src]
    rc_d, dt_d, text_d = _run(
        cmd, os.path.join(out, "bench-device.txt"), max(1, min(DEVICE_S, t_end - time.monotonic() - 100)), env
    )
    summary["device_bench"] = {"rc": rc_d, "seconds": round(dt_d, 1)}
    print(text_d[-4000:], flush=True)
    rc_b, dt_b, text_b = _run(
        [sys.executable, "-m", "mtpstate", "bench", "--only", "table", "--sizes", "1024,4096",
         "--json", os.path.join(out, "bench.json")],
        os.path.join(out, "bench.txt"),
        max(1, min(BENCH_S, t_end - time.monotonic() - 5)),
        env,
    )  # fmt: skip
    summary["bench"] = {"rc": rc_b, "seconds": round(dt_b, 1)}
    print(text_b[-4000:], flush=True)
    rc_v = verify_vllm(summary, vllm_src, env, max(1, min(VERIFY_S, t_end - time.monotonic() - 5)))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if rc == 0 and rc_d == 0 and rc_b == 0 and rc_v in (0, None) else 1


def verify_vllm(summary: dict, vllm_src, env: dict, timeout: float):
    """``mtpstate vllm-verify --device cuda --quick`` where vLLM is importable
    (its report and lines into ``summary["vllm_verify"]``); its exit status,
    or None where it was skipped (and why)."""
    env = dict(env)
    if vllm_src:
        env["PYTHONPATH"] = vllm_src + os.pathsep + env["PYTHONPATH"]
    probe = subprocess.run([sys.executable, "-c", "import vllm.version"], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["?"])[-1]
        summary["vllm_verify"] = {"skipped": f"vLLM is not importable here ({why}); pass --vllm-src DIR"}
        print(json.dumps(summary["vllm_verify"]), flush=True)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "verify.json")
        cmd = [sys.executable, "-m", "mtpstate", "vllm-verify", "--device", "cuda", "--quick", "--json", report]
        rc, dt, text = _run(cmd, os.path.join(tmp, "verify.txt"), timeout, env)
        doc = None
        if os.path.exists(report):
            with open(report) as f:
                doc = json.load(f)
    summary["vllm_verify"] = {
        "rc": rc,
        "seconds": round(dt, 1),
        "lines": text.strip().splitlines()[-14:],
        "report": doc,
    }
    print(text[-4000:], flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
