"""Suites: the YAML schema, its validation, profiles and grid expansion.

A suite file (``suites/<paper>/<name>.yaml``) holds:

* ``paper``, ``name``, ``table``, ``caption``: what the suite reproduces (``name``: the file's stem
  unless stated).
* ``extends``: shared files of the paper's suites merged under this one
  (:mod:`benchmarks.suite.file`: mappings merge, ``notes``/``overrides``/``marks`` lists extend).
* ``metric``: which run metric is tabulated and how the paper averaged it
  (``key``, ``label``, ``scale``, ``averaging``, ``pm``: std|sem|none, ``ddof``), and how the report
  computes and compares it (``aggregate``: final|last3_of_seed_mean_curve|best_val_round|
  max_over_rounds, ``also``: further aggregates shown as extra columns, ``curve_metric``,
  ``select_metric``, ``tolerance``, ``figure``, ``x_axis``; see
  :mod:`benchmarks.reporting.metric`).
* ``base``: a run configuration (:class:`pfl_core.config.RunConfig` as a mapping); none where
  every cell's grid values state every section (FedL2P's settings: ``data``, ``model``, ...).
* ``grid``: a list of axes. Each axis has a ``name`` and ``values``; a value is either a scalar
  assigned to the axis's ``key`` (a dotted config key, e.g. ``method.name``) or a mapping
  ``{label: ..., set: {dotted.key: value, ...}}``, or one that starts from another value of the axis
  and states what differs, ``{label: ..., like: <label>, set: {...}}`` (written out when the file is
  read: :mod:`benchmarks.suite.file`).
* ``methods``: per-method dotted overrides, applied to every cell whose ``method.name`` matches.
* ``overrides``: a list of ``{when: {axis: label or [labels]}, set: {...}}``, applied in order to
  the cells that match every condition (e.g. CAFeMe's model and fine-tuning rate per dataset).
* ``seeds``: the seeds of the paper profile. A config value ``"${seed}"`` is replaced by the run
  seed (e.g. ``data.params.rotation_seed: "${seed}"``).
* ``profiles``: named overrides (``seeds``, ``set``, ``methods``, ``overrides``); ``paper`` is
  the base itself. A profile's ``metric`` (``aggregate``, ``also``) changes how its report
  aggregates the runs (:meth:`Suite.metric_for`), not what they log. A profile ``like`` another
  starts from it (written out when the file is read: :mod:`benchmarks.suite.profile_like`).
* ``published``: the paper's numbers per cell (``cell``, ``mean``, ``pm``, ``pm_kind``, ``runs``,
  ``source``, required: where the paper prints it; a value without one is a load error).
* ``published_quantities``: the paper's values of per-cell quantities other than the tabulated
  metric, which the report derives from the runs' arrays (``metric.figure``; FedL2P Table 6's ARI of
  the clustered ``xi``, ``beta``, ``x``, ``eta``): ``{cell, quantity, mean, source}`` each.
* ``code_reference``: per cell, the per-seed values a re-run of the authors' released code gave,
  each naming a source whose provenance (repository, commit, local edits, rounds, data, machine,
  date) is data beside it (schema and checks in :mod:`benchmarks.suite.code_reference`).
* ``marks``: notes the report attaches to cells, each ``{when: {axis: label or [labels]}, mark: "‡",
  text: "..."}`` (e.g. MetaVers' baseline cells whose hyperparameters come from the baseline's own
  paper): the mark follows the cell's label in every table, the text is its legend line
  (:meth:`Suite.marks`).
* ``tuned``: which methods run with the values ``pflbench tune`` found instead of the paper's:
  ``{methods: [fedavg, ditto] | all, file: <name>.tuned.yml, profile: <profile>}`` (or just the
  list of methods). ``file`` (default ``<suite stem>.tuned.yml`` beside the suite; ``.yml`` so that
  no ``*.yaml`` glob takes it for a suite) holds the best
  parameters per cell, method and tuning profile with their provenance (see
  :mod:`benchmarks.tuning.tune`); ``profile`` (default: the run's own profile) names the profile whose
  tuned values every profile uses; ``params`` (``{method: [dotted keys]}``, default: the method's
  whole space) restricts a method's studies to those keys. A cell whose method is listed and has an entry gets the tuned
  dotted keys set after every other override (as in the study's trials); its :class:`RunSpec` carries
  the provenance (``RunSpec.tuned``) and its runs are tagged ``tuned=true``; other cells keep the
  paper's values (``tuned=false``).

A run's configuration is built as base <- cell values <- method overrides <- conditional
overrides <- profile overrides (``set``, then its ``methods``, then its ``overrides``).
Every expanded run is validated (dataset, model, method, partitioner, protocol, every key, and
every value against the type and range declared on its dataclass field or function parameter, see
:class:`pfl_core.config.Range`) when the suite is loaded, as are the suite's own keys (seeds, grid,
metric, published numbers), so a bad suite fails before anything runs, in one line naming the file,
the suite entry that set the value and the fix.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.suite.code_reference import Checks, parse_code_reference
from benchmarks.suite.file import read_suite_file
from pfl_core.algorithms import METHODS
from pfl_core.config import RunConfig
from benchmarks.suite.schema import (AXIS_KEYS, FREE_FORM, PROFILE_KEYS, PROFILE_METRIC_KEYS, PUBLISHED_KEYS,
                                     QUANTITY_KEYS,
                                     REQUIRED_KEYS, SCHEMA_KEYS, SuiteError, TOP_KEYS, check_cell,
                                     check_keys, check_label, check_marks, check_metric, check_overrides,
                                     check_placeholders, check_published_numbers, check_seeds, check_source,
                                     leaves, matches, substitute_seed, validate_config)
from benchmarks.suite.packaged import resolve_suite
from benchmarks.suite.tuned_values import check_tuned, read_tuned, tuned_profiles, tuned_spec


#: bump when a change of the core changes what every identical config computes; it changes every
#: hash (no stored run is skipped, resumed or reused; committed snapshots stop matching). A change
#: to one method is a named parameter its suites state instead (docs/suites.md, "CONFIG_VERSION",
#: with the decision for 457380c's pFedMe/CGPFL defaults and L2SGD draw: not bumped)
CONFIG_VERSION = 1


@dataclass(frozen=True)
class RunSpec:
    """One run of a suite: (cell, seed, profile) and its resolved, hashed configuration."""

    suite: str
    cell: dict[str, str]
    seed: int
    profile: str
    config: dict
    config_hash: str
    tuned: dict | None = None
    """Provenance of the tuned values this run uses (None: the paper's values); see ``tags``."""
    stage: str = ""
    """``pretrain`` for a stage-1 run (:mod:`benchmarks.running.stages`: its final state is kept and logged
    as the artifact ``pretrained/state.pt``); empty for the suite's own runs."""

    @property
    def tags(self) -> dict[str, str]:
        """Extra MLflow tags: ``tuned`` = ``true``/``false`` and, when tuned, ``tuned.*`` provenance."""
        if not self.tuned:
            return {"tuned": "false"}
        tags = {"tuned": "true"}
        for key, value in self.tuned.items():
            tags[f"tuned.{key}"] = (json.dumps(value, sort_keys=True, default=str)
                                    if isinstance(value, (dict, list)) else str(value))
        return tags

    @property
    def cell_id(self) -> str:
        return cell_id(self.cell)

    @property
    def method(self) -> str:
        return self.config["method"]["name"]


def cell_id(cell: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in cell.items())


def _without_defaults(value: Any, default: Any) -> Any:
    """``value`` minus the entries equal to ``default`` at the same path (dataclass fields only:
    free-form mappings such as ``method.params`` have an empty default and are kept whole)."""
    out = {}
    for key, v in value.items():
        if key not in default:
            out[key] = v
        elif isinstance(v, dict) and isinstance(default[key], dict) and default[key]:
            section = _without_defaults(v, default[key])
            if section:
                out[key] = section
        elif v != default[key]:
            out[key] = v
    return out


def config_hash(config: dict) -> str:
    """Hash of a resolved config, leaving out values equal to the schema's defaults, so adding a
    config key with a default does not orphan the runs already stored. A change that alters what
    an identical config computes bumps ``CONFIG_VERSION`` instead. A stage-1 ``model.pretrained``
    enters as its own defaults-free form (the stage-2 hash changes exactly when the stage-1 hash,
    :func:`stage1_hash`, does)."""
    defaults = RunConfig().to_dict()
    essential = _without_defaults(config, defaults)
    stage1 = (config.get("model") or {}).get("pretrained")
    if stage1 and "source" not in stage1:
        essential["model"]["pretrained"] = _without_defaults(stage1, defaults)
    payload = json.dumps({"v": CONFIG_VERSION, "config": essential}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def stage1_hash(config: dict) -> str | None:
    """The config hash of a resolved run config's stage 1 (``model.pretrained``), None without one
    (or with a ``source``, which trains nothing)."""
    stage1 = (config.get("model") or {}).get("pretrained")
    if not stage1 or "source" in stage1:
        return None
    return config_hash(RunConfig.from_dict(stage1).to_dict())


def _set_dotted(config: dict, key: str, value: Any, where: str, origins: dict | None = None) -> None:
    head = key.split(".")
    known_prefix = next((p for p in FREE_FORM if key.startswith(p + ".")), None)
    if key not in SCHEMA_KEYS and known_prefix is None:
        raise SuiteError(f"{where}: unknown config key {key!r}; allowed: {sorted(SCHEMA_KEYS)}")
    node = config
    for part in head[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SuiteError(f"{where}: {key!r} goes through a non-mapping value")
    node[head[-1]] = copy.deepcopy(value)
    if origins is not None:
        origins[key] = where


def _apply(config: dict, overrides: dict | None, where: str, origins: dict | None = None) -> None:
    """Set the dotted keys of ``overrides`` in ``config``; ``origins`` (dotted key -> suite entry)
    records where each value came from, for error messages."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise SuiteError(f"{where}: expected a mapping of dotted keys to values")
    for key, value in overrides.items():
        _set_dotted(config, str(key), value, f"{where}.{key}", origins)


@dataclass
class Axis:
    name: str
    labels: list[str]
    settings: list[dict]


@dataclass
class Suite:
    path: Path
    raw: dict
    axes: list[Axis] = field(default_factory=list)
    code_references: dict = field(default_factory=dict)
    """cell id -> :class:`benchmarks.suite.code_reference.CodeReference` (the ``code_reference`` key)."""

    @property
    def paper(self) -> str:
        return self.raw["paper"]

    @property
    def name(self) -> str:
        return self.raw["name"]

    @property
    def key(self) -> str:
        return f"{self.paper}/{self.name}"

    @property
    def metric(self) -> dict:
        """The tabulated metric with defaults filled in (label = key, scale 1, pm std, ddof 0);
        the report's keys (aggregate, tolerance, ...) are defaulted by benchmarks.reporting.metric."""
        raw = self.raw["metric"]
        return {"label": raw["key"], "scale": 1.0, "pm": "std", "ddof": 0, "averaging": "", **raw}

    def metric_for(self, profile: str = "paper") -> dict:
        """:attr:`metric` with the profile's ``metric`` keys (``aggregate``, ``also``) over it."""
        return {**self.metric, **(self._profile(profile).get("metric") or {})}

    @property
    def profiles(self) -> list[str]:
        return ["paper", *sorted(self.raw.get("profiles") or {})]

    @property
    def published(self) -> list[dict]:
        return self.raw.get("published") or []

    @property
    def published_quantities(self) -> list[dict]:
        """``published_quantities`` entries (cells normalised to grid order and string labels)."""
        return self.raw.get("published_quantities") or []

    def cells(self) -> list[dict[str, str]]:
        return [dict(zip((a.name for a in self.axes), combo))
                for combo in itertools.product(*(a.labels for a in self.axes))]

    def check_only(self, only: dict[str, list[str]], labels: bool = False) -> None:
        """Refuse an ``--only`` naming an axis the suite lacks (and with ``labels``, a label its axis
        lacks) in one line naming the suite's axes or the axis's labels."""
        by_name = {a.name: a.labels for a in self.axes}
        for axis, values in only.items():
            if axis not in by_name:
                raise SuiteError(f"{self.path}: --only names axis {axis!r}; axes: {list(by_name)}")
            if labels and (unknown := [v for v in values if v not in by_name[axis]]):
                raise SuiteError(f"{self.path}: --only {axis}={','.join(unknown)}: no such label; "
                                 f"{axis}: {by_name[axis]}")

    def expand(self, profile: str = "paper", seeds: list[int] | None = None,
               only: dict[str, list[str]] | None = None, use_tuned: bool = True) -> list[RunSpec]:
        """Every (cell, seed) run of ``profile``, filtered by ``only`` (axis -> allowed labels).
        ``use_tuned=False`` ignores the suite's ``tuned`` key (the paper's values everywhere)."""
        prof = self._profile(profile)
        run_seeds = list(seeds) if seeds is not None else list(prof.get("seeds", self.raw["seeds"]))
        only = only or {}
        self.check_only(only)
        specs, hashes = [], {}
        for combo in itertools.product(*(range(len(a.labels)) for a in self.axes)):
            cell = {a.name: a.labels[i] for a, i in zip(self.axes, combo)}
            if any(cell[axis] not in allowed for axis, allowed in only.items()):
                continue
            config = copy.deepcopy(self.raw.get("base") or {})
            origins = {key: f"{self.path}: base.{key}" for key in leaves(config)}
            for a, i in zip(self.axes, combo):
                _apply(config, a.settings[i], f"{self.path}: grid.{a.name}={a.labels[i]}", origins)
            method = (config.get("method") or {}).get("name")
            method = method if isinstance(method, str) else None  # a bad name fails in validate_config
            _apply(config, (self.raw.get("methods") or {}).get(method), f"{self.path}: methods.{method}", origins)
            self._apply_overrides(config, cell, self.raw.get("overrides"), "overrides", origins)
            _apply(config, prof.get("set"), f"{self.path}: profiles.{profile}.set", origins)
            _apply(config, (prof.get("methods") or {}).get(method),
                   f"{self.path}: profiles.{profile}.methods.{method}", origins)
            self._apply_overrides(config, cell, prof.get("overrides"), f"profiles.{profile}.overrides", origins)
            tuned = self._tuned_entry(cell, method, profile) if use_tuned else None
            if tuned is not None:
                _apply(config, tuned["params"], f"{self.tuned_path}: {cell_id(cell)}.{method}", origins)
            where = f"{self.path}: cell {cell_id(cell)}, profile {profile}"
            check_placeholders(config, where, origins)
            for seed in run_seeds:
                seeded = substitute_seed(config, int(seed))
                seeded["seed"] = int(seed)
                resolved = validate_config(seeded, where, origins)
                spec = RunSpec(self.key, cell, int(seed), profile, resolved, config_hash(resolved),
                               tuned["provenance"] if tuned is not None else None)
                twin = hashes.setdefault(spec.config_hash, spec)
                if twin is not spec and profile == "paper":  # a cut-down profile may merge cells
                    raise SuiteError(f"{self.path}: cells {twin.cell_id} and {spec.cell_id} (profile {profile}) "
                                     f"resolve to the same configuration (hash {spec.config_hash}): an axis "
                                     f"value changes nothing; remove the duplicate value or axis, or make "
                                     f"its 'set' differ")
                specs.append(spec)
        return specs

    # -- tuned values (``tuned`` key; written by benchmarks.tuning.tune) ---------------------------------
    @property
    def tuned_path(self) -> Path:
        """The tuned-parameters file of this suite (``tuned.file``, default ``<stem>.tuned.yml``)."""
        return self.path.parent / (tuned_spec(self.raw).get("file") or f"{self.path.stem}.tuned.yml")

    def uses_tuned(self, method: str) -> bool:
        """Whether the suite takes ``method``'s values from the tuned file (when it has an entry)."""
        methods = tuned_spec(self.raw).get("methods") or []
        return methods == "all" or method in methods

    def _tuned_entry(self, cell: dict[str, str], method: str, profile: str) -> dict | None:
        if not self.uses_tuned(method):
            return None
        allowed = tuned_profiles(self.raw)
        if allowed is not None and profile not in allowed:
            return None  # tuned.profiles: only those profiles' runs take tuned values
        source = tuned_spec(self.raw).get("profile") or profile
        entry = (((read_tuned(self.tuned_path).get("cells") or {}).get(cell_id(cell)) or {})
                 .get(method) or {}).get(source)
        if entry is None:
            return None
        provenance = {**(entry.get("provenance") or {}), "profile": source,
                      "file": self.tuned_path.name, "params": entry["params"]}
        return {"params": entry["params"], "provenance": provenance}

    def _apply_overrides(self, config: dict, cell: dict[str, str], overrides: list | None, where: str,
                         origins: dict | None = None) -> None:
        for i, entry in enumerate(overrides or []):
            if matches(cell, entry["when"]):
                _apply(config, entry.get("set"), f"{self.path}: {where}[{i}].set", origins)

    def marks(self, cell: dict[str, str]) -> list[tuple[str, str]]:
        """(mark, text) of every entry of the suite's ``marks`` whose ``when`` matches ``cell``."""
        return [(str(m["mark"]), str(m["text"])) for m in self.raw.get("marks") or [] if matches(cell, m["when"])]

    def _profile(self, profile: str) -> dict:
        if profile == "paper":
            return {}
        profiles = self.raw.get("profiles") or {}
        if profile not in profiles:
            raise SuiteError(f"{self.path}: unknown profile {profile!r}; allowed: {self.profiles}")
        return profiles[profile] or {}


def _parse_axis(raw: Any, where: str) -> Axis:
    check_keys(raw, AXIS_KEYS, where, {"name", "values"})
    values = raw["values"]
    if not isinstance(values, list) or not values:
        raise SuiteError(f"{where}.values: expected a non-empty list")
    labels, settings = [], []
    for i, value in enumerate(values):
        if isinstance(value, dict):
            check_keys(value, {"label", "set"}, f"{where}.values[{i}]", {"label"})
            check_label(value["label"], f"{where}.values[{i}].label")
            labels.append(str(value["label"]))
            settings.append(value.get("set") or {})
        else:
            if "key" not in raw:
                raise SuiteError(f"{where}: scalar values need the axis 'key' (a dotted config key)")
            if not isinstance(value, (str, int, float)) or (isinstance(value, float) and not math.isfinite(value)):
                raise SuiteError(f"{where}.values[{i}]: {value!r} is not a scalar; write a number or a name, or "
                                 f"{{label: <name>, set: {{{raw['key']}: <value>}}}}")
            check_label(value, f"{where}.values[{i}]")
            labels.append(str(value))
            settings.append({raw["key"]: value})
    if len(set(labels)) != len(labels):
        twice = sorted({label for label in labels if labels.count(label) > 1})
        raise SuiteError(f"{where}.values: duplicate label(s) {twice} in {labels}; list each value once")
    return Axis(str(raw["name"]), labels, settings)


def load_suite(path: str | Path) -> Suite:
    """Read and validate a suite file (a path, or a packaged suite's ``<paper>/<name>``); every run
    of every profile is checked before returning."""
    path = resolve_suite(path)
    raw = read_suite_file(path)
    check_keys(raw, TOP_KEYS, str(path), REQUIRED_KEYS)
    check_metric(raw["metric"], path)
    check_seeds(raw["seeds"], f"{path}: seeds")
    for name, prof in (raw.get("profiles") or {}).items():
        if isinstance(prof, dict) and "seeds" in prof:
            check_seeds(prof["seeds"], f"{path}: profiles.{name}.seeds")
    if not isinstance(raw["grid"], list) or not raw["grid"]:
        raise SuiteError(f"{path}: grid: expected a non-empty list of axes, e.g. "
                         f"[{{name: method, key: method.name, values: [fedavg, local]}}]")
    axes = [_parse_axis(a, f"{path}: grid[{i}]") for i, a in enumerate(raw["grid"])]
    names = [a.name for a in axes]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise SuiteError(f"{path}: grid[{i}].name: axis {name!r} appears twice; give each axis its own "
                             f"name and merge the values of a repeated one")
    axis_labels = {a.name: a.labels for a in axes}
    override_sections = [("overrides", raw.get("overrides"))]
    for name, prof in (raw.get("profiles") or {}).items():
        check_keys(prof or {}, PROFILE_KEYS, f"{path}: profiles.{name}")
        if "metric" in (prof or {}):
            check_keys(prof["metric"], PROFILE_METRIC_KEYS, f"{path}: profiles.{name}.metric")
        override_sections.append((f"profiles.{name}.overrides", (prof or {}).get("overrides")))
    for where, section in override_sections:
        check_overrides(section, axis_labels, f"{path}: {where}")
    check_marks(raw.get("marks"), axis_labels, f"{path}: marks")
    method_sections = [("methods", raw.get("methods"))] + [
        (f"profiles.{name}.methods", (prof or {}).get("methods"))
        for name, prof in (raw.get("profiles") or {}).items()]
    for where, section in method_sections:
        for name in section or {}:
            if name not in METHODS:
                raise SuiteError(f"{path}: {where}.{name}: unknown method; allowed: {METHODS.names()}")
    check_tuned(raw, path)
    suite = Suite(path, raw, axes)
    cells = suite.cells()
    axis_names = [a.name for a in axes]
    if not isinstance(raw.get("published") or [], list):
        raise SuiteError(f"{path}: published: expected a list of {{cell: ..., mean: ...}}")
    for i, entry in enumerate(suite.published):
        check_keys(entry, PUBLISHED_KEYS, f"{path}: published[{i}]", {"cell", "mean", "source"})
        check_source(entry, f"{path}: published[{i}]")
        check_published_numbers(entry, f"{path}: published[{i}]")
        entry["cell"] = check_cell(entry["cell"], axis_names, cells, f"{path}: published[{i}].cell")
    _check_published_quantities(suite, axis_names, cells)
    checks = Checks(check_keys, lambda cell, where: check_cell(cell, axis_names, cells, where), SuiteError)
    suite.code_references = {cell_id(ref.cell): ref for ref in
                             parse_code_reference(raw.get("code_reference"), f"{path}: code_reference", checks)}
    for profile in suite.profiles:
        suite.expand(profile)
    return suite


def _check_published_quantities(suite: Suite, axis_names: list[str], cells: list[dict[str, str]]) -> None:
    """``published_quantities``: a list of ``{cell, quantity, mean, source}``, each cell of the grid,
    each (cell, quantity) once, the mean a number."""
    section, where = suite.raw.get("published_quantities"), f"{suite.path}: published_quantities"
    if section is None:
        return
    if not isinstance(section, list):
        raise SuiteError(f"{where}: expected a list of {{cell: ..., quantity: ..., mean: ...}}")
    seen = set()
    for i, entry in enumerate(section):
        check_keys(entry, QUANTITY_KEYS, f"{where}[{i}]", {"cell", "quantity", "mean", "source"})
        check_source(entry, f"{where}[{i}]")
        check_published_numbers({"mean": entry["mean"]}, f"{where}[{i}]")
        if not isinstance(entry["quantity"], str) or not entry["quantity"]:
            raise SuiteError(f"{where}[{i}].quantity: expected a name (e.g. beta), got {entry['quantity']!r}")
        entry["cell"] = check_cell(entry["cell"], axis_names, cells, f"{where}[{i}].cell")
        key = (cell_id(entry["cell"]), entry["quantity"])
        if key in seen:
            raise SuiteError(f"{where}[{i}]: {key[1]!r} of cell {key[0]} is listed twice; list each once")
        seen.add(key)


def parse_only(items: list[str] | None) -> dict[str, list[str]]:
    """``["method=fedavg", "method=local", "dataset=x"]`` -> {method: [fedavg, local], dataset: [x]}."""
    only: dict[str, list[str]] = {}
    for item in items or []:
        if "=" not in item:
            raise SuiteError(f"--only expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        only.setdefault(key.strip(), []).extend(v.strip() for v in value.split(","))
    return only
