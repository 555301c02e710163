"""Paired timing on vLLM's real steps: the bookkeeping (vLLM's
finish/add/update + ``gather_batch_req_state`` against
``RequestTable.apply``) and the runner's host step up to the forward
(mtpstate on through the plugin, off), recorded once, interleaved per step.

``device="cpu"``: vLLM's device launches (its Triton kernels) and the
mirror's device work are counted no-ops (``shims``); ``"cuda"``: nothing is
shimmed, everything runs on the GPU, and the device is synchronized after
each side's step, outside the timed region, so that no side's time includes
the other's queued work."""

from __future__ import annotations

import contextlib
import pickle
import statistics
import time

import numpy as np

from mtpstate.tools.vllm_bench.driver import Driver
from mtpstate.tools.vllm_bench.reference import MRV2Reference
from mtpstate.tools.vllm_bench.shims import UNTIMED, _NoLaunch
from mtpstate.tools.vllm_bench.workloads import Workload

# ----------------------------------------------------------------------------
# paired timing on the real steps


def bench_workload(
    w: Workload, model_dir: str, repeats: int = 5, runner: bool = False, device: str = "cpu", sampler: bool = True
) -> dict:
    """Record the workload's steps once, then time, per step and interleaved,
    MRV2's host path (finish/add/update, then the batch -> row mapping of
    ``gather_batch_req_state``) against ``RequestTable.apply`` + ``rows`` for
    the same batch order, each on a freshly unpickled step (as a worker
    process receives it). The batch order (vLLM's ``sort_batch_req_ids``) is
    computed outside the timed region: both sides need it. ``runner``: the
    runner as the plugin patches it, mtpstate on, against vLLM's own
    methods, over the host part of ``execute_model`` up to the forward
    (``_bench_runner``; ``sampler``: vLLM's real Sampler attached on both
    sides, its per-step questions timed). ``device``: "cpu" (the shims; launches are no-ops)
    or "cuda" (nothing shimmed)."""
    ctx = _staging_launches_as_no_ops() if device == "cpu" else contextlib.nullcontext()
    with ctx:
        r = _bench_runner(w, model_dir, repeats, device, sampler) if runner else _bench(w, model_dir, repeats, device)
    r["device"] = device
    return r


def synchronizer(device: str):
    """What ends a side's step outside the timed region: the device drained
    (CUDA), nothing on the CPU."""
    if device == "cpu":
        return lambda: None
    import torch

    return torch.cuda.synchronize


@contextlib.contextmanager
def _staging_launches_as_no_ops():
    """The device step of the state staging is a launch on a GPU, on both
    sides: vLLM's Triton write kernel, and the mirror's device work (one
    graph replay). Both are no-ops inside (counted as launches); what is timed
    is everything up to them (vLLM's UVA staging, mtpstate's kernel
    staging)."""
    from vllm.v1.worker.gpu import buffer_utils

    from mtpstate.mirror import DeviceMirror

    emulated = buffer_utils._apply_write_kernel
    shipped = DeviceMirror._ship
    buffer_utils._apply_write_kernel = _NoLaunch()
    DeviceMirror._ship = _no_ship
    try:
        yield
    finally:
        buffer_utils._apply_write_kernel = emulated
        DeviceMirror._ship = shipped


def _no_ship(mirror, slot, n, n_tok):
    """``DeviceMirror._ship`` launching nothing: the step's one graph replay
    on a GPU, counted; token ids past the slot's token area still filled
    into the overflow chunks (host work), each chunk's replay counted."""
    _NoLaunch.launches += 1
    if n_tok > mirror._tcap:
        _fill_overflow(mirror, n_tok)


def _fill_overflow(mirror, n_tok):
    from mtpstate._kernels import slots
    from mtpstate._kernels.tokens import tok_fill

    done, nruns = mirror._tcap, int(mirror.table._cv[slots.TB_RES_NN])
    while done < n_tok:
        a = mirror._chunks[0].tokens
        done += tok_fill(mirror.table._ix_addr, mirror._tok_runs_addr, nruns, done, a.capacity, *a.addrs[:2])
        _NoLaunch.launches += 1


def _quiet(so) -> bool:
    return not so.scheduled_new_reqs and not so.finished_req_ids and not so.preempted_req_ids


