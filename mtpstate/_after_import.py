"""Run a function on a module right after it is executed, when it is first
imported (a finder first on ``sys.meta_path`` that wraps the module's own
loader). Standard library only: vLLM's plugin loader and the tiers' hooks
install it before anything heavy is imported."""

from __future__ import annotations

import importlib.abc
import sys

__all__ = ["AfterImport"]


class AfterImport(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path``: when module ``name`` is imported, its own loader
    executes it, then ``callback(module)`` runs (each time it is imported
    anew). Install it with :meth:`install`; ``once``: the finder leaves
    ``sys.meta_path`` after the first import."""

    def __init__(self, name: str, callback, once: bool = False):
        self.name, self.callback, self.once = name, callback, once

    def install(self):
        sys.meta_path.insert(0, self)
        return self

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader, self)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, finder: AfterImport):
        self._inner, self._finder = inner, finder

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        f = self._finder
        if f.once and f in sys.meta_path:
            sys.meta_path.remove(f)
        f.callback(module)

    def __getattr__(self, name):  # get_source, get_code, ... for tools that ask the loader
        return getattr(self._inner, name)
