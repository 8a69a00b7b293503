"""The pure parts of the reporting layer on hand-made numbers: verdict rule and its edges, the
paper's +- as a standard error, spreads, CAFeMe's curve statistic, best-validation selection,
conclusions (best method, Kendall tau), the metric section, fidelity switches, LaTeX escaping."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import kendalltau

from benchmarks.reporting import verdict as V
from benchmarks.reporting.conclusions import column_conclusion
from benchmarks.reporting.fidelity import dataset_is_offline, deviations, method_switches, model_switches, switches
from benchmarks.reporting.metric import metric_spec
from benchmarks.reporting.stats import best_val_round, last3_of_seed_mean_curve, per_seed_last3, sem, spread
from benchmarks.reporting.text import tex
from benchmarks.suite.spec import load_suite
from benchmarks.suite.schema import SuiteError
from conftest import tiny_suite_dict, write_suite

NAN = math.nan


def decide(**kw):
    base = dict(finished=3, expected=3, failed=0, ours=50.0, se_ours=0.5, paper=50.0, se_paper=0.5,
                tolerance=None, failure_reason="")
    return V.decide(**{**base, **kw})


# ------------------------------------------------------------------ verdicts

def test_reproduced_at_the_exact_edge_of_two_combined_se():
    # se 1.5 and 2.0 -> combined 2.5 -> bound 5.0 exactly (all binary-exact)
    v = decide(ours=55.0, se_ours=1.5, paper=50.0, se_paper=2.0)
    assert (v.verdict, v.rule, v.bound, v.diff) == (V.REPRODUCED, "2SE", 5.0, 5.0)
    assert decide(ours=45.0, se_ours=1.5, paper=50.0, se_paper=2.0).verdict == V.REPRODUCED


def test_above_and_below_just_past_the_edge():
    eps = 1e-9
    above = decide(ours=55.0 + eps, se_ours=1.5, paper=50.0, se_paper=2.0)
    below = decide(ours=45.0 - eps, se_ours=1.5, paper=50.0, se_paper=2.0)
    assert above.verdict == V.ABOVE and above.diff > 0
    assert below.verdict == V.BELOW and below.diff < 0


def test_bound_uses_both_standard_errors():
    only_paper = decide(ours=53.0, se_ours=0.0, paper=50.0, se_paper=1.5)   # bound 3.0
    both = decide(ours=53.5, se_ours=0.0, paper=50.0, se_paper=1.5)         # bound 3.0 < 3.5
    widened = decide(ours=53.5, se_ours=2.0, paper=50.0, se_paper=1.5)      # bound 5.0
    assert only_paper.verdict == V.REPRODUCED and both.verdict == V.ABOVE
    assert widened.verdict == V.REPRODUCED and widened.bound == pytest.approx(5.0)


def test_one_seed_uses_the_papers_se_only_and_says_so():
    v = decide(finished=1, expected=1, ours=52.0, se_ours=NAN, paper=50.0, se_paper=1.0)
    assert (v.verdict, v.rule, v.bound) == (V.REPRODUCED, "2SE*", 2.0)
    assert decide(finished=1, expected=1, ours=52.5, se_ours=NAN, paper=50.0, se_paper=1.0).verdict == V.ABOVE


def test_tolerance_where_the_paper_gives_no_spread_edges():
    at = decide(ours=51.0, se_ours=5.0, paper=50.0, se_paper=NAN, tolerance=1.0)
    past = decide(ours=48.9375, se_ours=5.0, paper=50.0, se_paper=NAN, tolerance=1.0)
    assert (at.verdict, at.rule, at.bound) == (V.REPRODUCED, "tol", 1.0)  # our SE is not used
    assert (past.verdict, past.rule) == (V.BELOW, "tol")
    zero = decide(ours=50.0, se_ours=NAN, paper=50.0, se_paper=NAN, tolerance=0.0)
    assert zero.verdict == V.REPRODUCED


def test_no_spread_no_tolerance_falls_back_to_our_se_or_undecided():
    v = decide(ours=51.0, se_ours=0.5, paper=50.0, se_paper=NAN, tolerance=None)
    assert (v.verdict, v.rule, v.bound) == (V.REPRODUCED, "2SE(ours)", 1.0)
    assert decide(ours=51.5, se_ours=0.5, paper=50.0, se_paper=NAN).verdict == V.ABOVE
    u = decide(finished=1, expected=1, ours=51.0, se_ours=NAN, paper=50.0, se_paper=NAN)
    assert u.verdict == V.UNDECIDED and math.isnan(u.bound)


def test_partial_keeps_the_provisional_comparison():
    v = decide(finished=1, expected=3, failed=2, ours=60.0, se_ours=NAN, paper=50.0, se_paper=1.0,
               failure_reason="diverged: nan")
    assert v.verdict == V.PARTIAL
    assert v.detail.startswith("one seed of 3 (above)") and "2 failed: diverged: nan" in v.detail
    assert decide(finished=2, expected=3, paper=None).detail == "2/3 (no reference)"


def test_one_seed_is_a_spot_check_never_reproduced():
    v = decide(finished=1, expected=3, ours=50.5, se_ours=NAN, paper=50.0, se_paper=1.0)
    assert v.verdict == V.PARTIAL and v.compared == V.REPRODUCED
    assert v.detail == "one seed of 3 (within the bound)"
    assert V.label(v) == "one seed of 3 (a spot check): within the paper's bound"
    assert "reproduc" not in V.label(v)
    two = decide(finished=2, expected=3, ours=50.5, se_ours=0.1, paper=50.0, se_paper=1.0)
    assert two.detail == "2/3 (reproduced)" and V.label(two) == "partial 2/3: reproduces the paper"


def test_failed_not_run_and_no_reference():
    failed = decide(finished=0, failed=3, ours=NAN, failure_reason="diverged: nan")
    assert (failed.verdict, failed.detail) == (V.FAILED, "diverged: nan")
    assert decide(finished=0, failed=0, ours=NAN).verdict == V.NOT_RUN
    assert decide(finished=0, failed=1, ours=NAN).detail == "no reason recorded"
    assert decide(paper=None).verdict == V.NO_REFERENCE
    assert decide(paper=NAN).verdict == V.NO_REFERENCE


def test_every_verdict_has_a_legend_and_every_rule_an_explanation():
    assert set(V.LEGEND) == set(V.VERDICTS)
    assert set(V.RULES) == {"2SE", "2SE*", "tol", "2SE(ours)"}


@pytest.mark.parametrize("pm,kind,runs,ddof,expected", [
    (2.0, "sem", 3, 0, 2.0),
    (3.0, "std", 9, 1, 1.0),                          # std/sqrt(n) with the unbiased std
    (2.0, "std", 5, 0, 2.0 * math.sqrt(5 / 4) / math.sqrt(5)),  # population std converted first
    (2.0, "std", None, 0, NAN), (2.0, "std", 1, 0, NAN),
    (None, "std", 5, 0, NAN), (NAN, "std", 5, 0, NAN), (2.0, "", 5, 0, NAN), (2.0, "none", 5, 0, NAN),
])
def test_paper_sem(pm, kind, runs, ddof, expected):
    got = V.paper_sem(pm, kind, runs, ddof)
    assert math.isnan(got) if math.isnan(expected) else got == pytest.approx(expected)


def test_paper_sem_matches_numpy_on_sampled_values():
    x = np.array([81.0, 84.0, 86.5, 79.0, 90.0])
    for ddof in (0, 1):
        assert V.paper_sem(float(np.std(x, ddof=ddof)), "std", len(x), ddof) == pytest.approx(
            np.std(x, ddof=1) / np.sqrt(len(x)))


# ------------------------------------------------------------------ statistics

def test_spread_and_sem():
    x = [1.0, 2.0, 4.0]
    assert spread(x, "std", 0) == pytest.approx(np.std(x, ddof=0))
    assert spread(x, "sem", 1) == pytest.approx(np.std(x, ddof=1) / np.sqrt(3))
    assert math.isnan(spread(x, "none", 0)) and math.isnan(spread([3.0], "std", 0))
    assert math.isnan(spread([1.0, 2.0], "std", 2))
    assert sem(x) == pytest.approx(np.std(x, ddof=1) / np.sqrt(3)) and math.isnan(sem([1.0]))


def test_cafeme_statistic_mean_of_last3_of_seed_mean_curve():
    curves = [[10, 20, 30, 60, 50], [20, 20, 50, 40, 90], [0, 30, 40, 50, 70]]
    grid = np.array(curves, dtype=float)
    value, pm = last3_of_seed_mean_curve(curves, "std", 0)
    assert value == pytest.approx(grid.mean(axis=0)[-3:].mean())
    assert pm == pytest.approx(np.mean([np.std(grid[:, k], ddof=0) for k in (2, 3, 4)]))
    # not the std of the per-seed last-3 means (a different statistic)
    assert pm != pytest.approx(np.std(grid[:, -3:].mean(axis=1)))
    _, pm1 = last3_of_seed_mean_curve(curves, "std", 1)
    assert pm1 == pytest.approx(np.mean([np.std(grid[:, k], ddof=1) for k in (2, 3, 4)]))
    assert per_seed_last3(curves[0]) == pytest.approx(140 / 3)


def test_cafeme_statistic_single_point_and_ragged_curves():
    value, pm = last3_of_seed_mean_curve([[40.0], [50.0]], "std", 0)  # FedAvg without fine-tuning
    assert (value, pm) == (45.0, 5.0)
    value, _ = last3_of_seed_mean_curve([[1, 2, 3, 4], [1, 2, 3]], "std", 0)
    assert value == pytest.approx(2.0)
    assert all(map(math.isnan, last3_of_seed_mean_curve([], "std", 0)))
    assert math.isnan(last3_of_seed_mean_curve([[1, 2, 3]], "std", 0)[1])  # one seed: no spread


def test_best_val_round_selection():
    val = {50: 0.60, 100: 0.72, 150: 0.72, 200: 0.70}
    test = {50: 0.58, 100: 0.69, 150: 0.71, 200: 0.73}
    pick = best_val_round(val, test)
    assert (pick.round, pick.val, pick.test) == (100, 0.72, 0.69)  # earliest of the tie, not max test
    assert best_val_round({0: NAN, 50: 0.1}, {0: 0.9, 50: 0.2}).round == 50
    assert best_val_round({1: 0.5}, {2: 0.5}) is None


# ------------------------------------------------------------------ conclusions

def test_column_conclusion_best_and_kendall_tau():
    ours = {"a": 80.0, "b": 70.0, "c": 60.0, "d": 90.0}
    paper = {"a": 85.0, "b": 60.0, "c": 65.0}
    c = column_conclusion("CIFAR-10 / Shards", ours, paper)
    assert (c.methods, c.best_ours, c.best_paper, c.best_holds) == (3, "a", "a", True)
    assert c.tau == pytest.approx(kendalltau([80, 70, 60], [85, 60, 65]).statistic)
    assert c.tau == pytest.approx(1 / 3)
    flipped = column_conclusion("x", {"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 1.0})
    assert flipped.tau == pytest.approx(-1.0) and not flipped.best_holds
    assert math.isnan(column_conclusion("x", {"a": 1.0}, {"a": 2.0}).tau)
    assert column_conclusion("x", {"a": 1.0}, {"b": 2.0}) is None


def test_an_exact_tie_with_the_papers_best_holds_and_is_named():
    """CGPFL-Heur choosing K = 4 computes what CGPFL-K4 computes (73.63 both, CIFAR-10 seed 0): a tie
    at the top that includes the paper's best holds, whichever order the methods come in, and the line
    names the tie; a tie that leaves the paper's best out does not hold."""
    from types import SimpleNamespace

    from benchmarks.reporting.text import conclusion_lines
    paper = {"APFL": 72.12, "CGPFL-K4": 72.78, "CGPFL-Heur": 74.75}
    for order in (["APFL", "CGPFL-K4", "CGPFL-Heur"], ["CGPFL-Heur", "CGPFL-K4", "APFL"]):
        ours = {m: {"APFL": 72.97, "CGPFL-K4": 73.63, "CGPFL-Heur": 73.63}[m] for m in order}
        c = column_conclusion("cifar10-cnn", ours, paper)
        assert (c.best_ours, c.tied, c.best_holds) == ("CGPFL-Heur", ("CGPFL-K4",), True)
        (line,) = conclusion_lines(SimpleNamespace(conclusions=[c]))
        assert "best ours **CGPFL-Heur (tied with CGPFL-K4)**, best paper **CGPFL-Heur** (holds)" in line
    other = column_conclusion("x", {"a": 2.0, "b": 2.0, "c": 1.0}, {"a": 1.0, "b": 2.0, "c": 3.0})
    assert other.best_paper == "c" and not other.best_holds and other.tied == ("b",)


