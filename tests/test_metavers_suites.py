"""The MetaVers suites (issue 13 item 5): grids and run counts, every published number against
``shared/specs/published-numbers.md``, the spec's hyperparameter table per setting, the reported
metric, the baseline marks and the profiles.

Most checks read the raw YAML, so they hold whatever this checkout registers; the checks that load
a suite (every profile expands and validates; the paper profile's 351 distinct runs) skip, naming
what is missing, while a method, dataset or config key the suite names is not registered here
(tests/suite_names.py). The smoke runs are in tests/test_suites_smoke.py."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from benchmarks.suite.spec import Suite, cell_id, load_suite
from conftest import REPO_ROOT, make_dry_run
from suite_names import unregistered
from test_suites_smoke import md_table
from benchmarks.suite.file import read_suite_file

SUITES = REPO_ROOT / "suites" / "metavers"
SPECS = Path(__file__).resolve().parents[2] / "shared" / "specs"
NAMES = ("table2", "table3", "table4", "table5", "table6", "fig2", "fig3")
DATASETS = {"CIFAR-10": "cifar10", "CIFAR-100": "cifar100", "CINIC-10": "cinic10", "miniImageNet": "miniimagenet"}
TABLE2_METHODS = ["Local", "FedAvg", "LG-FedAvg", "pFedMe", "FedProto", "Per-FedAvg", "pFedHN", "pFedGP", "FedPer",
                  "FedRep", "kNN-Per", "FedBABU", "MetaVers"]
#: Table 5 / the README appendix name the single-loss rows differently from the suite's labels
ABLATIONS = {"Only CE loss": "Only-CE", "Only Triplet loss": "Only-Triplet", "Only CE loss (L_S)": "Only-CE",
             "Only triplet loss (L_T)": "Only-Triplet", "MetaVers": "MetaVers", "Local": "Local"}


def raw(name: str) -> dict:
    return read_suite_file(SUITES / f"{name}.yaml")


def spec_text(name: str) -> str:
    path = SPECS / name
    if not path.is_file():
        pytest.skip(f"{path} not present")
    return path.read_text(encoding="utf-8")


def published(name: str) -> dict[str, tuple[float, float | None]]:
    return {cell_id({k: str(v) for k, v in e["cell"].items()}): (e["mean"], e.get("pm")) for e in raw(name)["published"]}


def pm_of(row: dict) -> float | None:
    value = next(v for k, v in row.items() if k.startswith("±"))
    return None if value.startswith("—") else float(value)


def readme_sem() -> dict[tuple[str, str, str], float]:
    """(dataset, clients, suite method label) -> the SEM of the authors' README (spec appendix)."""
    rows = md_table(spec_text("published-numbers.md"), "Appendix: MetaVers values with SEM")
    return {(DATASETS[r["dataset"]], r["clients"], ABLATIONS[r["method"]]): pm_of(r) for r in rows}


def loaded(name: str):
    """The loaded suite, or a skip naming what this checkout does not register yet."""
    missing = unregistered(SUITES / f"{name}.yaml")
    if missing:
        pytest.skip(f"metavers/{name} names what is not registered here yet: {', '.join(missing)}")
    return load_suite(SUITES / f"{name}.yaml")


def grid_size(data: dict) -> int:
    return math.prod(len(axis["values"]) for axis in data["grid"])


def labels(data: dict, axis: str) -> list[str]:
    values = next(a for a in data["grid"] if a["name"] == axis)["values"]
    return [str(v["label"]) if isinstance(v, dict) else str(v) for v in values]


# ------------------------------------------------------------------------------------ grids and counts


def test_every_metavers_suite_exists_with_its_paper_and_name():
    assert sorted(p.stem for p in SUITES.glob("*.yaml")) == sorted(NAMES)
    for name in NAMES:
        data = raw(name)
        assert (data["paper"], data["name"]) == ("metavers", name)


def test_table2_paper_profile_is_351_runs_of_the_papers_grid():
    data = raw("table2")
    assert labels(data, "dataset") == ["cifar10", "cifar100", "cinic10"]
    assert labels(data, "clients") == ["50", "100", "500"]
    assert labels(data, "method") == TABLE2_METHODS
    assert data["seeds"] == [0, 21, 42]
    assert grid_size(data) * len(data["seeds"]) == 351 == 3 * 3 * 13 * 3


