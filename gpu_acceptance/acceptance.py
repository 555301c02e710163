"""The whole GPU acceptance run in one call (``gpu_acceptance/run.sh OUT``),
for a machine whose image has torch, numba and pytest but no vLLM and no
network: the bundle (``make gpu-bundle``) is installed offline into a
folder of its own, then every part runs against each bundled vLLM release,
within one 8-minute budget, each part's result and log under ``OUT``:

===================  =========================================================
part                 what it runs (its result file under OUT)
===================  =========================================================
install              the bundle's wheels, ``pip install --no-index --target``;
                     the releases unpacked (``logs/install.log``)
vllm-verify-R        ``mtpstate vllm-verify --quick`` on release R, on the GPU
                     (on a CPU: ``--device cpu``) (``vllm-verify-R.json``)
cuda-tests           ``make gpu-check``'s CUDA tests (``cuda-tests.xml``)
mutant-NAME          ``vllm-verify --sabotage NAME`` on the newest release,
                     one workload for 30 steps: must FAIL (``mutant-NAME.json``)
bench-runner         ``mtpstate bench-vllm --device cuda --level runner``,
                     N = 1, 16, 256, 1024, 4096, steady and busy, vLLM's
                     Sampler attached (``bench-vllm-runner.json``)
bench-device         ``mtpstate bench --only device`` against vLLM's own
                     staged writes (``bench-device.json``)
bench-bookkeeping    ``mtpstate bench-vllm --device cuda --level bookkeeping``
                     (``bench-vllm-bookkeeping.json``)
===================  =========================================================

``summary.txt`` has one line per part: ``PASS``, ``FAIL`` (the run's exit
status and last line), ``SKIP`` (why: "no CUDA device", out of the
budget), with its seconds; ``summary.json`` the same with the machine
(date, GPU, driver, torch, CUDA, numba, Python). A part that fails does
not stop the others. Exit status 0 only if no part failed.

On a machine without CUDA the CUDA parts say "no CUDA device" and skip, and
``vllm-verify`` runs on the CPU, with the CPU's cap and budget
(``CPU_VERIFY_S``, ``CPU_BUDGET_S``): CI runs it that way on a stand-in of
the image. With network, the same run works from a fresh clone:
``make gpu-acceptance OUT=...`` builds the bundle first.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # (mtpstate: the working tree)
BUDGET_S = 8 * 60

# (part, cap in seconds) in the order they run: the most telling first, so
# that what the budget leaves out is the least. Caps from the CPU run on a
# 2-core VM scaled to a 16-core GPU host (docs/benchmarks.md, "GPU"):
# vllm-verify --quick is ~60 s of host work here per release.
CAPS = {
    "vllm-verify": 75,  # (a CPU run's: CPU_VERIFY_S)
    "cuda-tests": 150,
    "mutant": 25,
    "bench-runner": 150,
    "bench-device": 90,
    "bench-bookkeeping": 90,
}
# a run without CUDA (CI's stand-in of the image, on 2 cores): vllm-verify
# --quick on the CPU takes 1-3 minutes per release there, so its cap and the
# budget are the CPU's; nothing of the GPU's budget depends on them
CPU_BUDGET_S, CPU_VERIFY_S = 20 * 60, 400


class Run:
    def __init__(self, out: str, bundle: str, budget_s: float = BUDGET_S):
        self.out, self.bundle = out, bundle
        self.logs = os.path.join(out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.budget_s = budget_s
        self.t_end = time.monotonic() + budget_s
        self.parts: list[dict] = []
        self.work = tempfile.mkdtemp(prefix="mtpstate-gpu-acceptance-")  # (not a result: outside OUT)
        self.site = os.path.join(self.work, "site")
        self.env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(self.work, "numba-cache"))
        self.env.pop("VLLM_USE_MTPSTATE", None)

    def left(self) -> float:
        return self.t_end - time.monotonic()

    def record(self, part: str, status: str, seconds: float, detail: str = "", result: str | None = None) -> None:
        p = {"part": part, "status": status, "seconds": round(seconds, 1), "detail": detail, "result": result}
        self.parts.append(p)
        print(f"{status:5} {part:30} {seconds:6.1f} s  {detail}", flush=True)

    def run(self, part, cmd, cap, env=None, result=None, expect_fail=False) -> None:
        """Run ``cmd`` as part ``part`` within ``cap`` s and what the budget
        leaves; its output to ``logs/PART.log``."""
        timeout = min(cap, self.left() - 5)
        if timeout < 10:
            self.record(part, "SKIP", 0.0, f"out of the {self.budget_s / 60:.0f}-minute budget")
            return
        log = os.path.join(self.logs, f"{part}.log")
        t0 = time.perf_counter()
        try:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, cwd=ROOT, env=env or self.env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            self.record(part, "FAIL", time.perf_counter() - t0, f"timed out after {timeout:.0f} s", result)
            return
        dt = time.perf_counter() - t0
        with open(log) as f:
            lines = [line.strip() for line in f if line.strip()]
        # (a verdict line where the command prints one, else the last line)
        last = next((x for x in reversed(lines) if x.startswith(("PASS:", "FAIL:"))), lines[-1] if lines else "")[:200]
        ok = rc == 1 if expect_fail else rc == 0
        why = f"exit {rc}" + (" (a mutant must fail: exit 1)" if expect_fail else "") + f": {last}"
        self.record(part, "PASS" if ok else "FAIL", dt, last if ok else why, result)

    # -- the parts -------------------------------------------------------------

    def install(self) -> list[str]:
        """The bundle's wheels into a folder of their own, offline; each
        release's vLLM unpacked. Returns the releases, newest first."""
        t0 = time.perf_counter()
        with open(os.path.join(self.bundle, "manifest.json")) as f:
            manifest = json.load(f)
        wheels = sorted(os.path.join(self.bundle, k) for k in manifest["files"] if k.startswith("wheels/"))
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", "--target", self.site]
        with open(os.path.join(self.logs, "install.log"), "w") as log:
            subprocess.run(cmd + wheels, check=True, stdout=log, stderr=subprocess.STDOUT)
            for r in manifest["releases"]:
                with tarfile.open(os.path.join(self.bundle, f"vllm-{r}.tar.xz")) as tar:
                    tar.extractall(os.path.join(self.work, f"vllm-{r}"), filter="data")
                print(f"vllm {r}: unpacked", file=log)
        self.record(
            "install", "PASS", time.perf_counter() - t0, f"{len(wheels)} wheels, vLLM {', '.join(manifest['releases'])}"
        )
        return manifest["releases"]

    def env_for(self, release: str) -> dict:
        # the release's source first, then the bundle's packages, then mtpstate (the working tree)
        path = [os.path.join(self.work, f"vllm-{release}"), self.site, ROOT, self.env.get("PYTHONPATH", "")]
        return dict(self.env, PYTHONPATH=os.pathsep.join(p for p in path if p), VLLM_LOGGING_LEVEL="ERROR")


