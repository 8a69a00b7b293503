"""--executor ray (benchmarks.running.executors.RayExecutor): sweeps and Optuna trials as Ray tasks on a local
Ray instance of 2 CPUs, against real MLflow and Optuna SQLite stores in tmp_path.

Each test proves its runs left this process: the parent's ``run_experiment`` (or the objective) is
patched to raise, which Ray workers, importing the modules afresh, never see."""
from __future__ import annotations

import sys

import optuna
import pytest

import benchmarks.running.sweep as runner
import benchmarks.running.worker as worker
import benchmarks.tuning.tune as tuning
from benchmarks.cli import main
from benchmarks.running.sweep import run_sweep
from benchmarks.running.worker import DEFAULT_THREADS, KILL_HOOK_ENV
from benchmarks.running.executors import ExecutorError, LocalExecutor, RayExecutor
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import Tracker, read_json_artifact
from conftest import store, write_suite
from test_tuning import suite_dict

ray = pytest.importorskip("ray")  # installed by the dev extra (pyproject.toml); skipped only without it
# one pytest-xdist worker runs them all (`make test`: --dist loadgroup): `ray.init(address="auto")` would
# join the local Ray instance of a test running beside it, which test_thread_counts_and_option_errors refuses
pytestmark = pytest.mark.xdist_group("ray")

def quiet(*_args, **_kwargs):
    pass


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


