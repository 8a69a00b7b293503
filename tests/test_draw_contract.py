"""Randomness only in ``draw``: for every engine-equivalence case, ``carry_in`` (called after
``draw``) leaves every random generator where it found it - the client's stream generators, its
augmentation generator, and torch's, numpy's and Python's global generators. A method that draws in
``carry_in`` fails here by name; its draw belongs in ``draw`` (returned in a ``Drawn``)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pfl_core.algorithms import METHODS  # noqa: E402
from tests.test_engine_equivalence import CASES, run_path  # noqa: E402


def generator_states(client) -> list:
    gens = [s.generator for s in client.streams.values() if getattr(s, "generator", None) is not None]
    if client.augment is not None:
        gens.append(client.augment.generator)
    return [g.get_state() for g in gens]


def global_states() -> tuple:
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "fedl2p" else n for n in sorted(CASES)])
def test_carry_in_draws_no_random_numbers(name, monkeypatch):
    cls = METHODS.get(CASES[name][0])
    original, calls = cls.carry_in, []

    def checked(self, server, client, round_idx, drawn=None):
        before, globals_before = generator_states(client), global_states()
        carry = original(self, server, client, round_idx, drawn)
        after, globals_after = generator_states(client), global_states()
        assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{name}: carry_in drew from a client generator"
        assert torch.equal(globals_before[0], globals_after[0]), f"{name}: carry_in drew from torch's global generator"
        assert np.array_equal(globals_before[1], globals_after[1]) and globals_before[2] == globals_after[2], (
            f"{name}: carry_in drew from numpy's or Python's global generator")
        calls.append(client.cid)
        return carry

    monkeypatch.setattr(cls, "carry_in", checked)
    run_path(CASES[name], "sequential", rounds=2)
    assert calls or cls.batched_fallback is not None, f"{name}: carry_in never ran"
