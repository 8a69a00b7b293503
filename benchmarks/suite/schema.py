"""The suite schema and its checks: allowed keys, placeholders, seeds, marks, overrides, the
metric and published values, and the validation of every expanded run configuration against the
core's registries and declared field types (:func:`validate_config`). Nothing here knows a
:class:`benchmarks.suite.spec.Suite`; :func:`benchmarks.suite.spec.load_suite` calls these checks."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pfl_core.algorithms import METHODS
from pfl_core.analysis import ANALYSIS_METRICS, parse_analyses
from pfl_core.bn_support import check_bn_support
from pfl_core.config import RunConfig, section_keys
from pfl_core.fields import ConfigError, check_call_values
from pfl_core.data import DATASETS, PARTITIONERS
from pfl_core.data.builder import check_sources
from pfl_core.data.datasets import loader_params
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation import EVAL_KEY_PREFIXES, EVAL_KEYS, PROTOCOLS
from pfl_core.models import MODELS
from pfl_core.registry import UnknownNameError

TOP_KEYS = {"paper", "name", "table", "caption", "notes", "metric", "base", "grid", "methods",
            "overrides", "seeds", "profiles", "published", "tuned", "code_reference", "marks",
            "published_quantities", "extends"}


OVERRIDE_KEYS = {"when", "set"}


MARK_KEYS = {"when", "mark", "text"}


REQUIRED_KEYS = {"paper", "name", "metric", "grid", "seeds"}


METRIC_KEYS = {"key", "label", "scale", "averaging", "pm", "ddof", "aggregate", "also", "curve_metric",
               "select_metric", "tolerance", "figure", "x_axis", "sample_sd", "higher_is_better"}


PROFILE_KEYS = {"seeds", "set", "methods", "overrides", "description", "metric"}


PROFILE_METRIC_KEYS = {"aggregate", "also"}
"""What a profile's ``metric`` may change: how the report aggregates the same runs (e.g. the pFedMe
code's maximum over rounds as the headline), never which metric they log."""


PUBLISHED_KEYS = {"cell", "mean", "pm", "pm_kind", "runs", "source"}


QUANTITY_KEYS = {"cell", "quantity", "mean", "source"}


AXIS_KEYS = {"name", "key", "values"}


FREE_FORM = ("data.params", "data.partition", "data.client_splits", "data.source_splits", "model.params",
             "model.pretrained", "method.params", "evaluation.params")


SCHEMA_KEYS = section_keys()


class SuiteError(ValueError):
    """A suite file is malformed; the message names the file and the key."""


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> value of every leaf of nested mappings (lists are leaves)."""
    if not isinstance(value, dict) or not value:
        return {prefix: value} if prefix else {}
    out = {}
    for key, sub in value.items():
        out.update(leaves(sub, f"{prefix}.{key}" if prefix else str(key)))
    return out


def origin_of(origins: dict[str, str], key: str | None) -> str | None:
    """The suite entry that set dotted ``key`` (or the nearest enclosing key that was set)."""
    while key:
        if key in origins:
            return origins[key]
        key = key.rpartition(".")[0]
    return None


def check_keys(mapping: Any, allowed: set[str], where: str, required: set[str] = frozenset()) -> None:
    if not isinstance(mapping, dict):
        raise SuiteError(f"{where}: expected a mapping, got {type(mapping).__name__}")
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise SuiteError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted(set(required) - set(mapping))
    if missing:
        raise SuiteError(f"{where}: missing required key(s) {missing}")


SEED_TOKEN = "${seed}"


def check_placeholders(config: dict, where: str, origins: dict[str, str]) -> None:
    """Reject a ``"${...}"`` value other than ``"${seed}"`` (a typo such as ``"${sed}"`` would
    otherwise reach the run as a string)."""
    for key, value in leaves(config).items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, str) and v.startswith("${") and v != SEED_TOKEN:
                raise SuiteError(f"{origin_of(origins, key) or where}: unknown placeholder {v!r}; write "
                                 f"{SEED_TOKEN!r} (the only placeholder: the run seed) or a plain value")


def substitute_seed(value: Any, seed: int) -> Any:
    """Replace every ``"${seed}"`` value by the run seed (e.g. ``data.params.rotation_seed``), so
    per-seed randomness that lives outside the run's streams still follows the seed."""
    if isinstance(value, dict):
        return {k: substitute_seed(v, seed) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute_seed(v, seed) for v in value]
    return seed if value == SEED_TOKEN else value