def recorded_steps(w, model_dir):
    """The workload's steps, recorded once from vLLM's scheduler: (pickled
    steps, which of them are timed, the KV-cache groups' block sizes). A
    ``steady-*`` workload times only the steps that add and finish nothing;
    a ``chunked-*`` one, the steps from the first that runs its whole burst
    (the decodes beside the chunked prefills); any other, every step."""
    drv = Driver(w, model_dir)
    steps = list(drv.steps())
    if w.name.startswith("steady"):
        timed = [_quiet(so) for so in steps]
    elif w.name.startswith("chunked"):
        full = [len(so.num_scheduled_tokens) >= w.initial for so in steps]
        first = full.index(True) if True in full else len(steps)
        timed = [i >= first for i in range(len(steps))]
    else:
        timed = [True] * len(steps)
    return [pickle.dumps(so) for so in steps], timed, drv.block_sizes


def _bench(w, model_dir, repeats, device):
    """Per step, interleaved: vLLM (finish/free_states/add/update_requests,
    apply_staged_writes, then gather_batch_req_state) against
    ``RequestTable(decode_query_len=...).apply(so).batch``, and
    ``RequestTable.apply`` alone (no batch) for the apply-only figure. On
    CUDA both sides ship their state to the device: vLLM its staged writes,
    mtpstate its mirror (``RequestTable(device="cuda")``)."""
    import mtpstate

    blobs, timed, block_sizes = recorded_steps(w, model_dir)
    mirror = None if device == "cpu" else device
    kw = dict(max_num_reqs=w.max_num_seqs, max_model_len=w.max_model_len, block_sizes=block_sizes, device=mirror)
    sync = synchronizer(device)
    dq = 1 + w.num_spec
    t_ref, t_ours, t_apply, running = [], [], [], []
    for _ in range(repeats):
        args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, block_sizes, w.num_spec)
        ref = MRV2Reference(*args, device=device)
        ours = mtpstate.RequestTable(**kw, decode_query_len=dq)
        alone = mtpstate.RequestTable(**kw)
        for b, keep in zip(blobs, timed):
            s1, s2, s3 = pickle.loads(b), pickle.loads(b), pickle.loads(b)
            t0 = time.perf_counter()
            ref.apply(s1)
            vb = ref.gather(s1)
            t1 = time.perf_counter()
            sync()
            t1s = time.perf_counter()
            m2 = ours.apply(s2).batch.idx_mapping_np
            t2 = time.perf_counter()
            sync()
            t2s = time.perf_counter()
            alone.apply(s3)
            t3 = time.perf_counter()
            sync()
            assert len(m2) == len(vb.idx_mapping_np)
            if keep:
                t_ref.append(t1 - t0)
                t_ours.append(t2 - t1s)
                t_apply.append(t3 - t2s)
                running.append(len(s1.num_scheduled_tokens))
    ratios = np.array(t_ref) / np.array(t_ours)
    n_med = statistics.median(running)
    return {
        "workload": w.name,
        "subject": "RequestTable.apply(so).batch" + ("" if mirror is None else f" (mirrored to {device})"),
        "steps": len(blobs),
        "timed_steps": len(t_ref),
        "repeats": repeats,
        "median_running": n_med,
        "mrv2_median_us": statistics.median(t_ref) * 1e6,
        "mtpstate_median_us": statistics.median(t_ours) * 1e6,
        "apply_alone_median_us": statistics.median(t_apply) * 1e6,
        "apply_alone_ns_per_request": statistics.median(t_apply) * 1e9 / max(n_med, 1),
        "speedup": statistics.median(t_ref) / statistics.median(t_ours),
        "paired_median": float(np.median(ratios)),
        "paired_p10": float(np.percentile(ratios, 10)),
        "paired_p90": float(np.percentile(ratios, 90)),
    }


PHASES = ("finish", "add", "update", "gather", "prepare_inputs", "prepare_attn", "sample")
INPUT_PHASES = ("gather", "prepare_inputs", "prepare_attn")  # input preparation
INPUT = [PHASES.index(p) for p in INPUT_PHASES]
BOOK = [PHASES.index(p) for p in PHASES if p not in ("prepare_inputs", "prepare_attn")]  # bookkeeping + sampler


