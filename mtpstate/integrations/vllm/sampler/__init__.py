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

:class:`SamplingParamsWriter` does the per-request half: new requests'
sampling params read in place before the step (bad ones refused whole) and
written into the sampler's arrays by one kernel call, as vLLM's
``add_request`` would write them (``_kernels.sampling_params``).

Imports no vLLM: it works on the sampler object it is given, after checking
that its classes and the methods it replaces are exactly the ones this was
written against (:data:`mtpstate.integrations.vllm.plugin.COMPUTED`).
"""

from __future__ import annotations

import numpy as np

from mtpstate._kernels import sampler as _K
from mtpstate.integrations.vllm.sampler.answers import SamplerAnswers
from mtpstate.integrations.vllm.sampler.objects import (
    _CLASSES,
    _arrays,
    _builtin_processors,
    _is,
    _uva_tensors,
    _writer_reason,
)
from mtpstate.integrations.vllm.sampler.params_writer import SamplingParamsWriter
from mtpstate.integrations.vllm.sampler.uploads import SamplerUploads, _uploads_reason
from mtpstate.integrations.vllm.sampler.wrappers import _bind

__all__ = ["SamplerAnswers", "SamplerUploads", "SamplingParamsWriter", "attach", "unsupported_reason"]


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


def attach(state, sampler) -> SamplerAnswers | None:
    """Bind the answering wrappers on ``sampler`` (vLLM's ``Sampler``) for
    mtpstate's ``state`` (a ``ModelRunnerV2State``), or leave it alone and
    return None (:func:`unsupported_reason`, or a sampler method that is not
    the one this was written against)."""
    R = state.table.max_num_reqs
    if unsupported_reason(sampler, R) is not None or not _methods_known():
        return None
    a = SamplerAnswers(tuple(x for x, _ in _arrays(sampler, R)), R, int(sampler.sampling_states.vocab_size))
    guard = getattr(state.table, "_guard", None)
    a.writer = (
        None if _writer_reason(sampler) is not None else SamplingParamsWriter(sampler, R, sampler.add_request, guard)
    )
    try:
        if a.writer is not None:
            uvas = _uva_tensors(sampler)
            if _uploads_reason(uvas, R) is None:
                a.writer.uploads = SamplerUploads(uvas, R)
        _bind(sampler, a)
    except BaseException:
        a.detach()  # (what was bound: vLLM's again)
        raise
    return a


def _methods_known() -> bool:
    # the methods _bind replaces (and the body apply_sampling_params keeps)
    # are vLLM's own, as the plugin's guard checks them
    from mtpstate.integrations.vllm import plugin

    return plugin.sampler_methods_ok()
