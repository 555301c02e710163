"""The sampler's per-step answers (``_kernels.sampler.sp_answers``) against
numpy written as vLLM 0.34's sampler computes them (``sample/states.py``,
``sampler.py``, the processors' skip checks), on arbitrary per-row values:
0, 1, NaN, inf and ordinary floats; top_k at, below and above the vocab."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpstate._kernels import sampler as K

VOCAB = 50
FLOATS = st.sampled_from([0.0, 1.0, 0.5, 0.9, 1.5, float("nan"), float("inf"), -0.0, 1e-8])


@st.composite
def rows_and_batch(draw):
    R = draw(st.integers(1, 24))
    col = lambda elems: draw(st.lists(elems, min_size=R, max_size=R))  # noqa: E731
    arrays = {
        "temperature": np.array(col(FLOATS), np.float32),
        "top_k": np.array(col(st.integers(-1, VOCAB + 5)), np.int32),
        "top_p": np.array(col(FLOATS), np.float32),
        "min_p": np.array(col(FLOATS), np.float32),
        "seeds_set": np.array(col(st.booleans()), bool),
        "num_logprobs": np.array(col(st.integers(-1, VOCAB)), np.int32),
        "needs_logits_processing": np.array(col(st.booleans()), bool),
        "use_penalty": np.array(col(st.booleans()), bool),
        "num_token_ids": np.array(col(st.integers(0, 8)), np.int32),
        "use_logit_bias": np.array(col(st.booleans()), bool),
        "num_bad_words": np.array(col(st.integers(0, 3)), np.int32),
        "use_thinking_budget": np.array(col(st.booleans()), bool),
    }
    n = draw(st.integers(1, 2 * R))
    idx = np.array(draw(st.lists(st.integers(0, R - 1), min_size=n, max_size=n)), np.intp)
    return R, arrays, idx


def _answers(R, arrays, idx):
    args = [arrays[name].ctypes.data for name in K.SP_ARRAYS]
    return K.sp_answers(idx.ctypes.data, len(idx), R, VOCAB, *args)


def _vllm(arrays, idx, vocab_size):
    a = {k: v[idx] for k, v in arrays.items()}
    t = a["temperature"]
    flags = 0
    for bit, cond in (
        (K.SP_ANY_GREEDY, np.any(t == 0.0)),
        (K.SP_ANY_SEED, np.any(a["seeds_set"])),
        (K.SP_DO_TOP_K, np.any(a["top_k"] != VOCAB)),
        (K.SP_DO_TOP_P, np.any(a["top_p"] != 1.0)),
        (K.SP_TEMPERATURE, not np.all((t == 0.0) | (t == 1.0))),
        (K.SP_MIN_P, not np.all(a["min_p"] == 0.0)),
        (K.SP_NEEDS_PROCESSING, np.any(a["needs_logits_processing"])),
        (K.SP_USE_PENALTY, np.any(a["use_penalty"])),
        (K.SP_USE_LOGIT_BIAS, np.any(a["use_logit_bias"])),
        (K.SP_USE_THINKING_BUDGET, np.any(a["use_thinking_budget"])),
    ):
        flags |= bit if cond else 0
    do_top_p = bool(np.any(a["top_p"] != 1.0))
    topp_only = bool(do_top_p and np.any((a["top_k"] >= vocab_size) & (a["top_p"] < 1.0)))
    return {
        "flags": flags,
        "max_num_logprobs": int(np.max(a["num_logprobs"])),
        "max_num_token_ids": int(a["num_token_ids"].max(initial=0)),
        "max_top_k": int(np.max(a["top_k"])),
        "topp_only": topp_only,
        "max_num_bad_words": int(a["num_bad_words"].max()),
    }


@settings(max_examples=300, deadline=None)
@given(rows_and_batch(), st.sampled_from([VOCAB, VOCAB - 1, 1, VOCAB + 10]))
def test_answers_equal_vllms_numpy(case, vocab_size):
    R, arrays, idx = case
    flags, lp, tok, k, k_p, bw = _answers(R, arrays, idx)
    want = _vllm(arrays, idx, vocab_size)
    assert flags == want["flags"]
    assert (lp, tok, k, bw) == (
        want["max_num_logprobs"],
        want["max_num_token_ids"],
        want["max_top_k"],
        want["max_num_bad_words"],
    )
    # has_topp_only_rows for any vocab_size the caller passes
    assert (bool(flags & K.SP_DO_TOP_P) and k_p >= vocab_size) == want["topp_only"]


def test_a_changed_row_changes_the_answer():
    # the control: the answers follow the arrays (nothing cached per row)
    R = 4
    arrays = {
        name: np.zeros(R, np.float32 if name in ("temperature", "top_p", "min_p") else np.int32) for name in K.SP_ARRAYS
    }
    for name in ("seeds_set", "needs_logits_processing", "use_penalty", "use_logit_bias", "use_thinking_budget"):
        arrays[name] = np.zeros(R, bool)
    arrays["temperature"][:] = 1.0
    arrays["top_p"][:] = 1.0
    arrays["top_k"][:] = VOCAB
    idx = np.array([0, 2], np.intp)
    before = _answers(R, arrays, idx)
    assert not before[0] & K.SP_ANY_GREEDY
    arrays["temperature"][2] = 0.0
    assert _answers(R, arrays, idx)[0] & K.SP_ANY_GREEDY
    arrays["temperature"][2] = 1.0
    arrays["temperature"][3] = 0.0  # not in the batch
    assert _answers(R, arrays, idx) == before
