"""The ``round_curves`` figure (CGPFL Figures 1-2: test accuracy and training loss over rounds):
runs logged by hand into a real MLflow store, exported to a snapshot, the report built from the
snapshot and its figure's lines checked against the seed means of the logged histories."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from benchmarks.reporting.figures import suite_figures
from benchmarks.reporting.metric import metric_spec
from benchmarks.reporting.snapshot import SnapshotTracker, export_snapshot
from benchmarks.reporting.table import build_suite_report
from benchmarks.store.tracking import Tracker
from benchmarks.suite.spec import load_suite
from conftest import store, tiny_suite_dict, write_suite

ROUNDS = [1, 2, 3]
ACC = {0: [0.2, 0.5, 0.7], 1: [0.4, 0.5, 0.9]}  # seed -> round/acc_weighted
LOSS = {0: [2.0, 1.0, 0.5], 1: [1.0, 0.8, 0.3]}  # seed -> round/train_loss


@pytest.fixture
def report(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    data = copy.deepcopy(tiny_suite_dict())
    data.update(paper="hand", name="curves", published=[])
    data["base"]["data"]["dataset"] = "mnist"
    data["metric"].update(key="acc_weighted", figure="round_curves")
    data["grid"][1]["values"] = ["local", "fedavg"]
    suite = load_suite(write_suite(tmp_path / "suites" / "hand" / "curves.yaml", data))
    tracker = Tracker(*store(tmp_path / "store"))
    for spec in suite.expand("paper"):
        shift = 0.0 if spec.cell["method"] == "local" else 0.05
        rows = [{"round": r, "acc_weighted": a + shift, "train_loss": l + shift, "eval_loss": 9.0}
                for r, a, l in zip(ROUNDS, ACC[spec.seed], LOSS[spec.seed])]
        tracker.log(spec, {"paper": suite.paper, "table": suite.raw["table"]},
                    {"started": 1000.0, "ended": 1002.0, "info": {"device": "cpu", "dataset_offline": False},
                     "history": rows, "metrics": {"acc_weighted": rows[-1]["acc_weighted"]}}, ("c0ffee", False))
    path = tmp_path / "curves.snapshot.json"
    assert export_snapshot(suite, tracker, path) == len(suite.expand("paper"))
    return build_suite_report(suite, SnapshotTracker.load(path), "paper")


def test_the_figure_draws_seed_mean_accuracy_and_loss_over_rounds(report):
    assert metric_spec(report.suite).figure_histories == ("round/acc_weighted", "round/train_loss")
    fig = suite_figures(report)["figure"]
    axes = np.array(fig.axes).reshape(2, -1)  # row 0 accuracy, row 1 loss; one column per setting
    assert axes.shape == (2, 2)
    for column in range(2):
        acc = {line.get_label(): line for line in axes[0][column].lines}
        loss = {line.get_label(): line for line in axes[1][column].lines}
        assert set(acc) == set(loss) == {"local", "fedavg"}
        assert acc["local"].get_xdata().tolist() == ROUNDS
        np.testing.assert_allclose(acc["local"].get_ydata(), 100 * np.mean([ACC[0], ACC[1]], axis=0))
        np.testing.assert_allclose(acc["fedavg"].get_ydata(), 100 * (np.mean([ACC[0], ACC[1]], axis=0) + 0.05))
        np.testing.assert_allclose(loss["local"].get_ydata(), np.mean([LOSS[0], LOSS[1]], axis=0))
        np.testing.assert_allclose(loss["fedavg"].get_ydata(), np.mean([LOSS[0], LOSS[1]], axis=0) + 0.05)
