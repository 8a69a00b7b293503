"""Optuna tuning (benchmarks.tuning.tune): real studies in a tmp SQLite file, a real MLflow store in
tmp_path, the tiny digits28 suite of conftest."""
from __future__ import annotations

import copy

import optuna
import pytest
import yaml

import benchmarks.running.sweep as runner
import benchmarks.tuning.tune as tuning
import benchmarks.tuning.study as tuning_study
from benchmarks.store import mlflow_ui as ui
from benchmarks.cli import main
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.search_spaces import NOTHING_TO_TUNE, NoSearchSpaceError, describe, get_space, suggest
from benchmarks.suite.spec import _apply, load_suite
from benchmarks.suite.schema import SuiteError, validate_config
from benchmarks.store.tracking import Tracker
from benchmarks.tuning.tune import tune, tuning_config
from benchmarks.tuning.study import TuneError, TuneOptions
from conftest import store, tiny_suite_dict, write_suite
from pfl_core.algorithms import METHODS
from pfl_core.config import RunConfig

FAKE_GIT = ("0123456789abcdef0123456789abcdef01234567", False)


def quiet(*_args, **_kwargs):
    pass


@pytest.fixture(scope="module")
def mlstore(tmp_path_factory):
    """One MLflow store for the module (creating a store's tables takes seconds); each test uses
    its own suite name, hence its own experiments."""
    uri, art = store(tmp_path_factory.mktemp("mlflow"))
    Tracker(uri, art)
    return uri, art


def suite_dict(name: str, tuned=True) -> dict:
    data = tiny_suite_dict()
    data["name"] = name
    data["base"]["federation"]["batch_size"] = 100  # one batch per local epoch: seconds per study
    if tuned:
        data["tuned"] = {"methods": ["fedavg"]}
    return data


def options(tmp_path, mlstore, **kw) -> TuneOptions:
    uri, _ = mlstore
    base = dict(profile="smoke", trials=3, storage=f"sqlite:///{tmp_path}/optuna.db", seeds=(1000,),
                device="cpu", tracking_uri=uri, echo=None)
    return TuneOptions(**{**base, **kw})


def study_of(tmp_path, name, cell="setting=dir,method=fedavg", method="fedavg", profile="smoke"):
    return optuna.load_study(study_name=f"tiny/{name}|{cell}|{method}|{profile}",
                             storage=f"sqlite:///{tmp_path}/optuna.db")


def tuning_runs(mlstore, name):
    """The trials' runs (not the studies' parent runs)."""
    return Tracker(*mlstore).runs(f"tiny/{name}/tuning", status=None)


def study_runs(mlstore, name):
    return Tracker(*mlstore).runs(f"tiny/{name}/tuning", status=None, kind=ui.STUDY)


@pytest.fixture
def no_git(monkeypatch):
    import benchmarks.store.tracking as tracking

    monkeypatch.setattr(tracking, "git_state", lambda: FAKE_GIT)
    monkeypatch.setattr(runner, "git_state", lambda: FAKE_GIT)


# -- search spaces ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", [m for m in METHODS.names() if m not in NOTHING_TO_TUNE])
def test_every_method_has_a_space_whose_keys_and_values_validate(method):
    config = RunConfig().to_dict()
    config["method"] = {"name": method, "params": {"mu": 1.0} if method == "cgpfl_heur" else {}}
    config["data"].update(num_clients=20, unseen_fraction=0.2)
    config["evaluation"]["params"] = {"steps": 3}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(3):
        params = suggest(study.ask(), config)
        assert params and all(k.startswith(("method.params.", "evaluation.params.")) for k in params)
        assert any("lr" in k.rsplit(".", 1)[-1] or k.endswith(("alpha", "beta")) for k in params)
        tuned = copy.deepcopy(config)
        _apply(tuned, params, "test")
        validate_config(tuned, "test")
    fine_tunes = METHODS.get(method).finetune_at_eval or method in ("ft_bn_c", "ft_bn_g", "ft_bn_i")
    assert ("evaluation.params.lr" in params) == fine_tunes


def test_a_method_with_nothing_to_tune_says_so():
    assert set(NOTHING_TO_TUNE) <= set(METHODS.names())
    with pytest.raises(NoSearchSpaceError, match="global_model' has nothing to tune: Global Accuracy"):
        get_space("global_model")