def _timed_host_step(sub, so, out, sync):
    """``MRV2Reference.host_step`` with a clock between its phases (PHASES):
    finish_requests + free_states; add_requests (mtpstate's whole apply
    when on; vLLM's sampler.add_request per new request and its
    apply_staged_writes, when attached); update_requests + the block tables'
    apply_staged_writes; gather_batch_req_state; prepare_inputs;
    prepare_attn; the sampler's per-step questions
    (``MRV2Reference.sample_questions``; 0 without a sampler). Appends the
    seven durations to ``out``, then ``sync()`` (untimed). The shims' host
    stand-ins for GPU work (``shims.UNTIMED``) are not counted."""
    u0 = UNTIMED[0]
    t0 = time.perf_counter()
    sub.finish(so)
    t1 = time.perf_counter()
    sub.add(so)
    t2 = time.perf_counter()
    sub.update(so)
    t3 = time.perf_counter()
    batch = sub.gather(so)
    t4 = time.perf_counter()
    ib = sub.inputs(so, batch)
    t5 = time.perf_counter()
    u1 = UNTIMED[0]
    sub.attn(ib)
    t6 = time.perf_counter()
    if sub.sampler is not None:
        sub.sample_questions(ib)
    t7 = time.perf_counter()
    out.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4 - (u1 - u0), t6 - t5, t7 - t6))
    sync()


def _bench_runner(w, model_dir, repeats, device, sampler=True):
    """The patched runner with mtpstate on against itself off (vLLM's own
    code paths), per step and interleaved (which side goes first alternates
    by repeat), on freshly unpickled steps: the host part of
    ``execute_model`` up to the forward (``MRV2Reference.host_step``). A
    ``steady-*`` workload times only the steps that add and finish nothing.
    Also counts the torch operator calls per step on each side."""
    blobs, timed, block_sizes = recorded_steps(w, model_dir)
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, block_sizes, w.num_spec)
    sync = synchronizer(device)
    times = {False: [], True: []}
    running, with_new = [], []
    for rep in range(repeats):
        sides = {on: MRV2Reference(*args, use_mtpstate=on, device=device, sampler=sampler) for on in (False, True)}
        order = (False, True) if rep % 2 == 0 else (True, False)
        for b, keep in zip(blobs, timed):
            sos = {on: pickle.loads(b) for on in order}
            mark = {on: len(times[on]) for on in order}
            for on in order:
                _timed_host_step(sides[on], sos[on], times[on], sync)
            if not keep:
                for on in order:
                    del times[on][mark[on] :]
            elif rep == 0:
                running.append(len(sos[False].num_scheduled_tokens))
                with_new.append(bool(sos[False].scheduled_new_reqs))
    off = np.array(times[False])  # [timed steps x repeats, phases]
    on = np.array(times[True])
    t_off, t_on = off.sum(axis=1), on.sum(axis=1)
    ratios = t_off / t_on
    ops = _torch_op_counts(w, block_sizes, blobs, timed, device, sampler)
    answers = _answers_times(w, block_sizes, blobs, timed, device) if sampler else None
    shadow = _shadow_cost(w, block_sizes, blobs, timed, repeats, device, sampler)
    med = lambda a: float(np.median(a)) * 1e6  # noqa: E731  (us)
    return {
        "workload": w.name,
        "subject": "runner via mtpstate's vLLM plugin vs vLLM's own methods (execute_model's host part to the forward)",
        "max_running": int(max(running)),
        "median_running": float(statistics.median(running)),
        "steps": len(blobs),
        "timed_steps": len(running),
        "timed_steps_with_new_requests": int(sum(with_new)),
        "repeats": repeats,
        "vllm_median_us": med(t_off),
        "mtpstate_median_us": med(t_on),
        "speedup": float(np.median(t_off) / np.median(t_on)),
        "paired_median": float(np.median(ratios)),
        "paired_p10": float(np.percentile(ratios, 10)),
        "paired_p90": float(np.percentile(ratios, 90)),
        "phases_us": {
            "vllm": {p: med(off[:, k]) for k, p in enumerate(PHASES)},
            "mtpstate": {p: med(on[:, k]) for k, p in enumerate(PHASES)},
        },
        # gather + prepare_inputs + prepare_attn, per step: medians and the paired ratio
        "input_preparation": _paired(off[:, INPUT].sum(axis=1), on[:, INPUT].sum(axis=1)),
        # the sampler's share: its add_request + apply_staged_writes are in
        # "add" (vLLM's on both sides), its per-step questions are "sample"
        "sampler": sampler,
        "sample_questions": _paired(off[:, PHASES.index("sample")], on[:, PHASES.index("sample")]) if sampler else None,
        # the request-state bookkeeping with the sampler's share: finish, add
        # (with the sampler's add_request / apply_staged_writes), update,
        # gather, the sampler's questions (everything but prepare_inputs /
        # prepare_attn)
        "bookkeeping_and_sampler": _paired(off[:, BOOK].sum(axis=1), on[:, BOOK].sum(axis=1)) if sampler else None,
        # mtpstate's sampler answers per step (their counts kept at apply,
        # the answers computed at gather): median and p90, us
        "sampler_answers_us": answers,
        "torch_ops": ops,
        # shadow mode (VLLM_USE_MTPSTATE=shadow): what it adds to vLLM's own host step
        "shadow": shadow,
    }


