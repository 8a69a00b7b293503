"""Reading a suite file, with the defaults its paper's suites share (``extends``).

A suite's ``name`` is its file's stem (``table1`` for ``table1.yaml``) unless it states another.

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

A grid value may state only how it differs from another (``like``, :func:`resolve_likes`):
``{label: CGPFL-K3, like: CGPFL-K4, set: {method.params.num_clusters: 3}}`` is CGPFL-K4's ``set``
with ``method.params.num_clusters`` set to 3, written out (:func:`overlay`: the value the run gets
is what applying CGPFL-K4's keys, then these, would give). ``like`` names another value of the same
axis (one that is itself ``like`` another is resolved first); in a shared file, a grid value
``<label>: {like: <other grid value>, set: {...}}`` does the same within ``grid_values``. Every
suite, with or without ``extends``, is read with its ``like`` values written out, so a suite's
resolved configuration and hash do not depend on which way it was written.

A profile may likewise start from another profile of the suite (``profiles: {<name>: {like:
<other>, ...}}``, :mod:`benchmarks.suite.profile_like`), written out after the merge.

Several files merge left to right, then the suite; a grid value defined in two of them must be the
same (else the load fails naming both). A shared file may not ``extends`` another, nor
hold ``paper``-level identity keys (``name``, ``table``, ``grid``, ``published``): what it holds
is checked with the suite, as if written there. Its overrides and marks may name any label of the
paper, a suite's or a shared grid value; in each suite they apply to the labels it has (a condition
is cut to them, an entry left with none is left out: :mod:`benchmarks.suite.shared_when`), and a
label that is neither fails when the suite is loaded. Config hashes are computed on the merged, resolved
configuration: moving a value into a shared file changes no hash (``tests/test_suite_config_pins.py``).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from benchmarks.suite.merge_rule import merge
from benchmarks.suite.profile_like import like_sources, resolve_profile_likes
from benchmarks.suite.schema import TOP_KEYS, SuiteError, check_keys
from benchmarks.suite.shared_when import fit_shared, suite_labels
from benchmarks.suite.yaml_file import YamlFileError, read_yaml

#: the keys of a grid value that starts from another (``like``)
LIKE_KEYS = frozenset({"label", "like", "set"})

#: keys only a suite itself may state (what makes it this table and not another)
SUITE_ONLY = frozenset({"extends", "name", "table", "caption", "grid", "published", "published_quantities",
                        "code_reference", "tuned"})


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
    for label, value in values.items():
        if "like" in value:
            check_keys(value, LIKE_KEYS - {"label"}, f"{file}: grid_values.{label}", {"like"})
    return shared, values


def read_suite_file(path: Path) -> dict:
    """The suite at ``path`` as a mapping, its ``extends`` files merged in: a complete suite that no
    longer names them (it can be written anywhere and loads alike); :class:`SuiteError` naming the
    file and the fix."""
    raw = _read(path)
    if not isinstance(raw, dict):
        raise SuiteError(f"{path}: expected a mapping of suite keys (paper, name, metric, base, grid, ...), "
                         f"got {type(raw).__name__}")
    if "name" not in raw:  # the file says it: table1.yaml is the suite table1
        raw = {"name": Path(path).stem, **raw}
    liked: dict[str, str] = {}  # profile -> the file stating its ``like``
    if "extends" not in raw:
        like_sources(raw, str(path), liked)
        return resolve_profile_likes(_with_likes(raw, path), liked)
    merged: dict = {}
    named: dict = {}  # grid value label -> its set (whole, never merged across files)
    named_in: dict = {}
    files = [(file, *_read_shared(file)) for file in _shared_files(raw, path)]
    for file, _, values in files:
        for label, value in values.items():
            if label in named and named[label] != value:
                raise SuiteError(f"{path}: extends: grid value {label!r} is defined differently in {named_in[label]} "
                                 f"and {file.name}; give one of them another label")
            named[label], named_in[label] = value, file.name
    labels = suite_labels(raw.get("grid"))
    for file, shared, _ in files:
        merged = merge(merged, fit_shared(shared, labels, set(named), file))
        like_sources(shared, str(file), liked)
    like_sources(raw, str(path), liked)
    own = dict(raw)
    own.pop("extends")
    suite = merge(merged, own)
    if named:
        where = {label: f"{path.parent / named_in[label]}: grid_values.{label}" for label in named}
        named = resolve_likes({label: (value.get("like"), value.get("set")) if "like" in value else (None, value)
                               for label, value in named.items()}, where, "a grid value of the shared files")
        suite["grid"] = _named_values(suite.get("grid"), named, path)
    return resolve_profile_likes(_with_likes(suite, path), liked)


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


def overlay(base: dict, own: dict) -> dict:
    """A grid value's ``set`` that does what applying ``base``'s dotted keys and then ``own``'s
    would, written as ``base`` writes it where that is unambiguous: a key of ``own`` inside the one
    mapping of ``base`` that holds it (``method.params.num_clusters`` in ``method.params: {...}``)
    is set there, a key that ``base`` states is replaced where it stands, one that covers keys of
    ``base`` (``method.params`` over ``method.params.lr``) removes them; any other key is added after
    ``base``'s, which applies it last (neither argument is modified)."""
    out = copy.deepcopy(base)
    for key, value in own.items():
        key = str(key)
        for covered in [k for k in out if str(k).startswith(key + ".")]:
            del out[covered]
        outer = [k for k in out if key.startswith(f"{k}.")]
        if not outer and key in out:
            out[key] = copy.deepcopy(value)
            continue
        node = out[outer[0]] if len(outer) == 1 and key not in out else None
        parts = key[len(str(outer[0])) + 1:].split(".") if node is not None else []
        for part in parts[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[parts[-1]] = copy.deepcopy(value)
        else:  # not inside one mapping of base (or through a value that is not one): applied last
            out.pop(key, None)
            out[key] = copy.deepcopy(value)
    return out


def resolve_likes(entries: dict[str, tuple[Any, Any]], where: dict[str, str], kind: str) -> dict[str, dict]:
    """label -> its ``set`` written out, for ``entries`` label -> (``like`` or None, own ``set``): an
    entry ``like`` another starts from that one's resolved ``set`` and :func:`overlay`s its own;
    ``where`` names each entry for errors, ``kind`` what a ``like`` must name."""
    out: dict[str, dict] = {}

    def resolve(label: str, chain: tuple[str, ...]) -> dict:
        if label not in out:
            like, own = entries[label]
            if own is not None and not isinstance(own, dict):
                raise SuiteError(f"{where[label]}.set: expected a mapping of dotted keys to values, got {own!r}")
            if like is None:
                out[label] = own or {}
            elif str(like) not in entries:
                raise SuiteError(f"{where[label]}.like: {like!r} is not {kind} ({list(entries)}); name one of them "
                                 f"(the value starts from its set) or write this value's set in full")
            elif str(like) in (*chain, label):
                cycle = " -> ".join((*chain, label, str(like)))
                raise SuiteError(f"{where[label]}.like: {cycle} goes round in a circle; write one of them in full")
            else:
                out[label] = overlay(resolve(str(like), (*chain, label)), own or {})
        return out[label]

    for label in entries:
        resolve(label, ())
    return out


def _with_likes(suite: dict, path: Path) -> dict:
    """The suite with every grid value ``like`` another written out as ``{label, set}``."""
    grid = suite.get("grid")
    if not isinstance(grid, list):
        return suite
    axes = []
    for i, axis in enumerate(grid):
        values = axis.get("values") if isinstance(axis, dict) else None
        for j, value in enumerate(values if isinstance(values, list) else []):
            if isinstance(value, dict):
                check_keys(value, LIKE_KEYS, f"{path}: grid[{i}].values[{j}]", {"label"})
        if not isinstance(values, list) or not any(isinstance(v, dict) and "like" in v for v in values):
            axes.append(axis)
            continue
        entries, where = {}, {}
        for j, value in enumerate(values):
            at = f"{path}: grid[{i}].values[{j}]"
            if isinstance(value, dict):
                label = str(value.get("label"))
                entries.setdefault(label, (value.get("like"), value.get("set")))
            else:  # a scalar of a keyed axis sets the axis's key (a value may start from it too)
                label = str(value)
                entries.setdefault(label, (None, {axis["key"]: value} if "key" in axis else {}))
            where.setdefault(label, at)
        resolved = resolve_likes(entries, where, f"a label of axis {axis.get('name')!r}")
        axes.append({**axis, "values": [{"label": v["label"], "set": resolved[str(v["label"])]}
                                        if isinstance(v, dict) and "like" in v else v for v in values]})
    return {**suite, "grid": axes}