def test_spaces_follow_the_config_and_unknown_methods_fail_clearly():
    study = optuna.create_study()
    steps = {"method": {"name": "fedavg", "params": {"local_steps": 10}}, "evaluation": {"params": {}},
             "data": {"num_clients": 10}}
    assert "method.params.local_steps" in suggest(study.ask(), steps)
    epochs = {"method": {"name": "fedavg", "params": {}}, "evaluation": {"params": {}}, "data": {"num_clients": 10}}
    assert "method.params.local_epochs" in suggest(study.ask(), epochs)
    ifca = {"method": {"name": "ifca", "params": {}}, "evaluation": {"params": {}},
            "data": {"num_clients": 10, "unseen_fraction": 0.2}}
    trial = study.ask()
    suggest(trial, ifca)
    assert trial.distributions["method.params.num_clusters"].high == 4  # 8 seen clients / 2
    assert get_space("ditto").__name__ == "ditto_space"
    assert describe("ifca", ifca)["method.params.num_clusters"] == "int 2..4"
    with pytest.raises(NoSearchSpaceError, match="no search space for method 'nope'"):
        get_space("nope")


def test_a_method_without_tune_ranges_fails_clearly(monkeypatch):
    import benchmarks.suite.search_spaces as spaces
    from pfl_core.algorithms.base import Algorithm
    from pfl_core.fields import HyperParams

    class Bare(Algorithm):
        hyper_class = HyperParams

    fake = type("Fake", (), {"names": staticmethod(lambda: ["bare"]), "get": staticmethod(lambda name: Bare)})
    monkeypatch.setattr(spaces, "METHODS", fake)
    with pytest.raises(NoSearchSpaceError, match="'bare': HyperParams declares no Tune range"):
        get_space("bare")


def test_a_restricted_space_suggests_only_its_keys_and_names_them():
    """``tuned.params`` (a value the paper leaves unpublished): only those keys are drawn, the rest
    keep the cell's values, and the space's name (part of the stored objective) says which."""
    study = optuna.create_study()
    cell = {"method": {"name": "perfedavg", "params": {"local_steps": 10}}, "evaluation": {"params": {}},
            "data": {"num_clients": 10}}
    full = suggest(study.ask(), cell)
    assert {"method.params.alpha", "method.params.beta"} <= set(full)
    space = get_space("perfedavg", ["method.params.beta"])
    assert space.__name__ == "perfedavg_space[method.params.beta]"
    trial = study.ask()
    assert list(space(trial, cell)) == ["method.params.beta"]
    assert list(trial.distributions) == ["method.params.beta"]
    assert describe("perfedavg", cell, ["method.params.beta"]) == {"method.params.beta": "float 1e-05..0.1 (log)"}
    with pytest.raises(NoSearchSpaceError, match=r"'perfedavg' cannot tune \['method.params.mu'\]"):
        get_space("perfedavg", ["method.params.mu"])


# -- the objective's configuration ----------------------------------------------------------------
def test_tuning_config_evaluates_validation_data_only():
    base = RunConfig().to_dict()
    base["data"].update(num_clients=20, unseen_fraction=0.2, client_splits={"test": 0.2})
    base["evaluation"]["protocol"] = "unseen"
    base["federation"]["rounds"] = 10
    cfg, notes = tuning_config(base, TuneOptions())
    assert cfg["evaluation"]["target"] == "validation" and cfg["data"]["validation_fraction"] == 0.2
    assert cfg["federation"]["eval_every"] == 2 and notes["validation_fraction"] == 0.2
    assert cfg["data"]["unseen_fraction"] == 0.2 and base["evaluation"]["target"] == "test"
    base["evaluation"]["protocol"] = "seen"
    cfg, notes = tuning_config(base, TuneOptions(val_split=0.15))
    # test first, val after it: the test split is the same samples as in the table run
    assert list(cfg["data"]["client_splits"].items()) == [("test", 0.2), ("val", 0.15)]
    assert notes["val_split"] == 0.15
    base["data"].update(client_splits={"train": 0.75}, remainder="test")
    cfg, _ = tuning_config(base, TuneOptions())
    assert cfg["data"]["client_splits"] == {"train": 0.65, "val": 0.1}


