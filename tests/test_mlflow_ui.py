"""What the MLflow UI reads (benchmarks.store.mlflow_ui) and the parent run per sweep, on real SQLite stores."""
from __future__ import annotations

import json
import math

import pytest
from mlflow.tracking import MlflowClient

import benchmarks.running.sweep as runner
from benchmarks.store import mlflow_ui as ui
from benchmarks.cli import main
from benchmarks.reporting.collect import collect_runs
from benchmarks.reporting.metric import metric_spec
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.spec import Suite, _parse_axis, load_suite
from benchmarks.store.tracking import Tracker, command_line
from conftest import REPO_ROOT, store, tiny_suite_dict, write_suite
from benchmarks.suite.file import read_suite_file

FAKE_GIT = ("0123456789abcdef0123456789abcdef01234567", False)
COMMAND = "pflbench run suites/tiny/mini.yaml --profile smoke"


def quiet(*_args, **_kwargs):
    pass


@pytest.fixture(autouse=True)
def _isolated(isolated, monkeypatch):
    monkeypatch.setattr(runner, "git_state", lambda: FAKE_GIT)
    return isolated


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Three sweeps of the tiny suite (smoke, seed 0, fedavg_ft: 2 runs) into one store: the first runs
    one spec, the second resumes (runs the other), the third finds everything FINISHED."""
    root = tmp_path_factory.mktemp("resumed")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(root)
        mp.setattr(runner, "git_state", lambda: FAKE_GIT)
        suite = load_suite(write_suite(root / "suites" / "tiny" / "mini.yaml", tiny_suite_dict()))
        specs = suite.expand("smoke", seeds=[0], only={"method": ["fedavg_ft"]})
        tracker = Tracker(*store(root / "store"))
        summaries = [run_sweep(suite, part, tracker, device="cpu", echo=quiet, command=COMMAND)
                     for part in (specs[:1], specs, specs)]
    return {"suite": suite, "specs": specs, "tracker": tracker, "summaries": summaries}


def test_experiment_is_tagged_as_model_training_created_or_reused(tmp_path):
    uri, art = store(tmp_path / "store")
    client = MlflowClient(tracking_uri=uri)
    created = Tracker(uri, art).experiment_id("tiny/new")
    assert client.get_experiment(created).tags[ui.EXPERIMENT_KIND_TAG] == "custom_model_development"
    # an experiment made before the tag existed (or tagged GenAI by someone) is re-tagged when reused
    old = client.create_experiment("tiny/old", tags={ui.EXPERIMENT_KIND_TAG: "genai_development"})
    assert Tracker(uri, art).experiment_id("tiny/old") == old
    assert client.get_experiment(old).tags[ui.EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert Tracker(uri, art).experiment_id("tiny/absent", create=False) is None


def test_the_training_kind_is_the_one_mlflow_ui_knows():
    """The value is the UI's ExperimentKind.CUSTOM_MODEL_DEVELOPMENT in the installed MLflow bundle."""
    import pathlib

    import mlflow

    bundle = pathlib.Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    if not bundle.is_dir():
        pytest.skip("this mlflow has no UI bundle")
    text = "".join(p.read_text(errors="ignore") for p in bundle.glob("main.*.js"))
    assert f'CUSTOM_MODEL_DEVELOPMENT="{ui.TRAINING_KIND}"' in text
    assert f'"{ui.EXPERIMENT_KIND_TAG}"' in text
    assert f'"{ui.SAVED_VIEW_PREFIX}"' in text and '"viewStateShareKey"' in text
    assert f'DATE:"{ui.ORDER_BY}"' in text  # the sort the UI nests runs by (its "Created" column)


