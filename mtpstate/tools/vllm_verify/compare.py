"""What is compared after a step, vLLM against mtpstate: per request id,
every state field (and vLLM's device-side tensors); the batch; every field
of prepare_inputs' ``InputBatch``; the sampler's per-row values and its
answers. Each comparison counts the values it compared and keeps every
disagreement in full (request id, field, both values)."""

from __future__ import annotations

import dataclasses

import numpy as np

from mtpstate.integrations.vllm.shadow.checks import Disagreement
from mtpstate.integrations.vllm.shadow.columns import BATCH_FIELDS


class Comparison:
    """A step's comparison: ``values`` compared, ``bad`` (disagreements)."""

    def __init__(self):
        self.values = 0
        self.bad: list[Disagreement] = []

    def add(self, req_id, field, vllm, mtpstate, same: bool, n: int = 1) -> None:
        """``n`` values of ``field`` compared; record them if not ``same``."""
        self.values += n
        if not same:
            self.bad.append(Disagreement(req_id, field, vllm, mtpstate))

    def __bool__(self) -> bool:
        return bool(self.bad)


def _count(v) -> int:
    return len(v) if isinstance(v, list) else 1


def table_state(t) -> dict:
    """Per request id, the fields the comparison covers, from an mtpstate
    table (``RequestTable`` or a loop table of ``mtpstate.tools.reference``)."""
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


def compare_states(c: Comparison, ref: dict, got: dict, what: str = "") -> None:
    """Per request id and field (``what``: a prefix for the field names)."""
    only_ref, only_got = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    c.add(None, f"{what}live request ids (only on one side)", only_ref, only_got, not (only_ref or only_got))
    for rid in sorted(set(ref) & set(got)):
        for k, v in ref[rid].items():
            c.add(rid, what + k, v, got[rid][k], got[rid][k] == v, _count(v))


def compare_batches(c: Comparison, ref, ref_ids_of_rows, got, got_ids_of_rows) -> None:
    """vLLM's ``BatchReqState`` against mtpstate's, field by field;
    ``idx_mapping_np`` through each side's own rows."""
    if got is None:
        c.add(None, "batch", "a BatchReqState", None, False)
        return
    c.add(None, "batch.req_ids", list(ref.req_ids), list(got.req_ids), list(got.req_ids) == list(ref.req_ids))
    for f in BATCH_FIELDS:
        a, b = getattr(ref, f), getattr(got, f)
        if a is None or b is None or not isinstance(a, np.ndarray):
            same = (a is None) == (b is None) and (a is None or a == b)
            n = 1
        else:
            same = a.dtype == b.dtype and np.array_equal(a, b)
            n = a.size
        c.add(None, f"batch.{f}", a, b, bool(same), n)
    a, b = ref_ids_of_rows(ref.idx_mapping_np), got_ids_of_rows(got.idx_mapping_np)
    c.add(None, "batch.idx_mapping_np (as request ids)", a, b, a == b, len(a))
    c.add(
        None,
        "batch.idx_mapping_np.dtype",
        ref.idx_mapping_np.dtype,
        got.idx_mapping_np.dtype,
        got.idx_mapping_np.dtype == ref.idx_mapping_np.dtype,
    )


# InputBatch fields written on the device by prepare_inputs' Triton kernels:
# where those are no-ops (the CPU shims), compared by shape and dtype only
KERNEL_WRITTEN = ("input_ids", "positions", "seq_lens", "logits_indices")
# expand_idx_mapping's outputs with drafts: where vLLM's kernel is a no-op,
# mtpstate's (which computes them) are compared with that kernel as a loop
EXPANDED = ("expanded_idx_mapping", "expanded_local_pos")
ROW_FIELDS = ("idx_mapping", "idx_mapping_np")  # rows: compared through each side's own id map


