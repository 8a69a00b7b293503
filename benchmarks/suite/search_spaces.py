"""Search spaces of the Optuna studies (``pflbench tune``), read from the hyperparameter fields.

A method's tuning ranges sit on its hyperparameter dataclass, beside the validation ranges:
``lr: Annotated[PositiveFloat, Tune(1e-4, 1.0, log=True)]`` (:class:`pfl_core.fields.Tune`). The
evaluation protocol's fine-tuning rate sits on :class:`pfl_core.evaluation.config.EvalConfig`; a
method that tunes protocol fields itself declares them in ``tune_evaluation`` (FedL2P's FT
baselines: the paper's lr grid). This module turns those declarations into suggestions.

A space is ``space(trial, config) -> {dotted config key: value}``: every parameter is named by the
dotted key it sets (``method.params.lr``, ``evaluation.params.lr``, ...), so a trial's parameters,
the best parameters written to ``<suite>.tuned.yml`` and the values a suite run applies are the
same mapping. ``config`` is the cell's resolved run configuration (a dict). Three rules read it
(harness choices, :func:`active`):

- of ``local_steps`` and ``local_epochs``, only the one the cell counts (``local_steps`` when its
  value, or the method's default, is > 0);
- ``num_clusters`` at most half the seen training clients (and at least its declared low);
- the evaluation fine-tuning rate only when the protocol fine-tunes the method (``steps`` > 0).

Suggestions follow each range's ``order`` (then field order), which fixes what a seeded sampler
draws; ``tests/test_search_space_freeze.py`` holds every method's space to a frozen copy.
"""
from __future__ import annotations

from typing import Any

from pfl_core.algorithms import METHODS
from pfl_core.evaluation.config import EvalConfig
from pfl_core.fields import Tune, tuned_fields


class NoSearchSpaceError(KeyError):
    """A method has no tuning ranges."""

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


def nothing_to_tune() -> dict[str, str]:
    """method -> why it has nothing to tune (its class's ``nothing_to_tune``)."""
    return {name: METHODS.get(name).nothing_to_tune for name in METHODS.names()
            if METHODS.get(name).nothing_to_tune}


NOTHING_TO_TUNE = nothing_to_tune()
"""Methods with nothing to tune: ``pflbench tune`` says so instead of searching."""


def _params(config: dict) -> dict:
    return config["method"].get("params") or {}


