"""The wrappers :func:`~mtpstate.integrations.vllm.sampler.attach` binds on
the sampler's own objects (instance attributes: the classes stay vLLM's).
Each answers only for the batch mtpstate built (recognised by its
``idx_mapping_np`` object) and calls vLLM's method for any other."""

from __future__ import annotations

import sys

from mtpstate._kernels import sampler as _K
from mtpstate.integrations.vllm.sampler.answers import SamplerAnswers
from mtpstate.integrations.vllm.sampler.objects import _builtin_processors, top_k_top_p_takes_vocab

_K_NO_LOGPROBS = -1  # vLLM's NO_LOGPROBS (sample/states.py)


def _bind(sampler, a: SamplerAnswers) -> None:
    """Every wrapper, on the sampler's own objects (each noted in
    ``a.bound``, for :meth:`SamplerAnswers.detach`)."""
    _bind_writes(sampler, a)
    _bind_questions(sampler, a)
    _bind_processing(sampler, a)
    _bind_processors(sampler, a)


def _set(a: SamplerAnswers, obj, name: str, wrapper) -> None:
    a.bound.append((obj, name))
    setattr(obj, name, wrapper)


def _bind_writes(sampler, a: SamplerAnswers) -> None:
    """``add_request`` (noted for the writer in the add loop; any other call
    vLLM's, its row recounted) and ``apply_staged_writes`` (the writer's
    flush first)."""
    orig_add_request = sampler.add_request
    w = a.writer

    def add_request(req_idx, sampling_params):
        a.idx = None  # the rows' values change: the answers are recomputed with the next batch
        if w is not None:
            # (noted: a row of the step's add loop, one of its new rows)
            if w.note(req_idx, sampling_params):
                return None
            w.flush()  # (in order with any noted before)
        try:
            return orig_add_request(req_idx, sampling_params)
        finally:
            # (a new row of the step is counted already; a row no request
            # holds, as the dummy sampler run writes, is counted when one does)
            if a.row_live is None or a.row_live(req_idx):
                a.row_written(req_idx)
            if w is not None and w.uploads is not None:
                w.uploads.mark([req_idx])  # (a row it cannot read marks every row)

    orig_apply_staged_writes = sampler.apply_staged_writes

    def apply_staged_writes():
        if w is not None:
            try:
                w.flush()
            except Exception as e:
                if a.failed is None:
                    raise
                a.failed("the sampler's writes", e)  # (detached: the rows not written go to vLLM's add_request)
        return orig_apply_staged_writes()

    _set(a, sampler, "add_request", add_request)
    _set(a, sampler, "apply_staged_writes", apply_staged_writes)


