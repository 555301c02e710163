"""``mtpstate bench``: RequestTable and RequestIndex against the per-request
loop and the dict, on identical steps in one run.

Method: kernels are compiled/loaded before timing (``warmup``, reported
separately); each timed step is unpickled right before it is applied
(untimed), as a worker receives it, so its objects are fresh and warm in
cache; the table is rebuilt between repeats (untimed); medians and the
10th/90th percentiles of per-step times are reported.
"""

from __future__ import annotations

import json
import os
import pickle
import platform
import statistics
import time

import numpy as np

SIZES = [1, 16, 64, 256, 1024, 4096, 16384]
QUICK_SIZES = [1, 256, 4096]


def machine_info() -> dict:
    import numba

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def _pct(ts, q):
    return float(np.percentile(ts, q)) * 1e6


def _time_tables(impls, n, setup, blobs, ids, repeats):
    """Per-step times of each implementation on identical steps. Repeats and
    steps are interleaved across implementations, so that machine noise hits
    them alike. Each table is built once (hundreds of MB at large N, all
    pre-faulted); before every repeat it is emptied and the setup steps are
    applied again (untimed), which gives every repeat the same state."""
    from mtpstate.sim import SchedulerOutput
    from mtpstate.workloads import BLOCK_SIZE, MAX_MODEL_LEN

    tables = {
        name: cls(max_num_reqs=n, max_model_len=MAX_MODEL_LEN, block_sizes=[BLOCK_SIZE]) for name, cls in impls.items()
    }
    times = {name: [] for name in impls}
    live: set = set()
    for _ in range(repeats):
        for t in tables.values():
            t.apply(SchedulerOutput(finished_req_ids=set(live)))
            for so in setup:
                t.apply(so)
        for b in blobs:
            for name, t in tables.items():
                so = pickle.loads(b)  # fresh objects, as a worker receives them (untimed)
                if ids is not None:  # in-process engine: the same id objects every step
                    so.scheduled_cached_reqs.req_ids = ids
                t0 = time.perf_counter()
                t.apply(so)
                times[name].append(time.perf_counter() - t0)
                live |= set(so.num_scheduled_tokens) | {r.req_id for r in so.scheduled_new_reqs}
        for so in setup:
            live |= {r.req_id for r in so.scheduled_new_reqs}
    del tables
    return times


