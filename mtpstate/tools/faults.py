"""Faults injected into mtpstate's own code, one phase at a time, to show
that vLLM serves on without it: the real-engine tier (``engine_proof/``:
its driver's ``--faults``) and the runner differential
(``vllm_proof/test_fallback.py``) make the K-th call of one mtpstate
function raise :class:`InjectedFault`, once.

Standard library only: it may be imported before vLLM or mtpstate's
kernels are loaded (a function of a module not yet imported is wrapped
when the module is).
"""

from __future__ import annotations

import sys

from mtpstate._after_import import AfterImport

__all__ = ["PHASES", "InjectedFault", "inject"]

# phase -> (module, qualified name) of the mtpstate function made to raise
PHASES = {
    # the state half built: the runner must be left as it was
    "build": ("mtpstate.integrations.vllm.adapter", "_rebind_aliases"),
    "finish": ("mtpstate.integrations.vllm.adapter", "ModelRunnerV2State._leaving"),
    # the step's finish / add / update (one table call), before it changed anything
    "apply": ("mtpstate.table", "RequestTable.apply"),
    # after the table applied the step, before vLLM's dicts and the sampler heard of it
    "after-apply": ("mtpstate.integrations.vllm.sampler.answers", "SamplerAnswers.rows_changed"),
    "batch": ("mtpstate.integrations.vllm.adapter", "ModelRunnerV2State._gather"),
    "prepare-inputs": ("mtpstate.integrations.vllm.adapter", "ModelRunnerV2State._batch_inputs"),
    "sampler-writes": ("mtpstate.integrations.vllm.sampler.params_writer", "SamplingParamsWriter._write"),
    # the mirror's device work for a step with arrivals (the host was applied)
    "device-ship": ("mtpstate.mirror.ship", "_Ship._host_rest"),  # (the CPU's path; a GPU's: _slot_work)
}


class InjectedFault(RuntimeError):
    """The fault injected (never raised by mtpstate itself)."""


def _wrap(module, qualname: str, k: int) -> None:
    owner, _, name = qualname.rpartition(".")
    obj = getattr(module, owner) if owner else module
    orig = getattr(obj, name)
    calls = [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            raise InjectedFault(f"fault injected into {qualname} (call {k})")
        return orig(*args, **kwargs)

    faulty.__wrapped__ = orig
    setattr(obj, name, faulty)


def inject(phase: str, k: int = 3) -> None:
    """Make the ``k``-th call of ``phase``'s function raise, once: now if its
    module is loaded, else when it is first imported."""
    module, qualname = PHASES[phase]
    if module in sys.modules:
        _wrap(sys.modules[module], qualname, k)
    else:
        AfterImport(module, lambda m: _wrap(m, qualname, k), once=True).install()
