"""The ``max_over_rounds`` aggregate and ``metric.also`` (issue 11, item 8): pFedMe's convention
(the best round of each run) shown beside the last round, from runs in a real MLflow store."""
from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest

from benchmarks.reporting.build import write_report
from benchmarks.suite.spec import load_suite
from benchmarks.suite.schema import SuiteError
from benchmarks.store.tracking import Tracker
from conftest import store, tiny_suite_dict, write_suite

# seed -> acc_weighted per round (fractions); the last round is not the best one
HISTORY = {0: [0.50, 0.80, 0.70], 1: [0.60, 0.65, 0.90]}


def suite_dict(**metric) -> dict:
    data = copy.deepcopy(tiny_suite_dict())
    data.update(paper="hand", name="maxround", table="Max over rounds")
    data["base"]["data"]["dataset"] = "mnist"  # logged by hand, never run
    data["metric"].update(key="acc_weighted", **metric)
    data["published"] = [{"cell": {"setting": "dir", "method": "fedavg"}, "mean": 75.0, "source": "T"}]
    return data


def log_history_runs(suite, profile, root):
    """The dir/fedavg runs of ``profile`` logged with the per-seed round histories of HISTORY."""
    tracker = Tracker(*store(root))
    for spec in suite.expand(profile, only={"setting": ["dir"], "method": ["fedavg"]}):
        rows = [{"round": r + 1, "train_loss": 1.0, "acc_weighted": a} for r, a in enumerate(HISTORY[spec.seed])]
        tracker.log(spec, {"paper": suite.paper, "table": suite.raw["table"]},
                    {"started": 1.0, "ended": 2.0, "info": {"device": "cpu"}, "history": rows,
                     "metrics": {"acc_weighted": rows[-1]["acc_weighted"]}}, ("c0ffee", False))
    return tracker


def test_max_over_rounds_is_shown_beside_the_last_round(isolated):
    suite = load_suite(write_suite(isolated / "suites" / "hand" / "maxround.yaml",
                                   suite_dict(aggregate="final", also=["max_over_rounds"])))
    tracker = log_history_runs(suite, "paper", isolated / "store")
    md, csv, _ = write_report(suite, tracker, "paper", isolated / "reports")
    frame = pd.read_csv(csv)
    row = frame[(frame["setting"] == "dir") & (frame["method"] == "fedavg")].iloc[0]
    last = [100 * h[-1] for h in HISTORY.values()]
    best = [100 * max(h) for h in HISTORY.values()]
    assert row["mean"] == pytest.approx(np.mean(last)) and row["pm"] == pytest.approx(np.std(last))
    assert row["mean_max_over_rounds"] == pytest.approx(np.mean(best))
    assert row["pm_max_over_rounds"] == pytest.approx(np.std(best))
    text = md.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| setting | method |"))
    assert "| ours | ours (max_over_rounds) | paper |" in header
    assert f"{np.mean(best):.2f}" in text
    assert 'column "ours (max_over_rounds)": the same runs aggregated by `max_over_rounds`' in text


def test_max_over_rounds_as_the_main_aggregate_and_a_bad_also(isolated):
    suite = load_suite(write_suite(isolated / "suites" / "hand" / "maxround.yaml",
                                   suite_dict(aggregate="max_over_rounds")))
    from benchmarks.reporting.collect import run_value
    from benchmarks.reporting.metric import metric_spec

    metric = metric_spec(suite)
    assert metric.history_keys == ["round/acc_weighted"]
    hist = {"round/acc_weighted": dict(enumerate(HISTORY[1]))}
    assert run_value(metric, {"acc_weighted": 0.9}, hist) == pytest.approx(90.0)
    assert np.isnan(run_value(metric, {"acc_weighted": 0.9}, {}))
    bad = load_suite(write_suite(isolated / "suites" / "hand" / "bad.yaml", suite_dict(also=["best_round"])))
    with pytest.raises(SuiteError, match="also"):
        metric_spec(bad)


def test_a_profile_can_make_max_over_rounds_the_headline(isolated):
    """profiles.<name>.metric (aggregate, also): the profile's report aggregates the same kind of
    runs by the maximum over rounds and shows the last round beside it; the paper profile's
    report is unchanged; a profile metric key other than aggregate/also is refused."""
    data = suite_dict(aggregate="final", also=["max_over_rounds"])
    data["profiles"]["best"] = {"description": "pFedMe code's reading", "set": {"federation.rounds": 3},
                                "metric": {"aggregate": "max_over_rounds", "also": ["final"]}}
    suite = load_suite(write_suite(isolated / "suites" / "hand" / "maxround.yaml", data))
    from benchmarks.reporting.metric import metric_spec
    from benchmarks.reporting.snapshot import history_keys

    assert metric_spec(suite).aggregate == "final" and metric_spec(suite, "best").aggregate == "max_over_rounds"
    assert metric_spec(suite, "best").also == ("final",)
    assert history_keys(suite) == ["round/acc_weighted"]
    tracker = log_history_runs(suite, "best", isolated / "store")
    md, csv, _ = write_report(suite, tracker, "best", isolated / "reports")
    row = pd.read_csv(csv).query("setting == 'dir' and method == 'fedavg'").iloc[0]
    best = [100 * max(h) for h in HISTORY.values()]
    last = [100 * h[-1] for h in HISTORY.values()]
    assert row["mean"] == pytest.approx(np.mean(best)) and row["pm"] == pytest.approx(np.std(best))
    assert row["mean_final"] == pytest.approx(np.mean(last))
    assert "| ours | ours (final) | paper |" in md.read_text()
    data["profiles"]["best"]["metric"] = {"aggregate": "max_over_rounds", "key": "acc"}
    with pytest.raises(SuiteError, match=r"profiles\.best\.metric"):
        load_suite(write_suite(isolated / "suites" / "hand" / "bad.yaml", data))
