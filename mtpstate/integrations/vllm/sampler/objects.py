"""What of vLLM's sampler mtpstate reads and writes: the exact classes it
works with, the per-row arrays its answers read, and the arrays vLLM's
``add_request`` methods write (the writer's targets)."""

from __future__ import annotations

import inspect

import numpy as np

# the exact classes whose methods attach() replaces: attribute path -> (module, class)
_CLASSES = {
    "": ("vllm.v1.worker.gpu.sample.sampler", "Sampler"),
    "sampling_states": ("vllm.v1.worker.gpu.sample.states", "SamplingStates"),
    "penalties_state": ("vllm.v1.worker.gpu.sample.penalties", "PenaltiesState"),
    "logprob_token_ids_state": ("vllm.v1.worker.gpu.sample.logprob", "LogprobTokenIdsState"),
    "thinking_budget_state": ("vllm.v1.worker.gpu.sample.thinking_budget", "ThinkingBudgetState"),
}
_LOGIT_BIAS = ("vllm.v1.worker.gpu.sample.logit_bias", "LogitBiasState")
_BAD_WORDS = ("vllm.v1.worker.gpu.sample.bad_words", "BadWordsState")


def _is(obj, where) -> bool:
    t = type(obj)
    return (t.__module__, t.__qualname__) == where


def _builtin_processors(sampler):
    # Sampler.__init__'s list: logit bias, penalties, bad words, then custom ones
    procs = getattr(sampler, "logits_processors", None)
    if not isinstance(procs, list) or len(procs) < 3:
        return None
    lb, pen, bw = procs[:3]
    if not (_is(lb, _LOGIT_BIAS) and pen is getattr(sampler, "penalties_state", None) and _is(bw, _BAD_WORDS)):
        return None
    return lb, bw


def top_k_top_p_takes_vocab(sampling_states) -> bool:
    """Whether the release's ``SamplingStates.get_top_k_top_p`` takes the
    vocab size and answers ``(top_k, top_p, has_topp_only_rows)`` (0.33 on),
    or answers ``(top_k, top_p)`` without it (0.32)."""
    method = type(sampling_states).get_top_k_top_p
    return "vocab_size" in inspect.signature(method).parameters


def _arrays(sampler, R: int):
    # the per-row arrays sp_answers reads, in _K.SP_ARRAYS order
    ss = sampler.sampling_states
    lb, bw = _builtin_processors(sampler)
    return (
        (ss.temperature.np, np.float32),
        (ss.top_k.np, np.int32),
        (ss.top_p.np, np.float32),
        (ss.min_p.np, np.float32),
        (ss.seeds_set, np.bool_),
        (ss.num_logprobs, np.int32),
        (sampler.needs_logits_processing, np.bool_),
        (sampler.penalties_state.use_penalty, np.bool_),
        (sampler.logprob_token_ids_state.num_token_ids.np, np.int32),
        (lb.use_logit_bias, np.bool_),
        (bw.num_bad_words.np, np.int32),
        (_thinking_rows(sampler.thinking_budget_state, R), np.bool_),
        (lb.restore_when_all_masked.np, np.int32),
    )


def _thinking_rows(tb, R: int) -> np.ndarray:
    # a disabled ThinkingBudgetState has no per-row array: no row uses it
    if not tb.enabled:
        return np.zeros(R, dtype=bool)
    return tb.use_thinking_budget


def _writer_reason(sampler) -> str | None:
    # what keeps every request on vLLM's own add_request
    if sampler.thinking_budget_state.enabled:
        return "a thinking budget is configured"
    if getattr(sampler, "trace_replay_state", None) is not None:
        return "trace replay is enabled"
    if len(sampler.logits_processors) != 3:
        return "custom logits processors are configured"
    return None


def _targets(sampler):
    # sp_write's targets, in _P.SP_TARGETS order, with their dtypes: vLLM's
    # UvaBackedTensors (host side .np) and its host-only arrays
    ss, pen, lpt = sampler.sampling_states, sampler.penalties_state, sampler.logprob_token_ids_state
    lb, bw = _builtin_processors(sampler)
    i32, f32, b = np.int32, np.float32, np.bool_
    may_mask = getattr(sampler, "may_mask_logits", None)
    if may_mask is None:  # (a release whose sampler keeps none, 0.33: the writer's own array takes it)
        may_mask = np.zeros(sampler.needs_logits_processing.shape, np.bool_)
    return (
        (ss.temperature, f32),
        (ss.top_k, i32),
        (ss.top_p, f32),
        (ss.min_p, f32),
        (ss.seeds_set, b),
        (ss.seeds, np.int64),
        (ss.num_logprobs, i32),
        (sampler.needs_logits_processing, b),
        (may_mask, b),
        (pen.repetition_penalty, f32),
        (pen.frequency_penalty, f32),
        (pen.presence_penalty, f32),
        (pen.use_penalty, b),
        (lb.num_allowed_token_ids, i32),
        (lb.num_logit_bias, i32),
        (lb.min_lens, i32),
        (lb.num_stop_token_ids, i32),
        (lb.restore_when_all_masked, i32),
        (lb.use_logit_bias, b),
        (bw.num_bad_words, i32),
        (lpt.num_token_ids, i32),
        (lb.prompt_len_np, i32),  # (read: min_lens = prompt_len + min_tokens)
    )


def _host(target) -> np.ndarray:
    # a target's host array: a UvaBackedTensor's .np, or the array itself
    return target if isinstance(target, np.ndarray) else target.np


def _uva_tensors(sampler):
    # the UvaBackedTensors among the writer's targets: the ones with a device side
    return tuple(t for t, _ in _targets(sampler) if not isinstance(t, np.ndarray))
