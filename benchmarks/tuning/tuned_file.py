"""The tuned-parameters file ``<suite>.tuned.yml`` as ``pflbench tune`` writes it: a locked
read-modify-write, the lock beside the stores (``<results dir>/locks/``); read back by
:mod:`benchmarks.suite.tuned_values`."""
from __future__ import annotations

import fcntl
import hashlib
from pathlib import Path
from typing import Any

import yaml

from benchmarks.store.location import results_dir
from pfl_core.atomic_file import write_text

TUNED_HEADER = ("# Written by `pflbench tune` (benchmarks/tuning/tune.py): the best parameters per cell, method and\n"
                "# tuning profile, with their provenance. A suite uses them for the methods its `tuned` key\n"
                "# lists (benchmarks/suite/spec.py). Edit by re-tuning, not by hand.\n")


# -- the tuned-parameters file --------------------------------------------------------------------
def lock_path(path: Path) -> Path:
    """The lock of tuned file ``path``: ``<results dir>/locks/<name>.<digest of its full path>.lock``,
    beside the stores, never in the suite's folder (a command writes nothing into the checkout)."""
    digest = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]
    return results_dir() / "locks" / f"{Path(path).name}.{digest}.lock"


def write_tuned(path: Path, suite_key: str, cid: str, method: str, profile: str, params: dict,
                provenance: dict) -> Path:
    """Set ``cells[cid][method][profile] = {params, provenance}`` in the tuned file (locked
    read-modify-write, so concurrent ``pflbench tune`` calls of other methods keep their entries;
    the lock is :func:`lock_path`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_file = lock_path(path)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as lock:  # the file itself is replaced
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
        data["suite"] = suite_key
        entry = {"params": {k: _plain(v) for k, v in params.items()}, "provenance": _plain(provenance)}
        data.setdefault("cells", {}).setdefault(cid, {}).setdefault(method, {})[profile] = entry
        write_text(path, TUNED_HEADER + yaml.safe_dump(data, sort_keys=False, width=110))
    return path


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value