def validate_config(config: dict, where: str, origins: dict[str, str] | None = None) -> dict:
    """Check every name, key and value of one run configuration (types and ranges as declared on
    the dataclasses and signatures); return its fully resolved dict. An error names the suite entry
    that set the bad value when ``origins`` (dotted key -> entry) knows it, else ``where``."""
    try:
        cfg = RunConfig.from_dict(config)
        check_names(cfg)
        stage1 = cfg.stage1()
        if stage1 is not None:
            try:
                check_names(stage1)
            except (ConfigError, UnknownNameError, ValueError, TypeError) as err:
                key = getattr(err, "key", None)
                raise ConfigError(f"model.pretrained: {err}", f"model.pretrained.{key}" if key else "model.pretrained")
    except (ConfigError, UnknownNameError, ValueError, TypeError) as err:
        origin = origin_of(origins or {}, getattr(err, "key", None))
        raise SuiteError(f"{origin} ({where.split(': ', 1)[-1]}): {err}" if origin else f"{where}: {err}") from None
    resolved = cfg.to_dict()
    if stage1 is not None:  # resolved too: every stage-1 key in the run's params (config.json, MLflow)
        resolved["model"]["pretrained"] = stage1.to_dict()
    return resolved


def check_names(cfg: RunConfig) -> None:
    """The registered names of a run (dataset, model, method, protocol, partitioner) and the
    parameters checked against them; a :class:`ConfigError` keyed by the dotted config key."""
    DATASETS.get(cfg.data.dataset)
    check_call_values(loader_params(cfg.data.dataset), cfg.data.params, "data.params.",
                      f"dataset {cfg.data.dataset!r}")
    check_sources(cfg.data)
    MODELS.get(cfg.model.name)
    method = METHODS.get(cfg.method.name)
    check_bn_support(cfg.method.name, cfg.model.name)
    method.hyper_class.from_dict(cfg.method.params, where=f"method.params ({cfg.method.name}): ",
                                 path="method.params.")
    for i, step in enumerate(cfg.model.warm_start):
        if not isinstance(step, dict) or "name" not in step or set(step) - {"name", "params"}:
            raise ConfigError(f"model.warm_start[{i}] must be {{name: <method>, params: {{...}}}}")
        METHODS.get(step["name"]).hyper_class.from_dict(step.get("params", {}),
                                                        where=f"model.warm_start[{i}]: ")
        check_bn_support(step["name"], cfg.model.name, f"model.warm_start[{i}].name")
    PROTOCOLS.get(cfg.evaluation.protocol)
    EvalConfig.from_dict(cfg.evaluation.params, where="evaluation.params: ", path="evaluation.params.")
    parse_analyses(cfg.evaluation.analyses)
    partition = dict(cfg.data.partition)
    if "name" not in partition:
        raise ConfigError("data.partition needs a 'name'", "data.partition")
    name = partition.pop("name")
    check_call_values(PARTITIONERS.get(name), partition, "data.partition.", f"partitioner {name!r}")


def check_label(label: Any, where: str) -> None:
    """An axis label names a cell in tables, ``--only`` and ``published``: a non-blank name or number."""
    if label is None or not str(label).strip():
        raise SuiteError(f"{where}: empty label {label!r}; write a name, e.g. 'fedavg' or 'alpha=0.5'")


def matches(cell: dict[str, str], when: dict) -> bool:
    """Whether ``cell`` has, on every axis of ``when``, the label (or one of the labels) named there."""
    return all(cell[axis] in ([str(v) for v in want] if isinstance(want, list) else [str(want)])
               for axis, want in when.items())


def check_marks(section: Any, axis_labels: dict[str, list[str]], where: str) -> None:
    """``marks``: a list of ``{when, mark, text}``, the conditions naming grid labels, mark and text
    non-empty strings."""
    if section is None:
        return
    if not isinstance(section, list):
        raise SuiteError(f"{where}: expected a list of {{when: ..., mark: ..., text: ...}}")
    check_overrides(section, axis_labels, where, MARK_KEYS)
    for i, entry in enumerate(section):
        for key in ("mark", "text"):
            if not isinstance(entry[key], str) or not entry[key].strip():
                raise SuiteError(f"{where}[{i}].{key}: expected a non-empty string, got {entry[key]!r}")


