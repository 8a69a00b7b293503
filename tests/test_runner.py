"""The sweep runner against a real MLflow SQLite store in tmp_path."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

import benchmarks.running.sweep as runner
import benchmarks.running.worker as worker
import pfl_core.experiment as experiment
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import Tracker, default_tracking_uri, flatten, git_state, read_json_artifact
from pfl_core.algorithms import METHODS
from pfl_core.federation import DivergenceError
from conftest import store, tiny_suite_dict, write_suite

FAKE_GIT = ("0123456789abcdef0123456789abcdef01234567", False)


def quiet(*_args, **_kwargs):
    pass


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The tiny suite's smoke profile swept once into a module-wide store (12 runs)."""
    root = tmp_path_factory.mktemp("swept")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(root)
        mp.setattr(runner, "git_state", lambda: FAKE_GIT)
        suite = load_suite(write_suite(root / "mini.yaml", tiny_suite_dict()))
        specs = suite.expand("smoke")
        uri, art = store(root / "store")
        tracker = Tracker(uri, art)
        summary = run_sweep(suite, specs, tracker, device="cpu", echo=quiet, execution="sequential")
    runs = tracker.runs(suite.key, status=None)
    return {"suite": suite, "specs": specs, "tracker": tracker, "summary": summary, "runs": runs,
            "by_hash": {r.data.tags["config_hash"]: r for r in runs}}


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


def test_every_run_finished_once(swept):
    specs, runs, summary = swept["specs"], swept["runs"], swept["summary"]
    assert (summary.total, summary.skipped, summary.finished, summary.failed) == (len(specs), 0, len(specs), 0)
    assert len(runs) == len(specs)
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert set(swept["by_hash"]) == {s.config_hash for s in specs}


def test_run_tags(swept):
    suite = swept["suite"]
    for spec in swept["specs"]:
        tags = swept["by_hash"][spec.config_hash].data.tags
        assert tags["paper"] == suite.paper
        assert tags["table"] == suite.raw["table"]
        assert tags["suite"] == suite.key
        assert tags["cell"] == spec.cell_id
        assert tags["method"] == spec.method == spec.cell["method"]
        assert tags["seed"] == str(spec.seed)
        assert tags["profile"] == "smoke"
        assert tags["config_hash"] == spec.config_hash
        assert tags["git_commit"] == FAKE_GIT[0]
        assert tags["git_dirty"] == "false"
        assert re.fullmatch(r"[0-9a-f]{16}", tags["partition_digest"])
        assert re.fullmatch(r"[0-9a-f]{16}", tags["sampling_digest"])
        assert tags["device"] == "cpu"
        assert tags["offline_data"] == "true"  # digits28 is an offline stand-in
        assert "failure_reason" not in tags
        for axis, label in spec.cell.items():
            assert tags[f"cell.{axis}"] == label


def test_run_params_are_the_flattened_config(swept):
    for spec in swept["specs"]:
        params = swept["by_hash"][spec.config_hash].data.params
        assert params == flatten(spec.config)
        assert params["federation.rounds"] == str(spec.config["federation"]["rounds"])
        assert params["method.name"] == spec.method
        assert params["seed"] == str(spec.seed)


def test_per_round_and_final_metrics(swept):
    client = swept["tracker"].client
    for spec in swept["specs"]:
        run = swept["by_hash"][spec.config_hash]
        rounds = spec.config["federation"]["rounds"]
        history = client.get_metric_history(run.info.run_id, "round/train_loss")
        assert sorted(m.step for m in history) == list(range(1, rounds + 1))
        assert all(math.isfinite(m.value) and m.value > 0 for m in history)
        metrics = run.data.metrics
        for key in ("acc", "acc_weighted", "acc_last3", "wall_s"):
            assert key in metrics
        for key in ("acc", "acc_weighted", "acc_last3"):
            assert 0.0 <= metrics[key] <= 1.0
        # the final train loss is the last round's
        last = max(history, key=lambda m: m.step)
        assert metrics["train_loss"] == pytest.approx(last.value)
        # acc_last3 is the mean of the last three points of the fine-tuning curve
        curve = sorted(client.get_metric_history(run.info.run_id, "curve/acc"), key=lambda m: m.step)
        steps = spec.config["evaluation"]["params"]["steps"] if METHODS.get(spec.method).finetune_at_eval else 0
        assert [m.step for m in curve] == list(range(steps + 1))
        values = [m.value for m in curve]
        assert metrics["acc"] == pytest.approx(values[-1])
        assert metrics["acc_last3"] == pytest.approx(np.mean(values[-3:]))