def test_conclusion_is_provisional_while_the_papers_best_has_no_run():
    """Four of nine methods run: the best among them is no verdict on the paper's best method."""
    from types import SimpleNamespace

    from benchmarks.reporting.summary import count_rows
    from benchmarks.reporting.text import conclusion_lines
    paper = {"FedAvg": 46.3, "APFL": 72.1, "Ditto": 69.6, "CGPFL-Heur": 74.8, "IFCA": 60.2}
    ours = {"FedAvg": 49.6, "APFL": 73.0, "Ditto": 68.4, "CGPFL-Heur": NAN, "IFCA": NAN}
    c = column_conclusion("cifar10", ours, paper)
    assert (c.best_ours, c.best_paper, c.paper_top, c.not_run) == ("APFL", "APFL", "CGPFL-Heur",
                                                                  ("CGPFL-Heur", "IFCA"))
    assert c.best_holds and c.provisional
    (line,) = conclusion_lines(SimpleNamespace(conclusions=[c]))
    assert "Provisional" in line and "**CGPFL-Heur**, has no run yet" in line and "(holds so far)" in line
    ours.update({"CGPFL-Heur": 72.0})
    done = column_conclusion("mnist", ours, paper)
    assert not done.provisional and not done.best_holds and done.not_run == ("IFCA",)
    (line,) = conclusion_lines(SimpleNamespace(conclusions=[done]))
    assert "Provisional" not in line and "(does not hold)" in line and line.endswith("not run: IFCA")
    alone = column_conclusion("rmnist", {"APFL": 73.0}, {"APFL": 72.1, "FedAvg": 46.3})  # APFL: the paper's best
    assert alone.best_holds and alone.provisional  # one method: nothing ranked, whatever the paper's best
    (line,) = conclusion_lines(SimpleNamespace(conclusions=[alone]))
    assert "only **APFL** has both numbers: no ranking to check yet" in line and "holds" not in line
    report = SimpleNamespace(suite=SimpleNamespace(key="t1"), table=pd.DataFrame({"verdict": ["reproduced"]}),
                             conclusions=[c, done, alone])
    assert count_rows([report])[0][-1] == "0/1 (+2 provisional)"


