"""vLLM integration (Model Runner V2, ``vllm/v1/worker/gpu/``).

- :class:`ModelRunnerV2State`: the runner's request state kept by a
  :class:`mtpstate.RequestTable` (``adapter.py``).
- ``plugin.py``: the ``vllm.general_plugins`` entry point that applies the
  worked patch ``mrv2.patch`` to an installed vLLM when
  ``VLLM_USE_MTPSTATE=1``, guarded against vLLM versions it was not
  written for.

Imports no vLLM.
"""

from mtpstate.integrations.vllm.adapter import ModelRunnerV2State

__all__ = ["ModelRunnerV2State"]