def _shadow_cost(w, block_sizes, blobs, timed, repeats, device, sampler) -> dict:
    """Shadow mode's host cost per step: vLLM's own runner methods (off)
    with a :class:`mtpstate.integrations.vllm.shadow.Shadow` fed each step
    at the points its wrappers call it (before ``add_requests``, after
    ``update_requests``, after ``prepare_inputs``), its device tensors
    compared every ``DEFAULT_EVERY`` batches. The shadow's time and vLLM's
    are clocked apart, per step; ``overhead``: (vLLM + shadow) / vLLM."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from mtpstate.integrations.vllm import plugin
    from mtpstate.integrations.vllm.shadow import DEFAULT_EVERY, Shadow

    # the patched runner methods, as the plugin set them in this process
    release = plugin.installed_release()
    methods = {tuple(k.split(".", 1)): vars(GPUModelRunner)[k.split(".", 1)[1]] for k in plugin.SUPPORTED[release]}
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, block_sizes, w.num_spec)
    sync = synchronizer(device)
    t_vllm, t_shadow, checked = [], [], []
    with _staging_done_untimed(device):
        for _ in range(repeats):
            ref = MRV2Reference(*args, device=device, sampler=sampler)
            sh = Shadow(ref, methods, GPUModelRunner, every=DEFAULT_EVERY, log_every=1 << 62)
            for b, keep in zip(blobs, timed):
                so = pickle.loads(b)
                v, s = _shadowed_host_step(ref, sh, so)
                sync()
                if keep:
                    t_vllm.append(v)
                    t_shadow.append(s)
                    checked.append(sh.batches % sh.every == 0)
            if not sh.active:
                raise RuntimeError(f"the shadow stopped while timed: {sh.stopped}")
    v, s = np.array(t_vllm), np.array(t_shadow)
    over = (v + s) / v
    us = lambda a: float(a) * 1e6  # noqa: E731
    return {
        "every": DEFAULT_EVERY,
        "vllm_median_us": us(np.median(v)),
        "shadow_median_us": us(np.median(s)),
        "shadow_mean_us": us(np.mean(s)),
        "shadow_p90_us": us(np.percentile(s, 90)),
        "shadow_device_check_median_us": us(np.median(s[checked])) if any(checked) else None,
        "overhead_paired_median": float(np.median(over)),
        "overhead_paired_p10": float(np.percentile(over, 10)),
        "overhead_paired_p90": float(np.percentile(over, 90)),
    }


@contextlib.contextmanager
def _staging_done_untimed(device):
    """On the CPU shims: the staging's device step done (vLLM's write kernel
    in numpy, the mirror's copy on the CPU), so that the shadow's device
    comparisons see what a GPU would hold, each one's time added to
    ``UNTIMED`` (on a GPU it is the device's work: one launch each)."""
    if device != "cpu":
        yield
        return
    from vllm.v1.worker.gpu import buffer_utils

    from mtpstate.mirror import DeviceMirror
    from mtpstate.mirror.ship import _Ship
    from mtpstate.tools.vllm_bench.shims import _NumpyWriteKernel

    def untimed(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _NoLaunch.launches += 1
                UNTIMED[0] += time.perf_counter() - t0

        return run

    class _Kernel:
        def __getitem__(self, grid):
            return untimed(_NumpyWriteKernel()[grid])

    saved = buffer_utils._apply_write_kernel, DeviceMirror._ship
    buffer_utils._apply_write_kernel, DeviceMirror._ship = _Kernel(), untimed(_Ship._ship)
    try:
        yield
    finally:
        buffer_utils._apply_write_kernel, DeviceMirror._ship = saved


def _shadowed_host_step(sub, sh, so) -> tuple[float, float]:
    """``_timed_host_step``'s phases on vLLM's side, the shadow's hooks
    between them; returns (vLLM's seconds, the shadow's seconds), each
    without the shims' host stand-ins for device work (``UNTIMED``)."""
    clock = lambda: time.perf_counter() - UNTIMED[0]  # noqa: E731
    t0 = clock()
    sub.finish(so)
    a0 = clock()
    sh.before_add(so)
    a1 = clock()
    sub.add(so)
    sub.update(so)
    b0 = clock()
    sh.after_update(so)
    b1 = clock()
    batch = sub.gather(so)
    ib = sub.inputs(so, batch)
    c0 = clock()
    sh.after_prepare(so, batch, sub.descriptor(batch), ib)
    c1 = clock()
    sub.attn(ib)
    if sub.sampler is not None:
        sub.sample_questions(ib)
    t1 = clock()
    shadow = (a1 - a0) + (b1 - b0) + (c1 - c0)
    return (t1 - t0) - shadow, shadow


class _TimedAnswers:
    """A ``SamplerAnswers`` as the adapter calls it, each call timed (the
    sampler's wrappers keep the object itself)."""

    def __init__(self, answers):
        self._answers = answers
        self.seconds = 0.0

    def rows_changed(self, *args):
        t0 = time.perf_counter()
        self._answers.rows_changed(*args)
        self.seconds += time.perf_counter() - t0

    def compute(self, *args):
        t0 = time.perf_counter()
        self._answers.compute(*args)
        self.seconds += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._answers, name)


def _answers_times(w, block_sizes, blobs, timed, device="cpu") -> dict | None:
    """mtpstate's sampler answers per timed step, in a pass of their own
    (the calls timed one by one): ``SamplerAnswers.rows_changed`` at apply
    plus ``compute`` at gather, us; and the share of batches answered from
    the counts over the live rows. None: the sampler is left to vLLM."""
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, block_sizes, w.num_spec)
    sync = synchronizer(device)
    ref = MRV2Reference(*args, use_mtpstate=True, device=device, sampler=True)
    st = ref.mtpstate
    if st.sampler_answers is None:
        return None
    timer = st.sampler_answers = _TimedAnswers(st.sampler_answers)
    per_step = []
    for b, keep in zip(blobs, timed):
        so = pickle.loads(b)
        timer.seconds = 0.0
        ref.sample_questions(ref.host_step(so))
        sync()
        if keep:
            per_step.append(timer.seconds)
    a = timer._answers
    return {
        "median": statistics.median(per_step) * 1e6,
        "p90": float(np.percentile(per_step, 90)) * 1e6,
        "from_counts": a.from_counts / max(a.computed, 1),
    }


