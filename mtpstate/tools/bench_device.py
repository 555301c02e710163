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


# vLLM's sizes: max_num_reqs, max_model_len, block size, decode_query_len
SERVING = {"max_num_reqs": 1024, "max_model_len": 32768, "block_size": 16, "decode_query_len": 4}


def bench_serving(quick, progress, device=None) -> dict:
    """The mirror at vLLM's sizes in the vLLM adapter's configuration (three
    fields, engine lengths, a token target, idx_mapping, drafts zeroed),
    serving a busy simulated workload of 2k-20k-token prompts: its memory
    (``transfer_stats``), what it allocates and captures after construction
    (nothing, by design), and each step's host time (apply) and time until
    its device work has run (apply, then a synchronize). On the CPU the
    device is the deferred model of a GPU (the graph path; its work runs on
    the host at the synchronize), whose times are not a GPU's."""
    import torch

    from mtpstate import RequestTable
    from mtpstate.devices import DeferredOps
    from mtpstate.tools.sim import Simulator

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    R, L, bs, dql = (SERVING[k] for k in ("max_num_reqs", "max_model_len", "block_size", "decode_query_len"))
    on_gpu = torch.device(device).type == "cuda"
    ops = None if on_gpu else DeferredOps(torch)
    dev = device if on_gpu else "cpu"
    target = torch.zeros((R, L), dtype=torch.int32, device=dev)  # vLLM's all_token_ids
    drafts = torch.zeros((R, dql - 1), dtype=torch.int64, device=dev)  # vLLM's draft_tokens
    reserved = torch.cuda.memory_reserved() if on_gpu else 0
    t0 = time.perf_counter()
    table = RequestTable(
        max_num_reqs=R,
        max_model_len=L,
        block_sizes=[bs],
        device=dev,
        decode_query_len=dql,
        mirror_options={
            "fields": ("prefill_len", "prompt_len", "num_blocks"),
            "engine_lengths": True,
            "token_ids_target": target,
            "idx_mapping": True,
            "zero_rows_on_add": (drafts,),
            "ops": ops,
        },
    )
    build_s = time.perf_counter() - t0
    m = table._mirror
    built_reserved = torch.cuda.memory_reserved() if on_gpu else 0
    after = {"captures": 0, "allocations": 0}
    real = {k: getattr(m.ops, k) for k in ("capture", "pinned_empty", "empty")}

    def counted(kind, name):
        def call(*a, **k):
            after[kind] += 1
            return real[name](*a, **k)

        return call

    m.ops.capture = counted("captures", "capture")
    m.ops.pinned_empty = counted("allocations", "pinned_empty")
    m.ops.empty = counted("allocations", "empty")
    steps = 15 if quick else 60
    sim = Simulator(
        max_num_reqs=R, max_model_len=L, block_sizes=(bs,), max_num_batched_tokens=65536, arrivals_per_step=4,
        prompt_len=(2000, 20000), output_len=(20, 200), num_spec=dql - 1, seed=3,
    )  # fmt: skip
    sync = torch.cuda.synchronize if on_gpu else ops.synchronize
    progress.cell(f"device serving R={R} L={L}", 1)
    host, lands, arrivals = [], [], 0
    for k, so in enumerate(sim.run(steps)):
        a = time.perf_counter()
        res = table.apply(so)
        b = time.perf_counter()
        sync()
        c = time.perf_counter()
        if k >= 2:  # (the first steps compile what the warm-up did not reach)
            host.append(b - a)
            lands.append(c - a)
        arrivals += len(res.new_rows)
    progress.tick()
    stats = table.transfer_stats()
    out = {
        "config": {**SERVING, "adapter": True, "prompt_len": [2000, 20000], "steps": steps, "arrivals": arrivals},
        "device": device if on_gpu else "deferred model of a GPU (DeferredOps, on the CPU)",
        "path": stats["path"],
        "graph_error": stats["graph_error"],
        "build_s": build_s,
        "staging_capacity": stats["staging_capacity"],
        "token_chunk": stats["token_chunk"],
        "overflow_chunks": stats["overflow_chunks"],
        "pinned_bytes": stats["pinned_bytes"],
        "device_bytes": stats["device_bytes"],
        "graph_pool_bytes": stats["graph_pool_bytes"],
        "step_bytes_bound": 12 * stats["staging_capacity"] + 12 * R * L,
        "captures_built": sum(len(s.graphs) for s in (*m._slots, *m._chunks)),
        "captures_serving": after["captures"],
        "allocations_serving": after["allocations"],
        "reserved_growth_bytes": (torch.cuda.memory_reserved() - built_reserved) if on_gpu else None,
        "reserved_by_table_bytes": (built_reserved - reserved) if on_gpu else None,
        "apply_us": {"median": statistics.median(host) * 1e6, "max": max(host) * 1e6},
        "lands_us": {"median": statistics.median(lands) * 1e6, "max": max(lands) * 1e6},
    }
    table.close()
    return out


def format_serving_report(s: dict) -> list[str]:
    mib = 2**20
    c = s["config"]
    return [
        "",
        f"device mirror at vLLM's sizes (R = {c['max_num_reqs']}, L = {c['max_model_len']}, the adapter's "
        f"configuration; {c['steps']} busy steps of {c['prompt_len'][0]}-{c['prompt_len'][1]}-token prompts, "
        f"{c['arrivals']} arrivals) on {s['device']}, {s['path']} path:",
        f"  memory: pinned {s['pinned_bytes'] / mib:.1f} MiB, device {s['device_bytes'] / mib:.1f} MiB "
        f"(graph pool {s['graph_pool_bytes'] / mib:.1f}); one step can carry {s['step_bytes_bound'] / mib:.0f} MiB",
        f"  after construction: {s['captures_serving']} captures (of {s['captures_built']} made when built), "
        f"{s['allocations_serving']} allocations",
        f"  per step: apply {s['apply_us']['median']:.0f} us median, {s['apply_us']['max']:.0f} max; until it "
        f"lands {s['lands_us']['median']:.0f} us median, {s['lands_us']['max']:.0f} max",
    ]


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