def test_saved_view_is_the_envelope_the_ui_parses():
    envelope = json.loads(ui.saved_view(ui.SUITE_COLUMNS, "acc_last3"))
    assert isinstance(envelope["name"], str) and isinstance(envelope["createdAt"], int)
    state = json.loads(envelope["state"])
    columns = ["metrics.`acc_last3`", "tags.`method`", "tags.`seed`", "tags.`profile`", "tags.`tuned`", "tags.`cell`"]
    assert state["selectedColumns"] == columns
    # in this order (else the UI orders tag columns as it meets them), the run name wide enough to read
    assert state["columnOrder"] == ["attributes.`Run Name`", "runDateAndNestInfo", "duration", *columns]
    assert state["columnWidths"]["attributes.`Run Name`"] >= 300
    # sorted by creation time, oldest first: the one order in which the UI nests runs under their parent,
    # and a parent (created first) is loaded before its children in the UI's pages of 100 runs
    assert (state["orderByKey"], state["orderByAsc"], state["searchFilter"]) == ("attributes.start_time", True, "")
    url = ui.experiment_url("http://127.0.0.1:5000/", "7")
    assert url == ("http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
                   "&viewStateShareKey=pflbench")


def test_cell_runs_have_description_source_parent_and_curves(resumed):
    suite, specs, tracker = resumed["suite"], resumed["specs"], resumed["tracker"]
    runs = tracker.runs(suite.key, status=None)
    assert len(runs) == len(specs) == 2
    parents = {s.parent_run_id for s in resumed["summaries"]}
    for run in runs:
        tags = run.data.tags
        assert tags[ui.NOTE_TAG] == f"tiny, Tiny table | {tags['cell']} | seed 0 | profile smoke"
        assert (tags[ui.SOURCE_NAME_TAG], tags[ui.SOURCE_TYPE_TAG]) == (COMMAND, "JOB")
        assert tags[ui.PARENT_TAG] in parents and tags[ui.RUN_KIND_TAG] == ui.CELL
        # a short name to read (method, the other cell labels, seed); the whole cell stays in tags
        assert tags["mlflow.runName"] == f"{tags['cell.method']} · {tags['cell.setting']} · s0"
        assert tags["cell"] == f"setting={tags['cell.setting']},method={tags['cell.method']}"
        # per-round and fine-tuning curves are logged with their steps (the Model metrics tab plots them)
        rounds = tracker.client.get_metric_history(run.info.run_id, "round/train_loss")
        assert [m.step for m in rounds] == [1, 2]
        curve = tracker.client.get_metric_history(run.info.run_id, "curve/acc")
        assert [m.step for m in curve] == [0, 1, 2]  # smoke: steps 0, 1, 2 of fine-tuning


def test_one_parent_per_sweep_and_resume_never_duplicates_a_child(resumed):
    suite, specs, tracker = resumed["suite"], resumed["specs"], resumed["tracker"]
    first, second, third = resumed["summaries"]
    assert len({first.parent_run_id, second.parent_run_id, third.parent_run_id}) == 3
    parents = {r.info.run_id: r for r in tracker.runs(suite.key, status=None, kind=ui.SWEEP)}
    assert set(parents) == {first.parent_run_id, second.parent_run_id, third.parent_run_id}
    children = {}
    for run in tracker.runs(suite.key, status=None):
        children.setdefault(run.data.tags[ui.PARENT_TAG], []).append(run.data.tags["config_hash"])
    # first sweep: spec 0; the resumed sweep: only spec 1; the third: nothing (all FINISHED)
    assert children == {first.parent_run_id: [specs[0].config_hash], second.parent_run_id: [specs[1].config_hash]}
    expected = {first.parent_run_id: (1, 0, 1, 0), second.parent_run_id: (2, 1, 1, 0),
                third.parent_run_id: (2, 2, 0, 0)}
    for run_id, (total, skipped, finished, failed) in expected.items():
        run = parents[run_id]
        assert run.info.status == "FINISHED"
        assert {k: run.data.metrics[f"runs_{k}"] for k in ("total", "skipped", "finished", "failed")} == \
            {"total": total, "skipped": skipped, "finished": finished, "failed": failed}
        assert run.data.tags["runs_skipped"] == str(skipped)
        tags = run.data.tags
        assert (tags["profile"], tags["command"], tags[ui.SOURCE_NAME_TAG]) == ("smoke", COMMAND, COMMAND)
        assert (tags["git_commit"], tags["suite"], tags[ui.RUN_KIND_TAG]) == (FAKE_GIT[0], suite.key, ui.SWEEP)
        assert ui.PARENT_TAG not in tags
        files = [f.path for f in tracker.client.list_artifacts(run_id, "suite")]
        assert files == ["suite/mini.yaml"]


