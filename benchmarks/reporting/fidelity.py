"""Fidelity switches and deviations a cell ran with (docs/reports.md).

A switch is a method hyperparameter or model parameter whose value differs from its default (the
defaults are the paper's values: the method's hyperparameter dataclass, the model builder's
signature). Deviations are what makes a number not the paper's: a non-paper profile, offline data.
"""
from __future__ import annotations

import dataclasses
import inspect

from benchmarks.suite.spec import stage1_hash
from pfl_core.algorithms import METHODS
from pfl_core.config import FederationConfig
from pfl_core.data import DATASETS
from pfl_core.models import MODELS


def _fmt(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def field_defaults(cls) -> dict:
    """A hyperparameter dataclass's field defaults, read without instantiating it (a class may
    refuse its own defaults, e.g. a parameter the paper does not publish)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def method_switches(name: str, params: dict) -> list[str]:
    """``method.lr=0.05 (default 0.01)`` for each hyperparameter set away from its default."""
    defaults = field_defaults(METHODS.get(name).hyper_class)
    return [f"method.{k}={_fmt(v)} (default {_fmt(defaults[k]) if k in defaults else 'none'})"
            for k, v in sorted(params.items()) if k not in defaults or defaults[k] != v]


def model_switches(name: str, params: dict) -> list[str]:
    """``model.modulation='film' (default 'sigmoid')`` for each model parameter off its default."""
    try:
        signature = inspect.signature(MODELS.get(name)).parameters
    except (TypeError, ValueError):
        signature = {}
    out = []
    for k, v in sorted(params.items()):
        default = signature[k].default if k in signature else inspect.Parameter.empty
        if default is inspect.Parameter.empty or default != v:
            shown = "none" if default is inspect.Parameter.empty else _fmt(default)
            out.append(f"model.{k}={_fmt(v)} (default {shown})")
    return out


def mechanism(name: str, params: dict) -> list[str]:
    """The method's own one-line account of what produced the cell (e.g. IFCA's shared or
    independent cluster models), when its class has a ``mechanism(hp)``."""
    cls = METHODS.get(name)
    describe = getattr(cls, "mechanism", None)
    return [describe(cls.hyper_class.from_dict(params))] if describe else []


def warm_start(model: dict) -> list[str]:
    """``model.warm_start=perfedavg -> fedavg -> ifca`` when the run starts from predecessors."""
    steps = model.get("warm_start") or []
    return [f"model.warm_start={' -> '.join(s['name'] for s in steps)}"] if steps else []


def pretrained(config: dict) -> list[str]:
    """``model.pretrained=fedavg on cifar10, seed 1, 500 rounds (stage 1 <hash>)`` when the run
    starts from a stage-1 run (:mod:`benchmarks.running.stages`), ``model.pretrained=imagenet`` from weights."""
    stage1 = (config.get("model") or {}).get("pretrained") or {}
    if not stage1:
        return []
    if "source" in stage1:
        return [f"model.pretrained={stage1['source']}"]
    return [f"model.pretrained={stage1['method']['name']} on {stage1['data']['dataset']}, seed {stage1['seed']}, "
            f"{stage1['federation']['rounds']} rounds (stage 1 {stage1_hash(config)})"]


#: federation fields that change what a run reports (MetaVers code-vs-paper difference 10)
STOPPING_FIELDS = ("early_stopping", "early_stopping_key", "patience", "patience_rule", "early_stopping_after")


def stopping_switches(federation: dict) -> list[str]:
    """``federation.early_stopping=True (default False)`` and its settings, when it is on."""
    if not federation.get("early_stopping"):
        return []
    defaults = field_defaults(FederationConfig)
    return [f"federation.{k}={_fmt(federation[k])} (default {_fmt(defaults[k])})"
            for k in STOPPING_FIELDS if k in federation and federation[k] != defaults[k]]


def switches(config: dict) -> list[str]:
    """Every non-default method hyperparameter and model parameter of one resolved config, the
    method's mechanism line, the warm-start chain, the stage-1 model it starts from and early stopping."""
    method, model = config.get("method", {}), config.get("model", {})
    params = method.get("params") or {}
    return (method_switches(method["name"], params) + mechanism(method["name"], params)
            + model_switches(model["name"], model.get("params") or {}) + warm_start(model) + pretrained(config)
            + stopping_switches(config.get("federation") or {}))


def deviations(profile: str, offline: bool) -> list[str]:
    """Run-level deviations from the published setup."""
    out = []
    if profile != "paper":
        out.append(f"profile '{profile}', not the paper's setup")
    if offline:
        out.append("offline data (generated or bundled), not the paper's dataset")
    return out


def dataset_is_offline(name: str) -> bool:
    """Whether a registered dataset is an offline stand-in, known before any run: its loader is
    marked ``offline = True`` (``pfl_core/data/datasets.py``). Runs also record it (tag
    ``offline_data``)."""
    return bool(getattr(DATASETS.get(name), "offline", False))
