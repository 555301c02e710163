"""The differentials against vLLM 0.34.0's own code: per-request state and
batch diffs, the bare-table run (with the legacy negative control) and the
runner through mtpstate's plugin, compared after every step."""

from __future__ import annotations

import collections
import json
import pickle

import numpy as np

from mtpstate.tools.vllm_bench.driver import Driver
from mtpstate.tools.vllm_bench.reference import MRV2Reference, load_plugin
from mtpstate.tools.vllm_bench.workloads import Workload


def table_state(t) -> dict:
    """The same fields from an mtpstate table (RequestTable or a loop table)."""
    out = {}
    if hasattr(t, "index"):
        pairs = [(t.index.req_id(int(r)), int(r)) for r in t.index.live_rows()]
    else:
        pairs = list(t.req_id_to_index.items())
    for rid, r in pairs:
        pl = int(t.prefill_len[r])
        nb = [int(t.num_blocks[g, r]) for g in range(t.num_groups)]
        out[rid] = {
            "num_computed_tokens": int(t.num_computed_tokens[r]),
            "num_computed_prefill_tokens": int(t.num_computed_prefill_tokens[r]),
            "prefill_len": pl,
            "prompt_len": int(t.prompt_len[r]),
            "max_seq_len": int(t.max_seq_len[r]),
            "num_blocks": nb,
            "blocks": [t.block_tables[g][r, : nb[g]].tolist() for g in range(t.num_groups)],
            "prefill_token_ids": t.token_ids[r, :pl].tolist(),
            "is_prefilling": bool(t.is_prefilling(np.array([r]))[0]),
        }
    return out


def diff_states(ref: dict, got: dict, limit: int = 5) -> list[str]:
    """Disagreements, per request id and field (empty: they agree)."""
    out = []
    if set(ref) != set(got):
        a, b = sorted(set(ref) - set(got))[:3], sorted(set(got) - set(ref))[:3]
        out.append(f"live ids: only in vLLM {a}, only here {b}")
    for rid in sorted(set(ref) & set(got)):
        for k, v in ref[rid].items():
            if got[rid][k] != v:
                out.append(f"{rid!r}.{k}: vLLM {str(v)[:60]} vs {str(got[rid][k])[:60]}")
                if len(out) >= limit:
                    return out
    return out


BATCH_FIELDS = (
    "num_scheduled_tokens",
    "num_tokens",
    "num_draft_tokens_np",
    "prefill_len_np",
    "num_computed_prefill_tokens_np",
    "is_prefilling_np",
    "has_prefill",
    "prefill_runs_as_decode_np",
    "decode_graph_eligible",
)


def diff_batches(ref, ref_ids_of_rows, got, got_ids_of_rows) -> list[str]:
    """Disagreements between vLLM's ``BatchReqState`` and mtpstate's batch,
    field by field; ``idx_mapping_np`` through each side's own rows."""
    if got is None:
        return ["batch: None"]
    out = []
    if list(got.req_ids) != list(ref.req_ids):
        out.append(f"batch.req_ids: vLLM {list(ref.req_ids)[:4]} vs {list(got.req_ids)[:4]}")
    for f in BATCH_FIELDS:
        a, b = getattr(ref, f), getattr(got, f)
        if a is None or b is None or not isinstance(a, np.ndarray):
            same = (a is None) == (b is None) and (a is None or a == b)
        else:
            same = a.dtype == b.dtype and np.array_equal(a, b)
        if not same:
            out.append(f"batch.{f}: vLLM {str(a)[:60]} vs {str(b)[:60]}")
    if ref_ids_of_rows(ref.idx_mapping_np) != got_ids_of_rows(got.idx_mapping_np):
        out.append("batch.idx_mapping_np: rows map to other ids")
    if got.idx_mapping_np.dtype != ref.idx_mapping_np.dtype:
        out.append(f"batch.idx_mapping_np dtype {got.idx_mapping_np.dtype}")
    return out


# InputBatch fields written on the device by prepare_inputs' Triton kernels
# (no-ops on the CPU): their shape and dtype are compared, not their values
KERNEL_WRITTEN = ("input_ids", "positions", "seq_lens", "logits_indices")
# expand_idx_mapping's outputs with drafts: vLLM's kernel is a no-op here, so
# mtpstate's (which computes them) are compared with that kernel as a loop
EXPANDED = ("expanded_idx_mapping", "expanded_local_pos")
ROW_FIELDS = ("idx_mapping", "idx_mapping_np")  # rows: compared through each side's own id map