# ------------------------------------------------------------------ metric section, fidelity, LaTeX

def test_metric_section_defaults_and_errors(tmp_path):
    data = tiny_suite_dict()
    spec = metric_spec(load_suite(write_suite(tmp_path / "a.yaml", data)))
    assert (spec.aggregate, spec.tolerance, spec.figure, spec.curve_metric) == ("final", None, "table", "curve/acc")
    data["metric"].update(aggregate="last3_of_seed_mean_curve", tolerance=1, figure="line", x_axis="setting")
    spec = metric_spec(load_suite(write_suite(tmp_path / "b.yaml", data)))
    assert spec.history_keys == ["curve/acc"] and spec.tolerance == 1.0
    for bad, message in [({"aggregate": "median"}, "metric.aggregate"), ({"figure": "pie"}, "metric.figure"),
                         ({"figure": "line", "x_axis": "nope"}, "metric.x_axis"),
                         ({"tolerance": -1}, "metric.tolerance")]:
        data = tiny_suite_dict()
        data["metric"].update(bad)
        path = write_suite(tmp_path / "bad.yaml", data)
        with pytest.raises(SuiteError, match=message) as err:
            metric_spec(load_suite(path))
        assert str(path) in str(err.value)
    data = tiny_suite_dict()
    data["metric"]["bogus"] = 1
    with pytest.raises(SuiteError, match="bogus"):
        load_suite(write_suite(tmp_path / "c.yaml", data))


