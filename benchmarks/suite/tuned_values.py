"""Tuned-value files (``<suite>.tuned.yml``, written by ``pflbench tune``): the suite's ``tuned`` key
and the reading of a file, cached per path and modification time."""
from __future__ import annotations

from pathlib import Path


from benchmarks.suite.yaml_file import YamlFileError, read_yaml
from pfl_core.algorithms import METHODS

from benchmarks.suite.schema import SuiteError, check_keys

TUNED_KEYS = {"methods", "file", "profile", "params", "profiles"}


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


def tuned_profiles(raw: dict) -> list[str] | None:
    """The profiles whose runs take tuned values and which ``pflbench tune`` may tune for
    (``tuned.profiles``; None = every profile)."""
    return tuned_spec(raw).get("profiles")


def tuned_params(raw: dict, method: str) -> list[str] | None:
    """The dotted keys the suite's studies of ``method`` search (``tuned.params``; None = all)."""
    return (tuned_spec(raw).get("params") or {}).get(method)


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
    profiles = spec.get("profiles")
    if profiles is not None:
        known = ["paper", *(raw.get("profiles") or {})]
        if not isinstance(profiles, list) or not profiles or not all(isinstance(p, str) for p in profiles):
            raise SuiteError(f"{path}: tuned.profiles: expected a non-empty list of profile names, e.g. [tuned]")
        for name in profiles:
            if name not in known:
                raise SuiteError(f"{path}: tuned.profiles: unknown profile {name!r}; the suite's: {known}")
    if spec.get("file") is not None and (not isinstance(spec["file"], str) or spec["file"].endswith(".yaml")):
        raise SuiteError(f"{path}: tuned.file: expected a file name relative to the suite, not ending in "
                         f".yaml (every *.yaml beside a suite is read as a suite), e.g. {path.stem}.tuned.yml")
    params = spec.get("params")
    if params is not None:
        if not isinstance(params, dict):
            raise SuiteError(f"{path}: tuned.params: expected a mapping of method name to a list of dotted "
                             f"keys, e.g. {{perfedavg: [method.params.beta]}}")
        from benchmarks.suite.search_spaces import NoSearchSpaceError, get_space

        for name, keys in params.items():
            if methods != "all" and name not in methods:
                raise SuiteError(f"{path}: tuned.params.{name}: {name!r} is not in tuned.methods {methods}")
            if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
                raise SuiteError(f"{path}: tuned.params.{name}: expected a non-empty list of dotted keys")
            try:
                get_space(name, keys)
            except NoSearchSpaceError as err:
                raise SuiteError(f"{path}: tuned.params.{name}: {err}") from None
