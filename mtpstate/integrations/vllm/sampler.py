"""vLLM's sampler questions over the step's batch, answered by one kernel pass.

Every step, vLLM 0.34's ``Sampler`` asks a dozen questions of its per-row
arrays for the batch: ``np.any(needs_logits_processing[idx_mapping_np])``,
``get_logprobs_dims``, ``get_top_k_top_p``, ``any_greedy``, each logits
processor's skip check, ... each a fancy index and a reduction (35-53 us a
step on a 2-core VM). :class:`SamplerAnswers` computes all of them with one
call of ``_kernels.sampler.sp_answers`` when mtpstate hands out the step's
batch (``gather_batch_req_state``: after the add hooks, so every new row's
sampling params are in place), and :func:`attach` binds wrappers over the
methods that ask, on the sampler's own objects (instance attributes: the
class stays vLLM's). A wrapper answers only for the batch mtpstate built,
recognised by its ``idx_mapping_np`` object; any other batch (a dummy run's,
a shard's) and any call after a request was added since goes to vLLM's
method unchanged. The sampler's arrays, values and device tensors stay
vLLM's: only how the questions are computed changes.

Imports no vLLM: it works on the sampler object it is given, after checking
that its classes and the methods it replaces are exactly the ones this was
written against (:data:`mtpstate.integrations.vllm.plugin.COMPUTED`).
"""

from __future__ import annotations

import sys

import numpy as np

from mtpstate._kernels import sampler as _K

__all__ = ["SamplerAnswers", "attach", "unsupported_reason"]

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
    )


def _thinking_rows(tb, R: int) -> np.ndarray:
    # a disabled ThinkingBudgetState has no per-row array: no row uses it
    if not tb.enabled:
        return np.zeros(R, dtype=bool)
    return tb.use_thinking_budget


def unsupported_reason(sampler, max_num_reqs: int) -> str | None:
    """Why :func:`attach` leaves this sampler alone (None: it can attach)."""
    if sampler is None:
        return "no sampler (not the last pipeline stage)"
    for path, where in _CLASSES.items():
        obj = getattr(sampler, path, None) if path else sampler
        if not _is(obj, where):
            return f"sampler{'.' + path if path else ''} is a {type(obj).__qualname__}, not vLLM's {where[1]}"
    if _builtin_processors(sampler) is None:
        return "the sampler's logits processors are not vLLM's (logit bias, penalties, bad words)"
    try:
        arrays = _arrays(sampler, max_num_reqs)
    except AttributeError as e:
        return f"the sampler lacks an array: {e}"
    for name, (a, dtype) in zip(_K.SP_ARRAYS, arrays):
        if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == (max_num_reqs,) and a.flags.c_contiguous):
            return f"the sampler's {name} is not a contiguous {np.dtype(dtype)} array of {max_num_reqs} rows"
    return None


class SamplerAnswers:
    """The sampler's answers for the step's batch (one ``sp_answers`` call).

    ``idx``: the ``idx_mapping_np`` they answer for (None: none). Then
    ``flags`` (``_kernels.sampler.SP_*``), ``max_num_logprobs``,
    ``max_num_token_ids``, ``max_top_k`` (the batch max of top_k, for
    ``return_sampling_mask``), ``max_top_k_top_p`` (top_k's max over rows
    with top_p < 1; -1: none) and ``max_num_bad_words``.
    """

    __slots__ = (
        "idx",
        "flags",
        "max_num_logprobs",
        "max_num_token_ids",
        "max_top_k",
        "max_top_k_top_p",
        "max_num_bad_words",
        "computed",
        "_arrays",
        "_args",
        "_R",
        "_vocab",
    )

    def __init__(self, sampler, max_num_reqs: int):
        self._R = max_num_reqs
        self._vocab = int(sampler.sampling_states.vocab_size)
        # held: their addresses are read by the kernel every step
        self._arrays = tuple(a for a, _ in _arrays(sampler, max_num_reqs))
        self._args = tuple(a.ctypes.data for a in self._arrays)
        self.idx = None
        self.computed = 0  # steps answered (tests, stats)

    def compute(self, idx_addr: int, n: int, idx: np.ndarray) -> None:
        """Answer for the ``n`` rows at ``idx_addr`` (intp), whose copy
        ``idx`` is the ``idx_mapping_np`` vLLM's sampler will be asked with."""
        if n == 0:  # (vLLM's reductions over an empty batch raise: its own code answers)
            self.idx = None
            return
        (
            self.flags,
            self.max_num_logprobs,
            self.max_num_token_ids,
            self.max_top_k,
            self.max_top_k_top_p,
            self.max_num_bad_words,
        ) = _K.sp_answers(idx_addr, n, self._R, self._vocab, *self._args)
        self.idx = idx
        self.computed += 1

    def invalidate(self) -> None:
        self.idx = None


