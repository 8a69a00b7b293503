"""Reading a suite file, with the defaults its paper's suites share (``extends``).

A suite may begin with ``extends: _shared.yml`` (or a list of such files): YAML files beside it,
named with a leading underscore and the ``.yml`` suffix so that no ``*.yaml`` glob takes them for
suites, that hold what several suites of one paper state alike (notes, metric, base configuration,
per-method values, warm-start chains, profiles). The suite is read as if it had been written out
in full, by one rule:

* mappings merge key by key at every depth, the suite's value replacing the shared one at a leaf
  (so ``methods.ditto`` in a suite adds to or replaces single keys of the shared ``methods.ditto``);
* the lists ``notes``, ``overrides`` and ``marks`` (at any depth, e.g. a profile's ``overrides``)
  are the shared entries followed by the suite's: shared overrides apply first, so a suite's own
  override of the same key wins;
* every other value (seeds, grid, published numbers, scalars) is the suite's when it states one.

A shared file may also name grid values, ``grid_values: {<label>: {<dotted key>: value, ...}}``: an
axis without a ``key`` then lists such a value by its label alone (``values: [office, domainnet]``),
read as ``{label: office, set: {...}}`` written out.

Several files merge left to right, then the suite; a grid value defined in two of them must be the
same (else the load fails naming both). A shared file may not ``extends`` another, nor
hold ``paper``-level identity keys (``name``, ``table``, ``grid``, ``published``): what it holds
is checked with the suite, as if written there, so a shared override naming a label that some
suite lacks fails when that suite is loaded. Config hashes are computed on the merged, resolved
configuration: moving a value into a shared file changes no hash (``tests/test_suite_config_pins.py``).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from benchmarks.suite_schema import TOP_KEYS, SuiteError, check_keys
from benchmarks.yaml_file import YamlFileError, read_yaml

#: lists that a suite extends (shared entries first) instead of replacing
CONCATENATED = frozenset({"notes", "overrides", "marks"})

#: keys only a suite itself may state (what makes it this table and not another)
SUITE_ONLY = frozenset({"extends", "name", "table", "caption", "grid", "published", "published_quantities",
                        "code_reference", "tuned"})


def merge(shared: Any, own: Any, key: str | None = None) -> Any:
    """``own`` written over ``shared`` by the rule of this module (neither is modified)."""
    if isinstance(shared, dict) and isinstance(own, dict):  # each value copied once, shared keys first
        out = {k: merge(v, own[k], str(k)) if k in own else copy.deepcopy(v) for k, v in shared.items()}
        out.update({k: copy.deepcopy(v) for k, v in own.items() if k not in shared})
        return out
    if key in CONCATENATED and isinstance(shared, list) and isinstance(own, list):
        return copy.deepcopy(shared) + copy.deepcopy(own)
    return copy.deepcopy(own)


def _read(path: Path) -> Any:
    try:
        return read_yaml(path)
    except YamlFileError as err:
        raise SuiteError(str(err)) from None


def _shared_files(raw: dict, path: Path) -> list[Path]:
    names = raw.get("extends")
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise SuiteError(f"{path}: extends: expected a file name beside the suite or a list of them, "
                         f"e.g. extends: _shared.yml; got {raw.get('extends')!r}")
    files = []
    for name in names:
        file = path.parent / name
        if Path(name).name != name or not name.startswith("_") or not name.endswith(".yml"):
            raise SuiteError(f"{path}: extends: {name!r}: name a file in the suite's folder whose name starts "
                             f"with '_' and ends in '.yml' (e.g. _shared.yml), so no *.yaml glob takes it for a suite")
        if not file.is_file():
            raise SuiteError(f"{path}: extends: {file} does not exist; create it or remove the name")
        files.append(file)
    return files


def _read_shared(file: Path) -> tuple[dict, dict]:
    """A shared file's suite keys and its ``grid_values``, each checked."""
    shared = _read(file)
    if not isinstance(shared, dict):
        raise SuiteError(f"{file}: expected a mapping of shared suite keys, got {type(shared).__name__}")
    check_keys(shared, TOP_KEYS | {"grid_values"}, str(file))
    own_only = sorted(set(shared) & SUITE_ONLY)
    if own_only:
        raise SuiteError(f"{file}: {own_only} cannot be shared; move them into each suite (a shared file "
                         f"holds only {sorted(TOP_KEYS - SUITE_ONLY | {'grid_values'})})")
    values = shared.pop("grid_values", None) or {}
    if not isinstance(values, dict) or not all(isinstance(v, dict) for v in values.values()):
        raise SuiteError(f"{file}: grid_values: expected {{<label>: {{<dotted key>: value, ...}}, ...}}")
    return shared, values


def read_suite_file(path: Path) -> dict:
    """The suite at ``path`` as a mapping, its ``extends`` files merged in: a complete suite that no
    longer names them (it can be written anywhere and loads alike); :class:`SuiteError` naming the
    file and the fix."""
    raw = _read(path)
    if not isinstance(raw, dict):
        raise SuiteError(f"{path}: expected a mapping of suite keys (paper, name, metric, base, grid, ...), "
                         f"got {type(raw).__name__}")
    if "extends" not in raw:
        return raw
    merged: dict = {}
    named: dict = {}  # grid value label -> its set (whole, never merged across files)
    named_in: dict = {}
    for file in _shared_files(raw, path):
        shared, values = _read_shared(file)
        for label, value in values.items():
            if label in named and named[label] != value:
                raise SuiteError(f"{path}: extends: grid value {label!r} is defined differently in {named_in[label]} "
                                 f"and {file.name}; give one of them another label")
            named[label], named_in[label] = value, file.name
        merged = merge(merged, shared)
    own = dict(raw)
    own.pop("extends")
    suite = merge(merged, own)
    if named:
        suite["grid"] = _named_values(suite.get("grid"), named, path)
    return suite


def _named_values(grid: Any, named: dict, path: Path) -> Any:
    """The grid with each bare label of a keyless axis replaced by its shared ``grid_values`` entry."""
    if not isinstance(grid, list):
        return grid
    out = []
    for i, axis in enumerate(grid):
        if isinstance(axis, dict) and "key" not in axis and isinstance(axis.get("values"), list):
            values = []
            for value in axis["values"]:
                if isinstance(value, str):
                    if value not in named:
                        raise SuiteError(f"{path}: grid[{i}]: {value!r} is not a grid value of the shared files "
                                         f"(grid_values: {sorted(named)}); write {{label: {value}, set: {{...}}}} "
                                         f"or add it to grid_values")
                    value = {"label": value, "set": copy.deepcopy(named[value])}
                values.append(value)
            axis = {**axis, "values": values}
        out.append(axis)
    return out