@pytest.mark.parametrize("name, cells, seeds", [("table2", 117, 3), ("table3", 15, 3), ("table4", 4, 3),
                                                ("table5", 12, 3), ("table6", 4, 1), ("fig2", 4, 1), ("fig3", 6, 1)])
def test_grid_sizes(name, cells, seeds):
    data = raw(name)
    assert (grid_size(data), len(data["seeds"])) == (cells, seeds)


def test_table2_paper_profile_expands_to_351_distinct_validated_runs():
    suite = loaded("table2")
    specs = suite.expand("paper")
    assert len(specs) == 351 and len({s.config_hash for s in specs}) == 351
    assert {s.seed for s in specs} == {0, 21, 42}
    metavers = [s for s in specs if s.cell["method"] == "MetaVers"]
    assert len(metavers) == 27 and {s.config["model"]["name"] for s in metavers} == {"le_embedding"}
    assert {s.config["evaluation"]["protocol"] for s in metavers} == {"proto"}
    for s in specs:
        data = s.config["data"]
        assert data["num_clients"] == int(s.cell["clients"])
        assert data["partition"]["classes_per_client"] == {"cifar10": 2, "cifar100": 10, "cinic10": 4}[s.cell["dataset"]]
        assert data["source_splits"] == {"train": "train", "val": "val", "test": "test"}
        assert s.config["evaluation"]["params"]["val_split"] == "val"  # the history best_val_round reads
        if s.cell["dataset"] != "cinic10":
            assert data["params"]["val_size"] == 10000 and data["params"]["val_seed"] == s.seed


@pytest.mark.parametrize("name", NAMES)
def test_every_profile_expands_and_validates(name):
    suite = loaded(name)
    assert suite.profiles == ["paper", "quick", "smoke"]
    for profile in suite.profiles:
        assert suite.expand(profile)


# ------------------------------------------------------------------------------------ published numbers


def test_table2_published_numbers_equal_the_papers_table_and_readme_sems():
    text = spec_text("published-numbers.md")
    sems = readme_sem()
    expected = {}
    for row in md_table(text, "MetaVers Table 2"):
        cell = {"dataset": DATASETS[row["dataset"]], "clients": row["clients"], "method": row["method"]}
        assert pm_of(row) is None  # the paper prints no ± in Table 2
        pm = sems[(cell["dataset"], cell["clients"], "MetaVers")] if row["method"] == "MetaVers" else None
        expected[cell_id(cell)] = (float(row["accuracy (%)"]), pm)
    assert len(expected) == 117
    assert published("table2") == expected
    sources = {e["cell"]["method"]: e["source"] for e in raw("table2")["published"]}
    assert "README" in sources["MetaVers"] and sources["FedAvg"] == "Table 2"


def test_table3_published_numbers_equal_the_papers_table():
    expected = {cell_id({"clients": r["clients"], "method": r["method"]}): (float(r["mean (%)"]), pm_of(r))
                for r in md_table(spec_text("published-numbers.md"), "MetaVers Table 3")}
    assert len(expected) == 15 and published("table3") == expected
    assert {e["pm_kind"] for e in raw("table3")["published"]} == {"sem"}


def test_table4_published_numbers_equal_the_papers_table():
    rows = md_table(spec_text("published-numbers.md"), "MetaVers Table 4")
    expected = {cell_id({"method": r["method"]}): (float(r["nVAR"]), None) for r in rows}
    assert published("table4") == expected and len(expected) == 4
    assert {r["clients"] for r in rows} == {"100"} and {r["dataset"] for r in rows} == {"CIFAR-100"}


def test_table5_published_numbers_equal_the_papers_table_with_readme_sems():
    sems = readme_sem()
    expected = {}
    for r in md_table(spec_text("published-numbers.md"), "MetaVers Table 5"):
        method = ABLATIONS[r["method"]]
        pm = None if method == "Local" else sems[("cinic10", r["clients"], method)]
        expected[cell_id({"clients": r["clients"], "method": method})] = (float(r["accuracy (%)"]), pm)
    assert len(expected) == 12 and published("table5") == expected


