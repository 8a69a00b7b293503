"""Every method's tuning space suggests exactly what it did before the ranges moved onto the
hyperparameter fields (issue 27, item 3): the same parameter names, distributions (range, log
scale, choices), suggestion order and so, with a seeded ``RandomSampler``, the same values.

``tests/data/search_spaces_frozen.json`` was recorded from the per-method space functions of
``benchmarks/suite/search_spaces.py`` before the move (:func:`record`, run by hand with ``--write``);
it is a fixture, never regenerated from the code it checks."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import optuna
import pytest

from benchmarks.suite.search_spaces import NOTHING_TO_TUNE, suggest
from pfl_core.algorithms import METHODS
from pfl_core.config import RunConfig

FROZEN = Path(__file__).parent / "data" / "search_spaces_frozen.json"
TRIALS = 3


def cells() -> dict[str, dict]:
    """Cells that flip every config rule: batches vs epochs, fine-tuned or not, cluster caps."""
    base = RunConfig().to_dict()
    wide = copy.deepcopy(base)  # 16 seen clients (clusters up to 8), fine-tuning 3 steps
    wide["data"].update(num_clients=20, unseen_fraction=0.2)
    wide["evaluation"]["params"] = {"steps": 3}
    steps = copy.deepcopy(base)  # counts local steps, no fine-tuning, 10 seen clients (clusters up to 5)
    steps["data"].update(num_clients=10, unseen_fraction=0.0)
    steps["evaluation"]["params"] = {}
    steps["method"] = {"params": {"local_steps": 10}}
    small = copy.deepcopy(base)  # 5 seen clients: the cluster cap falls to its floor of 2
    small["data"].update(num_clients=6, unseen_fraction=0.2)
    small["evaluation"]["params"] = {"steps": 1}
    small["method"] = {"params": {"local_epochs": 2}}
    return {"wide": wide, "steps": steps, "small": small}


def record(method: str, cell: dict) -> list[list]:
    """Per trial: [[name, distribution repr, value], ...] in suggestion order (RandomSampler seed 0)."""
    config = copy.deepcopy(cell)
    config["method"] = {"name": method, "params": dict(cell["method"].get("params") or {})}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    out = []
    for _ in range(TRIALS):
        trial = study.ask()
        params = suggest(trial, config)
        assert list(params) == list(trial.distributions)
        out.append([[k, repr(trial.distributions[k]), params[k]] for k in trial.distributions])
    return out


def tuned_methods() -> list[str]:
    return [m for m in METHODS.names() if m not in NOTHING_TO_TUNE]


@pytest.mark.parametrize("method", tuned_methods())
def test_space_matches_the_frozen_copy(method):
    frozen = json.loads(FROZEN.read_text())
    assert method in frozen, f"{method}: not in the frozen copy (a new method needs no entry here)"
    for name, cell in cells().items():
        assert record(method, cell) == frozen[method][name], f"{method}, cell {name}"


def test_the_frozen_copy_covers_every_tuned_method():
    assert sorted(json.loads(FROZEN.read_text())) == sorted(tuned_methods())


if __name__ == "__main__" and "--write" in sys.argv:
    FROZEN.write_text(json.dumps({m: {n: record(m, c) for n, c in cells().items()} for m in tuned_methods()},
                                 indent=1) + "\n")
