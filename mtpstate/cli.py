"""Command line: ``mtpstate sim | replay | bench`` (also ``python -m mtpstate``)."""

from __future__ import annotations

import argparse
import json
import sys


def _bar(label, done, total, width=30):
    if done != total and done % max(1, total // 100):
        return  # redraw about 100 times
    fill = width * done // max(total, 1)
    print(f"\r  {label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}", end="", file=sys.stderr, flush=True)
    if done == total:
        print(file=sys.stderr)


def _ints(s):
    return tuple(int(x) for x in s.split(","))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mtpstate", description="batched request state for LLM serving engines")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("sim", help="simulate a scheduler and record a trace")
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True, help="trace file to write")
    s.add_argument("--num-spec", type=int, default=2, help="MTP draft tokens per decode step")
    s.add_argument("--accept", type=float, default=0.7, help="per-draft acceptance probability")
    s.add_argument("--max-num-reqs", type=int, default=64)
    s.add_argument("--max-model-len", type=int, default=4096)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192)
    s.add_argument("--block-sizes", type=_ints, default=(16,), help="comma-separated, one per KV-cache group")
    s.add_argument("--arrivals", type=float, default=2.0, help="mean new requests per step")
    s.add_argument("--prompt-len", type=_ints, default=(16, 512), help="low,high")
    s.add_argument("--output-len", type=_ints, default=(8, 256), help="low,high")
    s.add_argument("--preempt", type=float, default=0.05)
    s.add_argument("--abort", type=float, default=0.02)
    s.add_argument("--abort-waiting", type=float, default=0.02)
    s.add_argument("--prefix-hit", type=float, default=0.1)
    s.add_argument("--remote-kv", type=float, default=0.05)
    s.add_argument("--resume-mode", choices=["new", "cached"], default="new")

    r = sub.add_parser("replay", help="replay a trace; time per step and drift from the scheduler")
    r.add_argument("file")
    r.add_argument("--impl", choices=["vectorized", "loop", "legacy", "all"], default="all")
    r.add_argument("--json", metavar="OUT", help="write the results as JSON")
    r.add_argument("--plot", metavar="FILE.png", help="plot drift per step (needs matplotlib)")

    b = sub.add_parser("bench", help="RequestTable / RequestIndex against the loop / dict, in one run")
    b.add_argument("--quick", action="store_true", help="fewer sizes and repeats (well under a minute)")
    b.add_argument("--sizes", type=_ints, help="comma-separated N values")
    b.add_argument("--only", choices=["table", "vllm", "index"], help="run one part")
    b.add_argument("--json", metavar="FILE", help="write results as JSON")
    b.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib)")
    args = p.parse_args(argv)

    if args.cmd == "sim":
        from mtpstate.sim import SimConfig
        from mtpstate.trace import record

        cfg = SimConfig(
            max_num_reqs=args.max_num_reqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_sizes=args.block_sizes,
            arrivals_per_step=args.arrivals,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            num_spec=args.num_spec,
            accept=args.accept,
            preempt_prob=args.preempt,
            abort_prob=args.abort,
            abort_waiting_prob=args.abort_waiting,
            prefix_hit_prob=args.prefix_hit,
            remote_kv_prob=args.remote_kv,
            resume_mode=args.resume_mode,
            seed=args.seed,
        )
        tr = record(cfg, args.steps, args.out, progress=lambda i, n: _bar("sim", i, n))
        n_req = len({x for so in tr.steps for x in so.num_scheduled_tokens})
        print(f"wrote {args.out}: {len(tr)} steps, {n_req} requests")
    elif args.cmd == "replay":
        from mtpstate.replay import IMPLS, plot_drift, replay
        from mtpstate.trace import load

        tr = load(args.file)
        impls = IMPLS if args.impl == "all" else (args.impl,)
        res = replay(tr, impls, progress=lambda impl, i, n: _bar(f"{impl:<10}", i, n))
        print(f"{'impl':<12}{'us/step (mean)':>16}{'median':>10}{'max drift':>11}")
        for impl, x in res["impls"].items():
            print(f"{impl:<12}{x['us_per_step']:>16.1f}{x['median_us_per_step']:>10.1f}{x['max_drift']:>11}")
        if res["agree"] is not None:
            print("loop and vectorized agree on every step" if res["agree"] else "loop and vectorized DISAGREE")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f)
        if args.plot:
            plot_drift(res, args.plot, title=f"drift from the scheduler: {args.file}")
    elif args.cmd == "bench":
        from mtpstate.bench import run

        what = (args.only,) if args.only else ("table", "vllm", "index")
        run(quick=args.quick, sizes=args.sizes, json_path=args.json, plot_path=args.plot, what=what)
    return 0


if __name__ == "__main__":
    sys.exit(main())