def diff_inputs(ref, ref_ids_of_rows, got, got_ids_of_rows, decode_query_len=1) -> list[str]:
    """Disagreements between two ``InputBatch``es of ``prepare_inputs``,
    field by field (every dataclass field): arrays and tensors by dtype,
    shape and values (rows through each side's own id map; what only the
    no-op'd Triton kernels write, by dtype and shape; with drafts, ``got``'s
    expanded arrays against vLLM's ``expand_idx_mapping`` as a loop over
    ``ref``'s inputs), the rest by ``==``."""
    import dataclasses

    import torch

    from mtpstate.tools.reference import vllm_expand_idx_mapping

    out = []
    drafted = ref.num_draft_tokens_per_req is not None
    if drafted:
        want = vllm_expand_idx_mapping(ref.idx_mapping.cpu().numpy(), ref.cu_num_logits.cpu().numpy(), decode_query_len)
        want = dict(zip(EXPANDED, want)) if (want[1] >= 0).all() else {}  # (-1: left unwritten by vLLM)
    for fld in dataclasses.fields(ref):
        f = fld.name
        a, b = getattr(ref, f), getattr(got, f)
        if (a is None) != (b is None):
            out.append(f"input_batch.{f}: vLLM {a!r:.60} vs {b!r:.60}")
            continue
        if isinstance(a, (np.ndarray, torch.Tensor)):
            if type(a) is not type(b) or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
                out.append(f"input_batch.{f}: vLLM {type(a).__name__} {a.dtype} {tuple(a.shape)} vs {b!r:.80}")
                continue
            if f in KERNEL_WRITTEN or (f in EXPANDED and drafted and f not in want):
                continue
            va, vb = np.asarray(a.cpu() if isinstance(a, torch.Tensor) else a), None
            vb = np.asarray(b.cpu() if isinstance(b, torch.Tensor) else b)
            if f in EXPANDED and drafted:
                va = want[f]
            if f in ROW_FIELDS or f == "expanded_idx_mapping":
                same = ref_ids_of_rows(va.tolist()) == got_ids_of_rows(vb.tolist())
            else:
                same = np.array_equal(va, vb)
            if not same:
                out.append(f"input_batch.{f}: vLLM {va[:6]} vs {vb[:6]}")
        elif f in ("fast_prefill", "dcp_local_seq_lens"):
            if a is not None:
                out.append(f"input_batch.{f}: not compared (set)")
        elif a != b:
            out.append(f"input_batch.{f}: vLLM {a!r:.60} vs {b!r:.60}")
    return out


def run_workload(w: Workload, model_dir: str, check_pickled: bool = True, control: bool = True) -> dict:
    """Drive ``w``; compare mtpstate (and a pickled copy of each step) with the
    reference after every step. Returns counts of steps and disagreements."""
    import mtpstate
    from mtpstate.tools.reference import LegacyRequestTable

    drv = Driver(w, model_dir)
    kw = dict(max_num_reqs=w.max_num_seqs, max_model_len=w.max_model_len, block_sizes=drv.block_sizes)
    ref = MRV2Reference(w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, drv.block_sizes, w.num_spec)
    ours = mtpstate.RequestTable(**kw, decode_query_len=w.num_spec + 1)
    ours_pickled = mtpstate.RequestTable(**kw, decode_query_len=w.num_spec + 1) if check_pickled else None
    legacy = LegacyRequestTable(**kw) if control else None
    ref_ids = lambda rows: [ref.req_states.index_to_req_id[int(r)] for r in rows]  # noqa: E731
    res = {"workload": w.name, "steps": 0, "disagreements": 0, "control_disagreements": 0, "first": []}
    kinds = {
        "new": 0,
        "cached": 0,
        "finished": 0,
        "preempted": 0,
        "spec_tokens": 0,
        "max_running": 0,
        "prefix_hits": 0,
        "prompt_embeds": 0,
    }
    for so in drv.steps():
        blob = pickle.dumps(so)
        ref.apply(so)
        got = ours.apply(so).batch
        expect = ref.state()
        bad = diff_states(expect, table_state(ours))
        vbatch = ref.gather(so)
        bad += diff_batches(vbatch, ref_ids, got, lambda rows: [ours.index.req_id(int(r)) for r in rows])
        if ours_pickled is not None:
            got = ours_pickled.apply(pickle.loads(blob)).batch
            bad += [f"(pickled) {b}" for b in diff_states(expect, table_state(ours_pickled))]
            ids_p = lambda rows: [ours_pickled.index.req_id(int(r)) for r in rows]  # noqa: E731
            bad += [f"(pickled) {b}" for b in diff_batches(vbatch, ref_ids, got, ids_p)]
        res["batch_steps"] = res.get("batch_steps", 0) + 1
        if legacy is not None:
            legacy.apply(pickle.loads(blob))
            if diff_states(expect, table_state(legacy), limit=1):
                res["control_disagreements"] += 1
        res["steps"] += 1
        if bad:
            res["disagreements"] += 1
            if len(res["first"]) < 3:
                res["first"].append((res["steps"], bad[:5]))
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


