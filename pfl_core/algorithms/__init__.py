"""Method registry: one module per algorithm, registered by name with ``@METHODS.register``.

Every module of this package is imported here, so adding ``<name>.py`` that registers itself is
all it takes to add a method. ``_lib/`` holds what methods share that is not a method: one-method
maths (GP, hypergradients, margin losses, episodes), functional optimisers, head/body splits.
"""
from __future__ import annotations

import importlib
import pkgutil

from pfl_core.registry import Registry

METHODS: Registry = Registry("method")

from pfl_core.algorithms.base import Algorithm  # noqa: E402

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):  # _lib: method maths and plumbing, no methods
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["METHODS", "Algorithm"]