def test_fidelity_switches_against_the_dataclass_defaults():
    assert method_switches("fedavg", {}) == []
    got = method_switches("fedavg", {"lr": 0.05, "local_epochs": 5})
    assert got == ["method.lr=0.05 (default 0.001)"]  # local_epochs=5 is the default: not a switch
    assert model_switches("mlr", {}) == []
    assert model_switches("cafeme_a", {"modulation": "sigmoid", "context_labels": True}) == [
        "model.context_labels=True (default False)"]
    config = {"method": {"name": "fedavg", "params": {"lr": 0.05}},
              "model": {"name": "cafeme_a", "params": {"modulation": "film"}}}
    assert switches(config) == ["method.lr=0.05 (default 0.001)", "model.modulation='film' (default 'sigmoid')"]
    assert deviations("paper", False) == []
    assert len(deviations("smoke", True)) == 2


def test_latex_escaping():
    assert tex("fedavg_ft 50% a&b #1 $x$ {y}") == r"fedavg\_ft 50\% a\&b \#1 \$x\$ \{y\}"
    assert tex("a\\b^c~") == r"a\textbackslash{}b\textasciicircum{}c\textasciitilde{}"


def test_offline_datasets_known_before_any_run():
    assert dataset_is_offline("digits28") and dataset_is_offline("synthetic")
    assert not dataset_is_offline("mnist") and not dataset_is_offline("cifar10")


def test_a_lower_is_better_metric_picks_the_lowest_method_on_both_sides():
    ours, paper = {"a": 0.9, "b": 0.5, "c": 0.7}, {"a": 0.8, "b": 0.6, "c": 0.4}
    low = column_conclusion("nVAR", ours, paper, higher_is_better=False)
    assert (low.best_ours, low.best_paper, low.best_holds) == ("b", "c", False)
    high = column_conclusion("nVAR", ours, paper)
    assert (high.best_ours, high.best_paper) == ("a", "a")
    assert low.tau == high.tau  # the ordering agreement does not depend on the direction