def test_artifacts(swept):
    client = swept["tracker"].client
    for spec in swept["specs"]:
        run = swept["by_hash"][spec.config_hash]
        config = read_json_artifact(client, run.info.run_id, "config.json")
        assert config == spec.config
        info = read_json_artifact(client, run.info.run_id, "run_info.json")
        assert info["error"] is None
        clients = read_json_artifact(client, run.info.run_id, "clients.json")
        assert info["num_unseen_clients"] > 0
        assert len(clients) == info["num_unseen_clients"]  # the unseen protocol evaluates the held-out clients
        assert len({c["cid"] for c in clients}) == len(clients)
        steps = spec.config["evaluation"]["params"]["steps"] if METHODS.get(spec.method).finetune_at_eval else 0
        for c in clients:
            assert isinstance(c["num_samples"], int) and c["num_samples"] > 0
            assert len(c["acc"]) == steps + 1
        # the final metrics are the client mean / sample-weighted mean of the last step
        last = [c["acc"][-1] for c in clients]
        n = [c["num_samples"] for c in clients]
        assert run.data.metrics["acc"] == pytest.approx(np.mean(last))
        assert run.data.metrics["acc_weighted"] == pytest.approx(np.dot(last, n) / sum(n))


def test_digests_depend_on_seed_not_method(swept):
    tags = [swept["by_hash"][s.config_hash].data.tags for s in swept["specs"]]
    by_setting_seed: dict = {}
    for t in tags:
        by_setting_seed.setdefault((t["cell.setting"], t["seed"]), []).append(t)
    for group in by_setting_seed.values():
        assert len(group) == len(tiny_suite_dict()["grid"][1]["values"])
        assert len({t["partition_digest"] for t in group}) == 1
        assert len({t["sampling_digest"] for t in group}) == 1
    for setting in ("dir", "iid"):
        a, b = by_setting_seed[(setting, "0")][0], by_setting_seed[(setting, "1")][0]
        assert a["partition_digest"] != b["partition_digest"]
        assert a["sampling_digest"] != b["sampling_digest"]
    # a different partitioner with the same seed gives different client data
    assert by_setting_seed[("dir", "0")][0]["partition_digest"] != by_setting_seed[("iid", "0")][0]["partition_digest"]


def test_second_sweep_runs_nothing(tmp_path, tiny_suite):
    suite = load_suite(tiny_suite)
    specs = suite.expand("smoke", only={"setting": ["iid"]})
    tracker = Tracker(*store(tmp_path / "store"))
    first = run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    assert first.finished == len(specs)
    messages = []
    second = run_sweep(suite, specs, tracker, device="cpu", echo=messages.append)
    assert (second.total, second.skipped, second.finished, second.failed) == (len(specs), len(specs), 0, 0)
    assert len(tracker.runs(suite.key, status=None)) == len(specs)
    assert any(f"{len(specs)} of {len(specs)}" in m for m in messages)
    # a new seed runs only the new seed
    more = suite.expand("smoke", seeds=[0, 1, 2], only={"setting": ["iid"]})
    third = run_sweep(suite, more, tracker, device="cpu", echo=quiet)
    assert (third.skipped, third.finished) == (len(specs), len(more) - len(specs))