def test_table6_published_numbers_and_the_rows_quoted_from_frl():
    rows = md_table(spec_text("published-numbers.md"), "MetaVers Table 6")
    names = {"CIFAR-100": "cifar100_novel", "miniImageNet": "miniimagenet"}
    run = {cell_id({"dataset": names[r["dataset"]], "method": r["method"]}): (float(r["accuracy (%)"]), None)
           for r in rows if r["method"] in ("FedAvg", "MetaVers")}
    assert published("table6") == run and len(run) == 4
    notes = " ".join(raw("table6")["notes"])
    for r in rows:  # the two rows no harness method runs are kept, with their numbers, in the notes
        if r["method"] not in ("FedAvg", "MetaVers"):
            assert f"{r['method']} (" in notes or r["method"] in notes
            assert r["accuracy (%)"] in notes, r


def test_figures_have_no_published_numbers():
    for name in ("fig2", "fig3"):
        assert not raw(name).get("published")


# ------------------------------------------------------------------------------ hyperparameters, metric


def spec_hyperparameters() -> dict[tuple[str, str], dict]:
    """(dataset, U) -> MetaVers' values from the spec's table (README reproduction commands)."""
    rows = md_table(spec_text("metavers.md"), "Hyperparameters")
    out = {}
    for r in rows:
        query = re.match(r"\d+", r["Q (query)"]).group()
        out[(DATASETS[r["dataset"]], r["U"])] = {
            "shot": int(re.match(r"\d+", r["K (shot)"]).group()), "query": int(query), "gamma": float(r["γ"]),
            "weight_decay": 0.001 if "wd 1e-3" in r["optimizer"] else 0.0, "warmup": int(r["W"].strip("*"))}
    return out


def metavers_rows(name: str) -> dict[tuple[str, str], dict]:
    """(dataset, clients) -> the method.params.* an override sets on the MetaVers cells."""
    data = raw(name)
    dataset = {"table3": "cifar100", "table4": "cifar100", "table5": "cinic10"}.get(name)
    out = {}
    for entry in data["overrides"]:
        when = entry["when"]
        methods = when["method"] if isinstance(when["method"], list) else [when["method"]]
        if "MetaVers" in methods:
            key = (when.get("dataset", dataset), str(when.get("clients", 100)))
            out[key] = {k.removeprefix("method.params."): v for k, v in entry["set"].items()}
    return out


@pytest.mark.parametrize("name", ["table2", "table3", "table4", "table5"])
def test_metavers_values_per_setting_are_the_spec_table(name):
    spec = spec_hyperparameters()
    assert len(spec) == 9
    rows = metavers_rows(name)
    assert rows and set(rows) <= set(spec)
    for key, values in rows.items():
        assert {k: values[k] for k in spec[key]} == spec[key], key
        assert values.get("full_batch", False) == (key == ("cifar100", "500"))  # trainer.py:316-317
    if name == "table2":
        assert set(rows) == set(spec)


def test_table5_ablations_share_metavers_episodes_and_differ_only_in_the_loss():
    data = raw("table5")
    by_label = {v["label"]: v["set"] for v in data["grid"][1]["values"]}
    assert by_label["Only-CE"] == {"method.name": "metavers", "method.params.loss": "ce"}
    assert by_label["Only-Triplet"] == {"method.name": "metavers", "method.params.loss": "triplet",
                                        "method.params.margin_from": "fixed", "method.params.fixed_margin": 0.75}
    for entry in data["overrides"]:
        assert entry["when"]["method"] == ["Only-CE", "Only-Triplet", "MetaVers"]


@pytest.mark.parametrize("name", ["table2", "table3", "table5"])
def test_reported_metric_is_pooled_accuracy_at_the_best_validation_evaluation(name):
    metric = Suite(Path(name), raw(name)).metric  # as the report reads it: defaults filled in
    assert (metric["key"], metric["aggregate"], metric["select_metric"]) == (
        "round/acc_weighted", "best_val_round", "round/val_acc_weighted")
    assert (metric["pm"], metric["ddof"], metric["scale"]) == ("sem", 0, 100)
    base = raw(name)["base"]
    assert base["evaluation"]["params"]["reduction"] == "sample"  # pooled: correct / samples over clients
    assert base["federation"]["eval_every"] == 50 and base["federation"]["rounds"] == 1000


