"""Replay a trace through the implementations and measure the time per step
and the drift of ``num_computed_tokens`` from the scheduler's truth."""

from __future__ import annotations

import statistics
import time

import numpy as np

IMPLS = ("vectorized", "loop", "legacy")


def _make(impl, cfg):
    from mtpstate import RequestTable
    from mtpstate.tools.reference import LegacyRequestTable, LoopRequestTable

    cls = {"vectorized": RequestTable, "loop": LoopRequestTable, "legacy": LegacyRequestTable}[impl]
    return cls(max_num_reqs=cfg["max_num_reqs"], max_model_len=cfg["max_model_len"], block_sizes=cfg["block_sizes"])


def replay(trace, impls=IMPLS, progress=None) -> dict:
    """Apply every step of ``trace`` to each implementation.

    Returns ``{"steps": N, "impls": {impl: {"max_drift", "us_per_step",
    "median_us_per_step", "drift_per_step"}}, "agree": bool | None}``, where
    drift is the largest ``|num_computed_tokens - truth|`` over the requests
    scheduled in a step, and ``agree`` says whether loop and vectorized held
    identical values for them at every step (None unless both ran).
    """
    from mtpstate import warmup

    warmup()
    cfg = trace.config
    out = {"steps": len(trace), "impls": {}}
    seen = {}
    for impl in impls:
        t = _make(impl, cfg)
        times, drift = [], []
        values = []
        for i, (so, truth) in enumerate(zip(trace.steps, trace.truth)):
            t0 = time.perf_counter()
            t.apply(so)
            times.append(time.perf_counter() - t0)
            ids = list(truth)
            got = t.num_computed_tokens[t.rows(ids)] if ids else np.zeros(0, np.int32)
            want = np.fromiter(truth.values(), np.int64, len(ids))
            drift.append(int(np.abs(got.astype(np.int64) - want).max()) if ids else 0)
            values.append(got.copy())
            if progress is not None:
                progress(impl, i + 1, len(trace))
        seen[impl] = values
        out["impls"][impl] = {
            "max_drift": max(drift, default=0),
            "us_per_step": float(np.mean(times) * 1e6),
            "median_us_per_step": float(statistics.median(times) * 1e6) if times else 0.0,
            "drift_per_step": drift,
        }
    out["agree"] = None
    if "loop" in seen and "vectorized" in seen:
        out["agree"] = all(np.array_equal(a, b) for a, b in zip(seen["loop"], seen["vectorized"]))
    return out


def plot_drift(result, path, title=""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for impl, r in result["impls"].items():
        ax.plot(
            range(1, len(r["drift_per_step"]) + 1),
            r["drift_per_step"],
            label=f"{impl} (max {r['max_drift']})",
            lw=2 if impl == "legacy" else 1.2,
            ls="-" if impl == "legacy" else "--",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("max |num_computed_tokens - scheduler| (tokens)")
    ax.set_title(title or "drift of num_computed_tokens from the scheduler")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