def test_a_parent_starts_before_its_children_so_the_view_loads_it_first(resumed):
    """The saved view sorts by creation time, oldest first, and the UI nests a run only under a
    parent it has loaded (pages of 100 runs): a sweep's parent must not start after any child."""
    tracker = resumed["tracker"]
    parents = {r.info.run_id: r for r in tracker.runs(resumed["suite"].key, status=None, kind=ui.SWEEP)}
    for child in tracker.runs(resumed["suite"].key, status=None):
        assert child.info.start_time >= parents[child.data.tags[ui.PARENT_TAG]].info.start_time


def test_run_names_are_short_method_first_and_distinct_in_every_suite():
    assert ui.run_name({"setting": "digits28-unseen", "method": "fedavg"}, "fedavg", 1) == "fedavg · digits28-unseen · s1"
    # the method axis's label (it may name a variant), then the other labels in grid order
    assert ui.run_name({"dataset": "cifar10", "alpha": "0.1", "method": "FedL2P-LRNet-b1"}, "fedl2p", 3) == \
        "FedL2P-LRNet-b1 · cifar10, 0.1 · s3"
    assert ui.run_name({"dataset": "mnist"}, "cgpfl", 0) == "cgpfl · mnist · s0"  # no method axis
    assert ui.run_name({"method": "fedavg"}, "fedavg", 2) == "fedavg · s2"
    for path in sorted((REPO_ROOT / "suites").glob("*/*.yaml")):  # the raw grids: no registry needed
        grid = read_suite_file(path)["grid"]
        cells = Suite(path, {}, [_parse_axis(a, f"grid[{i}]") for i, a in enumerate(grid)]).cells()
        names = [ui.run_name(cell, "m", 1) for cell in cells]
        assert len(set(names)) == len(cells), path


def test_a_run_with_an_old_style_name_is_still_found_finished(tmp_path, tiny_suite):
    """Names are for reading: a store written before the short names (``<cell id> seed=<seed>``) is
    resumed and reported from by its tags alone."""
    suite = load_suite(tiny_suite)
    specs = suite.expand("smoke", seeds=[0], only={"method": ["local"], "setting": ["iid"]})
    tracker = Tracker(*store(tmp_path / "store"))
    run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    (run,) = tracker.runs(suite.key)
    tracker.client.set_tag(run.info.run_id, "mlflow.runName", f"{specs[0].cell_id} seed=0")
    again = run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    assert (again.finished, again.skipped) == (0, 1)
    frame = collect_runs(suite, tracker, "smoke", metric_spec(suite), specs=specs)
    assert list(frame["config_hash"]) == [specs[0].config_hash]


def test_parent_runs_are_invisible_to_resume_and_reports(resumed):
    suite, specs, tracker = resumed["suite"], resumed["specs"], resumed["tracker"]
    everything = tracker.runs(suite.key, status=None, kind=None)
    assert len(everything) == len(specs) + 3
    assert tracker.finished_hashes(suite.key) == {s.config_hash for s in specs}
    frame = collect_runs(suite, tracker, "smoke", metric_spec(suite), specs=specs)
    assert sorted(frame["config_hash"]) == sorted(s.config_hash for s in specs)
    assert not any(math.isnan(v) for v in frame["value"])


def test_experiment_description_and_view(resumed):
    suite, tracker = resumed["suite"], resumed["tracker"]
    exp = tracker.client.get_experiment(tracker.experiment_id(suite.key, create=False))
    assert exp.tags[ui.EXPERIMENT_KIND_TAG] == ui.TRAINING_KIND
    assert exp.tags[ui.NOTE_TAG].startswith(f"**{suite.key}**: Tiny table; metric `acc_last3` (test accuracy (%))")
    state = json.loads(json.loads(exp.tags[ui.SAVED_VIEW_PREFIX + ui.VIEW_ID])["state"])
    assert "metrics.`acc_last3`" in state["selectedColumns"] and "tags.`method`" in state["selectedColumns"]