def mirror_device() -> str | None:
    """ "cuda" when a GPU is there, "cpu" with a CPU-only torch, None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return "cuda" if torch.cuda.is_available() else "cpu"


WORKLOADS = ("steady-decode", "steady-decode-fresh-ids", "mixed")


def _rows(workload, n, times, base, device):
    """Result rows of one paired pass; speedups against ``base``."""
    out = []
    base_med = statistics.median(times[base]) * 1e6
    for impl, ts in times.items():
        med = statistics.median(ts) * 1e6
        ratios = np.array(times[base]) / np.array(ts)
        out.append(
            {
                "workload": workload,
                "n": n,
                "impl": impl,
                "baseline": base,
                "device": device if "mirror" in impl else None,
                "median_us": med,
                "p10_us": _pct(ts, 10),
                "p90_us": _pct(ts, 90),
                "ns_per_request": med * 1e3 / max(n, 1),
                "speedup": base_med / med,
                "paired_speedup_median": float(np.median(ratios)),
                "paired_speedup_p10": float(np.percentile(ratios, 10)),
                "paired_speedup_p90": float(np.percentile(ratios, 90)),
                "samples": len(ts),
            }
        )
    return out


def bench_table(sizes, quick, progress, mirror=True):
    """Two paired passes per workload and N: loop vs vectorized (host only);
    then, with torch, vectorized vs mirror vs loop-mirror, which gives the
    mirror's overhead over host-only apply and its speedup over the loop
    engine's staging."""
    from functools import partial

    from mtpstate import RequestTable
    from mtpstate.reference import LoopMirroredRequestTable, LoopRequestTable
    from mtpstate.workloads import mixed, steady_decode

    device = mirror_device() if mirror else None
    results = []
    for workload in WORKLOADS:
        for n in sizes:
            progress(f"{workload} N={n}")
            if workload == "mixed":
                setup, timed = mixed(n, steps=4 if quick else 8)
                ids = None
            else:
                setup, timed = steady_decode(n, steps=4 if quick else 16)
                ids = None if workload.endswith("fresh-ids") else timed[0].scheduled_cached_reqs.req_ids
            blobs = [pickle.dumps(so) for so in timed]
            repeats = max(2 if quick else 4, (300 if quick else 3000) // max(n, 1))
            if workload == "mixed":
                repeats = 1 if quick else 3
            host = {"loop": LoopRequestTable, "vectorized": RequestTable}
            results += _rows(workload, n, _time_tables(host, n, setup, blobs, ids, repeats), "loop", None)
            if device is not None:
                impls = {
                    "vectorized": RequestTable,
                    "mirror": partial(RequestTable, device=device),
                    "loop-mirror": partial(LoopMirroredRequestTable, device=device),
                }
                times = _time_tables(impls, n, setup, blobs, ids, repeats)
                rows = _rows(workload, n, {k: times[k] for k in ("loop-mirror", "mirror")}, "loop-mirror", device)
                overhead = np.array(times["mirror"]) / np.array(times["vectorized"])
                rows[1]["overhead_vs_host_median"] = float(np.median(overhead))
                rows[1]["overhead_vs_host_p10"] = float(np.percentile(overhead, 10))
                rows[1]["overhead_vs_host_p90"] = float(np.percentile(overhead, 90))
                results += rows
    return results


VLLM_WORKLOADS = ("vllm-busy", "vllm-steady-same-ids", "vllm-steady-fresh-ids")


def _mtpstate_idx_mapping(table, so):
    """apply, then MRV2's batch -> row mapping (requests sorted by scheduled
    tokens, stable: decode first) as one gather from the step's rows."""
    res = table.apply(so)
    nst = so.num_scheduled_tokens
    counts = np.fromiter(nst.values(), np.int32, len(nst))
    return res.rows[np.argsort(counts, kind="stable")]


def bench_vllm(sizes, quick, progress):
    """vLLM 0.34-shaped steps (TokenBuffer token ids, no resumed_req_ids,
    fresh lists): RequestTable vs the MRV2-style loop, each timed from the
    scheduler output to the batch -> row mapping ``idx_mapping``. Paired
    and interleaved per step; the two mappings are checked equal (untimed)."""
    from mtpstate import RequestTable
    from mtpstate.reference import VllmLoopRequestTable
    from mtpstate.workloads import BLOCK_SIZE, MAX_MODEL_LEN, vllm_busy, vllm_steady_decode

    results = []
    for workload in VLLM_WORKLOADS:
        for n in sizes:
            progress(f"{workload} N={n}")
            steps = 6 if quick else 16
            fresh = workload.endswith("fresh-ids")
            if workload == "vllm-busy":
                warm, timed = vllm_busy(n, steps=steps)
            else:
                warm, timed = vllm_steady_decode(n, steps=steps, fresh_ids=fresh)
            blobs = [pickle.dumps(so) for so in timed] if fresh else None
            repeats = max(2 if quick else 3, (200 if quick else 2000) // max(n, 1))
            times = {"mrv2-loop": [], "vectorized": []}
            pypath = 0
            for _ in range(repeats):
                a = RequestTable(max_num_reqs=n, max_model_len=MAX_MODEL_LEN, block_sizes=[BLOCK_SIZE])
                b = VllmLoopRequestTable(max_num_reqs=n, max_model_len=MAX_MODEL_LEN, block_sizes=[BLOCK_SIZE])
                for so in warm:
                    a.apply(so)
                    b.apply(so)
                for k, so in enumerate(timed):
                    s1 = pickle.loads(blobs[k]) if fresh else so
                    s2 = pickle.loads(blobs[k]) if fresh else so
                    t0 = time.perf_counter()
                    m1 = _mtpstate_idx_mapping(a, s1)
                    t1 = time.perf_counter()
                    m2 = b.apply(s2)
                    t2 = time.perf_counter()
                    times["vectorized"].append(t1 - t0)
                    times["mrv2-loop"].append(t2 - t1)
                    if len(m1) != len(m2) or any(a.index.req_id(int(x)) != b_id for x, b_id in zip(m1, _ids_of(b, m2))):
                        raise AssertionError(f"{workload} N={n}: batch -> row mappings disagree")
                pypath += a.python_path_steps
            rows = _rows(workload, n, times, "mrv2-loop", None)
            for r in rows:
                r["python_path_steps"] = pypath if r["impl"] == "vectorized" else None
            results += rows
    return results


def _ids_of(loop, rows):
    inv = {row: r for r, row in loop.req_id_to_index.items()}
    return [inv[int(x)] for x in rows]


def bench_index(sizes, quick, progress):
    from mtpstate import RequestIndex

    results = []
    for n in sizes:
        progress(f"index-lookup N={n}")
        ids = [f"cmpl-{i:032x}-0" for i in range(n)]
        ix = RequestIndex(n)
        ix.insert(ids)
        d = {k: i for i, k in enumerate(ids)}
        blob = pickle.dumps(ids)
        repeats = max(15, (2000 if quick else 20000) // n)
        a, b = [], []
        for _ in range(repeats):
            l1, l2 = pickle.loads(blob), pickle.loads(blob)
            t0 = time.perf_counter()
            np.fromiter(map(d.__getitem__, l1), np.int64, n)
            t1 = time.perf_counter()
            ix.lookup(l2)
            t2 = time.perf_counter()
            a.append(t1 - t0)
            b.append(t2 - t1)
        results += _rows("index-lookup-fresh-ids", n, {"dict": a, "index": b}, "dict", None)
    return results


def fit_costs(results) -> list[dict]:
    """Fixed cost per step (the median at N = 1) and per-request slope (a
    least-squares line through the medians at N >= 64)."""
    fits = []
    keys = sorted({(r["workload"], r["impl"]) for r in results})
    for wl, impl in keys:
        rs = [r for r in results if r["workload"] == wl and r["impl"] == impl]
        one = [r["median_us"] for r in rs if r["n"] == 1]
        big = [(r["n"], r["median_us"]) for r in rs if r["n"] >= 64]
        if not one or len(big) < 2:
            continue
        n, t = np.array(big, dtype=float).T
        slope, _ = np.polyfit(n, t, 1)
        fits.append({"workload": wl, "impl": impl, "fixed_us": one[0], "slope_ns": slope * 1e3})
    return fits


def format_table(machine, results, warmup_s) -> str:
    lines = [
        "mtpstate bench: " + ", ".join(f"{k}={v}" for k, v in machine.items()),
        f"kernel compile/cache-load (warmup, excluded from timings): {warmup_s * 1e3:.1f} ms",
        "",
        f"{'workload':<26}{'N':>7}  {'impl':<12}{'median us':>11}{'p10':>10}{'p90':>10}{'ns/req':>9}"
        f"{'speedup':>9}  {'(vs)':<12}{'paired p10-p90':>15}",
    ]
    for r in results:
        extra = ""
        if "overhead_vs_host_median" in r:
            extra = f"  mirror/host-only {r['overhead_vs_host_median']:.2f}x"
        if r.get("python_path_steps") is not None:
            extra = f"  python-path steps {r['python_path_steps']}"
        base = r.get("baseline", "")
        lines.append(
            f"{r['workload']:<26}{r['n']:>7}  {r['impl']:<12}{r['median_us']:>11.2f}{r['p10_us']:>10.2f}"
            f"{r['p90_us']:>10.2f}{r['ns_per_request']:>9.1f}{r['speedup']:>8.1f}x  {base:<12}"
            f"{r.get('paired_speedup_p10', 0):>7.1f}-{r.get('paired_speedup_p90', 0):<6.1f}{extra}"
        )
    return "\n".join(lines)


def run(quick=False, sizes=None, json_path=None, plot_path=None, what=("table", "vllm", "index"), out=print):
    import sys

    from mtpstate import warmup

    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    warmup_s = warmup()

    total = (
        (len(WORKLOADS) * len(sizes) if "table" in what else 0)
        + (len(VLLM_WORKLOADS) * len(sizes) if "vllm" in what else 0)
        + (len(sizes) if "index" in what else 0)
    )
    done = [0]

    def progress(msg):
        done[0] += 1
        width = 30
        fill = width * (done[0] - 1) // max(total, 1)
        bar = "#" * fill + "." * (width - fill)
        print(f"\r  [{bar}] {done[0]}/{total} {msg:<34}", end="", file=sys.stderr, flush=True)

    results = []
    if "table" in what:
        results += bench_table(sizes, quick, progress)
    if "vllm" in what:
        results += bench_vllm(sizes, quick, progress)
    if "index" in what:
        results += bench_index([n for n in sizes], quick, progress)
    print("\r" + " " * 80 + "\r", end="", file=sys.stderr)
    machine = machine_info()
    fits = fit_costs(results)
    out(format_table(machine, results, warmup_s))
    if fits:
        out("\nper-step fixed cost (median at N = 1) and per-request slope (least squares, N >= 64):")
        for f in fits:
            fixed, slope = f["fixed_us"], f["slope_ns"]
            out(f"  {f['workload']:<26}{f['impl']:<12} fixed {fixed:7.2f} us   slope {slope:7.1f} ns/req")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": machine, "warmup_s": warmup_s, "results": results, "fits": fits}, f, indent=1)
    if plot_path:
        plot(results, plot_path)
    return results


def plot(results, path):
    """Speedup over the baseline vs N (log x) and time per step vs N
    (log-log): one color per workload, one line style per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in results})
    colors = dict(zip(workloads, plt.get_cmap("tab10").colors))
    styles = {
        "vectorized": "-",
        "mirror": "--",
        "index": "-",
        "loop": ":",
        "loop-mirror": "-.",
        "dict": ":",
        "mrv2-loop": ":",
    }
    markers = {
        "vectorized": "o",
        "mirror": "s",
        "index": "^",
        "loop": "x",
        "loop-mirror": "+",
        "dict": "x",
        "mrv2-loop": "x",
    }
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for wl in workloads:
        for impl in styles:
            rs = sorted((r for r in results if r["workload"] == wl and r["impl"] == impl), key=lambda r: r["n"])
            if not rs:
                continue
            ns = [r["n"] for r in rs]
            kw = dict(color=colors[wl], ls=styles[impl], marker=markers[impl], ms=4)
            if impl not in ("loop", "dict", "loop-mirror", "mrv2-loop"):
                ax1.plot(ns, [r["speedup"] for r in rs], label=f"{wl}: {impl} vs {rs[0]['baseline']}", **kw)
            ax2.plot(ns, [r["median_us"] for r in rs], label=f"{wl}: {impl}", **kw)
    ax1.set_xscale("log")
    ax1.axhline(1, color="grey", lw=0.8)
    ax1.axhline(20, color="grey", lw=0.8, ls=":")
    ax1.set_xlabel("N running requests")
    ax1.set_ylabel("speedup (median time ratio, x)")
    ax1.set_title("speedup over the per-request loop (or dict)")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("N running requests")
    ax2.set_ylabel("median us per step")
    ax2.set_title("time per step")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5, ncol=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