def machine() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"], info["cuda"] = torch.__version__, torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001  (said in the summary, never raised)
        info["torch"] = f"not importable: {e}"
    try:
        import numba

        info["numba"] = numba.__version__
    except Exception as e:  # noqa: BLE001
        info["numba"] = f"not importable: {e}"
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if smi.returncode == 0:
            info["driver"] = smi.stdout.strip().splitlines()[0].split(", ")[-1]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print("usage: acceptance.py OUT [BUNDLE]", file=sys.stderr)
        return 2
    out = os.path.abspath(argv[0])
    bundle = os.path.abspath(argv[1] if len(argv) == 2 else os.path.join(ROOT, "gpu-bundle"))
    if not os.path.exists(os.path.join(bundle, "manifest.json")):
        print(f"acceptance: no bundle at {bundle} (make gpu-bundle writes it)", file=sys.stderr)
        return 2
    info = machine()
    cuda = "gpu" in info
    r = Run(out, bundle, BUDGET_S if cuda else CPU_BUDGET_S)
    verify_cap = CAPS["vllm-verify"] if cuda else CPU_VERIFY_S
    with open(os.path.join(out, "machine.json"), "w") as f:
        json.dump(info, f, indent=1)
    device = "cuda" if cuda else "cpu"
    no_cuda = "no CUDA device" + ("" if cuda else f" (torch {info.get('torch')})")
    try:
        releases = r.install()
    except Exception as e:  # noqa: BLE001  (said in the summary)
        r.record("install", "FAIL", 0.0, f"{type(e).__name__}: {e}")
        releases = []
    newest = releases[0] if releases else None
    mtp = [sys.executable, "-m", "mtpstate"]
    if newest:
        r.run(f"vllm-verify-{newest}", mtp + ["vllm-verify", "--device", device, "--quick", "--json",
              os.path.join(out, f"vllm-verify-{newest}.json")], verify_cap, r.env_for(newest),
              f"vllm-verify-{newest}.json")  # fmt: skip
    if cuda:
        xml = os.path.join(out, "cuda-tests.xml")
        r.run("cuda-tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
              "tests/test_mirror.py", "tests/test_mirror_serving.py", f"--junitxml={xml}"],
              CAPS["cuda-tests"], result="cuda-tests.xml")  # fmt: skip
    else:
        r.record("cuda-tests", "SKIP", 0.0, no_cuda)
    from mtpstate.tools.vllm_verify.sabotage import MUTANTS

    for name in MUTANTS:
        if not cuda or not newest:
            r.record(f"mutant-{name}", "SKIP", 0.0, no_cuda if not cuda else "no vLLM installed")
            continue
        r.run(f"mutant-{name}", mtp + ["vllm-verify", "--device", "cuda", "--sabotage", name, "--workload",
              "sync-spec3-chunked", "--steps", "30", "--json", os.path.join(out, f"mutant-{name}.json")],
              CAPS["mutant"], r.env_for(newest), f"mutant-{name}.json", expect_fail=True)  # fmt: skip
    benches = [
        ("bench-runner", ["bench-vllm", "--device", "cuda", "--level", "runner", "--workload", "steady", "--workload",
                          "busy", "--repeats", "2", "--json", os.path.join(out, "bench-vllm-runner.json")],
         "bench-vllm-runner.json"),
        ("bench-device", ["bench", "--only", "device", "--vllm-src", os.path.join(r.work, f"vllm-{newest}"),
                          "--json", os.path.join(out, "bench-device.json")], "bench-device.json"),
        ("bench-bookkeeping", ["bench-vllm", "--device", "cuda", "--level", "bookkeeping", "--workload", "steady",
                               "--workload", "busy", "--repeats", "2", "--json",
                               os.path.join(out, "bench-vllm-bookkeeping.json")], "bench-vllm-bookkeeping.json"),
    ]  # fmt: skip
    for part, args, result in benches:
        if not cuda or not newest:
            r.record(part, "SKIP", 0.0, no_cuda if not cuda else "no vLLM installed")
            continue
        r.run(part, mtp + args, CAPS[part], r.env_for(newest), result)
    for rel in releases[1:]:
        r.run(f"vllm-verify-{rel}", mtp + ["vllm-verify", "--device", device, "--quick", "--json",
              os.path.join(out, f"vllm-verify-{rel}.json")], verify_cap, r.env_for(rel),
              f"vllm-verify-{rel}.json")  # fmt: skip
    failed = [p for p in r.parts if p["status"] == "FAIL"]
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"machine": info, "budget_s": r.budget_s, "parts": r.parts, "passed": not failed}, f, indent=1)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        head = (
            f"{info['date']}  {info.get('gpu', 'no GPU')}  driver {info.get('driver', '-')}  torch {info.get('torch')}"
        )
        f.write(head + f"  numba {info.get('numba')}  Python {info['python']}\n")
        for p in r.parts:
            f.write(f"{p['status']:5} {p['part']:30} {p['seconds']:6.1f} s  {p['detail']}\n")
        f.write(f"{'PASS' if not failed else 'FAIL'}: {len(failed)} part(s) failed\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