def test_tuning_seeds_must_differ_from_the_table_seeds(tmp_path, isolated, mlstore):
    path = write_suite(tmp_path / "suites" / "tiny" / "seeds.yaml", suite_dict("seeds"))
    with pytest.raises(TuneError, match=r"overlap the suite's table seeds"):
        tune(path, ["fedavg"], {"setting": ["dir"]}, options(tmp_path, mlstore, seeds=(1, 1000)))
    with pytest.raises(TuneError, match=r"no cell with method \['nope'\]"):
        tune(path, ["nope"], None, options(tmp_path, mlstore))
    assert not set(tuning_study.DEFAULT_SEEDS) & {0, 1}


def test_suite_tuned_key_is_validated(tmp_path):
    bad = suite_dict("val")
    bad["tuned"] = {"methods": ["nope"]}
    with pytest.raises(SuiteError, match="tuned.methods: unknown method 'nope'"):
        load_suite(write_suite(tmp_path / "a" / "mini.yaml", bad))
    bad["tuned"] = {"methods": ["fedavg"], "profile": "huge"}
    with pytest.raises(SuiteError, match="tuned.profile: unknown profile 'huge'"):
        load_suite(write_suite(tmp_path / "b" / "mini.yaml", bad))
    bad["tuned"] = {"methods": "all", "colour": 1}
    with pytest.raises(SuiteError, match=r"tuned: unknown key\(s\) \['colour'\]"):
        load_suite(write_suite(tmp_path / "c" / "mini.yaml", bad))
    bad["tuned"] = {"methods": ["fedavg"], "params": {"local": ["method.params.lr"]}}
    with pytest.raises(SuiteError, match=r"tuned.params.local: 'local' is not in tuned.methods"):
        load_suite(write_suite(tmp_path / "d" / "mini.yaml", bad))
    bad["tuned"] = {"methods": ["fedavg"], "params": {"fedavg": ["method.params.beta"]}}
    with pytest.raises(SuiteError, match=r"tuned.params.fedavg: method 'fedavg' cannot tune \['method.params.beta'\]"):
        load_suite(write_suite(tmp_path / "e" / "mini.yaml", bad))
    bad["tuned"] = {"methods": ["fedavg"], "params": {"fedavg": []}}
    with pytest.raises(SuiteError, match=r"tuned.params.fedavg: expected a non-empty list"):
        load_suite(write_suite(tmp_path / "f" / "mini.yaml", bad))