def test_baseline_cells_are_marked_as_their_own_papers_values():
    expected = {"table2": [m for m in TABLE2_METHODS if m != "MetaVers"],
                "table3": ["FedAvg-Proto", "FedBABU-Proto", "FedRep-Proto", "pFedGP-Proto"],
                "table4": ["FedAvg", "FedBABU", "FedRep"], "table5": ["Local"], "table6": ["FedAvg"]}
    for name, methods in expected.items():
        (mark,) = raw(name)["marks"]
        marked = mark["when"]["method"]
        assert sorted(marked if isinstance(marked, list) else [marked]) == sorted(methods), name  # a set of labels
        assert mark["mark"] == "‡" and mark["text"]


# ------------------------------------------------------------------------------------------- profiles


@pytest.mark.parametrize("name", NAMES)
def test_quick_and_smoke_are_one_seed_and_cut_down(name):
    data = raw(name)
    profiles = data["profiles"]
    assert set(profiles) == {"quick", "smoke"}
    for profile in ("quick", "smoke"):
        assert len(profiles[profile].get("seeds", data["seeds"])) == 1
        assert profiles[profile]["description"]
    paper_rounds = data["base"]["federation"]["rounds"]
    if paper_rounds:  # fig3 attacks the untrained model (0 rounds) in every profile
        assert profiles["quick"]["set"]["federation.rounds"] < paper_rounds
        assert profiles["smoke"]["set"]["federation.rounds"] <= 2


def test_table2_quick_keeps_local_and_lg_fedavg_meaningful():
    suite = loaded("table2")
    by_method = {s.cell["method"]: s.config for s in suite.expand("quick", only={"dataset": ["cifar10"],
                                                                                 "clients": ["50"]})}
    assert by_method["Local"]["federation"]["rounds"] == 1
    assert by_method["Local"]["method"]["params"]["local_steps"] == 100
    lg = by_method["LG-FedAvg"]
    assert lg["method"]["params"]["pretrain_rounds"] < lg["federation"]["rounds"] == 50
    paper = {s.cell["method"]: s.config for s in suite.expand("paper", only={"dataset": ["cifar10"], "clients": ["50"]},
                                                              seeds=[0])}
    assert (paper["LG-FedAvg"]["federation"]["rounds"], paper["LG-FedAvg"]["method"]["params"]["pretrain_rounds"]) \
        == (1200, 1000)
    assert paper["MetaVers"]["federation"]["early_stopping"] is True
    assert paper["pFedHN"]["method"]["params"].get("clients_per_round", 1) == 1


# ------------------------------------------------------------------------------------------ make targets


@pytest.mark.parametrize("name", NAMES)
def test_make_reproduce_metavers_target_runs_its_suite_and_renders_the_report(name):
    out = make_dry_run(f"reproduce-metavers-{name}")
    assert re.findall(r"suites/metavers/\w+\.yaml", out) == [f"suites/metavers/{name}.yaml"]
    assert "pflbench run $f --profile quick --jobs 2" in out and "--report" in out


def test_make_reproduce_metavers_runs_every_metavers_suite():
    out = make_dry_run("reproduce-metavers")
    assert sorted(set(re.findall(r"suites/metavers/(\w+)\.yaml", out))) == sorted(NAMES)
    assert "suites/cafeme" not in out and "suites/cgpfl" not in out


