"""Method registry: one module per algorithm, registered by name."""
from __future__ import annotations

from pfl_core.registry import Registry

METHODS: Registry = Registry("method")

from pfl_core.algorithms import fedavg, local  # noqa: E402,F401  (registers the methods)
from pfl_core.algorithms.base import (  # noqa: E402
    Algorithm,
    ClientContext,
    ClientUpdate,
    HyperParams,
    ServerState,
)

__all__ = ["METHODS", "Algorithm", "ClientContext", "ClientUpdate", "HyperParams", "ServerState"]