def diff_sampler(ref, ib_ref, patched, ib_pat) -> list[str]:
    """The sampler, vLLM's runner off vs on: every per-row value per request
    id (host arrays and device tensors), the answers to its per-step
    questions for the batch (off: vLLM's numpy; on: mtpstate's), and on the
    patched side each answered method against vLLM's own on the same
    arrays."""
    bad = diff_states(ref.sampler_state(), patched.sampler_state())
    got_ref, launched_ref = _launching(ref.sample_questions, ib_ref)
    got_pat, launched_pat = _launching(patched.sample_questions, ib_pat)
    if launched_ref != launched_pat:  # (which launchers ran, with their flag and size arguments)
        bad.append(f"sampler launches: vLLM {launched_ref} vs mtpstate's {launched_pat}")
    for name, a, b in zip(("logprobs_dims", "top_k", "top_p", "has_topp_only_rows", "fused"), got_ref, got_pat):
        a, b = (x.tolist() if hasattr(x, "tolist") else x for x in (a, b))
        if a != b or type(a) is not type(b):
            bad.append(f"sampler {name}: vLLM {a!r} vs {b!r}")
    return bad + answered_vs_vllm(patched.sampler, patched.mtpstate.sampler_answers, ib_pat)


def _launching(sample_questions, ib):
    """``sample_questions(ib)``, and the sampler launchers it called (the
    CPU shims' no-ops) with their arguments that are not tensors."""
    import torch

    from mtpstate.tools.vllm_bench.shims import sampler_launchers

    launchers = sampler_launchers()
    before = {name: f.calls for name, f in launchers.items()}
    got = sample_questions(ib)
    launched = {}
    for name, f in launchers.items():
        if f.calls != before[name]:
            args, kwargs = f.last
            plain = [a for a in (*args, *kwargs.values()) if not isinstance(a, torch.Tensor)]
            launched[name] = (f.calls - before[name], plain)
    return got, launched


def _plain(x):
    if isinstance(x, tuple):
        return tuple(_plain(y) for y in x)
    return x.tolist() if hasattr(x, "tolist") else x


def answered_vs_vllm(s, answers, ib) -> list[str]:
    """Each sampler method mtpstate answers for the batch of ``ib``, against
    the class's own (vLLM's) method on the same arrays, and the skip checks
    (processing, penalties, logit bias, bad words, thinking budget,
    temperature, min-p) against vLLM's numpy."""
    from mtpstate._kernels import sampler as K
    from mtpstate.tools.vllm_bench.workloads import VOCAB

    idx, eim = ib.idx_mapping_np, ib.expanded_idx_mapping
    if answers.idx is not idx:
        return ["sampler: mtpstate did not answer for this batch"]
    ss, lpt = s.sampling_states, s.logprob_token_ids_state
    cases = {
        "get_logprobs_dims": (s, "get_logprobs_dims", (idx,)),
        "any_greedy": (ss, "any_greedy", (idx,)),
        "any_explicit_seed": (ss, "any_explicit_seed", (idx,)),
        "max_num_logprobs": (ss, "max_num_logprobs", (idx,)),
        "max_num_token_ids": (lpt, "max_num_token_ids", (idx,)),
    }
    for v in (VOCAB, VOCAB - 1, 50, 1):
        cases[f"get_top_k_top_p(vocab={v})"] = (ss, "get_top_k_top_p", (eim, idx, v))
    bad = []
    for name, (obj, meth, args) in cases.items():
        a, b = _plain(getattr(type(obj), meth)(obj, *args)), _plain(getattr(obj, meth)(*args))
        if a != b:
            bad.append(f"sampler.{name}: vLLM {a!r} vs mtpstate's {b!r}")
    lb, bw, tb = s.logits_processors[0], s.logits_processors[2], s.thinking_budget_state
    t = ss.temperature.np[idx]
    want = {
        "needs_logits_processing": bool(np.any(s.needs_logits_processing[idx])),
        "use_penalty": bool(np.any(s.penalties_state.use_penalty[idx])),
        "use_logit_bias": bool(np.any(lb.use_logit_bias[idx])),
        "use_thinking_budget": bool(tb.enabled and np.any(tb.use_thinking_budget[idx])),
        "restore_when_all_masked": bool(np.any(lb.restore_when_all_masked.np[idx])),
        "temperature": not np.all((t == 0.0) | (t == 1.0)),
        "min_p": not np.all(ss.min_p.np[idx] == 0.0),
        "max_num_bad_words": int(bw.num_bad_words.np[idx].max()),
        "max_top_k": int(np.max(ss.top_k.np[idx])),
    }
    f = answers.flags
    got = {
        "needs_logits_processing": bool(f & K.SP_NEEDS_PROCESSING),
        "use_penalty": bool(f & K.SP_USE_PENALTY),
        "use_logit_bias": bool(f & K.SP_USE_LOGIT_BIAS),
        "use_thinking_budget": bool(f & K.SP_USE_THINKING_BUDGET),
        "restore_when_all_masked": bool(f & K.SP_RESTORE_WHEN_MASKED),
        "temperature": bool(f & K.SP_TEMPERATURE),
        "min_p": bool(f & K.SP_MIN_P),
        "max_num_bad_words": answers.max_num_bad_words,
        "max_top_k": answers.max_top_k,
    }
    return bad + [f"sampler {k}: vLLM {v} vs mtpstate's {got[k]}" for k, v in want.items() if got[k] != v]