@pytest.mark.parametrize("profile", ["paper", "quick", "smoke"])
def test_table6_metavers_resolves_to_the_novel_class_trainer_of_the_code(profile):
    """trainer_novel_class.py: one batch per episode (``meta_update_frl``: ce_forward joint), the margin
    re-averaged per client over 500 values, rounds from 1, StepLR(5000, 0.5), 10 clients, Adam 1e-3."""
    specs = [s for s in loaded("table6").expand(profile) if s.cell["method"] == "MetaVers"]
    assert len(specs) == 2 and {s.config["model"]["name"] for s in specs} == {"conv4", "conv4_frl"}
    for s in specs:
        params = s.config["method"]["params"]
        assert params["ce_forward"] == "joint"
        assert {k: params[k] for k in ("margin_update", "margin_window", "first_round", "lr", "lr_step", "lr_gamma")} == {
            "margin_update": "client", "margin_window": 500, "first_round": 1, "lr": 0.001, "lr_step": 5000,
            "lr_gamma": 0.5}
        if profile == "paper":
            assert s.config["federation"]["clients_per_round"] == 10


def test_table4_best_method_is_the_lowest_nvar():
    """Table 4: nVAR, lower is better; the report's best method and bold values follow it."""
    import pandas as pd

    from benchmarks.reporting.metric import metric_spec
    from benchmarks.reporting.table import conclusions
    from benchmarks.reporting.text import _best

    spec = metric_spec(loaded("table4"))
    assert spec.higher_is_better is False
    assert all(metric_spec(loaded(n)).higher_is_better for n in ("table2", "table3", "table5", "table6"))
    table = pd.DataFrame({"method": ["FedAvg", "MetaVers"], "mean": [900.0, 400.0], "published_mean": [1000.0, 500.0]})
    (found,) = conclusions(["method"], "method", table, spec.higher_is_better)
    assert (found.best_ours, found.best_paper) == ("MetaVers", "MetaVers")
    assert _best(table["mean"], spec.higher_is_better) == 400.0


#: per baseline of issue 28 item 3: a phrase its suite note must hold and the source it must cite
READINGS = {
    "Local": ("100 plain SGD steps", "trainer.py:272"),
    "FedAvg": ("plain SGD", "McMahan et al. 2017, Algorithm 1"),
    "pFedHN": ("5000 hypernetwork steps", "experiments/pfedhn/trainer.py:263"),
    "FedRep": ("the CAFeMe code's recipe", "lgcollins/FedRep @ d82e629"),
    "FedBABU": ("Baseline reading, FedBABU", "FedBABU"),
}
RUNS = {"table2": ["Local", "FedAvg", "pFedHN", "FedRep", "FedBABU"], "table3": ["FedAvg", "FedRep", "FedBABU"],
        "table4": ["FedAvg", "FedRep", "FedBABU"], "table5": ["Local"]}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_baseline_reading_is_a_named_note_with_its_source(name):
    notes = raw(name)["notes"]
    for baseline in RUNS[name]:
        phrase, source = READINGS[baseline]
        note = [n for n in notes if n.startswith(f"Baseline reading, {baseline}:")]
        assert len(note) == 1, (name, baseline)
        assert phrase in note[0] and source in note[0], (name, baseline)
        assert "@" in note[0] or "Algorithm" in note[0] or "harness reading" in note[0], (name, baseline)


def test_table2_baselines_resolve_to_their_named_readings():
    """pFedHN: its code's 5000 steps (the quick and smoke profiles keep their own rounds); FedBABU
    fine-tunes in batches of 64; FedAvg plain SGD, Local 100 steps."""
    suite = loaded("table2")
    by_method = {}
    for profile in ("paper", "quick", "smoke"):
        for s in suite.expand(profile):
            by_method.setdefault((profile, s.cell["method"]), s.config)
    assert by_method[("paper", "pFedHN")]["federation"]["rounds"] == 5000
    assert by_method[("quick", "pFedHN")]["federation"]["rounds"] == 50
    assert by_method[("smoke", "pFedHN")]["federation"]["rounds"] == 2
    babu = by_method[("paper", "FedBABU")]["evaluation"]["params"]
    assert (babu["batch_size"], babu["steps"], babu["lr"]) == (64, 10, 0.005)
    fedavg = by_method[("paper", "FedAvg")]["method"]["params"]
    assert fedavg.get("momentum", 0.0) == 0.0 and fedavg.get("weight_decay", 0.0) == 0.0
    assert by_method[("paper", "Local")]["method"]["params"]["local_steps"] == 100
