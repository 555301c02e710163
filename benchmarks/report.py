"""Markdown tables from the committed benchmark results.

Usage:
  python benchmarks/report.py docs/bench-cpu.json      # mtpstate bench --json (docs/benchmarks.md)
  python benchmarks/report.py docs/bench-vllm-runner.json   # make bench-vllm, the runner (docs/vllm.md)
"""

import json
import sys

RUNNER_ORDER = ("steady", "busy")


def _n(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


def _opt(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def runner_table(results: list[dict]) -> str:
    """The runner's host step, vLLM's methods (off) vs mtpstate through the
    plugin (on), one row per workload, from ``harness.py --bench --runner``."""
    head = (
        "| workload | max running | off (vLLM), us | on (mtpstate), us | speedup (paired median, p10-p90) "
        "| off: update / gather / prepare, us | on: update / gather / prepare, us "
        "| torch ops off | torch ops on | launches off | launches on |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [head]
    key = lambda r: (RUNNER_ORDER.index(r["workload"].split("-")[0]), _n(r["workload"]))  # noqa: E731
    for r in sorted(results, key=key):
        ph, ops = r["phases_us"], r["torch_ops"]
        cells = [r["workload"], str(r["max_running"]), f"{r['vllm_median_us']:.0f}", f"{r['mtpstate_median_us']:.0f}"]
        cells.append(
            f"**{r['speedup']:.2f}x** ({r['paired_median']:.2f}x, {r['paired_p10']:.2f}-{r['paired_p90']:.2f})"
        )
        for side in ("vllm", "mtpstate"):
            cells.append(" / ".join(f"{ph[side][k]:.0f}" for k in ("update", "gather", "prepare")))
        for side in ("vllm", "mtpstate"):
            o = ops[side]
            cells.append(f"{_opt(o['without_new'])} / {_opt(o['with_new'])} (max {o['max']})")
        for side in ("vllm", "mtpstate"):
            n = ops[side]["no_op_launches"]
            cells.append(f"{_opt(n['without_new'])} / {_opt(n['with_new'])}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(path):
    d = json.load(open(path))
    if isinstance(d, list) and d and "vllm_median_us" in d[0]:
        print(runner_table(d))
        return
    res = d["results"]
    m = d["machine"]
    print(
        f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, numpy {m['numpy']}, numba {m['numba']}, "
        f"torch {m['torch']}. Kernel compile/cache-load before timing: {d['warmup_s'] * 1e3:.0f} ms.\n"
    )
    for wl in ("steady-decode", "steady-decode-fresh-ids", "mixed"):
        print(
            f"**{wl}** (median us per step; speedup = median ratio; paired = median and p10-p90 of per-step ratios)\n"
        )
        print(
            "| N | loop | vectorized | speedup | paired | mirror | mirror / host-only | loop-mirror | mirror speedup |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n in sorted({r["n"] for r in res if r["workload"] == wl}):
            g = {r["impl"]: r for r in res if r["workload"] == wl and r["n"] == n}
            v, lp = g["vectorized"], g["loop"]
            row = [
                f"{n}",
                f"{lp['median_us']:.1f}",
                f"{v['median_us']:.1f}",
                f"**{v['speedup']:.1f}x**",
                f"{v['paired_speedup_median']:.1f}x ({v['paired_speedup_p10']:.1f}-{v['paired_speedup_p90']:.1f})",
            ]
            if "mirror" in g:
                mi, lm = g["mirror"], g["loop-mirror"]
                row += [
                    f"{mi['median_us']:.1f}",
                    f"{mi['overhead_vs_host_median']:.2f}x",
                    f"{lm['median_us']:.1f}",
                    f"{mi['speedup']:.1f}x",
                ]
            else:
                row += ["-"] * 4
            print("| " + " | ".join(row) + " |")
        print()
    print("**index lookup, freshly unpickled ids** (median us per batch)\n")
    print("| N | dict + fromiter | RequestIndex.lookup | speedup | paired |")
    print("|---:|---:|---:|---:|---:|")
    for n in sorted({r["n"] for r in res if r["workload"].startswith("index")}):
        g = {r["impl"]: r for r in res if r["workload"].startswith("index") and r["n"] == n}
        x = g["index"]
        print(
            f"| {n} | {g['dict']['median_us']:.2f} | {x['median_us']:.2f} | **{x['speedup']:.2f}x** | "
            f"{x['paired_speedup_median']:.2f}x ({x['paired_speedup_p10']:.2f}-{x['paired_speedup_p90']:.2f}) |"
        )
    print("\n**fixed cost per step and per-request slope**\n")
    print("| workload | impl | fixed (N = 1), us | slope (N >= 64), ns/request |")
    print("|---|---|---:|---:|")
    for f in d["fits"]:
        print(f"| {f['workload']} | {f['impl']} | {f['fixed_us']:.2f} | {f['slope_ns']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1])