def test_diverging_run_is_failed_and_sweep_continues(tmp_path, suite_data):
    """A real divergence: MLR with lr = 1e38 overflows to a NaN loss in round 1."""
    suite_data["methods"] = {"fedavg": {"method.params.lr": 1.0e38}}
    suite_data.pop("published")
    suite = load_suite(write_suite(tmp_path / "div.yaml", suite_data))
    specs = suite.expand("smoke", seeds=[0], only={"setting": ["dir"]})
    tracker = Tracker(*store(tmp_path / "store"))
    summary = run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    assert (summary.finished, summary.failed) == (len(specs) - 1, 1)
    runs = {r.data.tags["method"]: r for r in tracker.runs(suite.key, status=None)}
    assert set(runs) == {s.method for s in specs}
    bad = runs["fedavg"]
    assert bad.info.status == "FAILED"
    assert "diverged" in bad.data.tags["failure_reason"] and "non-finite" in bad.data.tags["failure_reason"]
    assert "acc_last3" not in bad.data.metrics
    info = read_json_artifact(tracker.client, bad.info.run_id, "run_info.json")
    assert info["error"] == bad.data.tags["failure_reason"]
    assert {runs[m].info.status for m in runs if m != "fedavg"} == {"FINISHED"}
    # the next sweep retries only the failed run (it diverges again: same config, same seed)
    again = run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    assert (again.skipped, again.finished, again.failed) == (len(specs) - 1, 0, 1)
    retried = [r for r in tracker.runs(suite.key, status=None) if r.data.tags["config_hash"] == bad.data.tags["config_hash"]]
    assert len(retried) == 2 and {r.info.status for r in retried} == {"FAILED"}


def test_failed_run_is_rerun_by_the_next_sweep(tmp_path, tiny_suite, monkeypatch):
    """DivergenceError raised from inside the federation for one spec; the next sweep re-runs it only."""
    suite = load_suite(tiny_suite)
    specs = suite.expand("smoke", only={"setting": ["iid"], "method": ["fedavg", "local"]})
    real = experiment.run_lockstep

    def flaky(federations, executor, *rest):
        if any(type(f.algorithm).__name__ == "FedAvg" and f.streams.seed == 1 for f in federations):
            raise DivergenceError("injected: non-finite loss in round 1")
        return real(federations, executor, *rest)

    monkeypatch.setattr(experiment, "run_lockstep", flaky)
    tracker = Tracker(*store(tmp_path / "store"))
    first = run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    assert (first.finished, first.failed) == (len(specs) - 1, 1)
    failed = tracker.runs(suite.key, status="FAILED")
    assert len(failed) == 1
    tags = failed[0].data.tags
    assert (tags["method"], tags["seed"]) == ("fedavg", "1")
    assert "injected" in tags["failure_reason"]

    monkeypatch.setattr(experiment, "run_lockstep", real)
    second = run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    assert (second.skipped, second.finished, second.failed) == (len(specs) - 1, 1, 0)
    finished = tracker.runs(suite.key, status="FINISHED")
    assert len(finished) == len(specs)
    assert sum(r.data.tags["config_hash"] == tags["config_hash"] for r in finished) == 1


def test_any_crash_is_logged_failed(tmp_path, tiny_suite, monkeypatch):
    suite = load_suite(tiny_suite)
    specs = suite.expand("smoke", seeds=[0], only={"setting": ["iid"], "method": ["local", "fedavg"]})

    def boom(cfg, **kwargs):
        if cfg.method.name == "local":
            raise RuntimeError("boom in the core")
        return real(cfg, **kwargs)

    real = worker.run_experiment
    monkeypatch.setattr(worker, "run_experiment", boom)
    tracker = Tracker(*store(tmp_path / "store"))
    summary = run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    assert (summary.finished, summary.failed) == (1, 1)
    (bad,) = tracker.runs(suite.key, status="FAILED")
    assert bad.data.tags["method"] == "local"
    assert bad.data.tags["failure_reason"] == "RuntimeError: boom in the core"


def _metrics_and_history(tracker, run):
    metrics = {k: v for k, v in run.data.metrics.items() if k != "wall_s"}
    history = [(m.step, m.value) for m in sorted(
        tracker.client.get_metric_history(run.info.run_id, "round/train_loss"), key=lambda m: m.step)]
    return metrics, history