# -- a real study, resumed, then used by a run --------------------------------------------------
@pytest.mark.slow
def test_study_logs_trials_writes_tuned_file_resumes_and_a_run_uses_the_values(tmp_path, isolated, no_git, capsys, mlstore):
    path = write_suite(tmp_path / "suites" / "tiny" / "resume.yaml", suite_dict("resume"))
    uri, art = mlstore
    storage = f"sqlite:///{tmp_path}/optuna.db"
    rc = main(["tune", str(path), "--method", "fedavg", "--cell", "setting=dir", "--trials", "3",
               "--profile", "smoke", "--storage", storage, "--tracking-uri", uri, "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tiny/resume|setting=dir,method=fedavg|fedavg|smoke: best trial" in out
    assert (tmp_path / "optuna.db").exists()
    study = study_of(tmp_path, "resume")
    assert len(study.trials) == 3
    assert study.user_attrs["budget"]["n_trials"] == 3
    assert study.user_attrs["objective"]["seeds"] == [1000, 1001]
    assert study.user_attrs["objective"]["validation"] == {"protocol": "unseen", "validation_fraction": 0.2,
                                                          "eval_every": 1}
    # two seeds x two rounds of intermediate values, steps seed-major
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert complete and sorted(complete[0].intermediate_values) == [1, 2, 3, 4]
    assert complete[0].value == pytest.approx(sum(complete[0].user_attrs["seed_values"]) / 2)

    runs = tuning_runs(mlstore, "resume")
    assert len(runs) == 3
    tags = {int(r.data.tags["trial"]): r.data.tags for r in runs}
    assert sorted(tags) == [0, 1, 2]
    for number, t in tags.items():
        assert t["study"] == study.study_name and t["state"] == study.trials[number].state.name
        assert yaml.safe_load(t["params"]) == study.trials[number].params
        if t["state"] == "COMPLETE":
            assert float(t["value"]) == pytest.approx(study.trials[number].value)
    assert {r.data.params["method.params.lr"] for r in runs} == {str(t.params["method.params.lr"]) for t in study.trials}
    # in the MLflow UI: the trials nest under one parent run of the study, each named and described
    (parent,) = study_runs(mlstore, "resume")
    assert parent.data.tags["mlflow.runName"] == "study fedavg · dir"
    assert parent.data.tags["study"] == study.study_name and parent.info.status == "FINISHED"
    assert "Optuna study" in parent.data.tags[ui.NOTE_TAG]
    assert parent.data.metrics["best_value"] == pytest.approx(study.best_value)
    for run in runs:
        tags, trial = run.data.tags, study.trials[int(run.data.tags["trial"])]
        assert tags[ui.PARENT_TAG] == parent.info.run_id and tags[ui.RUN_KIND_TAG] == ui.TRIAL
        assert run.info.start_time >= parent.info.start_time  # the view (oldest first) loads the parent first
        assert tags["mlflow.runName"] == f"fedavg · dir · trial {trial.number}"
        note = tags[ui.NOTE_TAG]
        assert note.startswith(f"fedavg | setting=dir,method=fedavg | trial {trial.number}: {trial.state.name}")
        assert f"`method.params.lr` = {trial.params['method.params.lr']:.6g}" in note
        assert "maximise `acc_last3` on validation data, mean over tuning seeds 1000, 1001" in note

    tuned_file = path.parent / "resume.tuned.yml"
    data = yaml.safe_load(tuned_file.read_text())
    entry = data["cells"]["setting=dir,method=fedavg"]["fedavg"]["smoke"]
    best = study.best_trial
    assert entry["params"] == best.params
    prov = entry["provenance"]
    assert prov["study"] == study.study_name and prov["trial"] == best.number
    assert prov["value"] == pytest.approx(best.value) and prov["n_trials"] == 3
    assert prov["tuning_seeds"] == [1000, 1001] and prov["git_commit"] == FAKE_GIT[0]
    assert {"date", "storage", "timeout", "metric", "validation"} <= set(prov)

    # resuming adds trials up to the new budget rather than starting over; the same budget again adds none
    results = tune(path, ["fedavg"], {"setting": ["dir"]}, options(tmp_path, mlstore, trials=5, seeds=(1000, 1001)))
    study = study_of(tmp_path, "resume")
    assert [t.number for t in study.trials] == [0, 1, 2, 3, 4]
    assert results[0].n_complete + results[0].n_pruned + results[0].n_failed == 5
    assert len(study.user_attrs["budget_history"]) == 2 and study.user_attrs["budget"]["n_trials"] == 5
    tune(path, ["fedavg"], {"setting": ["dir"]}, options(tmp_path, mlstore, trials=5, seeds=(1000, 1001)))
    assert len(study_of(tmp_path, "resume").trials) == 5 and len(tuning_runs(mlstore, "resume")) == 5
    (again,) = study_runs(mlstore, "resume")  # a resumed study keeps its one parent run
    assert again.info.run_id == parent.info.run_id and again.info.status == "FINISHED"
    assert {r.data.tags[ui.PARENT_TAG] for r in tuning_runs(mlstore, "resume")} == {parent.info.run_id}
    assert again.data.metrics["trials_complete"] + again.data.metrics["trials_pruned"] + \
        again.data.metrics["trials_fail"] == 5
    # a resumed study must keep its objective
    with pytest.raises(TuneError, match="was created with objective"):
        tune(path, ["fedavg"], {"setting": ["dir"]}, options(tmp_path, mlstore, trials=6, seeds=(1000,)))

    # a run of the suite now uses the tuned values for fedavg (which the suite opts in), not for local
    best = study_of(tmp_path, "resume").best_trial
    suite = load_suite(path)
    specs = suite.expand("smoke", seeds=[0], only={"setting": ["dir"], "method": ["fedavg", "local"]})
    plain = {s.config_hash for s in suite.expand("smoke", use_tuned=False)}
    fedavg = [s for s in specs if s.method == "fedavg"]
    assert fedavg and all(s.tuned and s.tuned["trial"] == best.number for s in fedavg)
    assert all(s.config["method"]["params"]["lr"] == best.params["method.params.lr"] for s in fedavg)
    assert all(s.config["federation"]["rounds"] == 2 for s in fedavg)  # the profile still applies
    assert all(s.config["evaluation"]["target"] == "test" for s in fedavg)
    assert not {s.config_hash for s in fedavg} & plain
    assert all(s.tuned is None and s.config_hash in plain for s in specs if s.method == "local")
    assert [s.seed for s in fedavg] == [0]
    tracker = Tracker(uri, art)
    summary = run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    assert summary.finished == len(specs) == 2
    runs = tracker.runs(suite.key)
    for run in runs:
        if run.data.tags["method"] == "fedavg":
            assert run.data.tags["tuned"] == "true"
            assert run.data.tags["tuned.study"] == study.study_name
            assert run.data.tags["tuned.trial"] == str(best.number)
            assert float(run.data.params["method.params.lr"]) == pytest.approx(best.params["method.params.lr"])
        else:
            assert run.data.tags["tuned"] == "false"
    # the report marks the tuned cell, and only it
    from benchmarks.reporting.table import build_suite_report
    from benchmarks.reporting.text import render_markdown

    report = build_suite_report(suite, tracker, "smoke")
    marked = report.table[report.table["tuned"]]
    assert set(marked["method"]) == {"fedavg"} and set(marked["setting"]) == {"dir"}
    text = render_markdown(report)
    assert "fedavg †" in text and f"trial {best.number}" in text and "local †" not in text
    # the paper profile has no tuned entry: paper values
    assert all(s.tuned is None for s in suite.expand("paper"))


def test_a_tuned_profile_studies_only_the_listed_key_and_only_its_runs_use_the_value(tmp_path, isolated, no_git, mlstore):
    """The ``tuned`` profile pattern (CGPFL Table 1): ``tuned.params`` restricts the study to one
    key, the tuned file holds that key alone, runs of the profile that was tuned take it, and the
    other profiles' runs keep their configuration and hash."""
    data = suite_dict("onekey", tuned=False)
    data["tuned"] = {"methods": ["fedavg"], "params": {"fedavg": ["method.params.lr"]}}
    data["profiles"]["tuned"] = {"like": "smoke", "description": "smoke with fedavg's lr tuned"}
    before = {s.config_hash for s in load_suite(write_suite(tmp_path / "plain" / "tiny" / "onekey.yaml",
                                                            {**data, "tuned": None})).expand("smoke")}
    path = write_suite(tmp_path / "suites" / "tiny" / "onekey.yaml", data)
    (result,) = tune(path, ["fedavg"], {"setting": ["dir"]}, options(tmp_path, mlstore, profile="tuned", trials=2))
    study = study_of(tmp_path, "onekey", profile="tuned")
    assert study.user_attrs["objective"]["search_space"] == "fedavg_space[method.params.lr]"
    assert all(list(t.params) == ["method.params.lr"] for t in study.trials)
    entry = yaml.safe_load((path.parent / "onekey.tuned.yml").read_text())["cells"]["setting=dir,method=fedavg"]["fedavg"]
    assert list(entry) == ["tuned"] and list(entry["tuned"]["params"]) == ["method.params.lr"]
    assert entry["tuned"]["provenance"]["trial_seconds"] > 0  # the studies' cost, for the side-by-side table
    suite = load_suite(path)
    (run,) = suite.expand("tuned", seeds=[0], only={"setting": ["dir"], "method": ["fedavg"]})
    assert run.tuned and run.config["method"]["params"]["lr"] == result.best_params["method.params.lr"]
    assert run.config["method"]["params"]["local_epochs"] == 1  # the cell's value, not searched
    assert all(s.tuned is None for s in suite.expand("smoke"))
    assert {s.config_hash for s in suite.expand("smoke")} == before


# -- no test data is read -----------------------------------------------------------------------------
def _test_rows(config: dict) -> set[int]:
    """Rows of the test clients and of every test split of the run with this config."""
    from pfl_core.data import build_federated, load_dataset
    from pfl_core.seeding import RunStreams

    d = RunConfig.from_dict(config).data
    partition = dict(d.partition)
    fed = build_federated(load_dataset(d.dataset), num_clients=d.num_clients, partition=partition.pop("name"),
                          partition_params=partition, client_splits=d.client_splits,
                          unseen_fraction=d.unseen_fraction, streams=RunStreams(config["seed"]),
                          validation_fraction=d.validation_fraction, remainder=d.remainder)
    rows = {int(i) for c in fed.unseen_clients for split in fed.clients[c].splits.values() for i in split}
    rows |= {int(i) for c in fed.train_clients for i in fed.clients[c].splits.get("test", [])}
    return rows


@pytest.mark.parametrize("protocol", ["unseen", "seen"])
def test_tuning_never_reads_test_clients_or_test_splits(tmp_path, isolated, no_git, monkeypatch, protocol, mlstore):
    data = suite_dict(f"noread-{protocol}")
    data["grid"][1]["values"] = ["fedavg_ft"]
    data["published"] = []
    if protocol == "seen":
        data["base"]["data"]["unseen_fraction"] = 0.0
        data["base"]["evaluation"]["protocol"] = "seen"
    path = write_suite(tmp_path / "suites" / "tiny" / "noread.yaml", data)
    from pfl_core.data.federated import ArrayDataset

    import pfl_core.experiment as experiment

    read, original, run_original, current = [], ArrayDataset.batch, experiment.run_experiment, []

    def spy(self, index):
        read.append((current[-1] if current else None, {int(i) for i in index.tolist()}))
        return original(self, index)

    def run_spy(cfg, *args, **kwargs):
        current.append(cfg.seed)
        return run_original(cfg, *args, **kwargs)

    monkeypatch.setattr(ArrayDataset, "batch", spy)
    monkeypatch.setattr(experiment, "run_experiment", run_spy)
    opts = options(tmp_path, mlstore, trials=1, seeds=(1000, 1001), write=False)
    results = tune(path, ["fedavg_ft"], {"setting": ["dir"]}, opts)
    assert results[0].n_complete == 1 and read
    objective = tuning.Objective(load_suite(path), {"setting": "dir", "method": "fedavg_ft"}, "fedavg_ft", opts)
    configs = objective.configs(optuna.trial.FixedTrial({"method.params.lr": 0.05, "method.params.local_epochs": 1,
                                                         "evaluation.params.lr": 0.05}))
    assert [c["seed"] for c in configs] == [1000, 1001]
    assert all(c["evaluation"]["target"] == "validation" for c in configs)
    forbidden = {c["seed"]: _test_rows(c) for c in configs}
    assert all(forbidden.values()) and {seed for seed, _ in read} == {1000, 1001}
    assert all(not (batch & forbidden[seed]) for seed, batch in read)
    # the spy does see the test rows when the suite's own test evaluation runs
    table = load_suite(path).expand("smoke", only={"setting": ["dir"]})[0]
    read.clear()
    experiment.run_experiment(RunConfig.from_dict(table.config), device="cpu")
    assert any(batch & _test_rows(table.config) for seed, batch in read if seed == table.seed)


# -- pruning and divergence --------------------------------------------------------------------------
def test_pruner_stops_a_planted_bad_trial_and_a_diverging_trial_does_not_stop_the_study(tmp_path, isolated, no_git, mlstore):
    path = write_suite(tmp_path / "suites" / "tiny" / "prune.yaml", suite_dict("prune"))
    opts = options(tmp_path, mlstore, trials=5, pruner_startup=2)
    name = "tiny/prune|setting=dir,method=fedavg|fedavg|smoke"
    study = optuna.create_study(study_name=name, storage=opts.storage, direction="maximize")
    for lr in (0.1, 0.1, 1e-6, 1e300):  # two good ones, a planted bad one, a diverging one
        study.enqueue_trial({"method.params.lr": lr, "method.params.local_epochs": 1})
    with pytest.warns(UserWarning):  # Optuna warns that 1e300 is outside the space
        results = tune(path, ["fedavg"], {"setting": ["dir"]}, opts)
    trials = study_of(tmp_path, "prune").trials
    assert [t.state.name for t in trials[:2]] == ["COMPLETE", "COMPLETE"]
    assert trials[2].state.name == "PRUNED" and "failure_reason" not in trials[2].user_attrs
    assert max(trials[2].intermediate_values) < 2  # cut at its first evaluation round
    assert trials[3].state.name == "PRUNED" and trials[3].user_attrs["failure_reason"].startswith("diverged")
    assert trials[4].state.name in ("COMPLETE", "PRUNED") and len(trials) == 5  # the study went on
    assert results[0].best_trial in (0, 1, 4)
    tags = {r.data.tags["trial"]: r.data.tags for r in tuning_runs(mlstore, "prune")}
    assert tags["2"]["state"] == "PRUNED" and tags["3"]["failure_reason"].startswith("diverged")


# -- nor do its normalisation statistics (issue 15, item 6) -------------------------------------------
@pytest.mark.parametrize("protocol", ["unseen", "seen"])
def test_tuning_pixel_statistics_ignore_test_clients_and_test_splits(monkeypatch, protocol):
    """With ``data.normalize: pixel`` a tuning run's statistics, hence its score, are the same
    when every test row (test clients, test splits) is blanked; a table run keeps the paper code's
    whole-dataset statistics (``data.normalize_stats: auto``), which blanking does move."""
    from dataclasses import replace

    import torch

    import pfl_core.experiment as experiment

    base = copy.deepcopy(tiny_suite_dict()["base"])
    base["data"].update(normalize="pixel", partition={"name": "iid"})
    base["method"]["name"] = "fedavg_ft"
    base["federation"]["rounds"] = 2
    if protocol == "seen":
        base["data"]["unseen_fraction"] = 0.0
        base["evaluation"]["protocol"] = "seen"
    table = validate_config({**base, "seed": 1000}, "test")
    tuning_cfg, _ = tuning_config(table, TuneOptions())
    forbidden = torch.tensor(sorted(_test_rows(tuning_cfg)))
    original = experiment._cached_dataset

    def blanked(*args):
        dataset = original(*args)
        x = dataset.x.clone()
        x[forbidden] = 0
        return replace(dataset, x=x)

    def stats_and_score(config: dict, blank: bool):
        with monkeypatch.context() as m:
            if blank:
                m.setattr(experiment, "_cached_dataset", blanked)
            cfg = RunConfig.from_dict(config)
            setup = experiment.prepare_run(cfg, torch.device("cpu"))
            result = experiment.run_experiment(cfg, device="cpu")
        return setup.fed.dataset.mean, setup.fed.dataset.std, result.metrics

    mean, std, metrics = stats_and_score(tuning_cfg, blank=False)
    mean_b, std_b, metrics_b = stats_and_score(tuning_cfg, blank=True)
    assert len(forbidden) > 0
    assert torch.equal(mean, mean_b) and torch.equal(std, std_b)
    assert metrics == metrics_b
    table_mean, _, _ = stats_and_score(table, blank=False)
    table_mean_b, _, _ = stats_and_score(table, blank=True)
    assert not torch.equal(table_mean, table_mean_b)  # the table run's statistics include test rows
    assert not torch.equal(mean, table_mean)
    with pytest.raises(SuiteError, match="normalize_stats"):
        validate_config({**tuning_cfg, "data": {**tuning_cfg["data"], "normalize_stats": "dataset"}}, "here")


def test_tuned_profiles_keeps_every_other_profile_untuned_and_refuses_to_tune_for_it(tmp_path, isolated, no_git, mlstore):
    """``tuned.profiles: [tuned]`` (CGPFL Table 1): a tuned-file entry written for ``smoke`` (as a
    ``pflbench tune`` without ``--profile tuned`` would have written it) is taken by no run, and
    ``pflbench tune --profile smoke`` refuses in one line naming the profile to use."""
    data = suite_dict("guarded", tuned=False)
    data["tuned"] = {"methods": ["fedavg"], "profiles": ["tuned"]}
    data["profiles"]["tuned"] = {"like": "smoke", "description": "smoke with fedavg's values tuned"}
    path = write_suite(tmp_path / "suites" / "tiny" / "guarded.yaml", data)
    entry = {"params": {"method.params.lr": 0.123}, "provenance": {"trial": 0}}
    (path.parent / "guarded.tuned.yml").write_text(yaml.safe_dump(
        {"suite": "tiny/guarded", "cells": {"setting=dir,method=fedavg": {"fedavg": {"smoke": entry, "tuned": entry}}}}))
    suite = load_suite(path)
    only = {"setting": ["dir"], "method": ["fedavg"]}
    assert all(s.tuned is None for s in suite.expand("smoke", only=only))
    assert all(s.tuned and s.config["method"]["params"]["lr"] == 0.123 for s in suite.expand("tuned", only=only))
    with pytest.raises(TuneError, match=r"tuned.profiles is \['tuned'\].*tune with --profile tuned$"):
        tune(path, ["fedavg"], {"setting": ["dir"]}, options(tmp_path, mlstore, profile="smoke", trials=1))
    data["tuned"]["profiles"] = ["colour"]
    with pytest.raises(SuiteError, match=r"tuned.profiles: unknown profile 'colour'"):
        load_suite(write_suite(tmp_path / "suites" / "tiny" / "bad.yaml", data))


def test_trial_seconds_leave_out_trials_failed_as_stale():
    """A trial whose worker died spans from its start until the death was noticed (hours, not
    compute): the study's cost in the tuned file leaves it out."""
    import datetime

    import optuna

    from benchmarks.tuning.study import trials_seconds

    study = optuna.create_study(direction="maximize")
    start = datetime.datetime(2026, 11, 28, 7, 0, 0)
    dist = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    for seconds, state, stale in ((10, "COMPLETE", False), (20, "PRUNED", False), (3 * 3600, "FAIL", True)):
        study.add_trial(optuna.trial.FrozenTrial(
            number=0, trial_id=0, state=optuna.trial.TrialState[state], value=0.5 if state == "COMPLETE" else None,
            values=None, datetime_start=start, datetime_complete=start + datetime.timedelta(seconds=seconds),
            params={"x": 0.5}, distributions=dist, user_attrs={"stale": True} if stale else {}, system_attrs={},
            intermediate_values={0: 0.4} if state == "PRUNED" else {}))
    assert trials_seconds(study) == 30.0


def test_a_tpe_budget_within_the_random_start_up_is_named_a_seeded_random_search():
    import optuna

    from benchmarks.tuning.study import TuneOptions, make_sampler, random_startup_note

    assert "seeded random search" in random_startup_note(TuneOptions(trials=6))
    assert random_startup_note(TuneOptions(trials=11)) is None
    assert random_startup_note(TuneOptions(trials=6, sampler="random")) is None
    # what the note says: two cells' studies (different objectives) try the same six values
    tried = []
    for shift in (0.0, 0.3):
        study = optuna.create_study(direction="maximize", sampler=make_sampler(TuneOptions(trials=6)))
        study.optimize(lambda t: -(t.suggest_float("beta", 1e-4, 1e-1, log=True) - shift) ** 2, n_trials=6)
        tried.append([t.params["beta"] for t in study.trials])
    assert tried[0] == tried[1]


def test_a_trial_shows_a_per_round_bar_in_this_process_and_none_in_workers(tmp_path, isolated, no_git, capsys, mlstore,
                                                                          monkeypatch):
    """A paper-scale trial takes minutes: with --jobs 1 its rounds tick on a bar over seeds x rounds
    (stderr), as a run's do; without an echo (pool and Ray workers) there is none."""
    from benchmarks.tuning import tune as tune_module

    bars, make = [], tune_module.Objective.progress_bar
    monkeypatch.setattr(tune_module.Objective, "progress_bar", lambda *a: bars.append(make(*a)) or bars[-1])
    path = write_suite(tmp_path / "suites" / "tiny" / "bar.yaml", suite_dict("bar"))
    rounds = load_suite(path).expand("smoke")[0].config["federation"]["rounds"]
    tune(path, ["fedavg"], {"setting": ["dir"]}, options(tmp_path, mlstore, trials=1, seeds=(1000, 1001), echo=quiet))
    err = capsys.readouterr().err
    assert f"trial 0 (fedavg, 2 seed(s)):   0%|          | 0/{2 * rounds}" in err
    assert [(b.n, b.total) for b in bars] == [(2 * rounds, 2 * rounds)]  # every round of both seeds ticked
    tune(path, ["fedavg"], {"setting": ["dir"]}, options(tmp_path, mlstore, trials=2, seeds=(1000, 1001)))
    assert "trial 1" not in capsys.readouterr().err
