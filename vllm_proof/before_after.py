"""Before and after a change to mtpstate, paired, on vLLM's real steps.

Records each workload's scheduler steps once from vLLM 0.34's scheduler
(the timing workloads of ``mtpstate/tools/vllm_bench/workloads.py``), then times ``RequestTable.apply`` (with
the batch) for two source trees of mtpstate, in alternating processes
(A, B, A, B, ...), on the very same steps. Each step's A/B time ratio pairs
the two; the figure is the median ratio over all steps and runs, with p10 and
p90. Between steps each side allocates and frees 8 MiB, so that the step
does not find all of its data in cache (as in a server, where other work
runs between steps).

    python vllm_proof/before_after.py OLD_TREE NEW_TREE \\
        --workload busy-1024 --workload steady-4096 [--runs 3] [--json out.json]

``--level runner`` times the runner's host step instead, with mtpstate on
through its plugin and vLLM's real Sampler attached (``MRV2Reference.host_step``
and its ``sample_questions``, as ``mtpstate bench-vllm --level runner``
times the on side); ``--level mirror`` times ``apply`` with a device
mirror on the CPU (``device="cpu"``, the mirror's host path).

A tree is a directory holding the ``mtpstate`` package (a git worktree of an
older commit: ``git worktree add /tmp/old <commit>``). Run with the vLLM
tier's environment (``make test-vllm`` builds it), as ``make bench-vllm``
does.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def record(names: list[str], out_dir: str) -> None:
    """Each workload's steps (pickled), as the vLLM-level benchmark records them."""
    sys.path.insert(0, HERE)
    from mtpstate.tools.vllm_bench.bench import recorded_steps
    from mtpstate.tools.vllm_bench.shims import install_cpu_shims
    from mtpstate.tools.vllm_bench.workloads import BENCH_WORKLOADS, write_model_dir

    install_cpu_shims()
    model_dir = write_model_dir()
    for name in names:
        w = BENCH_WORKLOADS[name]
        blobs, timed, block_sizes = recorded_steps(w, model_dir)
        rec = dict(
            blobs=blobs,
            timed=timed,
            bs=block_sizes,
            R=w.max_num_seqs,
            L=w.max_model_len,
            T=w.max_num_batched_tokens,
            dq=1 + w.num_spec,
        )
        with open(os.path.join(out_dir, f"{name}.pkl"), "wb") as f:
            pickle.dump(rec, f)


# per level: (what a side builds, once per pass over the steps; what is timed per step)
LEVELS = {
    "table": (
        "t = mtpstate.RequestTable(max_num_reqs=d['R'], max_model_len=d['L'], block_sizes=d['bs'], "
        "decode_query_len=d['dq'])",
        "t.apply(s).batch.idx_mapping_np",
    ),
    "mirror": (
        "t = mtpstate.RequestTable(max_num_reqs=d['R'], max_model_len=d['L'], block_sizes=d['bs'], "
        "decode_query_len=d['dq'], device='cpu', mirror_options={'idx_mapping': True})",
        "t.apply(s).batch.idx_mapping_np",
    ),
    "runner": (
        "t = MRV2Reference(d['R'], d['L'], d['T'], d['bs'], d['dq'] - 1, use_mtpstate=True, sampler=True)",
        "t.sample_questions(t.host_step(s))",
    ),
}
# the runner level: vLLM's code on the CPU, mtpstate applied by its plugin
_RUNNER_SETUP = """
from mtpstate.tools.vllm_bench.reference import MRV2Reference, cache_envs, load_plugin
from mtpstate.tools.vllm_bench.shims import install_cpu_shims
install_cpu_shims()
load_plugin()
cache_envs()
"""


def time_tree(tree: str, path: str, repeats: int, level: str = "table") -> list[float]:
    """Per timed step, seconds of the ``level``'s step (:data:`LEVELS`) with
    the mtpstate of ``tree`` (run in a subprocess: one tree per process)."""
    build, step = LEVELS[level]
    setup = _RUNNER_SETUP if level == "runner" else ""
    code = f"""
import json, pickle, sys, time
import numpy as np
sys.path.insert(0, {tree!r})
import mtpstate
assert mtpstate.__file__.startswith({tree!r}), mtpstate.__file__
{setup}
d = pickle.load(open({path!r}, "rb"))
out = []
for rep in range({repeats} + 1):
    {build}
    for k, (s, keep) in enumerate(zip([pickle.loads(b) for b in d["blobs"]], d["timed"])):
        junk = bytearray(8 << 20)  # other work between steps
        del junk
        np.random.seed(k)  # (the sampler's draws for unseeded requests: the same on both trees)
        t0 = time.perf_counter()
        {step}
        dt = time.perf_counter() - t0
        if keep and rep:  # (the first pass warms up)
            out.append(dt)
print(json.dumps(out))
"""
    env = dict(os.environ, MTPSTATE_COMPILE_NOTICE="0")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _describe(tree: str) -> str:
    """The tree's git commit (short), or its path."""
    try:
        out = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", tree, "status", "--porcelain", "--", "mtpstate"], capture_output=True, text=True
        )
        if out.returncode == 0:
            return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except OSError:
        pass
    return tree


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--workload", action="append", required=True)
    p.add_argument("--runs", type=int, default=3, help="process pairs per workload (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="passes over the steps per process (default 3)")
    p.add_argument("--level", choices=sorted(LEVELS), default="table", help="what is timed (default: table)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    old, new = os.path.abspath(args.old), os.path.abspath(args.new)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        record(args.workload, tmp)
        for name in args.workload:
            path = os.path.join(tmp, f"{name}.pkl")
            time_tree(old, path, 0, args.level)  # compile (or load) both trees' kernels first
            time_tree(new, path, 0, args.level)
            a_all, b_all, ratios = [], [], []
            for _ in range(args.runs):
                a = time_tree(old, path, args.repeats, args.level)
                b = time_tree(new, path, args.repeats, args.level)
                a_all += a
                b_all += b
                ratios += [x / y for x, y in zip(a, b)]
            r = {
                "workload": name,
                "level": args.level,
                "old_median_us": statistics.median(a_all) * 1e6,
                "new_median_us": statistics.median(b_all) * 1e6,
                "paired_median": float(np.median(ratios)),
                "paired_p10": float(np.percentile(ratios, 10)),
                "paired_p90": float(np.percentile(ratios, 90)),
                "steps": len(ratios),
            }
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        from mtpstate.tools.vllm_bench.bench import run_machine

        machine = run_machine()
        doc = {"machine": machine, "old": _describe(old), "new": _describe(new), "results": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
