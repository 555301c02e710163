"""Markdown tables from a ``mtpstate bench --json`` file (for docs/benchmarks.md).

Usage: python benchmarks/report.py docs/bench-cpu.json
"""

import json
import sys


def main(path):
    d = json.load(open(path))
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