def attach(state, sampler) -> SamplerAnswers | None:
    """Bind the answering wrappers on ``sampler`` (vLLM's ``Sampler``) for
    mtpstate's ``state`` (a ``ModelRunnerV2State``), or leave it alone and
    return None (:func:`unsupported_reason`, or a sampler method that is not
    the one this was written against)."""
    R = state.table.max_num_reqs
    if unsupported_reason(sampler, R) is not None or not _methods_known():
        return None
    a = SamplerAnswers(sampler, R)
    _bind(sampler, a)
    return a


def _methods_known() -> bool:
    # the methods _bind replaces (and the body apply_sampling_params keeps)
    # are vLLM's own, as the plugin's guard checks them
    from mtpstate.integrations.vllm import plugin

    return plugin.sampler_methods_ok()


def _bind(sampler, a: SamplerAnswers) -> None:
    import torch

    ss = sampler.sampling_states
    pen = sampler.penalties_state
    lpt = sampler.logprob_token_ids_state
    tb = sampler.thinking_budget_state
    lb, bw = _builtin_processors(sampler)
    states_mod = sys.modules[type(ss).__module__]  # its launchers, looked up per call as vLLM's methods do
    logits_context = sys.modules[type(sampler).__module__].LogitsContext

    orig_add_request = sampler.add_request

    def add_request(req_idx, sampling_params):
        a.idx = None  # the rows' values change: the answers are recomputed with the next batch
        return orig_add_request(req_idx, sampling_params)

    orig_get_logprobs_dims = sampler.get_logprobs_dims

    def get_logprobs_dims(idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_get_logprobs_dims(idx_mapping_np)
        lp, tok = a.max_num_logprobs, a.max_num_token_ids
        if lp == _K_NO_LOGPROBS and tok == 0:
            return None
        return (lp if lp != _K_NO_LOGPROBS else 0), tok

    orig_apply_sampling_params = sampler.apply_sampling_params

    def apply_sampling_params(
        logits,
        expanded_idx_mapping,
        idx_mapping,
        idx_mapping_np,
        pos,
        input_ids,
        expanded_local_pos,
        seq_lens_upper_bound_np,
        skip_top_k_top_p=False,
    ):
        if idx_mapping_np is not a.idx:
            return orig_apply_sampling_params(
                logits,
                expanded_idx_mapping,
                idx_mapping,
                idx_mapping_np,
                pos,
                input_ids,
                expanded_local_pos,
                seq_lens_upper_bound_np,
                skip_top_k_top_p,
            )
        if not a.flags & _K.SP_NEEDS_PROCESSING:
            return logits
        # vLLM's body after its check (the processors' own checks answered below)
        logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        ctx = logits_context(
            expanded_idx_mapping=expanded_idx_mapping,
            idx_mapping=idx_mapping,
            idx_mapping_np=idx_mapping_np,
            expanded_local_pos=expanded_local_pos,
            input_ids=input_ids,
            pos=pos,
            seq_lens_upper_bound_np=seq_lens_upper_bound_np,
        )
        for processor in sampler.logits_processors:
            logits = processor.apply(logits, ctx)
        sampler.thinking_budget_state.apply(logits, ctx)
        sampler.sampling_states.apply_temperature(logits, expanded_idx_mapping, idx_mapping_np)
        sampler.sampling_states.apply_min_p(logits, expanded_idx_mapping, idx_mapping_np)
        if skip_top_k_top_p:
            return logits
        return sampler.sampling_states.apply_top_k_top_p(logits, expanded_idx_mapping, idx_mapping_np)

    orig_any_greedy = ss.any_greedy

    def any_greedy(idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_any_greedy(idx_mapping_np)
        return (a.flags & _K.SP_ANY_GREEDY) != 0

    orig_any_explicit_seed = ss.any_explicit_seed

    def any_explicit_seed(idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_any_explicit_seed(idx_mapping_np)
        return (a.flags & _K.SP_ANY_SEED) != 0

    orig_max_num_logprobs = ss.max_num_logprobs

    def max_num_logprobs(idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_max_num_logprobs(idx_mapping_np)
        return a.max_num_logprobs

    orig_get_top_k_top_p = ss.get_top_k_top_p

    def get_top_k_top_p(expanded_idx_mapping, idx_mapping_np, vocab_size):
        if idx_mapping_np is not a.idx:
            return orig_get_top_k_top_p(expanded_idx_mapping, idx_mapping_np, vocab_size)
        flags = a.flags
        do_top_p = (flags & _K.SP_DO_TOP_P) != 0
        # vLLM's device gathers, for the rows that need them
        top_k = ss.top_k.gpu[expanded_idx_mapping] if flags & _K.SP_DO_TOP_K else None
        top_p = ss.top_p.gpu[expanded_idx_mapping] if do_top_p else None
        return top_k, top_p, do_top_p and a.max_top_k_top_p >= vocab_size

    orig_apply_temperature = ss.apply_temperature

    def apply_temperature(logits, expanded_idx_mapping, idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_apply_temperature(logits, expanded_idx_mapping, idx_mapping_np)
        if a.flags & _K.SP_TEMPERATURE:
            states_mod.apply_temperature(logits, expanded_idx_mapping, ss.temperature.gpu)
        return None

    orig_apply_min_p = ss.apply_min_p

    def apply_min_p(logits, expanded_idx_mapping, idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_apply_min_p(logits, expanded_idx_mapping, idx_mapping_np)
        if a.flags & _K.SP_MIN_P:
            states_mod.apply_min_p(logits, expanded_idx_mapping, ss.min_p.gpu)
        return None

    def _skip_unless(obj, flag):
        # a processor's apply(logits, ctx): vLLM's when a row of the batch uses it
        orig = obj.apply

        def apply(logits, ctx):
            if ctx.idx_mapping_np is a.idx and not a.flags & flag:
                return logits
            return orig(logits, ctx)

        obj.apply = apply

    _skip_unless(pen, _K.SP_USE_PENALTY)
    _skip_unless(lb, _K.SP_USE_LOGIT_BIAS)

    orig_bw_apply = bw.apply

    def bad_words_apply(logits, ctx):
        if ctx.idx_mapping_np is a.idx and a.max_num_bad_words == 0:
            return logits
        return orig_bw_apply(logits, ctx)

    orig_tb_apply = tb.apply

    def thinking_budget_apply(logits, ctx):
        if ctx.idx_mapping_np is a.idx and not a.flags & _K.SP_USE_THINKING_BUDGET:
            return None
        return orig_tb_apply(logits, ctx)

    orig_max_num_token_ids = lpt.max_num_token_ids

    def max_num_token_ids(idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_max_num_token_ids(idx_mapping_np)
        return a.max_num_token_ids

    sampler.add_request = add_request
    sampler.get_logprobs_dims = get_logprobs_dims
    sampler.apply_sampling_params = apply_sampling_params
    ss.any_greedy = any_greedy
    ss.any_explicit_seed = any_explicit_seed
    ss.max_num_logprobs = max_num_logprobs
    ss.get_top_k_top_p = get_top_k_top_p
    ss.apply_temperature = apply_temperature
    ss.apply_min_p = apply_min_p
    bw.apply = bad_words_apply
    tb.apply = thinking_budget_apply
    lpt.max_num_token_ids = max_num_token_ids


_K_NO_LOGPROBS = -1  # vLLM's NO_LOGPROBS (sample/states.py)
