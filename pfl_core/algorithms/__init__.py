"""Method registry: one module per algorithm, registered by name with ``@METHODS.register``.

Every module of this package is imported here, so adding ``<name>.py`` that registers itself is
all it takes to add a method. ``_lib/`` holds what methods share that is not a method: one-method
maths (GP, hypergradients, margin losses, episodes), functional optimisers, head/body splits.
"""
from __future__ import annotations

from pfl_core.registry import Registry, import_package_modules

METHODS: Registry = Registry("method")

from pfl_core.algorithms.base import Algorithm  # noqa: E402

import_package_modules(__name__, __path__)  # _lib: method maths and plumbing, no methods

__all__ = ["METHODS", "Algorithm"]
