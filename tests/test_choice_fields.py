"""Choice fields are declared one way (``Literal``) and checked the same way whether a
hyperparameter object comes from a suite (``from_dict``) or is built directly."""
from __future__ import annotations

import typing

import pytest

from pfl_core.algorithms import METHODS
from pfl_core.fields import ConfigError

REQUIRED = {"cgpfl_heur": {"mu": 10.0}}  # no default: the paper does not publish it
CHOICES = [("pfedme", "predictor"), ("pfedme", "theta_start"), ("cgpfl", "omega_update"),
           ("cgpfl", "cluster_alignment"), ("cgpfl_heur", "mu_scale"), ("cgpfl_heur", "penalty"),
           ("ditto", "anchor"), ("perfedavg", "variant"), ("perfedavg", "hvp"), ("apfl", "mix_with")]


@pytest.mark.parametrize("method, name", CHOICES)
def test_a_choice_outside_its_literal_is_refused_both_ways(method, name):
    cls = METHODS.get(method).hyper_class
    hint = typing.get_type_hints(cls)[name]
    assert typing.get_origin(hint) is typing.Literal, f"{cls.__name__}.{name} is not declared as a Literal"
    for good in typing.get_args(hint):
        assert getattr(cls.from_dict({**REQUIRED.get(method, {}), name: good}), name) == good
    with pytest.raises(ConfigError, match=f"{name} must be one of"):
        cls.from_dict({name: "nope"})
    with pytest.raises(ConfigError, match=f"{name} must be one of"):
        cls(**{**REQUIRED.get(method, {}), name: "nope"})


def test_every_registered_method_checks_its_literal_fields_when_built_directly():
    """A class with its own __post_init__ still gets the choice check (HyperParams wraps it in)."""
    for name in METHODS.names():
        cls = METHODS.get(name).hyper_class
        literal = [k for k, h in typing.get_type_hints(cls).items() if typing.get_origin(h) is typing.Literal]
        for field_name in literal:
            with pytest.raises(ConfigError):
                cls(**{field_name: object()})
