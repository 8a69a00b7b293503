"""The one rule by which a suite is written over its shared files (:mod:`benchmarks.suite.file`) and a
profile over the profile it is ``like`` (:mod:`benchmarks.suite.profile_like`): mappings merge key by
key at every depth, the lists in :data:`CONCATENATED` are the shared entries then the own ones, and
any other value is replaced."""
from __future__ import annotations

import copy
from typing import Any

#: lists that a suite extends (shared entries first) instead of replacing
CONCATENATED = frozenset({"notes", "overrides", "marks"})

def merge(shared: Any, own: Any, key: str | None = None) -> Any:
    """``own`` written over ``shared`` by the rule above (neither is modified)."""
    if isinstance(shared, dict) and isinstance(own, dict):  # each value copied once, shared keys first
        out = {k: merge(v, own[k], str(k)) if k in own else copy.deepcopy(v) for k, v in shared.items()}
        out.update({k: copy.deepcopy(v) for k, v in own.items() if k not in shared})
        return out
    if key in CONCATENATED and isinstance(shared, list) and isinstance(own, list):
        return copy.deepcopy(shared) + copy.deepcopy(own)
    return copy.deepcopy(own)
