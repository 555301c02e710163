"""vLLM integration (Model Runner V2, ``vllm/v1/worker/gpu/``).

- :class:`ModelRunnerV2State`: the runner's request state kept by a
  :class:`mtpstate.RequestTable` (``adapter.py``).
- ``plugin.py``: the ``vllm.general_plugins`` entry point that applies the
  worked patch ``mrv2.patch`` to an installed vLLM when
  ``VLLM_USE_MTPSTATE=1``, guarded against vLLM versions it was not
  written for.

Imports no vLLM, and nothing beyond the standard library until a name is
used: vLLM imports the plugin's entry point in every process, asked or not.
"""

from __future__ import annotations

__all__ = ["ModelRunnerV2State"]


def __getattr__(name: str):
    if name == "ModelRunnerV2State":
        from mtpstate.integrations.vllm.adapter import ModelRunnerV2State

        return ModelRunnerV2State
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
