"""Best-validation selection end to end (MetaVers spec, "Model selection"): a real sweep logs the
per-round validation and test histories to an MLflow store in a tmp folder, with early stopping;
the report's ``best_val_round`` cell equals the test value at each run's best validation round."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from benchmarks.reporting.stats import best_val_round
from benchmarks.reporting import write_report
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import Tracker
from conftest import store, tiny_suite_dict, write_suite


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


def bestval_suite() -> dict:
    data = copy.deepcopy(tiny_suite_dict())
    data["base"]["data"].update(unseen_fraction=0.0, client_splits={"test": 0.2, "val": 0.2})
    data["base"]["federation"].update(rounds=8, eval_every=2, early_stopping=True, patience=0,
                                      patience_rule="no_best", early_stopping_after=0)
    data["base"]["evaluation"] = {"protocol": "seen", "params": {"val_split": "val", "reduction": "sample"}}
    data["base"]["method"] = {"name": "fedavg", "params": {"lr": 0.05, "local_epochs": 1}}
    data["grid"] = [{"name": "lr", "values": [{"label": "normal", "set": {"method.params.lr": 0.05}},
                                              {"label": "tiny", "set": {"method.params.lr": 1e-7}}]}]
    data["metric"].update(key="round/acc_weighted", aggregate="best_val_round", select_metric="round/val_acc_weighted",
                          pm="sem", ddof=0)
    data["profiles"] = {"smoke": {"seeds": [0, 1, 2]}}
    data["published"] = [{"cell": {"lr": "normal"}, "mean": 50.0, "source": "made up"}]
    return data


@pytest.mark.slow
def test_the_report_picks_the_test_value_at_the_best_validation_round(tmp_path):
    suite = load_suite(write_suite(tmp_path / "suites" / "tiny" / "bestval.yaml", bestval_suite()))
    tracker = Tracker(*store(tmp_path / "store"))
    summary = run_sweep(suite, suite.expand("smoke"), tracker, device="cpu", echo=lambda *a, **k: None)
    assert summary.finished == 6
    picks, stops = {"normal": [], "tiny": []}, {"normal": [], "tiny": []}
    for run in tracker.runs(suite.key, "FINISHED"):
        cell = run.data.tags["cell.lr"]
        client, run_id = tracker.client, run.info.run_id
        val = {m.step: m.value for m in client.get_metric_history(run_id, "round/val_acc_weighted")}
        test = {m.step: m.value for m in client.get_metric_history(run_id, "round/acc_weighted")}
        assert sorted(val) == sorted(test) and sorted(val) == list(range(2, max(val) + 1, 2))
        stopped = run.data.metrics["stopped_round"]
        rounds = max(m.step for m in client.get_metric_history(run_id, "round/train_loss"))
        assert stopped == rounds  # training ended at the recorded round
        stops[cell].append(stopped)
        best = max(val.values())
        first_best = min(r for r, v in val.items() if v == best)
        picks[cell].append(test[first_best])
        assert best_val_round(val, test).round == first_best
    # lr 1e-7 changes no prediction: the 2nd evaluation is no new best, and patience 0 stops there
    assert stops["tiny"] == [4.0, 4.0, 4.0]
    md, _, table = write_report(suite, tracker, "smoke", tmp_path / "reports")
    assert "federation.early_stopping=True (default False)" in md.read_text()  # the switch, in the report
    assert "federation.patience_rule='no_best' (default 'drop')" in md.read_text()
    for _, row in table.iterrows():
        assert row["n_seeds"] == 3
        assert row["mean"] == pytest.approx(100 * np.mean(picks[row["lr"]]))
        assert row["pm"] == pytest.approx(100 * np.std(picks[row["lr"]]) / math.sqrt(3))
