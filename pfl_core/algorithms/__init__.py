"""Method registry: one module per algorithm, registered by name with ``@METHODS.register``.

Every module of this package is imported here, so adding ``<name>.py`` that registers itself is
all it takes to add a method.
"""
from __future__ import annotations

import importlib
import pkgutil

from pfl_core.registry import Registry

METHODS: Registry = Registry("method")

from pfl_core.algorithms.base import (  # noqa: E402
    Algorithm,
    ClientContext,
    ClientUpdate,
    HyperParams,
    ServerState,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["METHODS", "Algorithm", "ClientContext", "ClientUpdate", "HyperParams", "ServerState"]