def _max_clusters(config: dict, cap: int) -> int:
    data = config["data"]
    seen = data["num_clients"] - int(round(data["num_clients"] * data.get("unseen_fraction", 0.0)))
    return min(cap, seen // 2)


def active(method: str, config: dict) -> list[tuple[str, type, Tune]]:
    """(dotted key, base type, range) of what the cell tunes, in suggestion order."""
    cls = METHODS.get(method)
    fields = tuned_fields(cls.hyper_class)
    names = {name for name, _, _ in fields}
    out = []
    for name, base, tune in fields:
        if name in ("local_steps", "local_epochs") and {"local_steps", "local_epochs"} <= names:
            counts_steps = _params(config).get("local_steps", getattr(cls.hyper_class, "local_steps", 0))
            if (name == "local_steps") != bool(counts_steps):
                continue
        if name == "num_clusters":
            tune = Tune(tune.low, max(tune.low, _max_clusters(config, int(tune.high))), tune.log, tune.order)
        out.append((f"method.params.{name}", base, tune))
    steps = (config["evaluation"].get("params") or {}).get("steps", 0)
    fine_tuned = {name for name, _, _ in tuned_fields(EvalConfig)} if cls.finetune_at_eval and steps else set()
    for name, base, tune in tuned_fields(EvalConfig):
        if name in cls.tune_evaluation or name in fine_tuned:
            out.append((f"evaluation.params.{name}", base, cls.tune_evaluation.get(name, tune)))
    return sorted(out, key=lambda row: row[2].order)


def _suggest_one(trial, key: str, base: type, tune: Tune) -> Any:
    if tune.choices:
        return trial.suggest_categorical(key, tune.choices)
    if base is int:
        return trial.suggest_int(key, int(tune.low), int(tune.high), log=tune.log)
    return trial.suggest_float(key, tune.low, tune.high, log=tune.log)


class FieldSpace:
    """The search space of one method, read from its hyperparameter fields; ``keys`` (dotted keys)
    restricts it to those parameters (a suite's ``tuned.params``), the others keep the cell's values."""

    def __init__(self, method: str, keys: tuple[str, ...] | None = None):
        self.method, self.keys = method, tuple(keys) if keys else None
        self.__name__ = f"{method}_space" + (f"[{','.join(self.keys)}]" if self.keys else "")

    def rows(self, config: dict) -> list[tuple[str, type, Tune]]:
        """(dotted key, base type, range) the cell ``config`` searches, in suggestion order."""
        rows = active(self.method, config)
        if self.keys is None:
            return rows
        chosen = [row for row in rows if row[0] in self.keys]
        missing = [key for key in self.keys if key not in {row[0] for row in chosen}]
        if missing:
            raise NoSearchSpaceError(f"method {self.method!r} does not tune {missing} in this cell; it tunes "
                                     f"{[row[0] for row in rows]}")
        return chosen

    def __call__(self, trial, config: dict) -> dict[str, Any]:
        return {key: _suggest_one(trial, key, base, tune) for key, base, tune in self.rows(config)}


def tunable_keys(method: str) -> list[str]:
    """Every dotted key ``method`` can tune in some cell (its fields' ranges, and the evaluation
    protocol's where it fine-tunes or declares them)."""
    cls = METHODS.get(method)
    keys = [f"method.params.{name}" for name, _, _ in tuned_fields(cls.hyper_class)]
    evaluation = [name for name, _, _ in tuned_fields(EvalConfig)] if cls.finetune_at_eval else []
    return keys + [f"evaluation.params.{name}" for name in dict.fromkeys([*cls.tune_evaluation, *evaluation])]


def get_space(method: str, keys: list[str] | tuple[str, ...] | None = None) -> FieldSpace:
    """``method``'s search space; ``keys`` restricts it to those dotted keys (each one it can tune)."""
    if method in NOTHING_TO_TUNE:
        raise NoSearchSpaceError(f"method {method!r} has nothing to tune: {NOTHING_TO_TUNE[method]}")
    if method not in METHODS.names():
        raise NoSearchSpaceError(f"no search space for method {method!r}: not a registered method")
    cls = METHODS.get(method)
    if not tuned_fields(cls.hyper_class) and not cls.tune_evaluation:
        raise NoSearchSpaceError(
            f"no search space for method {method!r}: {cls.hyper_class.__name__} declares no Tune range "
            f"(add Tune(...) to its fields, or set nothing_to_tune on the method)")
    allowed = tunable_keys(method)
    unknown = [key for key in keys or () if key not in allowed]
    if unknown:
        raise NoSearchSpaceError(f"method {method!r} cannot tune {unknown}; its tunable keys: {allowed}")
    return FieldSpace(method, tuple(keys) if keys else None)


def suggest(trial, config: dict) -> dict[str, Any]:
    """The trial's parameters for the cell ``config`` (dotted key -> value)."""
    return get_space(config["method"]["name"])(trial, config)


def describe(method: str, config: dict, keys: list[str] | tuple[str, ...] | None = None) -> dict[str, str]:
    """dotted key -> its range in words, for the cell ``config`` (what a study of it searches)."""
    def words(base, tune):
        if tune.choices:
            return f"one of {list(tune.choices)}"
        return f"{base.__name__} {tune.low:g}..{tune.high:g}{' (log)' if tune.log else ''}"

    return {key: words(base, tune) for key, base, tune in FieldSpace(method, keys).rows(config)}
