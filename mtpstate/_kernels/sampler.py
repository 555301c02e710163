"""The sampler's per-step answers over a batch: one pass over the batch's
rows of an engine's per-row sampling arrays, read by address (vLLM's
``SamplingStates`` / ``PenaltiesState`` / ``Sampler`` arrays), instead of a
fancy index and a reduction per question.

The answers are bit flags plus maxima; ``mtpstate.integrations.vllm``'s
sampler glue turns them into the values vLLM's methods return. Comparisons
are numpy's: float32 values against the exact constants 0, 1 (a NaN
temperature is neither, so temperature "applies", as ``np.all`` says).
"""

from __future__ import annotations

from mtpstate._kernels.jit import jit
from mtpstate._kernels.native import view_f32, view_i32, view_i64, view_u8

# flags (bit i set: the batch has at least one such row)
SP_ANY_GREEDY = 1  # temperature == 0
SP_ANY_SEED = 2  # seeds_set
SP_DO_TOP_K = 4  # top_k != vocab
SP_DO_TOP_P = 8  # top_p != 1
SP_TEMPERATURE = 16  # temperature not in {0, 1}: apply_temperature launches
SP_MIN_P = 32  # min_p != 0: apply_min_p launches
SP_NEEDS_PROCESSING = 64  # needs_logits_processing
SP_USE_PENALTY = 128  # use_penalty
SP_USE_LOGIT_BIAS = 256  # use_logit_bias
SP_USE_THINKING_BUDGET = 512  # use_thinking_budget

# sp_answers' addresses, in this order (each array [max_num_reqs])
SP_ARRAYS = (
    "temperature",  # float32
    "top_k",  # int32
    "top_p",  # float32
    "min_p",  # float32
    "seeds_set",  # bool
    "num_logprobs",  # int32
    "needs_logits_processing",  # bool
    "use_penalty",  # bool
    "num_token_ids",  # int32
    "use_logit_bias",  # bool
    "num_bad_words",  # int32
    "use_thinking_budget",  # bool
)


@jit
def sp_answers(
    idx_addr,
    n,
    R,
    vocab,
    temperature_addr,
    top_k_addr,
    top_p_addr,
    min_p_addr,
    seeds_set_addr,
    num_logprobs_addr,
    needs_addr,
    use_penalty_addr,
    num_token_ids_addr,
    use_logit_bias_addr,
    num_bad_words_addr,
    use_thinking_budget_addr,
):
    """The answers for the ``n`` rows at ``idx_addr`` (intp, each in
    [0, R)): ``(flags, max num_logprobs, max num_token_ids (0 for none),
    max top_k, max top_k over rows with top_p < 1 (-1: none), max
    num_bad_words)``."""
    idx = view_i64(idx_addr, n)  # [n]
    temperature = view_f32(temperature_addr, R)  # [R]
    top_k = view_i32(top_k_addr, R)
    top_p = view_f32(top_p_addr, R)
    min_p = view_f32(min_p_addr, R)
    seeds_set = view_u8(seeds_set_addr, R)
    num_logprobs = view_i32(num_logprobs_addr, R)
    needs = view_u8(needs_addr, R)
    use_penalty = view_u8(use_penalty_addr, R)
    num_token_ids = view_i32(num_token_ids_addr, R)
    use_logit_bias = view_u8(use_logit_bias_addr, R)
    num_bad_words = view_i32(num_bad_words_addr, R)
    use_thinking_budget = view_u8(use_thinking_budget_addr, R)
    flags = 0
    max_logprobs = -(1 << 31)
    max_token_ids = 0
    max_top_k = -(1 << 31)
    max_top_k_top_p = -1
    max_bad_words = -(1 << 31)
    for i in range(n):
        r = idx[i]
        t = temperature[r]
        k = top_k[r]
        p = top_p[r]
        if t == 0.0:
            flags |= SP_ANY_GREEDY
        elif t != 1.0:
            flags |= SP_TEMPERATURE
        if k != vocab:
            flags |= SP_DO_TOP_K
        if p != 1.0:
            flags |= SP_DO_TOP_P
        if p < 1.0 and k > max_top_k_top_p:
            max_top_k_top_p = k
        if min_p[r] != 0.0:
            flags |= SP_MIN_P
        if seeds_set[r] != 0:
            flags |= SP_ANY_SEED
        if needs[r] != 0:
            flags |= SP_NEEDS_PROCESSING
        if use_penalty[r] != 0:
            flags |= SP_USE_PENALTY
        if use_logit_bias[r] != 0:
            flags |= SP_USE_LOGIT_BIAS
        if use_thinking_budget[r] != 0:
            flags |= SP_USE_THINKING_BUDGET
        max_bad_words = max(max_bad_words, num_bad_words[r])
        max_logprobs = max(max_logprobs, num_logprobs[r])
        max_token_ids = max(max_token_ids, num_token_ids[r])
        max_top_k = max(max_top_k, k)
    return flags, max_logprobs, max_token_ids, max_top_k, max_top_k_top_p, max_bad_words