def test_a_description_written_by_a_researcher_is_kept(tmp_path):
    tracker = Tracker(*store(tmp_path / "store"))
    exp = tracker.describe_experiment("tiny/x", "**tiny/x**: ours", ui.SUITE_COLUMNS, "acc")
    tracker.describe_experiment("tiny/x", "**tiny/x**: ours, updated", ui.SUITE_COLUMNS, "acc")
    assert tracker.client.get_experiment(exp).tags[ui.NOTE_TAG] == "**tiny/x**: ours, updated"
    tracker.client.set_experiment_tag(exp, ui.NOTE_TAG, "my notes on this table")
    tracker.describe_experiment("tiny/x", "**tiny/x**: ours again", ui.SUITE_COLUMNS, "acc_last3")
    tags = tracker.client.get_experiment(exp).tags
    assert tags[ui.NOTE_TAG] == "my notes on this table"
    assert "metrics.`acc_last3`" in json.loads(json.loads(tags[ui.SAVED_VIEW_PREFIX + ui.VIEW_ID])["state"])["selectedColumns"]


def test_interrupted_sweep_leaves_a_killed_parent_with_its_counts(tmp_path, tiny_suite, monkeypatch):
    suite = load_suite(tiny_suite)
    specs = suite.expand("smoke", seeds=[0], only={"method": ["local"]})
    tracker = Tracker(*store(tmp_path / "store"))
    real, calls = runner.execute_specs, []

    def interrupted_after_one(*args):
        if calls:
            raise KeyboardInterrupt
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(runner, "execute_specs", interrupted_after_one)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    (parent,) = tracker.runs(suite.key, status=None, kind=ui.SWEEP)
    assert parent.info.status == "KILLED"
    assert (parent.data.metrics["runs_total"], parent.data.metrics["runs_finished"]) == (2, 1)
    # the run that finished, and the claim of the interrupted one (KILLED, benchmarks.store.claims)
    children = tracker.runs(suite.key, status=None)
    assert sorted(c.info.status for c in children) == ["FINISHED", "KILLED"]
    assert all(c.data.tags[ui.PARENT_TAG] == parent.info.run_id for c in children)


@pytest.mark.slow
def test_cli_run_attaches_report_and_command_to_the_parent(tiny_suite, tmp_path, capsys):
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    (tmp_path / "store").mkdir()
    argv = ["run", str(tiny_suite), "--profile", "smoke", "--seeds", "0", "--only", "method=fedavg",
            "--only", "setting=iid", "--tracking-uri", uri, "--device", "cpu", "--report", "--out", str(tmp_path / "rep")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    tracker = Tracker(uri)
    (parent,) = tracker.runs("tiny/mini", status=None, kind=ui.SWEEP)
    (child,) = tracker.runs("tiny/mini", status=None)
    command = command_line(["/usr/bin/pflbench", *argv])
    assert parent.data.tags["command"] == child.data.tags[ui.SOURCE_NAME_TAG] == command
    assert child.data.tags[ui.PARENT_TAG] == parent.info.run_id
    report = {f.path for f in tracker.client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/tiny.pdf", "report/mini.md", "report/mini.tex", "report/mini.csv"} <= report
    md = tracker.client.download_artifacts(parent.info.run_id, "report/mini.md", str(tmp_path))
    assert open(md).read() == (tmp_path / "rep" / "tiny" / "mini.md").read_text()
    assert ui.experiment_url(ui.LOCAL_UI, parent.info.experiment_id) in out


def test_mlflow_ui_main_prints_each_experiment_link(tmp_path, capsys):
    uri, art = store(tmp_path / "store")
    exp = Tracker(uri, art).experiment_id("tiny/mini")
    assert ui.main(["--store", uri, "--base", "http://127.0.0.1:5001"]) == 0
    out = capsys.readouterr().out
    assert "tiny/mini" in out and ui.experiment_url("http://127.0.0.1:5001", exp) in out
    assert "Default" not in out