def _paired(off, on) -> dict:
    r = off / on
    return {
        "vllm_median_us": float(np.median(off)) * 1e6,
        "mtpstate_median_us": float(np.median(on)) * 1e6,
        "paired_median": float(np.median(r)),
        "paired_p10": float(np.percentile(r, 10)),
        "paired_p90": float(np.percentile(r, 90)),
    }


def breakdown_workload(w: Workload, model_dir: str, repeats: int = 3) -> dict:
    """Where the patched side's host time goes: the runner's methods one by
    one, and ``RequestTable.apply`` inside ``add_requests``, medians in us
    over the timed steps after a 10-step warm-up, with vLLM's side (off) run
    before each step as in the benchmark (the staging's device launches
    no-op'd, as there)."""
    blobs, timed, block_sizes = recorded_steps(w, model_dir)
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, block_sizes, w.num_spec)
    names = (
        "finish_requests",
        "add_requests",
        "update_requests+apply_staged_writes",
        "gather",
        "prepare_inputs",
        "prepare_attn",
    )
    out: dict = {}
    with _staging_launches_as_no_ops():
        for _ in range(repeats):
            off, on = MRV2Reference(*args), MRV2Reference(*args, use_mtpstate=True)
            R, table = on._runner, on.mtpstate.table
            inner = []

            def timed_apply(so, apply=table.apply, inner=inner):
                t0 = time.perf_counter()
                r = apply(so)
                inner.append(time.perf_counter() - t0)
                return r

            table.apply = timed_apply
            for i, (b, keep) in enumerate(zip(blobs, timed)):
                so_off, so = pickle.loads(b), pickle.loads(b)
                off.host_step(so_off)
                inner.clear()
                t = [time.perf_counter()]
                R.finish_requests(on, so)
                t.append(time.perf_counter())
                R.free_states(on, so)
                R.add_requests(on, so)
                t.append(time.perf_counter())
                R.update_requests(on, so)
                on.block_tables.apply_staged_writes()
                t.append(time.perf_counter())
                batch = on.gather(so)
                t.append(time.perf_counter())
                ib = on.inputs(so, batch)
                t.append(time.perf_counter())
                R.prepare_attn(on, ib)
                t.append(time.perf_counter())
                if i < 10 or not keep:
                    continue
                for k, name in enumerate(names):
                    out.setdefault(name, []).append(t[k + 1] - t[k])
                out.setdefault("  of add_requests: RequestTable.apply", []).extend(inner)
                out.setdefault("total", []).append(t[-1] - t[0])
    return {"workload": w.name, "breakdown_us": {k: statistics.median(v) * 1e6 for k, v in out.items()}}


