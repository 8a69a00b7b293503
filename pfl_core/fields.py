"""Typed, checked fields: numeric ranges and choices declared in annotations, checked when a
configuration or a method's hyperparameters are built, so a bad value fails at load time with its
dotted key (:class:`ConfigError`), never hours into a sweep."""
from __future__ import annotations

import functools
import inspect
import math
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Annotated, Any


@dataclass(frozen=True)
class Range:
    """A numeric constraint declared in a field's annotation, ``Annotated[int, Range(ge=1)]``, and
    checked by :func:`check_values` when a configuration is built (issue 15, item 4: a bad value
    fails when the suite is loaded, not hours into a sweep)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def admits(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def describe(self) -> str:
        bounds = [(">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt)]
        return " and ".join(f"{op} {bound:g}" for op, bound in bounds if bound is not None)


@dataclass(frozen=True)
class Tune:
    """A tuning range declared in a field's annotation beside its :class:`Range`, e.g.
    ``Annotated[PositiveFloat, Tune(1e-4, 1.0, log=True)]``, read by the harness's search spaces
    (``pflbench tune``, ``benchmarks/suite/search_spaces.py``); the core only declares it. An ``int``
    field is searched over integers, a ``float`` field over reals, ``choices`` over a fixed grid.
    ``order``: the field's place among a trial's suggestions (ties: field order), which fixes what
    a seeded sampler draws; the evaluation fine-tuning rate has order 10 (:data:`FINETUNE_ORDER`)."""

    low: float = 0.0
    high: float = 0.0
    log: bool = False
    order: int = 0
    choices: tuple = ()

    def at(self, order: int) -> "Tune":
        """The same range at another place among the suggestions."""
        return Tune(self.low, self.high, self.log, order, self.choices)


FINETUNE_ORDER = 10
"""Order of the evaluation protocol's fine-tuning rate among a trial's suggestions: fields of
order above it are suggested after it (harness choice, kept from the first search spaces)."""

#: shared tuning ranges (harness choice: about two decades either side of the papers' values)
SGD_LR = Tune(1e-4, 1.0, log=True)
"""Plain SGD learning rates (FedAvg, Local, IFCA, the MetaVers baselines, pFedHN, pFedGP)."""
ADAM_LR = Tune(1e-5, 1e-1, log=True)
"""Adam learning rates (Ditto's global step, FedRep, MetaVers' server)."""
PROX_LR = Tune(1e-4, 1e-1, log=True)
"""Local-model steps of the proximal methods (pFedMe, CGPFL, APFL, L2SGD)."""


@functools.lru_cache(maxsize=None)
def type_hints(obj, include_extras: bool = True) -> dict:
    """``typing.get_type_hints(obj)`` of a class or function, resolved once per process: a suite's
    load checks every run's config against the same few classes thousands of times, and resolving
    the string annotations (``from __future__ import annotations``) was most of that time."""
    return typing.get_type_hints(obj, include_extras=include_extras)


def tuned_fields(cls) -> list[tuple[str, Any, Tune]]:
    """(name, base type, :class:`Tune`) of every field of dataclass ``cls`` that declares a tuning
    range, in suggestion order (``order``, then field order)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for index, f in enumerate(fields(cls)):
        hint = hints.get(f.name)
        if type(None) in typing.get_args(hint):  # ``Annotated[X, Tune(...)] | None``
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if typing.get_origin(hint) is Annotated:
            base, *extras = typing.get_args(hint)
            out += [(index, f.name, base, e) for e in extras if isinstance(e, Tune)]
    return [(name, base, tune) for _, name, base, tune in sorted(out, key=lambda r: (r[3].order, r[0]))]


#: the constrained scalar types of config and hyperparameter fields
PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
Fraction = Annotated[float, Range(ge=0, lt=1)]
"""A share of something that must leave a remainder (held-out clients, a split)."""
Probability = Annotated[float, Range(ge=0, le=1)]


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names its path (``key``: the dotted
    path of the offending value, when known, so that a suite can say which of its entries set it)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _unwrap(hint) -> tuple[Any, list[Range]]:
    """(base type, its Range constraints) of a possibly ``Annotated`` type hint."""
    if typing.get_origin(hint) is Annotated:
        base, *extras = typing.get_args(hint)
        return base, [e for e in extras if isinstance(e, Range)]
    return hint, []


