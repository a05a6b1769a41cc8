"""megatron-core's compiled fusions are handed to ``torch.compile`` on first call, not at
import.

:func:`install` (run by ``import megatron_jreg``) adds an import finder that wraps
``megatron.core.jit.jit_fuser`` as it loads: a decorated function goes to ``torch.compile``,
with the same arguments, the first time it is called, which saves the 1.7 s of importing
dynamo at import (docs/design.md, "Start-up time"). A process that imports megatron-core
before ``megatron_jreg`` keeps megatron-core's eager decoration.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

MODULE = "megatron.core.jit"


def on_first_call(compile_fn):
    """A decorator like ``compile_fn`` (``torch.compile``) that calls it on the decorated
    function's first call; ``@d`` and ``@d(**options)`` are both accepted."""

    def decorator(fn=None, **options):
        if fn is None:
            return functools.partial(decorator, **options)
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn, **options)
            return compiled(*args, **kwargs)

        return call

    return decorator


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the path finder does; its loader wraps ``jit_fuser``
    after the module has run."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            import torch

            if module.jit_fuser is torch.compile:
                module.jit_fuser = on_first_call(torch.compile)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Add the finder once, ahead of the path finder; no effect once megatron-core's jit
    module is loaded."""
    if MODULE not in sys.modules and not any(isinstance(f, _JitFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitFinder())
