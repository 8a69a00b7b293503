"""Property (issue 15, item 4): a mutated valid suite is either rejected when it is loaded, with a
message naming the file and a key, or accepted and then every one of its runs runs.

Hypothesis picks a leaf of the probe's valid suite (tests/bad_inputs.py) - or a new key beside one -
and a value from a pool of plausible mistakes (negative, zero, fractional, NaN, strings,
placeholders, lists, booleans, nulls). The runs are the suite's own, cut to one round and one
fine-tuning step so that a few dozen examples take seconds. A run may end in ``DivergenceError``
(a legal outcome: the runner logs it FAILED with its reason); any other error means the bad value
slipped past validation.
"""
from __future__ import annotations

import copy
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.suite.spec import load_suite
from benchmarks.suite.schema import TOP_KEYS, SuiteError
from bad_inputs import base_suite
from conftest import write_suite
from pfl_core.config import RunConfig, section_keys
from pfl_core.training import DivergenceError
from pfl_core.experiment import run_experiment

VALUES = [-3, -1, 0, 1, 2, 3, -0.5, 0.0, 0.3, 0.9, 1.0, 1.5, math.nan, math.inf, "", "x", "${sed}",
          "${seed}", "1e-3", "fedavg", "iid", True, False, None, [], [0], [0, 0], {}]


def _leaves(value, prefix=()):
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            yield from _leaves(sub, prefix + (key,))
    elif isinstance(value, list) and value:
        for i, sub in enumerate(value):
            yield from _leaves(sub, prefix + (i,))
    else:
        yield prefix


def _tiny(data: dict) -> dict:
    data = copy.deepcopy(data)
    data["base"]["federation"]["rounds"] = 1
    data["base"]["evaluation"]["params"]["steps"] = 1
    return data


LEAVES = sorted(set(_leaves(_tiny(base_suite()))), key=str)
#: every key a message may name: suite keys, config keys and their last components
KEY_WORDS = TOP_KEYS | section_keys() | {k.rsplit(".", 1)[-1] for k in section_keys()}


def _mutate(data: dict, path: tuple, value, new_key: bool) -> None:
    node = data
    for part in path[:-1]:
        node = node[part]
    last = path[-1]
    if new_key and isinstance(node, dict):
        node[f"{last}_extra"] = value
    else:
        node[last] = value


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(LEAVES), value=st.sampled_from(VALUES), new_key=st.booleans())
def test_a_mutated_suite_is_rejected_naming_file_and_key_or_runs(tmp_path, path, value, new_key):
    data = _tiny(base_suite())
    _mutate(data, path, copy.deepcopy(value), new_key)
    suite_file = write_suite(tmp_path / "mutated.yaml", data)
    try:
        suite = load_suite(suite_file)
    except SuiteError as err:
        message = str(err)
        assert str(suite_file) in message and "\n" not in message, message
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", message)) | set(re.findall(r"[A-Za-z_]+", message))
        assert words & KEY_WORDS, f"no key named in: {message}"
        return
    for spec in suite.expand("paper"):
        try:
            run_experiment(RunConfig.from_dict(spec.config), device="cpu", execution="sequential")
        except DivergenceError:
            pass