def run_runner_differential(w: Workload, model_dir: str, deferred: bool = False, sampler: bool = True) -> dict:
    """vLLM's unpatched source, mtpstate applied by its plugin through vLLM's
    own ``load_general_plugins()``: the runner's methods as the plugin
    patched them, mtpstate on (``ModelRunnerV2State``), against vLLM's own
    methods, compared after every step:
    the state, and the whole ``BatchReqState`` of ``gather_batch_req_state``
    (on: built from ``StepResult.batch``), plus ``idx_mapping``.
    ``deferred``: mtpstate's device work on a model of a GPU's asynchrony
    (its graph path), counted per step (``ops_per_step``: each distinct
    count and how many steps had it), then run before the comparison (vLLM's
    own code reads the tensors at once on the CPU)."""
    load_plugin()
    drv = Driver(w, model_dir)
    args = (w.max_num_seqs, w.max_model_len, w.max_num_batched_tokens, drv.block_sizes, w.num_spec)
    ops = None
    if deferred:
        import torch

        from mtpstate.devices import DeferredOps

        ops = DeferredOps(torch, graphs=True)
    ref = MRV2Reference(*args, sampler=sampler)
    patched = MRV2Reference(*args, use_mtpstate=True, ops=ops, sampler=sampler)
    answers = patched.mtpstate.sampler_answers if sampler else None
    if sampler and answers is None:
        raise RuntimeError("mtpstate did not attach to vLLM's Sampler")
    res = {"workload": w.name, "steps": 0, "disagreements": 0, "first": [], "sampler_answered": 0}
    per_step = collections.Counter()
    ids_ref = lambda rows: [ref.req_states.index_to_req_id[int(r)] for r in rows]  # noqa: E731
    ids_pat = lambda rows: [patched.req_states.index_to_req_id[int(r)] for r in rows]  # noqa: E731
    for so in drv.steps():
        blob = pickle.dumps(so)
        so2 = pickle.loads(blob)
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
        bad = diff_states(ref.state(device=True), patched.state(device=True))
        # the whole BatchReqState: vLLM's gather (off) against StepResult.batch (on)
        bad += diff_batches(ref.gather(so), ids_ref, patched.gather(so2), ids_pat)
        rows = patched.gather(so2).idx_mapping_np
        if patched.mtpstate.idx_mapping(rows).tolist() != rows.tolist():
            bad.append("idx_mapping: the tensor differs from the batch's idx_mapping_np")
        # prepare_inputs' host results (its Triton kernels are no-ops here)
        vb, pb = ref.gather(so), patched.gather(so2)
        # every other step padded as for a full CUDA graph (requests and tokens)
        n = len(vb.req_ids)
        pad = None if res["steps"] % 2 else (min(n + 3, ref.max_num_reqs), vb.num_tokens + 5)
        ib_ref, ib_pat = ref.prepare(so, vb, pad), patched.prepare(so2, pb, pad)
        bad += diff_inputs(ib_ref, ids_ref, ib_pat, ids_pat, ref.decode_query_len)
        if sampler:
            bad += diff_sampler(ref, ib_ref, patched, ib_pat)
            res["sampler_answered"] += answers.idx is ib_pat.idx_mapping_np
        res["steps"] += 1
        if bad:
            res["disagreements"] += 1
            if len(res["first"]) < 3:
                res["first"].append((res["steps"], bad[:5]))
    if ops is not None:
        res["ops_per_step"] = dict(per_step)
    if sampler:  # (batches answered: of them, from the counts over the live rows)
        res["sampler_batches"], res["sampler_from_counts"] = answers.computed, answers.from_counts
    if sampler and answers.writer is not None:
        res["sampler_params_written"], res["sampler_params_by_vllm"] = answers.writer.written, answers.writer.by_vllm
        up = answers.writer.uploads
        res["sampler_uploads"] = None if up is None else up.uploads
    return res