def test_same_cell_and_seed_is_deterministic_across_stores(tmp_path, swept):
    suite = swept["suite"]
    specs = [s for s in swept["specs"] if s.cell["method"] == "fedavg_ft" and s.cell["setting"] == "dir"]
    tracker = Tracker(*store(tmp_path / "other"))
    run_sweep(suite, specs, tracker, device="cpu", echo=quiet, execution="sequential")  # the path of `swept`
    mine = {r.data.tags["config_hash"]: r for r in tracker.runs(suite.key)}
    assert set(mine) == {s.config_hash for s in specs}
    for spec in specs:
        ours = _metrics_and_history(tracker, mine[spec.config_hash])
        theirs = _metrics_and_history(swept["tracker"], swept["by_hash"][spec.config_hash])
        assert ours == theirs
        assert mine[spec.config_hash].data.tags["partition_digest"] == \
            swept["by_hash"][spec.config_hash].data.tags["partition_digest"]
    # and the two seeds really differ (the comparison above is not vacuous)
    a, b = (_metrics_and_history(tracker, mine[s.config_hash]) for s in specs)
    assert a != b


@pytest.mark.slow
def test_process_pool_matches_in_process(tmp_path, swept):
    suite = swept["suite"]
    specs = [s for s in swept["specs"] if s.cell["method"] == "fedavg" and s.cell["setting"] == "iid"]
    assert len(specs) == 2
    tracker = Tracker(*store(tmp_path / "pool"))
    summary = run_sweep(suite, specs, tracker, jobs=2, device="cpu", echo=quiet, execution="sequential")
    assert (summary.finished, summary.failed) == (2, 0)
    pooled = {r.data.tags["config_hash"]: r for r in tracker.runs(suite.key)}
    for spec in specs:
        ours, ours_hist = _metrics_and_history(tracker, pooled[spec.config_hash])
        theirs, theirs_hist = _metrics_and_history(swept["tracker"], swept["by_hash"][spec.config_hash])
        assert ours == theirs and ours_hist == theirs_hist  # one torch thread per run either way: bit-identical


def test_git_state_outside_a_repository(tmp_path, monkeypatch):
    monkeypatch.delenv("GIT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert git_state() == ("unknown", True)


def test_default_store_does_not_depend_on_the_current_directory(tmp_path, monkeypatch):
    """Issue 15 item 7: a sweep started from another folder finds the same store: the checkout's
    results/ by default, $PFLBENCH_RESULTS_DIR when set, $MLFLOW_TRACKING_URI above both."""
    from benchmarks.tuning.study import default_storage

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PFLBENCH_RESULTS_DIR", raising=False)
    repo = Path(__file__).resolve().parents[1]
    uris = set()
    for cwd in (tmp_path, repo / "suites"):
        monkeypatch.chdir(cwd)
        uris.add(default_tracking_uri())
    assert uris == {f"sqlite:///{repo / 'results' / 'mlflow.db'}"}
    assert not (tmp_path / "results").exists()
    monkeypatch.setenv("PFLBENCH_RESULTS_DIR", str(tmp_path / "elsewhere"))
    assert default_tracking_uri() == f"sqlite:///{tmp_path / 'elsewhere' / 'mlflow.db'}"
    assert default_storage() == f"sqlite:///{tmp_path / 'elsewhere' / 'optuna.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/env.db")
    assert default_tracking_uri() == f"sqlite:///{tmp_path}/env.db"


@pytest.mark.slow
def test_lockstep_batched_sweep_logs_each_seed_once_with_the_numbers_of_the_plain_sweep(tmp_path, swept):
    """--lockstep-seeds --execution batched: the seeds of a cell run as one group, each run is logged
    once, tagged with its path, and its metrics are the plain (sequential, one-by-one) sweep's."""
    suite, specs = swept["suite"], swept["specs"]
    tracker = Tracker(*store(tmp_path / "lockstep"))
    summary = run_sweep(suite, specs, tracker, device="cpu", echo=quiet, execution="batched", lockstep_seeds=True)
    assert (summary.finished, summary.failed) == (len(specs), 0)
    runs = tracker.runs(suite.key, status=None)
    assert sorted(r.data.tags["config_hash"] for r in runs) == sorted(s.config_hash for s in specs)
    seeds_per_cell = {s.cell_id: sum(t.cell_id == s.cell_id for t in specs) for s in specs}
    for run in runs:
        tags = run.data.tags
        assert tags["lockstep_runs"] == str(seeds_per_cell[tags["cell"]])
        assert tags["execution"] in ("batched", "sequential")
        plain = swept["by_hash"][tags["config_hash"]]
        assert plain.data.tags["execution"] == "sequential" and plain.data.tags["lockstep_runs"] == "1"
        for key, value in plain.data.metrics.items():
            if key != "wall_s":
                assert run.data.metrics[key] == pytest.approx(value, abs=1e-4), key