def _bind_questions(sampler, a: SamplerAnswers) -> None:
    """The questions over the batch that return values: logprob dims, the
    greedy / seed flags, the maxima, ``get_top_k_top_p``."""
    ss = sampler.sampling_states
    lpt = sampler.logprob_token_ids_state
    orig_get_logprobs_dims = sampler.get_logprobs_dims

    def get_logprobs_dims(idx_mapping_np, *args, **kwargs):
        # (a release's further arguments, 0.33's include_token_ids: vLLM's)
        if idx_mapping_np is not a.idx or args or kwargs:
            return orig_get_logprobs_dims(idx_mapping_np, *args, **kwargs)
        lp, tok = a.max_num_logprobs, a.max_num_token_ids
        if lp == _K_NO_LOGPROBS and tok == 0:
            return None
        return (lp if lp != _K_NO_LOGPROBS else 0), tok

    def flag_of(obj, name, flag):
        # a yes/no question over the batch: the answer's flag
        orig = getattr(obj, name)

        def answer(idx_mapping_np):
            if idx_mapping_np is not a.idx:
                return orig(idx_mapping_np)
            return (a.flags & flag) != 0

        return answer

    orig_max_num_logprobs = ss.max_num_logprobs

    def max_num_logprobs(idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_max_num_logprobs(idx_mapping_np)
        return a.max_num_logprobs

    orig_get_top_k_top_p = ss.get_top_k_top_p
    # in the form of the release's method: with the vocab size and
    # has_topp_only_rows (0.33 on) or without both (0.32)
    takes_vocab = top_k_top_p_takes_vocab(ss)
    num_extra_args = 1 if takes_vocab else 0

    def get_top_k_top_p(expanded_idx_mapping, idx_mapping_np, *args, **kwargs):
        if idx_mapping_np is not a.idx or len(args) + len(kwargs) != num_extra_args:
            return orig_get_top_k_top_p(expanded_idx_mapping, idx_mapping_np, *args, **kwargs)
        flags = a.flags
        do_top_p = (flags & _K.SP_DO_TOP_P) != 0
        # vLLM's device gathers, for the rows that need them
        top_k = ss.top_k.gpu[expanded_idx_mapping] if flags & _K.SP_DO_TOP_K else None
        top_p = ss.top_p.gpu[expanded_idx_mapping] if do_top_p else None
        if not takes_vocab:
            return top_k, top_p
        (vocab_size,) = args or tuple(kwargs.values())
        return top_k, top_p, do_top_p and a.max_top_k_top_p >= vocab_size

    orig_max_num_token_ids = lpt.max_num_token_ids

    def max_num_token_ids(idx_mapping_np):
        if idx_mapping_np is not a.idx:
            return orig_max_num_token_ids(idx_mapping_np)
        return a.max_num_token_ids

    _set(a, sampler, "get_logprobs_dims", get_logprobs_dims)
    _set(a, ss, "any_greedy", flag_of(ss, "any_greedy", _K.SP_ANY_GREEDY))
    _set(a, ss, "any_explicit_seed", flag_of(ss, "any_explicit_seed", _K.SP_ANY_SEED))
    _set(a, ss, "max_num_logprobs", max_num_logprobs)
    _set(a, ss, "get_top_k_top_p", get_top_k_top_p)
    _set(a, lpt, "max_num_token_ids", max_num_token_ids)


def _bind_processing(sampler, a: SamplerAnswers) -> None:
    """``apply_sampling_params`` (skipped when no row needs processing, else
    vLLM's body) and the temperature / min-p launchers (launched when a row
    of the batch needs them)."""
    import torch

    ss = sampler.sampling_states
    states_mod = sys.modules[type(ss).__module__]  # its launchers, looked up per call as vLLM's methods do
    logits_context = sys.modules[type(sampler).__module__].LogitsContext
    orig_apply_sampling_params = sampler.apply_sampling_params

    def apply_sampling_params(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, *args, **kwargs):
        if idx_mapping_np is not a.idx:
            return orig_apply_sampling_params(
                logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, *args, **kwargs
            )
        if not a.flags & _K.SP_NEEDS_PROCESSING:
            return logits
        return processed(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, *args, **kwargs)

    def processed(
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

    def launch_if(name, flag, values):
        # apply_temperature / apply_min_p: vLLM's launcher, when a row of the batch needs it
        orig = getattr(ss, name)

        def apply(logits, expanded_idx_mapping, idx_mapping_np):
            if idx_mapping_np is not a.idx:
                return orig(logits, expanded_idx_mapping, idx_mapping_np)
            if a.flags & flag:
                getattr(states_mod, name)(logits, expanded_idx_mapping, getattr(ss, values).gpu)
            return None

        return apply

    _set(a, sampler, "apply_sampling_params", apply_sampling_params)
    _set(a, ss, "apply_temperature", launch_if("apply_temperature", _K.SP_TEMPERATURE, "temperature"))
    _set(a, ss, "apply_min_p", launch_if("apply_min_p", _K.SP_MIN_P, "min_p"))


def _bind_processors(sampler, a: SamplerAnswers) -> None:
    """Each built-in logits processor's ``apply``: skipped when no row of
    the batch uses it (the logit bias's body kept, its restore flag from
    the answers)."""
    pen = sampler.penalties_state
    tb = sampler.thinking_budget_state
    lb, bw = _builtin_processors(sampler)

    orig_pen_apply = pen.apply

    def penalties_apply(logits, ctx):
        if ctx.idx_mapping_np is a.idx and not a.flags & _K.SP_USE_PENALTY:
            return logits
        return orig_pen_apply(logits, ctx)

    orig_lb_apply = lb.apply
    lb_mod = sys.modules[type(lb).__module__]  # its launcher, looked up per call as vLLM's method does

    def logit_bias_apply(logits, ctx):
        if ctx.idx_mapping_np is not a.idx:
            return orig_lb_apply(logits, ctx)
        flags = a.flags
        if not flags & _K.SP_USE_LOGIT_BIAS:
            return logits
        # vLLM's body after its checks (both answered)
        lb_mod.apply_logit_bias(
            logits,
            ctx.expanded_idx_mapping,
            ctx.pos,
            lb.num_allowed_token_ids.gpu,
            lb.allowed_token_ids.gpu,
            lb.num_logit_bias.gpu,
            lb.logit_bias_token_ids.gpu,
            lb.logit_bias.gpu,
            lb.min_lens.gpu,
            lb.num_stop_token_ids.gpu,
            lb.restore_when_all_masked.gpu,
            lb.stop_token_ids.gpu,
            (flags & _K.SP_RESTORE_WHEN_MASKED) != 0,
        )
        return logits

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

    _set(a, pen, "apply", penalties_apply)
    _set(a, lb, "apply", logit_bias_apply)
    _set(a, bw, "apply", bad_words_apply)
    _set(a, tb, "apply", thinking_budget_apply)
