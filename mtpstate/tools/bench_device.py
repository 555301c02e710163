"""``mtpstate bench --only device``: what the device mirror costs the host,
how soon its work lands, and the same step's upload done vLLM's way.

For steady decode and mixed steps (arrivals and finishes every step), at
each N, every step freshly unpickled (as a worker receives it) and the
sides interleaved per step:

- ``host``: ``RequestTable.apply`` without a mirror;
- ``mirror``: ``RequestTable(device=...).apply``, host time (it returns
  without waiting for the device);
- ``mirror-lands``: the same call, then a device synchronize;
- ``vllm-way-lands``: the same step applied by the transcribed vLLM loop
  with vLLM's staged upload (per-request ``(row, start, values)`` runs),
  then a device synchronize. With ``vllm_src`` (an unpacked vLLM sdist),
  the upload is vLLM's own ``StagedWriteTensor.apply_write`` (its Triton
  kernel; the UVA view, vLLM's one compiled op, made by a shim); otherwise,
  or where that cannot be imported, an upload of the same shape (the runs
  packed into a pinned buffer from a ring, one copy, one scatter). The
  result says which.

Paired per step: mirror - host and lands - mirror (us), mirror / host, and
vLLM-way lands / mirror lands.
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import time

import numpy as np

DEVICE_SIZES = [1, 16, 256, 1024, 4096]
DEVICE_WORKLOADS = ("steady-decode", "mixed")
IMPLS = ("host", "mirror", "mirror-lands", "vllm-way-lands")


def _pct(ts, q) -> float:
    return float(np.percentile(np.asarray(ts) * 1e6, q))


def _same_shape_upload(torch, device):
    """The runs' upload as vLLM shapes it, without vLLM: packed into a
    pinned buffer taken round robin (depth 2), one copy, one scatter."""
    pinned = device.type == "cuda"
    pool = [None, None]
    k = [0]

    def upload(flat, pos, vals):
        n = len(pos)
        i = k[0] = (k[0] + 1) % 2
        buf = pool[i]
        if buf is None or buf[0].shape[0] < n:
            cap = 1 << max(n - 1, 1).bit_length()
            buf = pool[i] = (
                torch.empty(cap, dtype=torch.int64, pin_memory=pinned),
                torch.empty(cap, dtype=torch.int32, pin_memory=pinned),
            )
        buf[0].numpy()[:n] = pos
        buf[1].numpy()[:n] = vals
        flat.index_copy_(0, buf[0][:n].to(device, non_blocking=True), buf[1][:n].to(device, non_blocking=True))

    return upload


def _vllm_upload(vllm_src: str, torch, device, size):
    """vLLM's own staged write of one ``[1, size]`` int32 tensor (each run
    ``stage_write(0, start, values)``, then ``apply_write``), imported from
    the sdist at ``vllm_src``; the UVA view (``torch.ops._C``) made through
    ``__cuda_array_interface__`` (pinned host memory is addressable from the
    device with unified addressing). Returns (flat tensor, upload)."""
    if vllm_src not in sys.path:
        sys.path.insert(0, vllm_src)
    from vllm.utils import torch_utils
    from vllm.v1.worker.gpu import buffer_utils

    from mtpstate.tools.vllm_bench.shims import uva_view

    torch_utils.get_accelerator_view_from_cpu_tensor = uva_view
    buffer_utils.get_accelerator_view_from_cpu_tensor = uva_view
    staged = buffer_utils.StagedWriteTensor((1, size), torch.int32, device)

    def upload(flat, pos_runs, values):
        for start, run in zip(pos_runs, values):
            staged.stage_write(0, start, run)
        staged.apply_write()

    return staged.gpu.view(-1), upload


def _vllm_way_table(vllm_src, device):
    """The class of the ``vllm-way`` side and a label saying which upload it uses."""
    import torch

    from mtpstate.tools.reference import LoopMirroredRequestTable

    dev = torch.device(device)
    label = "same-shape upload (per-request runs packed into pinned memory, 1 copy + 1 scatter)"
    vllm_error = None
    if vllm_src is not None and dev.type == "cuda":
        try:
            _vllm_upload(vllm_src, torch, dev, 16)  # importable, and it runs
            label = f"vLLM's StagedWriteTensor.apply_write ({os.path.abspath(vllm_src)}; UVA view shimmed)"
        except Exception as e:  # reported in the result: the fallback is the same-shape upload
            vllm_error = f"{type(e).__name__}: {e}"
    elif vllm_src is not None:
        vllm_error = "vLLM's staged writes need a CUDA device (Triton)"
    use_vllm = vllm_src is not None and vllm_error is None

    class VllmWay(LoopMirroredRequestTable):
        def __init__(self, *a, **k):
            super().__init__(*a, device=dev, **k)
            if use_vllm:
                self.flat, self._up = _vllm_upload(vllm_src, torch, dev, self.flat.numel())
                self._runs = True
            else:
                self._up, self._runs = _same_shape_upload(torch, dev), False

        def _ship_staged(self):
            if self._runs:
                self._up(self.flat, self._staged_starts, self._staged_values)
            else:
                self._up(self.flat, *self.staged_elements())

    return VllmWay, label, vllm_error


def bench_device(sizes, quick, progress, device=None, vllm_src=None):
    """Result rows (see the module docstring) and the run's device facts."""
    import torch

    from mtpstate import RequestTable
    from mtpstate.tools.sim import SchedulerOutput
    from mtpstate.tools.workloads import BLOCK_SIZE, MAX_MODEL_LEN, mixed, steady_decode

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    vllm_way, label, vllm_error = _vllm_way_table(vllm_src, device)
    facts = {"device": device, "vllm_way": label, "vllm_src_error": vllm_error, "mirror_path": None}
    results = []
    for workload in DEVICE_WORKLOADS:
        for n in sizes:
            steps = 4 if quick else 12
            setup, timed = mixed(n, steps=steps) if workload == "mixed" else steady_decode(n, steps=steps)
            blobs = [pickle.dumps(so) for so in timed]
            repeats = max(2, (100 if quick else 1200) // max(n, 1))
            if workload == "mixed":
                repeats = 1 if quick else 3
            progress.cell(f"device {workload} N={n}", repeats)
            kw = dict(max_num_reqs=n, max_model_len=MAX_MODEL_LEN, block_sizes=[BLOCK_SIZE])
            host, mirror, vway = RequestTable(**kw), RequestTable(**kw, device=device), vllm_way(**kw)
            facts["mirror_path"] = mirror._mirror.path
            facts["mirror_graph_error"] = mirror._mirror.graph_error
            times = {k: [] for k in IMPLS}
            live: set = set()
            for _ in range(repeats):
                for t in (host, mirror, vway):
                    t.apply(SchedulerOutput(finished_req_ids=set(live)))
                    for so in setup:
                        t.apply(so)
                sync()
                for b in blobs:
                    so = pickle.loads(b)
                    t0 = time.perf_counter()
                    host.apply(so)
                    times["host"].append(time.perf_counter() - t0)
                    so = pickle.loads(b)
                    t0 = time.perf_counter()
                    mirror.apply(so)
                    t1 = time.perf_counter()
                    sync()
                    t2 = time.perf_counter()
                    times["mirror"].append(t1 - t0)
                    times["mirror-lands"].append(t2 - t0)
                    so = pickle.loads(b)
                    t0 = time.perf_counter()
                    vway.apply(so)
                    sync()
                    times["vllm-way-lands"].append(time.perf_counter() - t0)
                    live |= set(so.num_scheduled_tokens) | {r.req_id for r in so.scheduled_new_reqs}
                for so in setup:
                    live |= {r.req_id for r in so.scheduled_new_reqs}
                progress.tick()
            results += _rows(workload, n, times)
            del host, mirror, vway
    return results, facts


def _rows(workload, n, times) -> list[dict]:
    arr = {k: np.asarray(v) for k, v in times.items()}
    paired = {
        "mirror_minus_host_us": (arr["mirror"] - arr["host"]) * 1e6,
        "mirror_over_host": arr["mirror"] / arr["host"],
        "lands_minus_mirror_us": (arr["mirror-lands"] - arr["mirror"]) * 1e6,
        "vllm_way_over_mirror_lands": arr["vllm-way-lands"] / arr["mirror-lands"],
    }
    row = {"workload": workload, "n": n, "samples": len(times["host"])}
    for k, ts in times.items():
        row[k] = {"median_us": statistics.median(ts) * 1e6, "p10_us": _pct(ts, 10), "p90_us": _pct(ts, 90)}
    for k, v in paired.items():
        row[k] = {"median": float(np.median(v)), "p10": float(np.percentile(v, 10)), "p90": float(np.percentile(v, 90))}
    return [row]


def _spread(v: dict, fmt: str = "{:.1f}") -> str:
    """median (p10-p90)"""
    return f"{fmt.format(v['median'])} ({fmt.format(v['p10'])}-{fmt.format(v['p90'])})"


def format_device_report(results, facts) -> list[str]:
    """The device part of the console report."""
    lines = [
        "",
        f"device mirror on {facts['device']} ({facts['mirror_path']} path"
        + (f": {facts['mirror_graph_error']}" if facts.get("mirror_graph_error") else "")
        + f"); vLLM's way: {facts['vllm_way']}",
    ]
    if facts.get("vllm_src_error"):
        lines.append(f"  (--vllm-src not used: {facts['vllm_src_error']})")
    for wl in DEVICE_WORKLOADS:
        rs = [r for r in results if r["workload"] == wl]
        if not rs:
            continue
        lines += [
            "",
            f"device {wl} (median us per step; paired: median (p10-p90) of per-step differences or ratios)",
            f"{'N':>6} | {'host':>8} {'mirror':>8} {'+us':>16} {'x host':>6} | {'lands':>8} {'+us':>16}"
            f" | {'vLLM-way lands':>14} {'vs mirror lands':>18}",
        ]
        for r in rs:
            vway = _spread(r["vllm_way_over_mirror_lands"], "{:.2f}")
            lines.append(
                f"{r['n']:>6} | {r['host']['median_us']:>8.1f} {r['mirror']['median_us']:>8.1f} "
                f"{_spread(r['mirror_minus_host_us']):>16} {r['mirror_over_host']['median']:>5.2f}x | "
                f"{r['mirror-lands']['median_us']:>8.1f} {_spread(r['lands_minus_mirror_us']):>16} | "
                f"{r['vllm-way-lands']['median_us']:>14.1f} {vway + 'x':>18}"
            )
    return lines
