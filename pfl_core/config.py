"""The fully resolved configuration of one run, as nested dataclasses.

The harness builds it from a suite (YAML) and hashes its dict form; the core only needs plain
dicts, so ``pfl_core`` imports neither YAML nor MLflow. Unknown keys are rejected with their path.
"""
from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any


@dataclass
class DataConfig:
    dataset: str = "digits28"
    """Registered dataset name (``pflbench list datasets``)."""
    params: dict = field(default_factory=dict)
    """Loader parameters (e.g. Synthetic's alpha and beta)."""
    split: str = "train"
    """Which split of the source dataset is partitioned: train, test or all."""
    normalize: str = "none"
    """Input normalisation: ``none`` (the loader's), ``pixel`` (per-pixel standardisation over the
    dataset, pFedMe/CGPFL MNIST) or ``half`` ((x - 0.5) / 0.5 per channel, pFedMe CIFAR-10)."""
    subsample: int = 0
    """Keep a random subset of this many samples before partitioning (0: all). For smoke and
    quick profiles; the subset follows the seed (stream ``subsample``)."""
    num_clients: int = 100
    partition: dict = field(default_factory=lambda: {"name": "iid"})
    """``{name: <partitioner>, <param>: <value>, ...}`` (``pflbench list partitioners``)."""
    client_splits: dict = field(default_factory=lambda: {"test": 0.2})
    """Fractions of each client's samples per named split (floored); ``train`` gets the rest."""
    unseen_fraction: float = 0.0
    """Fraction of clients held out of training for the ``unseen`` protocol (CAFeMe: 0.2)."""
    validation_fraction: float = 0.0
    """Fraction of the remaining clients held out of training as validation clients (tuning)."""
    remainder: str = "train"
    """The split that takes what ``client_splits`` leaves (``test`` with ``{train: 0.75}`` floors
    the train part instead)."""
    redraw_short_clients: bool = False
    """Redraw the partition while a client's train split holds fewer than
    ``federation.batch_size`` samples (the CAFeMe authors' de-facto rule: their code crashes on
    such a client, so their published Dirichlet and FEMNIST numbers come from seeds without one;
    issue 11 item 2). False (default): keep the partition; such a client trains on one short batch
    (CAFeMe spec, "Crash hazard"), and ``run_info.json`` lists it."""


@dataclass
class ModelConfig:
    name: str = "mlr"
    params: dict = field(default_factory=dict)
    warm_start: list = field(default_factory=list)
    """Methods trained before this run's method, each from the previous one's final global model
    (``[{name: fedavg, params: {...}}, ...]``); the run's method starts where the last ends. Off
    (empty) by default: it emulates the CAFeMe code's single model object shared by its baselines
    (spec diff 15), a known defect reproduced only on request."""


@dataclass
class MethodConfig:
    name: str = "fedavg"
    params: dict = field(default_factory=dict)
    """Overrides of the method's hyperparameter dataclass."""


@dataclass
class FederationConfig:
    rounds: int = 100
    clients_per_round: int = 5
    """Clients sampled uniformly without replacement per round (0 = all training clients)."""
    batch_size: int = 32
    reshuffle: bool = False
    """Reshuffle a client's batches every epoch (False: shuffle once, fixed order, as CAFeMe)."""
    drop_last: bool = True
    eval_every: int = 0
    """Evaluate every this many rounds (0: only after the last round)."""


@dataclass
class EvaluationConfig:
    protocol: str = "seen"
    """``unseen`` (held-out clients, fine-tuning curve) or ``seen`` (personalized predictors)."""
    target: str = "test"
    """``test``: the paper's evaluation. ``validation``: tuning; the unseen protocol evaluates the
    validation clients, the seen protocol the ``val`` split; test clients and splits are never read."""
    params: dict = field(default_factory=dict)
    """Overrides of :class:`pfl_core.evaluation.EvalConfig`."""


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RunConfig":
        return _build(cls, values, "")


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names its path."""


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_value_types(cls, values: dict, where: str = "") -> dict:
    """Reject values whose type does not match a scalar or ``Literal`` field of dataclass ``cls``.

    YAML reads ``1e-3`` as a string and ``5.`` as a float; catching that at load time keeps a bad
    suite from failing hours into a sweep. Integers are accepted (and converted) for float fields.
    """
    hints = typing.get_type_hints(cls)
    checked = dict(values)
    for name, value in values.items():
        expected = hints.get(name)
        if typing.get_origin(expected) is typing.Literal:
            allowed = typing.get_args(expected)
            if value not in allowed:
                raise ConfigError(f"{where}{name} must be one of {list(allowed)}, got {value!r}")
            continue
        if expected not in _SCALARS:
            continue
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            checked[name], ok = float(value), True
        if not ok:
            raise ConfigError(f"{where}{name} must be {_SCALARS[expected]}, got {value!r} "
                              f"({type(value).__name__})")
    return checked


def _build(cls, values: Any, path: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(values).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown key(s) {[where + k for k in unknown]}; allowed under "
                          f"{path or 'the run config'}: {sorted(known)}")
    kwargs = {}
    values = check_value_types(cls, values, f"{path}." if path else "")
    for name, value in values.items():
        default = cls.__dataclass_fields__[name].default_factory
        sub = f"{path}.{name}" if path else name
        nested = default() if callable(default) else None
        if is_dataclass(nested):
            kwargs[name] = _build(type(nested), value, sub)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def section_keys(cls=RunConfig, prefix: str = "") -> set[str]:
    """All dotted keys of the config schema (``data.num_clients``, ...) for validating overrides.
    Free-form dict fields (``params``, ``partition``, ``client_splits``) accept any sub-key."""
    keys = set()
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        keys.add(key)
        default = f.default_factory() if callable(f.default_factory) else None
        if is_dataclass(default):
            keys |= section_keys(type(default), key + ".")
    return keys
