"""The differentials against vLLM's own code, step by step: the bare table
(``RequestTable`` against vLLM's ``RequestState`` / ``BlockTables`` and the
runner's update methods, with the legacy engine as a negative control) and
the runner (vLLM's runner methods as mtpstate's plugin patches them, on,
against vLLM's own, off, with vLLM's real Sampler). Both drive vLLM's real
scheduler (``mtpstate.tools.vllm_bench.driver``) and compare after every
step (``compare``)."""

from __future__ import annotations

import collections
import json
import pickle

import numpy as np

from mtpstate.tools.vllm_bench.bench import synchronizer
from mtpstate.tools.vllm_bench.driver import Driver
from mtpstate.tools.vllm_bench.reference import MRV2Reference, load_plugin
from mtpstate.tools.vllm_bench.workloads import Workload
from mtpstate.tools.vllm_verify.compare import (
    Comparison,
    compare_batches,
    compare_inputs,
    compare_sampler,
    compare_states,
    table_state,
)


def _new_result(name: str) -> dict:
    return {"workload": name, "steps": 0, "values": 0, "disagreements": 0, "first": [], "first_full": None}


def _record(res: dict, c: Comparison) -> None:
    """One compared step into the result: its values, and its disagreements
    (the first three steps' shortly, the very first in full)."""
    res["steps"] += 1
    res["values"] += c.values
    if not c:
        return
    res["disagreements"] += 1
    if len(res["first"]) < 3:
        res["first"].append((res["steps"], [str(d) for d in c.bad[:5]]))
    if res["first_full"] is None:
        d = c.bad[0]
        res["first_full"] = {
            "workload": res["workload"],
            "step": res["steps"],
            "req_id": d.req_id,
            "field": d.field,
            "vllm": repr(d.vllm),
            "mtpstate": repr(d.mtpstate),
            "text": d.full(),
        }


def run_table_differential(w: Workload, model_dir: str, check_pickled: bool = True, control: bool = True) -> dict:
    """Drive ``w``; compare ``RequestTable`` (and a table fed a pickled copy
    of each step) with vLLM's own state code after every step, the batch
    with vLLM's ``gather_batch_req_state``; the legacy engine (incrementing
    num_computed_tokens) as a negative control. Returns the counts."""
    import mtpstate
    from mtpstate.tools.reference import LegacyRequestTable

    drv = Driver(w, model_dir)
    kw = dict(max_num_reqs=w.max_num_seqs, max_model_len=w.max_model_len, block_sizes=drv.block_sizes)
    ref = MRV2Reference(w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, drv.block_sizes, w.num_spec)
    ours = mtpstate.RequestTable(**kw, decode_query_len=w.num_spec + 1)
    ours_pickled = mtpstate.RequestTable(**kw, decode_query_len=w.num_spec + 1) if check_pickled else None
    legacy = LegacyRequestTable(**kw) if control else None
    ref_ids = lambda rows: [ref.req_states.index_to_req_id[int(r)] for r in rows]  # noqa: E731
    res = _new_result(w.name)
    res["control_disagreements"] = 0
    kinds = dict.fromkeys(
        ("new", "cached", "finished", "preempted", "spec_tokens", "max_running", "prefix_hits", "prompt_embeds"), 0
    )
    for so in drv.steps():
        blob = pickle.dumps(so)
        ref.apply(so)
        got = ours.apply(so).batch
        expect = ref.state()
        c = Comparison()
        compare_states(c, expect, table_state(ours))
        vbatch = ref.gather(so)
        compare_batches(c, vbatch, ref_ids, got, lambda rows: [ours.index.req_id(int(r)) for r in rows])
        if ours_pickled is not None:
            got = ours_pickled.apply(pickle.loads(blob)).batch
            compare_states(c, expect, table_state(ours_pickled), "(pickled) ")
            ids_p = lambda rows: [ours_pickled.index.req_id(int(r)) for r in rows]  # noqa: E731
            compare_batches(c, vbatch, ref_ids, got, ids_p)
        res["batch_steps"] = res.get("batch_steps", 0) + 1
        if legacy is not None:
            legacy.apply(pickle.loads(blob))
            cl = Comparison()
            compare_states(cl, expect, table_state(legacy))
            res["control_disagreements"] += bool(cl)
        _record(res, c)
        kinds["new"] += len(so.scheduled_new_reqs)
        kinds["prefix_hits"] += sum(1 for r in so.scheduled_new_reqs if r.num_computed_tokens > 0)
        kinds["prompt_embeds"] += sum(1 for r in so.scheduled_new_reqs if r.prompt_token_ids is None)
        kinds["cached"] += len(so.scheduled_cached_reqs.req_ids)
        kinds["finished"] += len(so.finished_req_ids)
        kinds["preempted"] += len(so.preempted_req_ids or ())
        kinds["spec_tokens"] += sum(len(v) for v in so.scheduled_spec_decode_tokens.values())
        kinds["max_running"] = max(kinds["max_running"], len(so.num_scheduled_tokens))
    res["kinds"] = kinds
    res["python_path_steps"] = ours.python_path_steps  # steps that needed a Python conversion (0 expected)
    return res