def _torch_op_counts(w, block_sizes, blobs, timed, device="cpu", sampler=False) -> dict:
    """torch operator calls per step (a TorchDispatchMode counter, in a pass
    of its own: counting slows the calls) on each side, over the timed part
    (``MRV2Reference.host_step``): on a GPU each is a kernel launch, a copy
    or a view. Device launches the counter does not see (Triton kernels; the
    mirror's graph replay) are counted apart: on the CPU as the no-ops that
    stand for them (``no_op_launches``), on CUDA as the runtime and driver
    calls the profiler records (``cuda_launches``, a third pass). Split by
    steps with and without new requests, to show whether counts grow with
    them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def per_kind(values: dict) -> dict:
        return {k: (statistics.median(v) if v else None) for k, v in values.items()}

    sync = synchronizer(device)
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, block_sizes, w.num_spec)
    out = {}
    for side, on in (("vllm", False), ("mtpstate", True)):
        ref = MRV2Reference(*args, use_mtpstate=on, device=device, sampler=sampler)
        counts = {"with_new": [], "without_new": []}
        launches = {"with_new": [], "without_new": []}
        for b, keep in zip(blobs, timed):
            so = pickle.loads(b)
            Count.n = 0
            launched = _NoLaunch.launches
            with Count():
                ib = ref.host_step(so)
                if sampler:
                    ref.sample_questions(ib)
            sync()
            if keep:
                kind = "with_new" if so.scheduled_new_reqs else "without_new"
                counts[kind].append(Count.n)
                launches[kind].append(_NoLaunch.launches - launched)
        out[side] = per_kind(counts)
        out[side]["max"] = max(counts["with_new"] + counts["without_new"])
        if device == "cpu":
            out[side]["no_op_launches"] = per_kind(launches)
        else:
            out[side]["cuda_launches"] = per_kind(_cuda_launch_counts(args, on, device, blobs, timed))
    return out


# the CUDA runtime / driver calls that put work on a stream
_LAUNCH_CALLS = ("LaunchKernel", "GraphLaunch", "MemcpyAsync", "MemsetAsync", "cuLaunch", "cuMemcpy", "cuMemset")


def _cuda_launch_counts(args, on, device, blobs, timed) -> dict:
    """Per timed step, the calls that put work on a CUDA stream during
    ``host_step`` (kernel and graph launches, asynchronous copies and
    memsets), as torch's profiler records them: one profile per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    ref = MRV2Reference(*args, use_mtpstate=on, device=device)
    counts = {"with_new": [], "without_new": []}
    for b, keep in zip(blobs, timed):
        so = pickle.loads(b)
        if not keep:
            ref.host_step(so)
            torch.cuda.synchronize()
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ref.host_step(so)
        torch.cuda.synchronize()
        n = sum(1 for e in prof.events() if e.name.startswith("cu") and any(k in e.name for k in _LAUNCH_CALLS))
        counts["with_new" if so.scheduled_new_reqs else "without_new"].append(n)
    return counts


def run_machine(device: str = "cpu") -> dict:
    """The machine and versions of a benchmark run, for its JSON."""
    from vllm.version import __version__ as vllm_version

    from mtpstate.tools.bench import machine_info

    machine = dict(machine_info(), vllm=vllm_version)
    if device == "cpu":
        machine.pop("mirror_device", None)  # (the mirror's device work is counted, not run: see _no_ship)
    return machine