@pytest.fixture
def parent_cannot_run(monkeypatch):
    """Runs in this process fail: a FINISHED run was computed by a Ray worker."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("ran in the parent process")

    monkeypatch.setattr(worker, "run_experiment", refuse)


def by_hash(tracker, suite_key):
    runs = {}
    for run in tracker.runs(suite_key, status=None):
        runs.setdefault(run.data.tags["config_hash"], []).append(run)
    return runs


@pytest.mark.slow
def test_smoke_sweep_on_ray_resumes_and_logs_every_run_once(tmp_path, tiny_suite, capsys, monkeypatch):
    uri, art = store(tmp_path / "store")
    args = ["run", str(tiny_suite), "--profile", "smoke", "--tracking-uri", uri, "--device", "cpu"]
    suite = load_suite(tiny_suite)
    specs = suite.expand("smoke")
    # a partial sweep in this process first: the Ray sweep must skip its runs
    assert main(args + ["--only", "method=local"]) == 0
    local = [s for s in specs if s.method == "local"]
    assert 0 < len(local) < len(specs)
    capsys.readouterr()

    def refuse(*_args, **_kwargs):
        raise AssertionError("ran in the parent process")

    monkeypatch.setattr(worker, "run_experiment", refuse)
    assert main(args + ["--executor", "ray", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    todo = len(specs) - len(local)
    assert f"{todo} finished, 0 failed, {len(local)} skipped of {len(specs)} runs" in out
    assert "local Ray instance of 2 CPUs: 1 CPU(s)/torch thread(s)" in out
    assert not ray.is_initialized()  # the instance it started is shut down

    tracker = Tracker(uri, art)
    runs = by_hash(tracker, suite.key)
    assert set(runs) == {s.config_hash for s in specs}
    for spec in specs:
        (run,) = runs[spec.config_hash]  # exactly once
        assert run.info.status == "FINISHED"
        assert run.data.tags["method"] == spec.method and run.data.tags["seed"] == str(spec.seed)
        assert {"acc", "acc_weighted", "acc_last3", "train_loss", "wall_s"} <= set(run.data.metrics)
        assert 0.0 <= run.data.metrics["acc_last3"] <= 1.0
        rounds = tracker.client.get_metric_history(run.info.run_id, "round/train_loss")
        assert sorted(m.step for m in rounds) == list(range(1, spec.config["federation"]["rounds"] + 1))
        if spec.method != "local":  # every run: DEFAULT_THREADS torch threads, whatever --jobs
            info = read_json_artifact(tracker.client, run.info.run_id, "run_info.json")
            assert info["torch_threads"] == DEFAULT_THREADS == 1 and info["error"] is None

    # everything FINISHED: a rerun runs nothing (and starts no Ray instance)
    assert main(args + ["--executor", "ray", "--jobs", "2"]) == 0
    assert f"0 finished, 0 failed, {len(specs)} skipped of {len(specs)} runs" in capsys.readouterr().out
    assert sum(len(r) for r in by_hash(tracker, suite.key).values()) == len(specs)


def _killed_sweep(tmp_path, tiny_suite, monkeypatch, max_retries):
    """Two runs on Ray; the worker that starts the first one kills itself (SIGKILL) once."""
    suite = load_suite(tiny_suite)
    specs = suite.expand("smoke", seeds=[0], only={"setting": ["iid"], "method": ["fedavg", "local"]})
    armed = tmp_path / "kill"
    armed.mkdir()
    (armed / specs[0].config_hash).touch()
    monkeypatch.setenv(KILL_HOOK_ENV, str(armed))  # before Ray starts: its workers inherit it
    tracker = Tracker(*store(tmp_path / "store"))
    executor = RayExecutor(jobs=2, max_retries=max_retries, device="cpu")
    summary = run_sweep(suite, specs, tracker, device="cpu", echo=quiet, executor=executor)
    assert not (armed / specs[0].config_hash).exists()  # the worker did die
    return suite, specs, tracker, summary


@pytest.mark.slow
def test_worker_killed_mid_run_is_retried_and_finished_once(tmp_path, tiny_suite, monkeypatch, parent_cannot_run):
    suite, specs, tracker, summary = _killed_sweep(tmp_path, tiny_suite, monkeypatch, max_retries=1)
    assert (summary.finished, summary.failed) == (2, 0)
    runs = by_hash(tracker, suite.key)
    assert {h: [r.info.status for r in rs] for h, rs in runs.items()} == \
        {s.config_hash: ["FINISHED"] for s in specs}


@pytest.mark.slow
def test_worker_killed_without_retries_is_failed_with_its_reason_then_resumed(tmp_path, tiny_suite, monkeypatch,
                                                                              parent_cannot_run):
    suite, specs, tracker, summary = _killed_sweep(tmp_path, tiny_suite, monkeypatch, max_retries=0)
    assert (summary.finished, summary.failed) == (1, 1)
    (failed,) = tracker.runs(suite.key, status="FAILED")
    assert failed.data.tags["config_hash"] == specs[0].config_hash
    reason = failed.data.tags["failure_reason"]
    assert reason.startswith("WorkerLost: Ray worker lost on each of 1 attempt(s) (--max-retries 0)")
    assert "WorkerCrashedError" in reason
    assert "acc" not in failed.data.metrics
    # the next sweep re-runs only the FAILED run (the kill hook is spent: it finishes)
    again = run_sweep(suite, specs, tracker, device="cpu", echo=quiet, executor=RayExecutor(jobs=2, device="cpu"))
    assert (again.skipped, again.finished, again.failed) == (1, 1, 0)
    runs = by_hash(tracker, suite.key)
    assert sorted(r.info.status for r in runs[specs[0].config_hash]) == ["FAILED", "FINISHED"]
    assert [r.info.status for r in runs[specs[1].config_hash]] == ["FINISHED"]


@pytest.mark.slow
def test_tune_on_ray_shares_the_study_and_the_parent_logs_each_trial_once(tmp_path, capsys, monkeypatch):
    path = write_suite(tmp_path / "suites" / "tiny" / "rayt.yaml", suite_dict("rayt"))
    uri, art = store(tmp_path / "store")
    storage = f"sqlite:///{tmp_path}/optuna.db"

    def refuse(*_args, **_kwargs):
        raise AssertionError("a trial ran in the parent process")

    monkeypatch.setattr(tuning.Objective, "__call__", refuse)
    rc = main(["tune", str(path), "--method", "fedavg", "--cell", "setting=dir", "--trials", "3",
               "--seeds", "1000", "--profile", "smoke", "--storage", storage, "--tracking-uri", uri,
               "--device", "cpu", "--executor", "ray", "--jobs", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    name = "tiny/rayt|setting=dir,method=fedavg|fedavg|smoke"
    assert f"{name}: best trial" in out
    study = optuna.load_study(study_name=name, storage=storage)
    assert [t.number for t in study.trials] == [0, 1, 2]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)  # none ran in this process
    runs = Tracker(uri, art).runs("tiny/rayt/tuning", status=None)
    assert sorted(int(r.data.tags["trial"]) for r in runs) == [0, 1, 2]  # each trial logged once, by the parent
    assert {r.data.tags["study"] for r in runs} == {name}
    assert out.count("  trial ") == 3
    tuned = (path.parent / "rayt.tuned.yml").read_text()
    assert name in tuned and "method.params.lr" in tuned
    assert not ray.is_initialized()


def test_thread_counts_and_option_errors(tmp_path, tiny_suite, capsys, monkeypatch):
    # one fixed default whatever --jobs (issue 15, item 3), --threads overrides it
    assert LocalExecutor(jobs=2).threads == LocalExecutor(jobs=1).threads == DEFAULT_THREADS == 1
    assert LocalExecutor(jobs=2, threads=3).threads == 3
    assert RayExecutor(jobs=2).threads == DEFAULT_THREADS
    assert RayExecutor(address="auto").threads == 1 and RayExecutor(address="auto", threads=4).threads == 4
    with pytest.raises(ExecutorError, match="--gpus-per-run must be"):
        RayExecutor(gpus_per_run=1.5)
    with pytest.raises(ExecutorError, match="--threads must be >= 1"):
        LocalExecutor(threads=0)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = ["run", str(tiny_suite), "--profile", "smoke", "--tracking-uri", uri, "--device", "cpu"]
    assert main(args + ["--address", "auto", "--gpus-per-run", "0.5"]) == 2
    assert "--address, --gpus-per-run: only with --executor ray" in capsys.readouterr().err
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(args + ["--executor", "ray", "--address", "auto"]) == 2  # no cluster runs here
    assert "cannot connect to the Ray cluster at --address auto: ConnectionError" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed
    assert main(args + ["--executor", "ray"]) == 2
    assert "--executor ray needs Ray: pip install -e '.[cluster]'" in capsys.readouterr().err
    assert Tracker(uri).runs("tiny/mini", status=None) == []