def run_runner_differential(
    w: Workload,
    model_dir: str,
    deferred: bool = False,
    sampler: bool = True,
    device: str = "cpu",
    fault: tuple[str, int] | None = None,
    between=None,
) -> dict:
    """vLLM's unpatched source, mtpstate applied by its plugin through vLLM's
    own ``load_general_plugins()``: the runner's methods as the plugin
    patched them, mtpstate on (``ModelRunnerV2State``), against vLLM's own
    methods, compared after every step: the state (with vLLM's device-side
    tensors, copied back after a synchronize), the whole ``BatchReqState``
    and ``idx_mapping``, every field of ``prepare_inputs``' ``InputBatch``
    (every other step padded as for a full CUDA graph), the sampler's
    values and answers.
    ``deferred`` (CPU only): mtpstate's device work on a model of a GPU's
    asynchrony (its graph path), counted per step (``ops_per_step``: each
    distinct count and how many steps had it), then run before the
    comparison. ``device="cuda"``: both runners on the GPU, vLLM's kernels
    run for real (what they write is compared by value).
    ``fault=(phase, k)``: mtpstate runs as the engine runs it (an error of
    its own hands the runner back to vLLM) and the ``k``-th call of
    ``phase`` (:mod:`mtpstate.tools.faults`) raises: the runner must agree
    with vLLM's own on every step all the same (``handed_back``: the step
    at which it was handed back). ``between(step, ref, patched)``: called
    before each step (what an engine does to its runner between steps)."""
    load_plugin()
    drv = Driver(w, model_dir)
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, drv.block_sizes, w.num_spec)
    ops = None
    if deferred:
        import torch

        from mtpstate.devices import DeferredOps

        ops = DeferredOps(torch, graphs=True)
    on_gpu = device != "cpu"
    ref = MRV2Reference(*args, sampler=sampler, device=device)
    if fault is not None:
        from mtpstate.tools import faults

        faults.inject(*fault)
    patched = MRV2Reference(
        *args, use_mtpstate=True, ops=ops, sampler=sampler, device=device, fallback=fault is not None
    )
    state = patched.mtpstate  # (a build fault: None, vLLM's own methods from the start)
    if state is None and (fault is None or fault[0] != "build"):
        raise RuntimeError("mtpstate did not attach to the runner")
    answers = state.sampler_answers if sampler and state is not None else None
    if sampler and answers is None and state is not None:
        raise RuntimeError("mtpstate did not attach to vLLM's Sampler")
    sync = synchronizer(device)
    res = _new_result(w.name)
    res["sampler_answered"] = 0
    per_step = collections.Counter()
    ids_ref = lambda rows: [ref.req_states.index_to_req_id[int(r)] for r in rows]  # noqa: E731
    ids_pat = lambda rows: [patched.req_states.index_to_req_id[int(r)] for r in rows]  # noqa: E731
    for so in drv.steps():
        if between is not None:
            between(res["steps"], ref, patched)
            state = patched.__dict__.get("_mtpstate_live", state)  # (the runner's KV cache initialized again)
            answers = state.sampler_answers if sampler and state is not None else None
        so2 = pickle.loads(pickle.dumps(so))
        # unseeded requests' seeds are vLLM's draws from numpy's global
        # generator, in add order: the same state before each side's step
        np.random.seed(res["steps"])
        ref.apply(so)
        if ops is not None:
            before = dict(ops.issued)
        np.random.seed(res["steps"])
        patched.apply(so2)
        if ops is not None:
            issued = {k: v - before.get(k, 0) for k, v in ops.issued.items() if v != before.get(k, 0)}
            per_step[json.dumps(issued, sort_keys=True)] += 1
            ops.synchronize()
        sync()
        c = Comparison()
        compare_states(c, ref.state(device=True), patched.state(device=True))
        # the whole BatchReqState: vLLM's gather (off) against StepResult.batch (on)
        vb, pb = ref.gather(so), patched.gather(so2)
        compare_batches(c, vb, ids_ref, pb, ids_pat)
        rows = pb.idx_mapping_np
        if state is not None and state.handed_back is None:
            shipped = state.idx_mapping(rows).tolist()
            c.add(None, "idx_mapping (the device tensor)", rows.tolist(), shipped, shipped == rows.tolist(), len(rows))
        elif "handed_back" not in res:
            res["handed_back"] = res["steps"]
        # prepare_inputs' results, every other step padded as for a full CUDA graph (requests and tokens)
        n = len(vb.req_ids)
        pad = None if res["steps"] % 2 else (min(n + 3, ref.max_num_reqs), vb.num_tokens + 5)
        ib_ref, ib_pat = ref.prepare(so, vb, pad), patched.prepare(so2, pb, pad)
        sync()
        compare_inputs(c, ib_ref, ids_ref, ib_pat, ids_pat, ref.decode_query_len, kernels_ran=on_gpu)
        if sampler:
            compare_sampler(c, ref, ib_ref, patched, ib_pat, launches=not on_gpu)
            res["sampler_answered"] += answers is not None and answers.idx is ib_pat.idx_mapping_np
        _record(res, c)
    if ops is not None:
        res["ops_per_step"] = dict(per_step)
    if answers is not None:  # (batches answered: of them, from the counts over the live rows)
        res["sampler_batches"], res["sampler_from_counts"] = answers.computed, answers.from_counts
    if answers is not None and answers.writer is not None:
        res["sampler_params_written"], res["sampler_params_by_vllm"] = answers.writer.written, answers.writer.by_vllm
        up = answers.writer.uploads
        res["sampler_uploads"] = None if up is None else up.uploads
    return res