def check_values(hints: dict[str, Any], values: dict, where: str = "",
                 defaults: dict[str, Any] | None = None, path: str | None = None) -> dict:
    """Check ``values`` against type ``hints`` (name -> hint): scalar types, ``Literal`` choices,
    finite numbers and ``Range`` constraints; return them with integers converted for float fields.
    Errors name ``where + name``, what is expected and the default (the fix); their ``key`` is
    ``path + name`` (default ``where + name``), the dotted config key."""
    checked = dict(values)
    for name, value in values.items():
        hint = hints.get(name)
        if type(None) in typing.get_args(hint):  # ``X | None``: null, or a value checked as X
            if value is None:
                continue
            others = [a for a in typing.get_args(hint) if a is not type(None)]
            hint = others[0] if len(others) == 1 else hint
        expected, ranges = _unwrap(hint)
        key = f"{where}{name}"
        dotted = f"{path if path is not None else where}{name}"
        default = (defaults or {}).get(name, MISSING)
        hint = "" if default is MISSING else f" (default: {default!r})"
        if typing.get_origin(expected) is typing.Literal:
            allowed = typing.get_args(expected)
            if value not in allowed:
                raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}", dotted)
            continue
        if expected not in _SCALARS:
            continue
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            checked[name], ok = float(value), True
        if not ok:
            what = _SCALARS[expected] + "".join(f" {r.describe()}" for r in ranges)
            raise ConfigError(f"{key} must be {what}, got {value!r} ({type(value).__name__}){hint}", dotted)
        if expected is float and not math.isfinite(checked[name]):
            raise ConfigError(f"{key} must be a finite number, got {value!r}{hint}", dotted)
        for bound in ranges:
            if not bound.admits(checked[name]):
                raise ConfigError(f"{key} must be {bound.describe()}, got {value!r}{hint}", dotted)
    return checked


def field_defaults(cls) -> dict[str, Any]:
    """The default of every field of dataclass ``cls`` that has one (for error messages)."""
    out = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def check_value_types(cls, values: dict, where: str = "", path: str | None = None) -> dict:
    """Reject values that do not fit the fields of dataclass ``cls`` (:func:`check_values`).

    YAML reads ``1e-3`` as a string and ``5.`` as a float; catching that at load time keeps a bad
    suite from failing hours into a sweep. Integers are accepted (and converted) for float fields.
    """
    return check_values(type_hints(cls), values, where, field_defaults(cls), path)


def check_call_values(fn, values: dict, where: str, what: str) -> dict:
    """:func:`check_values` for the keyword parameters of function ``fn`` (a partitioner, a
    loader): an unknown name or a bad value raises :class:`ConfigError` keyed ``where + name``."""
    params = {k: p for k, p in inspect.signature(fn).parameters.items()
              if p.default is not inspect.Parameter.empty}
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise ConfigError(f"{where}{unknown[0]}: not a parameter of {what}; allowed: "
                          f"{sorted(params) or '(none)'}", where + unknown[0])
    defaults = {k: p.default for k, p in params.items()}
    return check_values(type_hints(fn), values, where, defaults)


def check_choices(obj) -> None:
    """Every ``Literal``-typed field of dataclass instance ``obj`` holds one of its choices (the one
    way a choice field is declared: ``name: Literal["a", "b"] = "a"``)."""
    hints = type_hints(type(obj), False)
    for f in fields(obj):
        hint = hints.get(f.name)
        if typing.get_origin(hint) is typing.Literal and getattr(obj, f.name) not in typing.get_args(hint):
            raise ConfigError(f"{f.name} must be one of {list(typing.get_args(hint))}, got {getattr(obj, f.name)!r}")


@dataclass
class HyperParams:
    """Base class of every method's (and protocol's) hyperparameters: a dataclass whose fields are
    checked by name, type, ``Literal`` choice and declared :class:`Range` when built.

    Choice fields are declared one way, as ``Literal``; they are checked by :meth:`from_dict` and,
    for an instance built directly, before the ``__post_init__`` the class uses runs (its own or a
    mixin's, wrapped in by ``__init_subclass__``, so those checks may rely on valid choices)."""

    def __post_init__(self) -> None:
        check_choices(self)

    __post_init__.checks_choices = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__post_init__  # the class's own, or a mixin's earlier in the MRO
        if not getattr(own, "checks_choices", False):
            def __post_init__(self, _own=own) -> None:
                check_choices(self)
                _own(self)
            __post_init__.checks_choices = True
            cls.__post_init__ = __post_init__

    @classmethod
    def from_dict(cls, values: dict, where: str = "", path: str | None = None) -> "HyperParams":
        """Build from a mapping, checking names, types and declared ranges; errors start with
        ``where`` and carry the dotted key ``path + name`` (:class:`ConfigError`)."""
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ConfigError(
                f"{where}unknown hyperparameter(s) {unknown} for {cls.__name__}; "
                f"allowed: {sorted(allowed)}", None if path is None else path + unknown[0]
            )
        return cls(**check_value_types(cls, values, where, path))
