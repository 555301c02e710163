"""The sampler's per-step answers (``_kernels.sampler``, through
``SamplerAnswers``) against numpy written as vLLM 0.34's sampler computes
them (``sample/states.py``, ``sampler.py``, the processors' skip checks),
on arbitrary per-row values: 0, 1, NaN, inf and ordinary floats; top_k at,
below and above the vocab. Both ways of answering: the pass over a batch,
and the counts kept over the live rows (a stateful test: rows freed,
added and rewritten step by step, batches of every live row and of some)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mtpstate._kernels import sampler as K
from mtpstate._kernels import slots as T
from mtpstate.integrations.vllm.sampler import SamplerAnswers

VOCAB = 50
FLOATS = st.sampled_from([0.0, 1.0, 0.5, 0.9, 1.5, float("nan"), float("inf"), -0.0, 1e-8])


# a row's values, as the strategies draw them (column -> strategy)
COLUMNS = {
    "temperature": (np.float32, FLOATS),
    "top_k": (np.int32, st.integers(-1, VOCAB + 5)),
    "top_p": (np.float32, FLOATS),
    "min_p": (np.float32, FLOATS),
    "seeds_set": (bool, st.booleans()),
    "num_logprobs": (np.int32, st.integers(-1, VOCAB)),
    "needs_logits_processing": (bool, st.booleans()),
    "use_penalty": (bool, st.booleans()),
    "num_token_ids": (np.int32, st.integers(0, 8)),
    "use_logit_bias": (bool, st.booleans()),
    "num_bad_words": (np.int32, st.integers(0, 3)),
    "use_thinking_budget": (bool, st.booleans()),
    "restore_when_all_masked": (np.int32, st.integers(0, 1)),
}
assert tuple(COLUMNS) == K.SP_ARRAYS


@st.composite
def rows_and_batch(draw):
    R = draw(st.integers(1, 24))
    arrays = {
        name: np.array(draw(st.lists(elems, min_size=R, max_size=R)), dtype) for name, (dtype, elems) in COLUMNS.items()
    }
    n = draw(st.integers(1, 2 * R))
    idx = np.array(draw(st.lists(st.integers(0, R - 1), min_size=n, max_size=n)), np.intp)
    return R, arrays, idx


def _answers_of(a: SamplerAnswers, idx):
    a.compute(idx.ctypes.data, len(idx), idx)
    return a.flags, a.max_num_logprobs, a.max_num_token_ids, a.max_top_k, a.max_top_k_top_p, a.max_num_bad_words


def _answers(R, arrays, idx):
    # by the pass over the batch (nothing counted)
    return _answers_of(SamplerAnswers(tuple(arrays[n] for n in K.SP_ARRAYS), R, VOCAB), idx)


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
        (K.SP_RESTORE_WHEN_MASKED, np.any(a["restore_when_all_masked"])),
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


def _assert_equal(got, want, vocab_size=VOCAB):
    flags, lp, tok, k, k_p, bw = got
    assert flags == want["flags"]
    assert (lp, tok, k, bw) == (
        want["max_num_logprobs"],
        want["max_num_token_ids"],
        want["max_top_k"],
        want["max_num_bad_words"],
    )
    # has_topp_only_rows for any vocab_size the caller passes
    assert (bool(flags & K.SP_DO_TOP_P) and k_p >= vocab_size) == want["topp_only"]


@settings(max_examples=300, deadline=None)
@given(rows_and_batch(), st.sampled_from([VOCAB, VOCAB - 1, 1, VOCAB + 10]))
def test_answers_equal_vllms_numpy(case, vocab_size):
    R, arrays, idx = case
    _assert_equal(_answers(R, arrays, idx), _vllm(arrays, idx, vocab_size), vocab_size)


class _Step:
    """A table step's rows, where ``sp_rows_changed`` reads them: the
    table's context slots and its result rows (cached, new, freed)."""

    def __init__(self, R):
        self.R = R
        self.res = np.zeros(3 * R, np.int32)
        self.ctx = np.zeros(T.TB_SIZE, np.int64)
        self.ctx[T.TB_RES] = self.res.ctypes.data

    def set(self, freed, new):
        R = self.R
        self.res[R : R + len(new)] = new
        self.res[2 * R : 2 * R + len(freed)] = freed
        self.ctx[T.TB_RES_NC], self.ctx[T.TB_RES_NN], self.ctx[T.TB_RES_NF] = R, len(new), len(freed)
        return self.ctx.ctypes.data


class CountedAnswers(RuleBasedStateMachine):
    """Steps free and add rows (new values written at each added row, as
    the sampler's add_request writes them), a row is sometimes rewritten
    outside a step, and every batch's answers equal vLLM's numpy over it,
    counted or not."""

    R = 12

    def __init__(self):
        super().__init__()
        R = self.R
        self.arrays = {name: np.zeros(R, dtype) for name, (dtype, _) in COLUMNS.items()}
        self.answers = SamplerAnswers(tuple(self.arrays[n] for n in K.SP_ARRAYS), R, VOCAB)
        self.step = _Step(R)
        self.live: list[int] = []
        self.fast_expected = 0

    def _write(self, data, r):
        for name, (_, elems) in COLUMNS.items():
            self.arrays[name][r] = data.draw(elems)

    @rule(data=st.data())
    def a_step(self, data):
        # some live rows freed, some free rows (freed ones too) added; the
        # new rows written after the step, as the runner's add hooks do
        freed = sorted(data.draw(st.sets(st.sampled_from(self.live))) if self.live else [])
        free = sorted(set(range(self.R)) - set(self.live) | set(freed))
        new = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=len(free))) if free else []
        self.answers.rows_changed(self.step.set(freed, new))
        self.live = sorted(set(self.live) - set(freed) | set(new))
        for r in new:
            if data.draw(st.booleans()):  # (a pooling request's row keeps its values)
                self._write(data, r)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def a_row_rewritten(self, data):
        r = data.draw(st.sampled_from(self.live))
        self._write(data, r)
        self.answers.row_written(r)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def a_batch(self, data):
        every = data.draw(st.booleans())
        rows = list(self.live) if every else data.draw(st.lists(st.sampled_from(self.live), unique=True, min_size=1))
        idx = np.array(data.draw(st.permutations(rows)), np.intp)
        before = self.answers.from_counts
        _assert_equal(_answers_of(self.answers, idx), _vllm(self.arrays, idx, VOCAB))
        # a batch of every live row is answered from the counts; a smaller one is not
        assert self.answers.from_counts == before + (len(idx) == len(self.live))

    @invariant()
    def counts_match_the_live_rows(self):
        assert self.answers._ctx[K.A_VALID] == 1


CountedAnswers.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_counted_answers = CountedAnswers.TestCase


def test_a_row_that_is_not_an_int_makes_every_batch_a_pass():
    R = 3
    arrays = {name: np.zeros(R, dtype) for name, (dtype, _) in COLUMNS.items()}
    a = SamplerAnswers(tuple(arrays[n] for n in K.SP_ARRAYS), R, VOCAB)
    step = _Step(R)
    a.rows_changed(step.set([], [0, 1, 2]))
    idx = np.arange(R, dtype=np.intp)
    _answers_of(a, idx)
    assert a.from_counts == 1
    a.row_written("1")
    arrays["temperature"][1] = 0.5
    _assert_equal(_answers_of(a, idx), _vllm(arrays, idx, VOCAB))
    assert a.from_counts == 1  # (by a pass)


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
