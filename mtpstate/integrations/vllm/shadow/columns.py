"""What is compared per request, by name: the runner's request-state
columns and the sampler's per-row values, each as its host array and (where
vLLM keeps one) its device tensor. One list for the shadow and for the
differentials (``mtpstate.tools.vllm_verify``)."""

from __future__ import annotations

# the fields of vLLM's BatchReqState compared as they are (idx_mapping_np,
# rows, through each side's id map; max_seq_len_np where both sides are
# gather_batch_req_state's, which fills it only with pipeline parallelism)
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

# columns written when a request is added, and then only by vLLM's kernels
# (never by a later step's host code): compared for the step's new requests,
# and for every live request at a device check
ADDED_ONLY = ("prefill_len", "prompt_len", "max_seq_len")


def state_columns(req_states, block_tables) -> dict:
    """The request state's per-row host arrays: name -> ``[max_num_reqs]``
    array (``num_blocks[g]`` per KV-cache group)."""
    rs, bt = req_states, block_tables
    out = {
        "num_computed_tokens": rs.num_computed_tokens_np,
        "num_computed_prefill_tokens": rs.num_computed_prefill_tokens,
        "prefill_len": rs.prefill_len.np,
        "prompt_len": rs.prompt_len.np,
        "max_seq_len": rs.max_seq_len,
    }
    for g in range(bt.num_blocks.np.shape[0]):
        out[f"num_blocks[{g}]"] = bt.num_blocks.np[g]
    return out


def state_device_columns(req_states, block_tables) -> dict:
    """The request state's per-row device tensors that only the host's
    staged writes change: name -> ``[max_num_reqs]`` tensor."""
    rs, bt = req_states, block_tables
    out = {"prefill_len.gpu": rs.prefill_len.gpu, "prompt_len.gpu": rs.prompt_len.gpu}
    for g in range(bt.num_blocks.gpu.shape[0]):
        out[f"num_blocks[{g}].gpu"] = bt.num_blocks.gpu[g]
    return out


def engine_device_columns(req_states) -> dict:
    """The device tensors a new request's row is seeded with, which vLLM's
    kernels advance after every forward (compared in the step that adds it)."""
    return {"total_len.gpu": req_states.total_len.gpu, "num_computed_tokens.gpu": req_states.num_computed_tokens.gpu}


def sampler_columns(sampler) -> dict:
    """vLLM's sampler's per-row values: name -> ``(host array, device
    tensor or None)``, each ``[max_num_reqs]``."""
    s = sampler
    ss, pen, lpt = s.sampling_states, s.penalties_state, s.logprob_token_ids_state
    lb, bw = s.logits_processors[0], s.logits_processors[2]
    uva = {
        "temperature": ss.temperature,
        "top_k": ss.top_k,
        "top_p": ss.top_p,
        "min_p": ss.min_p,
        "seeds": ss.seeds,
        "repetition_penalty": pen.repetition_penalty,
        "frequency_penalty": pen.frequency_penalty,
        "presence_penalty": pen.presence_penalty,
        "num_token_ids": lpt.num_token_ids,
        # the processors' per-row values (logit bias, allowed ids, min_tokens, bad words)
        "num_allowed_token_ids": lb.num_allowed_token_ids,
        "num_logit_bias": lb.num_logit_bias,
        "min_lens": lb.min_lens,
        "num_stop_token_ids": lb.num_stop_token_ids,
        "restore_when_all_masked": lb.restore_when_all_masked,
        "num_bad_words": bw.num_bad_words,
    }
    out = {name: (t.np, t.gpu) for name, t in uva.items()}
    for name, a in (
        ("seeds_set", ss.seeds_set),
        ("num_logprobs", ss.num_logprobs),
        ("needs_logits_processing", s.needs_logits_processing),
        ("may_mask_logits", getattr(s, "may_mask_logits", None)),  # (None: a release without it, 0.33)
        ("use_penalty", pen.use_penalty),
        ("use_logit_bias", lb.use_logit_bias),
    ):
        if a is not None:
            out[name] = (a, None)
    return out


def vllm_answers(sampler, idx) -> dict:
    """The per-step questions vLLM's sampler asks of the batch ``idx``
    (its rows), answered by vLLM's own methods and numpy on its arrays."""
    import numpy as np

    s = sampler
    ss, lpt = s.sampling_states, s.logprob_token_ids_state
    lb, bw, tb = s.logits_processors[0], s.logits_processors[2], s.thinking_budget_state
    t = ss.temperature.np[idx]
    return {
        "get_logprobs_dims": type(s).get_logprobs_dims(s, idx),
        "any_greedy": type(ss).any_greedy(ss, idx),
        "any_explicit_seed": type(ss).any_explicit_seed(ss, idx),
        "max_num_logprobs": int(type(ss).max_num_logprobs(ss, idx)),
        "max_num_token_ids": int(type(lpt).max_num_token_ids(lpt, idx)),
        "needs_logits_processing": bool(np.any(s.needs_logits_processing[idx])),
        "use_penalty": bool(np.any(s.penalties_state.use_penalty[idx])),
        "use_logit_bias": bool(np.any(lb.use_logit_bias[idx])),
        "use_thinking_budget": bool(tb.enabled and np.any(tb.use_thinking_budget[idx])),
        "restore_when_all_masked": bool(np.any(lb.restore_when_all_masked.np[idx])),
        "temperature": not np.all((t == 0.0) | (t == 1.0)),
        "min_p": not np.all(ss.min_p.np[idx] == 0.0),
        "max_num_bad_words": int(bw.num_bad_words.np[idx].max()) if len(idx) else 0,
        "max_top_k": int(np.max(ss.top_k.np[idx])) if len(idx) else 0,
    }


def mtpstate_answers(sampler, answers, idx) -> dict:
    """The same questions as mtpstate answers them (``answers``: its
    ``SamplerAnswers``, computed for the batch ``idx``): the sampler's
    answered methods, and the answers' flags and maxima."""
    from mtpstate._kernels import sampler as K

    ss, lpt, f = sampler.sampling_states, sampler.logprob_token_ids_state, answers.flags
    return {
        "get_logprobs_dims": sampler.get_logprobs_dims(idx),
        "any_greedy": ss.any_greedy(idx),
        "any_explicit_seed": ss.any_explicit_seed(idx),
        "max_num_logprobs": int(ss.max_num_logprobs(idx)),
        "max_num_token_ids": int(lpt.max_num_token_ids(idx)),
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
