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

SIZES = [1, 256, 1024, 4096]  # the default run: the sizes that tell the story, ~2 min on 2 cores
FULL_SIZES = [1, 16, 64, 256, 1024, 4096, 16384]  # --full
QUICK_SIZES = [1, 256, 4096]


def version_string() -> str:
    """mtpstate's version, plus the git commit when running from a checkout
    ("0.1.0 (git daef054)", "+dirty" when it has local changes)."""
    import subprocess

    from mtpstate import __version__

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(root, ".git")):
        return __version__
    try:
        git = ["git", "-C", root]
        commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(git + ["status", "--porcelain", "-uno"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return __version__
    if commit.returncode != 0:
        return __version__
    return f"{__version__} (git {commit.stdout.strip()}{'+dirty' if dirty.stdout.strip() else ''})"


def machine_info() -> dict:
    """The run's metadata: date, mtpstate version and commit, interpreter and
    library versions, CPU, and where the device mirror's tensors live."""
    import datetime

    import numba

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "mtpstate": version_string(),
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
    dev = mirror_device()
    names = {None: "none (torch not installed)", "cpu": "cpu (no GPU: mirror timings are host copies)"}
    info["mirror_device"] = names.get(dev, dev)
    if dev == "cuda":
        import torch

        info["mirror_device"] = f"cuda ({torch.cuda.get_device_name()})"
    return info


def caption(machine: dict) -> str:
    """Two lines naming the run: for the console header and the plot."""
    m = machine
    return (
        f"{m['date']}, mtpstate {m['mtpstate']}; mirror target: {m['mirror_device']}\n"
        f"{m['cpu']}, {m['cores']} cores; Python {m['python']}, numpy {m['numpy']}, numba {m['numba']}, "
        f"torch {m['torch']}"
    )


class Progress:
    """Progress of a bench run on stderr: on a terminal, a bar within the
    current cell (workload x N) with its ETA; elsewhere one line per finished
    cell (no ``\r`` frames in pipes and CI logs)."""

    def __init__(self, total_cells: int, stream=None):
        import sys

        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.total, self.cells = total_cells, 0
        self.t_run = time.perf_counter()
        self.label, self.units, self.done, self.t_cell = "", 1, 0, 0.0
        self._last = 0.0

    def cell(self, label: str, units: int) -> None:
        self._finish_cell()
        self.cells += 1
        self.label, self.units, self.done, self.t_cell = label, max(units, 1), 0, time.perf_counter()
        self._draw()

    def tick(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self._last >= 0.2:  # a terminal redraw costs ~10 us: not every tick
            self._last = now
            self._draw()

    def _draw(self) -> None:
        if not self.tty:
            return
        el = time.perf_counter() - self.t_cell
        eta = f"ETA {el / self.done * (self.units - self.done):4.0f} s" if self.done else "ETA    ? s"
        fill = 20 * self.done // self.units
        print(
            f"\r  [{self.cells}/{self.total}] {self.label:<30} [{'#' * fill}{'.' * (20 - fill)}] {eta}",
            end="",
            file=self.stream,
            flush=True,
        )

    def _finish_cell(self) -> None:
        if self.cells and not self.tty:
            el = time.perf_counter() - self.t_cell
            print(f"  [{self.cells}/{self.total}] {self.label}: {el:.1f} s", file=self.stream, flush=True)

    def close(self) -> None:
        self._finish_cell()
        if self.tty:
            print("\r" + " " * 90 + "\r", end="", file=self.stream, flush=True)
        self.cells = 0


def _pct(ts, q):
    return float(np.percentile(ts, q)) * 1e6


def _time_tables(impls, n, setup, blobs, ids, repeats, tick=lambda: None):
    """Per-step times of each implementation on identical steps. Repeats and
    steps are interleaved across implementations, so that machine noise hits
    them alike. Each table is built once (hundreds of MB at large N, all
    pre-faulted); before every repeat it is emptied and the setup steps are
    applied again (untimed), which gives every repeat the same state."""
    from mtpstate.tools.sim import SchedulerOutput
    from mtpstate.tools.workloads import BLOCK_SIZE, MAX_MODEL_LEN

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
        tick()
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
    from mtpstate.tools.reference import LoopMirroredRequestTable, LoopRequestTable
    from mtpstate.tools.workloads import mixed, steady_decode

    device = mirror_device() if mirror else None
    results = []
    for workload in WORKLOADS:
        for n in sizes:
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
            progress.cell(f"{workload} N={n}", repeats * (2 if device is not None else 1))
            host = {"loop": LoopRequestTable, "vectorized": RequestTable}
            times = _time_tables(host, n, setup, blobs, ids, repeats, progress.tick)
            results += _rows(workload, n, times, "loop", None)
            if device is not None:
                impls = {
                    "vectorized": RequestTable,
                    "mirror": partial(RequestTable, device=device),
                    "loop-mirror": partial(LoopMirroredRequestTable, device=device),
                }
                times = _time_tables(impls, n, setup, blobs, ids, repeats, progress.tick)
                rows = _rows(workload, n, {k: times[k] for k in ("loop-mirror", "mirror")}, "loop-mirror", device)
                overhead = np.array(times["mirror"]) / np.array(times["vectorized"])
                rows[1]["overhead_vs_host_median"] = float(np.median(overhead))
                rows[1]["overhead_vs_host_p10"] = float(np.percentile(overhead, 10))
                rows[1]["overhead_vs_host_p90"] = float(np.percentile(overhead, 90))
                results += rows
    return results


VLLM_WORKLOADS = ("vllm-busy", "vllm-steady-same-ids", "vllm-steady-fresh-ids")


def bench_vllm(sizes, quick, progress):
    """vLLM 0.34-shaped steps (TokenBuffer token ids, no resumed_req_ids,
    fresh lists, MTP k=3): the whole per-step bookkeeping, RequestTable's
    ``apply(so).batch`` against the MRV2-style loop (finish/add/update, then
    ``gather_batch_req_state``: its sort, fromiters and gathers). Paired and
    interleaved per step; the two batches are checked equal (untimed)."""
    from mtpstate import RequestTable
    from mtpstate.tools.reference import VllmLoopRequestTable
    from mtpstate.tools.workloads import BLOCK_SIZE, MAX_MODEL_LEN, vllm_busy, vllm_steady_decode

    results = []
    for workload in VLLM_WORKLOADS:
        for n in sizes:
            steps = 6 if quick else 16
            fresh = workload.endswith("fresh-ids")
            if workload == "vllm-busy":
                warm, timed = vllm_busy(n, steps=steps)
            else:
                warm, timed = vllm_steady_decode(n, steps=steps, fresh_ids=fresh)
            blobs = [pickle.dumps(so) for so in timed] if fresh else None
            repeats = max(2 if quick else 3, (200 if quick else 2000) // max(n, 1))
            progress.cell(f"{workload} N={n}", repeats)
            times = {"mrv2-loop": [], "vectorized": []}
            pypath = 0
            for _ in range(repeats):
                kw = dict(max_num_reqs=n, max_model_len=MAX_MODEL_LEN, block_sizes=[BLOCK_SIZE], decode_query_len=4)
                a = RequestTable(**kw)
                b = VllmLoopRequestTable(**kw)
                for so in warm:
                    a.apply(so)
                    b.apply(so)
                for k, so in enumerate(timed):
                    s1 = pickle.loads(blobs[k]) if fresh else so
                    s2 = pickle.loads(blobs[k]) if fresh else so
                    t0 = time.perf_counter()
                    got = a.apply(s1).batch
                    t1 = time.perf_counter()
                    want = b.apply(s2)
                    t2 = time.perf_counter()
                    times["vectorized"].append(t1 - t0)
                    times["mrv2-loop"].append(t2 - t1)
                    m1, m2 = got.idx_mapping_np, want["idx_mapping_np"]
                    if got.req_ids != want["req_ids"] or [a.index.req_id(int(x)) for x in m1] != _ids_of(b, m2):
                        raise AssertionError(f"{workload} N={n}: the batches disagree")
                pypath += a.python_path_steps
                progress.tick()
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
        ids = [f"cmpl-{i:032x}-0" for i in range(n)]
        ix = RequestIndex(n)
        ix.insert(ids)
        d = {k: i for i, k in enumerate(ids)}
        blob = pickle.dumps(ids)
        repeats = max(15, (2000 if quick else 20000) // n)
        progress.cell(f"index-lookup N={n}", repeats)
        a, b = [], []
        for _ in range(repeats):
            progress.tick()
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


# what each workload's table compares: (implementation, its baseline, label)
COMPARISONS = {
    "table": (("vectorized", "loop"), ("mirror", "loop-mirror")),
    "vllm": (("vectorized", "mrv2-loop"),),
    "index": (("index", "dict"),),
}
# speed targets drawn on the plot: workload -> (ratio, label)
TARGETS = {
    "steady-decode": (20.0, "target 20x (N >= 1024)"),
    "steady-decode-fresh-ids": (20.0, "target 20x (N >= 1024)"),
    "vllm-busy": (10.0, "target 10x (N >= 1024)"),
    "vllm-steady-same-ids": (30.0, "target 30x (N >= 1024)"),
    "vllm-steady-fresh-ids": (25.0, "target 25x (N >= 1024)"),
}


def _part(workload: str) -> str:
    return "vllm" if workload.startswith("vllm") else "index" if workload.startswith("index") else "table"


def _workloads(results) -> list[str]:
    seen: dict = {}
    for r in results:
        seen.setdefault(r["workload"], None)
    return list(seen)


def format_report(machine, results, warmup_s, fits=()) -> str:
    """The console report: a header naming the run, then one table per
    workload with the speedups first (no rows for the baselines)."""
    how = "compiled" if machine.get("kernels_compiled") else "loaded from cache"
    lines = [
        *(f"mtpstate bench: {line}" for line in caption(machine).split("\n")),
        f"kernels {how} in {warmup_s:.1f} s before timing (excluded). speedup = ratio of median step times;",
        "paired = median (p10-p90) of per-step ratios (same steps, interleaved). Times: median us per step.",
    ]
    w = 48  # width of one comparison's columns
    for wl in _workloads(results):
        rs = [r for r in results if r["workload"] == wl]
        by = {(r["n"], r["impl"]): r for r in rs}
        ns = sorted({r["n"] for r in rs})
        pairs = [(i, b) for i, b in COMPARISONS[_part(wl)] if any((n, i) in by for n in ns)]
        pypath = any(r.get("python_path_steps") is not None for r in rs)
        head, cols = f"{'':>6}", f"{'N':>6}"
        for impl, base in pairs:
            tag = f" (mirror target: {machine['mirror_device'].split(' ')[0]})" if impl == "mirror" else ""
            head += f" | {(impl + ' vs ' + base + tag)[:w]:<{w}}"
            cols += f" | {'speedup':>7} {'paired':>16} {base:>11} {impl:>11}"
        if "mirror" in dict(pairs):
            head += " |"
            cols += " | mirror/host"
        if pypath:
            head += " |"
            cols += " | python-path steps"
        lines += ["", f"{wl}", head, cols]
        for n in ns:
            row = f"{n:>6}"
            for impl, base in pairs:
                r = by.get((n, impl))
                if r is None:
                    row += f" | {'-':>7} {'-':>16} {'-':>11} {'-':>11}"
                    continue
                p = f"{r['paired_speedup_median']:.1f}x ({r['paired_speedup_p10']:.1f}-{r['paired_speedup_p90']:.1f})"
                row += f" | {r['speedup']:>6.1f}x {p:>16} {by[(n, base)]['median_us']:>11.2f} {r['median_us']:>11.2f}"
            if "mirror" in dict(pairs):
                m = by.get((n, "mirror"), {})
                row += f" | {m['overhead_vs_host_median']:>10.2f}x" if "overhead_vs_host_median" in m else " |"
            if pypath:
                row += f" | {by[(n, pairs[0][0])].get('python_path_steps')!s:>17}"
            lines.append(row)
    if fits:
        lines += ["", "fixed cost per step (median at N = 1) and per-request slope (least squares, N >= 64):"]
        for f in fits:
            fixed, slope = f["fixed_us"], f["slope_ns"]
            lines.append(f"  {f['workload']:<26}{f['impl']:<12} fixed {fixed:7.2f} us   slope {slope:7.1f} ns/req")
    return "\n".join(lines)


def run(
    quick=False,
    sizes=None,
    full=False,
    json_path=None,
    plot_path=None,
    what=("table", "vllm", "index"),
    out=print,
    wrote=None,
    progress_stream=None,
    vllm_src=None,
):
    """Run the benchmark parts in ``what`` (``"device"``: the device mirror,
    :mod:`mtpstate.tools.bench_device`, with ``vllm_src`` for vLLM's own
    staged writes); print the report, write the JSON and plot if asked
    (``wrote(path)`` is called for each file written)."""
    from mtpstate import warmup
    from mtpstate._kernels.jit import COMPILE_NOTICE
    from mtpstate.tools.bench_device import (
        DEVICE_SIZES,
        DEVICE_WORKLOADS,
        bench_device,
        bench_serving,
        format_device_report,
        format_serving_report,
    )

    sizes_given = sizes
    sizes = sorted(set(sizes or (QUICK_SIZES if quick else FULL_SIZES if full else SIZES)))
    compiled_before = COMPILE_NOTICE.total_s
    warmup_s = warmup()
    machine = machine_info()
    machine["kernels_compiled"] = COMPILE_NOTICE.total_s > compiled_before

    dev_sizes = sorted(set(sizes_given or (QUICK_SIZES if quick else DEVICE_SIZES)))
    total = (
        (len(DEVICE_WORKLOADS) * len(dev_sizes) + 1 if "device" in what else 0)
        + (len(WORKLOADS) * len(sizes) if "table" in what else 0)
        + (len(VLLM_WORKLOADS) * len(sizes) if "vllm" in what else 0)
        + (len(sizes) if "index" in what else 0)
    )
    progress = Progress(total, progress_stream)
    results = []
    device = None
    try:
        if "device" in what:
            dev_results, facts = bench_device(dev_sizes, quick, progress, vllm_src=vllm_src)
            device = {"facts": facts, "results": dev_results, "serving": bench_serving(quick, progress)}
        if "table" in what:
            results += bench_table(sizes, quick, progress)
        if "vllm" in what:
            results += bench_vllm(sizes, quick, progress)
        if "index" in what:
            results += bench_index(sizes, quick, progress)
    finally:
        progress.close()
    fits = fit_costs(results)
    report = format_report(machine, results, warmup_s, fits)
    if device is not None:
        dev_report = format_device_report(device["results"], device["facts"]) + format_serving_report(device["serving"])
        report = "\n".join([report, *dev_report])
    out(report)
    if json_path:
        doc = {"machine": machine, "warmup_s": warmup_s, "results": results, "fits": fits}
        if device is not None:
            doc["device"] = device
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
        if wrote:
            wrote(json_path)
    if plot_path:
        plot(results, plot_path, machine)
        if wrote:
            wrote(plot_path)
    return results


def plot(results, path, machine=None):
    """One panel per workload: the speedup of each implementation over its
    baseline vs N (log x), the break-even and the workload's target labelled;
    the run's metadata as the caption."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = _workloads(results)
    cols = min(3, len(wls))
    rows = math.ceil(len(wls) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows + 0.6), squeeze=False)
    for ax, wl in zip(axes.flat, wls):
        rs = [r for r in results if r["workload"] == wl]
        for k, (impl, base) in enumerate(COMPARISONS[_part(wl)]):
            pts = sorted((r["n"], r["speedup"]) for r in rs if r["impl"] == impl)
            if not pts:
                continue
            label = f"{impl} vs {base}"
            style = dict(marker="o", lw=1.8)
            if impl == "mirror":
                dev = (machine or {}).get("mirror_device", "?").split(" ")[0]
                label = f"mirror vs loop-mirror (target device: {dev})"
                style = dict(marker="s", lw=1.2, ls="--", alpha=0.7)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, color=f"C{k}", **style)
        ax.axhline(1, color="grey", lw=0.8, label="break-even (1x)")
        if wl in TARGETS:
            ratio, tlabel = TARGETS[wl]
            ax.axhline(ratio, color="C3", lw=1, ls=":", label=tlabel)
        ax.set_xscale("log")
        ax.set_title(wl, fontsize=11)
        ax.set_xlabel("N running requests")
        ax.set_ylabel("speedup (x)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8.5, loc="upper left")
    for ax in list(axes.flat)[len(wls) :]:
        ax.set_visible(False)
    if machine:
        fig.text(0.5, 0.005, caption(machine), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
