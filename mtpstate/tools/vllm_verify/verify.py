"""``mtpstate vllm-verify``: the runner differential on the vLLM installed
here, as an operator runs it before turning mtpstate on. One line per
workload (steps, values compared, disagreements), the first disagreement in
full, then one verdict line."""

from __future__ import annotations

import time
from dataclasses import replace

from mtpstate.tools.vllm_verify.runs import run_runner_differential

# each workload's steps x this (--quick: x 1: about a minute on 2 cores)
STEP_SCALE = 4


def workloads(names=None, quick: bool = False, steps: int | None = None) -> list:
    """The workloads to drive (``mtpstate.tools.vllm_bench.workloads.WORKLOADS``:
    steady and busy batches, chunked prefill, MTP k = 1-4, preemption, async
    scheduling, prefix caching with two KV groups, prompt embeddings, ids
    outside ASCII), each run for :data:`STEP_SCALE` times its steps (``quick``:
    its steps), at most ``steps``."""
    from mtpstate.tools.vllm_bench.workloads import WORKLOADS

    scale = 1 if quick else STEP_SCALE
    out = []
    for name in names or sorted(WORKLOADS):
        w = WORKLOADS[name]
        n = w.steps * scale if steps is None else min(w.steps * scale, steps)
        out.append(replace(w, steps=n))
    return out


VERIFY_CPU_NOTE = (
    "vLLM's device launches are no-ops on both sides, so what only its Triton kernels write is compared by dtype "
    "and shape; mtpstate's device mirror ships for real (on the CPU its host path writes the tensors)"
)
VERIFY_CUDA_NOTE = "nothing of mtpstate or vLLM's kernels is shimmed; device tensors are compared after a synchronize"


def shimmed(device: str, applied: tuple[str, ...]) -> tuple[str, ...]:
    """What is shimmed of vLLM (``applied``: what ``bench_vllm.prepare``
    applied; on the CPU, vLLM's part of it: mtpstate's mirror runs)."""
    from mtpstate.tools import bench_vllm

    return bench_vllm.VLLM_CPU_SHIMS if device == "cpu" else applied


def header(found: dict, device: str, applied: tuple[str, ...]) -> list[str]:
    """The lines naming what is verified: the versions, the device, what is
    shimmed of vLLM (:func:`shimmed`)."""
    from mtpstate.tools import bench_vllm

    note = VERIFY_CPU_NOTE if device == "cpu" else VERIFY_CUDA_NOTE
    return bench_vllm.header(found, device, shimmed(device, applied), note)


def workload_line(r: dict) -> str:
    verdict = "agrees" if r["disagreements"] == 0 else f"{r['disagreements']} steps disagree"
    return (
        f"{r['workload']:<24} {r['steps']:>4} steps  {r['values']:>10,} values compared  "
        f"{r['disagreements']:>3} disagreements  ({verdict}; {r['seconds']:.0f} s)"
    )


def verdict(results: list[dict], device: str, vllm_version: str, sabotaged: str | None) -> tuple[bool, str]:
    """(passed, the verdict line)."""
    steps = sum(r["steps"] for r in results)
    values = sum(r["values"] for r in results)
    bad = sum(r["disagreements"] for r in results)
    what = f"{len(results)} workloads, {steps} steps, {values:,} values compared on {device}, vLLM {vllm_version}"
    if bad == 0:
        line = f"PASS: mtpstate agrees with vLLM's own runner: {what}, 0 disagreements"
        if sabotaged:
            line += f" (with mutant {sabotaged!r} injected: this check could not see it)"
        return True, line
    line = f"FAIL: mtpstate disagrees with vLLM's own runner on {bad} steps ({what})"
    if sabotaged:
        line += f"; mutant {sabotaged!r} was injected, so this is the expected outcome"
    return False, line


def verify(device: str = "cpu", quick: bool = False, names=None, steps=None, sabotage=None, say=print) -> dict:
    """Run the runner differential (``runs.run_runner_differential``) on
    each workload; ``say`` each line. vLLM must be set up for ``device``
    (``mtpstate.tools.bench_vllm.prepare``). Returns the report (JSON-able):
    ``machine``, ``device``, ``sabotage``, ``results`` (per workload),
    ``first_disagreement``, ``passed``, ``verdict``."""
    from vllm.version import __version__ as vllm_version

    from mtpstate.tools.vllm_bench.bench import run_machine
    from mtpstate.tools.vllm_bench.workloads import write_model_dir

    if sabotage is not None:
        from mtpstate.tools.vllm_verify.sabotage import sabotage as inject

        inject(sabotage)
    model_dir = write_model_dir()
    results = []
    for w in workloads(names, quick, steps):
        t0 = time.perf_counter()
        r = run_runner_differential(w, model_dir, device=device)
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        say(workload_line(r))
    first = next((r["first_full"] for r in results if r["first_full"] is not None), None)
    if first is not None:
        say(f"first disagreement: workload {first['workload']}, step {first['step']}: {first['text']}")
    passed, line = verdict(results, device, vllm_version, sabotage)
    say(line)
    return {
        "machine": run_machine(device),
        "device": device,
        "sabotage": sabotage,
        "results": results,
        "first_disagreement": first,
        "passed": passed,
        "verdict": line,
    }