@pytest.mark.slow
def test_a_failing_seed_in_a_lockstep_group_fails_alone(tmp_path, swept, monkeypatch):
    suite, specs = swept["suite"], swept["specs"]
    real = experiment.run_lockstep

    def flaky(federations, executor, *rest):
        if any(f.streams.seed == 1 for f in federations):
            raise DivergenceError("injected: non-finite loss in round 1")
        return real(federations, executor, *rest)

    monkeypatch.setattr(experiment, "run_lockstep", flaky)
    tracker = Tracker(*store(tmp_path / "lockstep"))
    summary = run_sweep(suite, specs, tracker, device="cpu", echo=quiet, lockstep_seeds=True)
    failed = tracker.runs(suite.key, status="FAILED")
    assert summary.failed == len(failed) == sum(s.seed == 1 for s in specs) > 0
    assert {r.data.tags["seed"] for r in failed} == {"1"}
    assert all("injected" in r.data.tags["failure_reason"] for r in failed)
    assert summary.finished == len(specs) - summary.failed


@pytest.mark.slow
@pytest.mark.parametrize("started", ["by map", "by start", "by start, nothing to run"])
def test_pool_ends_gracefully_without_leaked_semaphores(tmp_path, started):
    """A finished ``--jobs 2`` map shuts its workers down instead of killing them: a killed worker
    leaves its tqdm lock (a POSIX semaphore) to Python's resource tracker, which then warned
    "leaked semaphore objects" at the end of every ``make demo``. Workers started ahead
    (``pflbench run`` starts them while the store opens) end the same way, also when no run
    needed them."""
    import subprocess
    import sys

    (tmp_path / "bars.py").write_text(
        "import sys\nfrom tqdm import tqdm\n\n"
        "def work(k):\n    for _ in tqdm(range(3), file=sys.stderr):\n        pass\n    return k * k\n")
    script = ("import bars\nfrom benchmarks.running.executors import LocalExecutor\n"
              "if __name__ == '__main__':\n"
              "    executor = LocalExecutor(jobs=2, threads=1)\n"
              f"    if {started != 'by map'}:\n"
              "        executor.start()\n"
              f"    calls = [] if {started.endswith('nothing to run')} else [(k, (k,)) for k in range(4)]\n"
              "    out = executor.map(bars.work, calls) if calls else []\n"
              "    print(sorted(r for _, r, _ in out))\n"
              "    executor.close()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(runner.__file__).parents[2])])}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ("[]" if started.endswith("nothing to run") else "[0, 1, 4, 9]")
    assert "leaked semaphore" not in proc.stderr


def test_map_after_start_runs_on_the_workers_started_ahead():
    executor = runner.LocalExecutor(jobs=2, threads=1)
    executor.start()
    started = set(executor._warm._processes)
    try:
        pids = {pid for _, pid, _ in executor.map(os.getpid, [(k, ()) for k in range(4)])}
        assert executor._warm is None
    finally:
        executor.close()
    assert len(started) == 2 and pids <= started


def test_a_worker_process_imports_no_library_a_plain_run_does_not_use():
    """Every ``--jobs`` worker imports the entry point and the worker module before its first run:
    scikit-learn, SciPy, scikit-image (analyses, novel-class splits, attack scores), MLflow (the
    parent alone writes) and the report's libraries are imported where they are used."""
    import subprocess
    import sys
    heavy = ("sklearn", "scipy", "skimage", "mlflow", "pandas", "matplotlib", "optuna", "ray")
    code = ("import sys, benchmarks.cli, benchmarks.running.worker; "
            f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(worker.__file__).parents[2])
    assert out.stdout.strip() == "", out.stdout
