"""The vLLM tier's command line: mtpstate against a supported vLLM release's own code
(the one on PYTHONPATH), on CPU.

vLLM's real ``Scheduler`` / ``AsyncScheduler`` (batch queue depth 2, as the
engine core runs it) is driven by a fake model
(``mtpstate.tools.vllm_bench.driver``). Every step it emits goes, as the
worker receives it (and also as a pickled copy), to the reference (vLLM's
real ``RequestState``, ``BlockTables``, staging and runner methods, on CPU:
``mtpstate.tools.vllm_bench.reference`` and ``shims``) and to mtpstate; the
differentials (``mtpstate.tools.vllm_verify``, which ``mtpstate
vllm-verify`` runs too) compare them after every step, and the
negative controls (``mtpstate.tools.vllm_verify.sabotage``) must disagree; ``--breakdown`` times the
runner's host step with mtpstate on method by method. The paired benchmarks
are ``mtpstate bench-vllm`` (``make bench-vllm``). Needs vLLM's source on
``sys.path`` (``make test-vllm`` sets it up; nothing is built and no model is
downloaded).

Run: ``python vllm_proof/harness.py [--workload NAME] [--runner [--deferred | --sabotage KIND]]
[--breakdown]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from mtpstate.tools.vllm_bench.bench import breakdown_workload, run_machine
from mtpstate.tools.vllm_bench.reference import cache_envs, load_plugin
from mtpstate.tools.vllm_bench.shims import install_cpu_shims
from mtpstate.tools.vllm_bench.workloads import BENCH_WORKLOADS, WORKLOADS, write_model_dir
from mtpstate.tools.vllm_verify.runs import run_runner_differential, run_table_differential
from mtpstate.tools.vllm_verify.sabotage import MUTANTS, sabotage


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workload",
        choices=sorted({**WORKLOADS, **BENCH_WORKLOADS}),
        action="append",
        help="default: all (with --breakdown: the timing workloads)",
    )
    p.add_argument("--steps", type=int, help="override each workload's step count")
    p.add_argument(
        "--scale-steps",
        type=int,
        metavar="N",
        help="each workload's step count x N / 400, at most N (what make test-vllm runs)",
    )
    p.add_argument(
        "--runner",
        action="store_true",
        help="the runner as mtpstate's vLLM plugin patches it (on) against vLLM's own methods (off)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="instead of the differential: the runner's host step with mtpstate on, timed by method",
    )
    p.add_argument(
        "--sabotage",
        choices=list(MUTANTS),
        help="with --runner: break what the mirror ships to vLLM's tensors (a negative control: must disagree)",
    )
    p.add_argument(
        "--deferred",
        action="store_true",
        help="with --runner: mtpstate's device work on a model of a GPU's asynchrony, counted per step",
    )
    p.add_argument(
        "--shadow",
        action="store_true",
        help="shadow mode: vLLM's own runner with and without mtpstate's shadow (identical results), "
        "and what the shadow reports (with --sabotage: the mutant, found)",
    )
    p.add_argument(
        "--every",
        type=int,
        action="append",
        help="with --shadow: MTPSTATE_SHADOW_EVERY of a shadowed run (repeatable; default 16)",
    )
    p.add_argument("--fault-at", type=int, help="with --shadow: the shadow raises in this step (0-based)")
    p.add_argument("--long-id-at", type=int, help="with --shadow: the n-th request's id is one mtpstate refuses")
    p.add_argument(
        "--inject",
        action="append",
        metavar="PHASE:K",
        help="with --runner: the K-th call of PHASE (mtpstate.tools.faults) raises, mtpstate running as the "
        "engine runs it (handed back to vLLM); one run per --inject (repeatable)",
    )
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    install_cpu_shims()
    if args.shadow:
        load_plugin(mode="shadow")
    elif args.runner or args.breakdown:
        load_plugin()  # through vLLM's own plugin loader, as every vLLM process
    if args.breakdown:
        cache_envs()  # timed as a serving vLLM runs, once started
    if args.sabotage:
        sabotage(args.sabotage)
    model_dir = write_model_dir()
    table = {**WORKLOADS, **BENCH_WORKLOADS}
    names = args.workload or sorted(BENCH_WORKLOADS if args.breakdown else WORKLOADS)
    results, failed = [], False
    for name in names:
        w = table[name] if args.steps is None else replace(table[name], steps=args.steps)
        if args.scale_steps is not None:
            w = replace(w, steps=min(w.steps * args.scale_steps // 400, args.scale_steps))
        t0 = time.perf_counter()
        if args.shadow:
            failed |= _shadowed(w, model_dir, args)
            continue
        if args.breakdown:
            r = breakdown_workload(w, model_dir)
        elif args.runner and args.inject:
            for spec in args.inject:
                phase, _, k = spec.partition(":")
                r = run_runner_differential(w, model_dir, fault=(phase, int(k or 3)))
                r["fault"] = spec
                print(json.dumps(r), flush=True)
                failed |= r["disagreements"] > 0
            continue
        elif args.runner:
            r = run_runner_differential(w, model_dir, deferred=args.deferred)
        else:
            r = run_table_differential(w, model_dir)
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        print(json.dumps(r), flush=True)
        if not args.breakdown:
            failed |= r["disagreements"] > 0
            failed |= not args.runner and w.num_spec > 0 and r["control_disagreements"] == 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": run_machine(), "results": results}, f, indent=1)
    return 1 if failed else 0


def _shadowed(w, model_dir, args) -> bool:
    """One line per shadowed run: vLLM's results identical to the run
    without the shadow (every step's hash), and the shadow's report.
    Returns whether the shadow found a disagreement where none was put."""
    import torch

    from mtpstate.devices import DeferredOps
    from mtpstate.tools.vllm_verify.runs import run_shadow

    if args.long_id_at is not None:
        w = replace(w, long_request_id=args.long_id_at)
    base = run_shadow(w, model_dir, shadowed=False)["digests"]
    failed = False
    for every in args.every or [16]:
        t0 = time.perf_counter()
        ops = DeferredOps(torch, graphs=True) if args.deferred else None
        r = run_shadow(w, model_dir, shadowed=True, every=every, ops=ops, fault_at=args.fault_at)
        digests = r.pop("digests")
        differ = [i for i, (a, b) in enumerate(zip(base, digests)) if a != b]
        r.update(
            every=every,
            identical=len(base) == len(digests) and not differ,
            first_differing_step=differ[0] if differ else None,
            seconds=time.perf_counter() - t0,
        )
        print(json.dumps(r), flush=True)
        sh = r["shadow"] or {}
        failed |= not r["identical"] or (sh.get("disagreements", 0) > 0 and not args.sabotage)
    return failed


if __name__ == "__main__":
    sys.exit(main())