def _raising(scheduler_output):
    raise RuntimeError("a fault of the shadow's own (injected)")


def _digest(ref, batch, ib) -> str:
    """Everything vLLM's runner holds and hands out after a step, as one
    hash: its state (host and device), the batch, every InputBatch field,
    the sampler's values and numpy's global RNG state (from which vLLM draws
    seeds)."""
    import dataclasses
    import hashlib

    import torch

    def plain(v):
        if isinstance(v, torch.Tensor):
            v = v.cpu().numpy()
        if isinstance(v, np.ndarray):
            return (str(v.dtype), v.shape, v.tobytes())
        return v

    parts = [ref.state(device=True), ref.sampler_state() if ref.sampler is not None else None]
    parts.append({k: plain(v) for k, v in batch._asdict().items()})  # (a NamedTuple)
    inputs = {f.name: plain(getattr(ib, f.name)) for f in dataclasses.fields(ib)}
    # (an empty tensor that vLLM's kernel fills: a no-op on the CPU shims)
    inputs["logits_indices"] = inputs["logits_indices"][:2]
    parts.append(inputs)
    state = np.random.get_state()
    parts.append((state[0], state[1].tobytes(), state[2:]))
    return hashlib.sha256(pickle.dumps(parts)).hexdigest()


def run_shadow(
    w: Workload, model_dir: str, shadowed: bool, every: int | None = None, ops=None, fault_at: int | None = None
) -> dict:
    """vLLM's own runner methods driven through ``w`` (every other step
    padded as for a full CUDA graph), with shadow mode observing them
    (``shadowed``; :func:`mtpstate.tools.vllm_bench.reference.load_plugin`
    ``(mode="shadow")`` first) or not. Returns one hash per step of all
    that vLLM's runner holds and hands out (:func:`_digest`), and with the
    shadow its report and the step each device check ran at. ``every``:
    ``MTPSTATE_SHADOW_EVERY`` for this run; ``ops``: the shadow mirror's
    device operations (a ``DeferredOps``); ``fault_at``: the shadow raises
    an exception of its own in that step (a bug of the shadow's, modelled)."""
    import os

    from mtpstate.integrations.vllm import shadow

    drv = Driver(w, model_dir)
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, drv.block_sizes, w.num_spec)
    saved = os.environ.get(shadow.EVERY_VAR)
    if every is not None:
        os.environ[shadow.EVERY_VAR] = str(every)
    if shadowed:
        import vllm.v1.worker.gpu.model_runner as runner_module

        shadow.install(runner_module, dict(shadow._METHODS), ops=ops)
    try:
        ref = MRV2Reference(*args, sampler=True, shadowed=shadowed)
        digests = []
        for step, so in enumerate(drv.steps()):
            if step == fault_at and shadowed:
                sh = shadow.shadow_of(ref)
                if sh is not None:
                    sh.after_update = _raising
            np.random.seed(step)
            ref.apply(so)
            vb = ref.gather(so)
            pad = None if step % 2 else (min(len(vb.req_ids) + 3, ref.max_num_reqs), vb.num_tokens + 5)
            ib = ref.prepare(so, vb, pad)
            digests.append(_digest(ref, vb, ib))
    finally:
        if every is not None:
            if saved is None:
                os.environ.pop(shadow.EVERY_VAR, None)
            else:
                os.environ[shadow.EVERY_VAR] = saved
    out = {"workload": w.name, "steps": len(digests), "digests": digests}
    if shadowed:
        sh = ref.__dict__.get("_mtpstate_shadow")
        out["shadow"] = None if sh is None else sh.report()
    return out
