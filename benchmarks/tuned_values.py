"""Tuned-value files (``<suite>.tuned.yml``, written by ``pflbench tune``): the suite's ``tuned`` key
and the reading of a file, cached per path and modification time."""
from __future__ import annotations

import fcntl
import hashlib
from pathlib import Path
from typing import Any

import yaml

from benchmarks.yaml_file import YamlFileError, read_yaml
from pfl_core.algorithms import METHODS

from benchmarks.stores import results_dir
from benchmarks.suite_schema import SuiteError, check_keys
from pfl_core.atomic_file import write_text

TUNED_KEYS = {"methods", "file", "profile"}


_TUNED_CACHE: dict[str, tuple] = {}


def tuned_spec(raw: dict) -> dict:
    spec = raw.get("tuned") or {}
    return {"methods": spec} if isinstance(spec, (list, str)) else spec


def read_tuned(path: Path) -> dict:
    """The tuned-parameters file (``{}`` if absent), cached by modification time."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return {}
    key, stamp = str(path.resolve()), (stat.st_mtime_ns, stat.st_size)
    if _TUNED_CACHE.get(key, (None,))[0] != stamp:
        try:
            data = read_yaml(path) or {}
        except YamlFileError as err:
            raise SuiteError(str(err)) from None
        check_keys(data, {"suite", "cells"}, str(path))
        for cid, methods in (data.get("cells") or {}).items():
            for method, profiles in (methods or {}).items():
                for prof, entry in (profiles or {}).items():
                    check_keys(entry, {"params", "provenance"}, f"{path}: cells.{cid}.{method}.{prof}",
                                {"params"})
                    if not isinstance(entry["params"], dict):
                        raise SuiteError(f"{path}: cells.{cid}.{method}.{prof}.params: expected a "
                                         f"mapping of dotted keys to values")
        _TUNED_CACHE[key] = (stamp, data)
    return _TUNED_CACHE[key][1]


def check_tuned(raw: dict, path: Path) -> None:
    if raw.get("tuned") is None:
        return
    spec = tuned_spec(raw)
    check_keys(spec, TUNED_KEYS, f"{path}: tuned")
    methods = spec.get("methods") or []
    if methods != "all":
        if not isinstance(methods, list):
            raise SuiteError(f"{path}: tuned.methods: expected a list of method names or 'all'")
        for name in methods:
            if name not in METHODS:
                raise SuiteError(f"{path}: tuned.methods: unknown method {name!r}; allowed: {METHODS.names()}")
    profile = spec.get("profile")
    if profile is not None and profile != "paper" and profile not in (raw.get("profiles") or {}):
        raise SuiteError(f"{path}: tuned.profile: unknown profile {profile!r}")
    if spec.get("file") is not None and (not isinstance(spec["file"], str) or spec["file"].endswith(".yaml")):
        raise SuiteError(f"{path}: tuned.file: expected a file name relative to the suite, not ending in "
                         f".yaml (every *.yaml beside a suite is read as a suite), e.g. {path.stem}.tuned.yml")


TUNED_HEADER = ("# Written by `pflbench tune` (benchmarks/tuning.py): the best parameters per cell, method and\n"
                "# tuning profile, with their provenance. A suite uses them for the methods its `tuned` key\n"
                "# lists (benchmarks/suite.py). Edit by re-tuning, not by hand.\n")


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