def compare_inputs(
    c: Comparison, ref, ref_ids_of_rows, got, got_ids_of_rows, decode_query_len=1, kernels_ran: bool = False
) -> None:
    """Two ``InputBatch``es of ``prepare_inputs``, every dataclass field:
    arrays and tensors by dtype, shape and values (rows through each side's
    own id map), the rest by ``==``. ``kernels_ran``: vLLM's Triton kernels
    really ran (a GPU), so what they write is compared by value too; else
    by dtype and shape, and with drafts ``got``'s expanded arrays against
    vLLM's ``expand_idx_mapping`` as a loop over ``ref``'s inputs."""
    import torch

    from mtpstate.tools.reference import vllm_expand_idx_mapping

    drafted = ref.num_draft_tokens_per_req is not None and not kernels_ran
    want = {}
    if drafted:
        want = vllm_expand_idx_mapping(ref.idx_mapping.cpu().numpy(), ref.cu_num_logits.cpu().numpy(), decode_query_len)
        want = dict(zip(EXPANDED, want)) if (want[1] >= 0).all() else {}  # (-1: left unwritten by vLLM)
    for fld in dataclasses.fields(ref):
        f = fld.name
        a, b = getattr(ref, f), getattr(got, f)
        if (a is None) != (b is None):
            c.add(None, f"input_batch.{f}", a, b, False)
            continue
        if isinstance(a, (np.ndarray, torch.Tensor)):
            if type(a) is not type(b) or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
                kind = (type(a).__name__, a.dtype, tuple(a.shape))
                c.add(None, f"input_batch.{f} (type, dtype, shape)", kind, b, False)
                continue
            if (f in KERNEL_WRITTEN and not kernels_ran) or (f in EXPANDED and drafted and f not in want):
                c.add(None, f"input_batch.{f} (dtype, shape)", a.dtype, b.dtype, True)
                continue
            va = np.asarray(a.cpu() if isinstance(a, torch.Tensor) else a)
            vb = np.asarray(b.cpu() if isinstance(b, torch.Tensor) else b)
            if f in EXPANDED and drafted:
                va = want[f]
            if f in ROW_FIELDS or f == "expanded_idx_mapping":
                ia, ib = ref_ids_of_rows(va.tolist()), got_ids_of_rows(vb.tolist())
                c.add(None, f"input_batch.{f} (as request ids)", ia, ib, ia == ib, va.size)
            else:
                c.add(None, f"input_batch.{f}", va, vb, bool(np.array_equal(va, vb)), va.size)
        elif f in ("fast_prefill", "dcp_local_seq_lens"):
            c.add(None, f"input_batch.{f} (not compared when set)", a, None, a is None)
        else:
            c.add(None, f"input_batch.{f}", a, b, bool(a == b))


def compare_sampler(c: Comparison, ref, ib_ref, patched, ib_pat, launches: bool = True) -> None:
    """The sampler, vLLM's runner off vs on: every per-row value per request
    id (host arrays and device tensors), the answers to its per-step
    questions for the batch (off: vLLM's numpy; on: mtpstate's), with
    ``launches`` (the CPU shims count them) which launchers ran with which
    flags, and on the patched side each answered method against vLLM's own
    on the same arrays."""
    compare_states(c, ref.sampler_state(), patched.sampler_state(), "sampler.")
    if launches:
        got_ref, launched_ref = _launching(ref.sample_questions, ib_ref)
        got_pat, launched_pat = _launching(patched.sample_questions, ib_pat)
        c.add(None, "sampler launches", launched_ref, launched_pat, launched_ref == launched_pat)
    else:
        got_ref, got_pat = ref.sample_questions(ib_ref), patched.sample_questions(ib_pat)
    for name, a, b in zip(("logprobs_dims", "top_k", "top_p", "has_topp_only_rows", "fused"), got_ref, got_pat):
        a, b = (x.tolist() if hasattr(x, "tolist") else x for x in (a, b))
        c.add(None, f"sampler {name}", a, b, a == b and type(a) is type(b), _count(a))
    state = patched.mtpstate
    if getattr(state, "handed_back", "") is None:  # (after a hand-back: vLLM's answers on both sides)
        compare_answers(c, patched.sampler, state.sampler_answers, ib_pat)


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


def compare_answers(c: Comparison, s, answers, ib) -> None:
    """Each sampler method mtpstate answers for the batch of ``ib``, against
    the class's own (vLLM's) method on the same arrays, and the skip checks
    (processing, penalties, logit bias, bad words, thinking budget,
    temperature, min-p) against vLLM's numpy."""
    from mtpstate.integrations.vllm.sampler.objects import top_k_top_p_takes_vocab
    from mtpstate.integrations.vllm.shadow.columns import mtpstate_answers, vllm_answers
    from mtpstate.tools.vllm_bench.workloads import VOCAB

    idx, eim = ib.idx_mapping_np, ib.expanded_idx_mapping
    c.add(None, "sampler: answered for this batch", True, answers.idx is idx, answers.idx is idx)
    if answers.idx is not idx:
        return
    ss = s.sampling_states
    takes_vocab = top_k_top_p_takes_vocab(ss)
    for v in (VOCAB, VOCAB - 1, 50, 1) if takes_vocab else (None,):
        args = (eim, idx, v) if takes_vocab else (eim, idx)
        a, b = _plain(type(ss).get_top_k_top_p(ss, *args)), _plain(ss.get_top_k_top_p(*args))
        c.add(None, f"sampler.get_top_k_top_p(vocab={v})", a, b, a == b)
    want, got = vllm_answers(s, idx), mtpstate_answers(s, answers, idx)
    for k, v in want.items():
        a, b = _plain(v), _plain(got[k])
        c.add(None, f"sampler answer {k}", a, b, a == b)
