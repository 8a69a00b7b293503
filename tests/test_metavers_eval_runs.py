"""The MetaVers evaluation options through :func:`pfl_core.experiment.run_experiment` (data served
by a stand-in loader): protocol ``proto`` with validation every evaluation, nVAR and early
stopping; protocol ``novel_class`` on its own dataset splits."""
from __future__ import annotations

import pytest
import torch

import pfl_core.experiment as experiment
from pfl_core.config import RunConfig
from pfl_core.data.federated import ArrayDataset
from tests.helpers import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def images(n, classes, seed, offset=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes + offset
    return ArrayDataset(f"stand-in {seed}", torch.rand(n, 3, 32, 32, generator=gen), y, classes + offset)


@pytest.fixture
def stand_in(monkeypatch):
    """``_cached_dataset`` serving 120 training images of 4 classes, and novel classes 4..9 (val)
    and 10..15 (test) for the novel-class splits."""
    served = []

    def load(name, params, split, data_dir):
        served.append(split)
        return {"train": images(120, 4, 0), "val": images(72, 6, 1, offset=4),
                "test": images(72, 6, 2, offset=10)}[split]

    monkeypatch.setattr(experiment, "_cached_dataset", load)
    return served


def config(**evaluation) -> dict:
    return {
        "data": {"dataset": "cifar10", "num_clients": 4, "unseen_fraction": 0.0,
                 "client_splits": {"val": 0.2, "test": 0.2}, "partition": {"name": "iid"}},
        "model": {"name": "lenet"},
        "method": {"name": "fedavg", "params": {"lr": 0.05, "local_epochs": 1}},
        "federation": {"rounds": 6, "clients_per_round": 2, "batch_size": 8, "eval_every": 2,
                       "early_stopping": True, "patience": 0, "patience_rule": "no_best",
                       "early_stopping_after": 0},
        "evaluation": evaluation,
    }


def test_proto_run_logs_val_and_test_every_evaluation_nvar_and_the_stop(stand_in):
    cfg = RunConfig.from_dict(config(protocol="proto", params={"val_split": "val", "nvar": True}))
    result = experiment.run_experiment(cfg, device="cpu", execution="sequential")
    evaluated = [row for row in result.history if "avg_acc" in row]
    assert [row["round"] for row in evaluated] == list(range(2, len(result.history) + 1, 2))
    assert all({"val_avg_acc", "val_mean_acc", "nvar"} <= set(row) for row in evaluated)
    assert result.metrics["stopped_round"] == len(result.history)
    assert result.info["early_stopped_at_round"] in (None, len(result.history))
    assert result.metrics["avg_acc"] == evaluated[-1]["avg_acc"]
    assert sum(c["num_samples"] for c in result.clients) == 4 * round(0.2 * 30)  # every test sample


def test_novel_class_run_evaluates_its_own_splits(stand_in):
    params = {"groups_val": 2, "groups_test": 3, "users": 2, "batch_size": 16}
    values = config(protocol="novel_class", params=params)
    values["federation"]["early_stopping_key"] = "val_acc"  # Table 6 stops on the mean group accuracy
    cfg = RunConfig.from_dict(values)
    result = experiment.run_experiment(cfg, device="cpu", execution="sequential")
    assert stand_in == ["train", "val", "test"]
    evaluated = [row for row in result.history if "val_acc" in row]
    assert [row["round"] for row in evaluated] == list(range(2, len(result.history) + 1, 2))
    assert "acc" in evaluated[0] and "test_at_best_val" in result.metrics
    assert result.clients == []
    again = experiment.run_experiment(cfg, device="cpu", execution="sequential")
    assert again.history == result.history  # groups drawn from the run's own streams