def check_overrides(section: Any, axis_labels: dict[str, list[str]], where: str,
                     keys: set[str] = OVERRIDE_KEYS) -> None:
    if section is None:
        return
    if not isinstance(section, list):
        raise SuiteError(f"{where}: expected a list of {{when: ..., set: ...}}")
    for i, entry in enumerate(section):
        check_keys(entry, keys, f"{where}[{i}]", keys)
        check_keys(entry["when"], set(axis_labels), f"{where}[{i}].when")
        for axis, want in entry["when"].items():
            for label in want if isinstance(want, list) else [want]:
                if str(label) not in axis_labels[axis]:
                    raise SuiteError(f"{where}[{i}].when.{axis}: {label!r} is not a label of the axis; "
                                     f"labels: {axis_labels[axis]}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_seeds(seeds: Any, where: str) -> None:
    """Seeds: a non-empty list of distinct non-negative integers (``seeds: 1`` or ``"42"`` is not)."""
    if not isinstance(seeds, list) or not seeds:
        raise SuiteError(f"{where}: expected a non-empty list of integers, e.g. [0, 1, 2], got {seeds!r}")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise SuiteError(f"{where}: {seed!r} is not a non-negative integer; write e.g. [0, 1, 2]")
    duplicates = sorted({s for s in seeds if seeds.count(s) > 1})
    if duplicates:
        raise SuiteError(f"{where}: seed(s) {duplicates} listed twice; list each seed once")


#: the run metrics a suite's ``metric`` may name, as logged by :mod:`benchmarks.store.tracking`
FINAL_METRICS = (*EVAL_KEYS, "train_loss", "wall_s", "stopped_round", *ANALYSIS_METRICS)


HISTORY_METRICS = tuple(f"round/{k}" for k in (*EVAL_KEYS, "train_loss"))


CURVE_METRICS = ("curve/acc", "curve/acc_weighted")


def check_metric(metric: Any, path: Path) -> None:
    check_keys(metric, METRIC_KEYS, f"{path}: metric", {"key"})
    if metric.get("pm", "std") not in ("std", "sem", "none"):
        raise SuiteError(f"{path}: metric.pm must be std, sem or none, got {metric['pm']!r}")
    history = metric.get("aggregate") == "best_val_round"
    allowed = HISTORY_METRICS if history else FINAL_METRICS
    key_ok = isinstance(metric["key"], str) and not history and metric["key"].startswith(EVAL_KEY_PREFIXES)
    if metric["key"] not in allowed and not key_ok:
        raise SuiteError(f"{path}: metric.key: {metric['key']!r} is not a metric that runs log; allowed: "
                         f"{list(allowed)}")
    if "curve_metric" in metric and metric["curve_metric"] not in CURVE_METRICS:
        raise SuiteError(f"{path}: metric.curve_metric: {metric['curve_metric']!r}; allowed: {list(CURVE_METRICS)}")
    for key in ("scale", "ddof"):
        if key in metric and not is_number(metric[key]):
            raise SuiteError(f"{path}: metric.{key}: expected a number, got {metric[key]!r}")


def check_published_numbers(entry: dict, where: str) -> None:
    """The paper's numbers are numbers: ``mean`` (and ``pm`` when given) finite, ``runs`` >= 1."""
    for key in ("mean", "pm"):
        if key in entry and entry[key] is not None and not is_number(entry[key]):
            raise SuiteError(f"{where}.{key}: expected a number, got {entry[key]!r}; write the paper's value "
                             f"without units or '%' (e.g. 81.2)")
    if entry.get("pm") is not None and entry["pm"] < 0:
        raise SuiteError(f"{where}.pm: a spread cannot be negative, got {entry['pm']!r}")
    runs = entry.get("runs")
    if runs is not None and (isinstance(runs, bool) or not isinstance(runs, int) or runs < 1):
        raise SuiteError(f"{where}.runs: expected a positive integer, got {runs!r}")
    if entry.get("pm_kind") not in (None, "std", "sem", "none"):
        raise SuiteError(f"{where}.pm_kind: expected std, sem or none, got {entry['pm_kind']!r}")


def check_source(entry: dict, where: str) -> None:
    """A published value names where it is printed (e.g. "Table 2"): a value without a traceable
    source is not a reference (issue 28)."""
    if not isinstance(entry["source"], str) or not entry["source"].strip():
        raise SuiteError(f"{where}.source: expected where the value is published (e.g. 'Table 2'), "
                         f"got {entry['source']!r}")


def check_cell(cell: Any, axis_names: list[str], cells: list[dict[str, str]], where: str) -> dict[str, str]:
    """A cell named in the suite file (``published``, ``code_reference``): every axis, a cell of the
    grid; returned in axis order with string labels, whatever the YAML wrote."""
    check_keys(cell, set(axis_names), where, set(axis_names))
    cell = {name: str(cell[name]) for name in axis_names}
    if cell not in cells:
        raise SuiteError(f"{where}: {cell} is not a cell of the grid")
    return cell
