"""Reliability (docs/reliability.md): the same numbers whatever --jobs, exit codes,
claims shared by concurrent runners, stale runs, interruptions and checkpoints. Subprocess tests
run the real ``pflbench`` entry point on real SQLite MLflow stores in tmp_path."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import traceback

import pytest
from mlflow.tracking import MlflowClient

from benchmarks.cli import main
from benchmarks.running.lifecycle import Interrupted, signals_interrupt
from benchmarks.running.sweep import run_sweep
from benchmarks.running.worker import KILL_HOOK_ENV
from benchmarks.running.executors import LocalExecutor
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import Tracker
from conftest import REPO_ROOT, store, tiny_suite_dict, write_suite

DEMO = REPO_ROOT / "suites" / "demo" / "offline.yaml"
DIGITS = ["--only", "setting=digits28-unseen", "--only", "method=fedavg"]


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


def finished_metrics(uri: str, suite_key: str) -> dict[str, dict]:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(suite_key)
    runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED' and tags.run_kind = 'cell'")
    out = {}
    for run in runs:
        history = client.get_metric_history(run.info.run_id, "round/train_loss")
        out[run.data.tags["config_hash"]] = {
            **{k: v for k, v in run.data.metrics.items() if k != "wall_s"},
            "history": [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)],
            "torch_threads": run.data.tags.get("torch_threads")}
    return out


@pytest.mark.slow
def test_jobs_1_and_jobs_2_give_bit_identical_metrics(tmp_path, capsys):
    """The CNN cell of the demo (thread count changes float sums there): one torch thread per run
    by default, whatever --jobs, so every metric and every round's loss is bit-identical."""
    args = ["run", str(DEMO), "--profile", "smoke", "--device", "cpu", "--seeds", "0", "1", *DIGITS]
    one, two = f"sqlite:///{tmp_path}/one.db", f"sqlite:///{tmp_path}/two.db"
    assert main(args + ["--tracking-uri", one, "--jobs", "1"]) == 0
    assert main(args + ["--tracking-uri", two, "--jobs", "2"]) == 0
    key = load_suite(DEMO).key
    a, b = finished_metrics(one, key), finished_metrics(two, key)
    assert len(a) == 2 and a == b
    assert {m["torch_threads"] for m in a.values()} == {"1"}


# -- exit codes, concurrent runners, interruptions (real `pflbench run` processes) ------------------
def pflbench(*args: str, cwd) -> subprocess.Popen:
    """A real ``pflbench run`` process (its own process group, like a command in a terminal)."""
    return subprocess.Popen([sys.executable, "-m", "benchmarks.cli", "run", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def runs_by_status(uri: str, suite_key: str, kind: str = "cell") -> dict[str, list]:
    """The suite's runs of ``kind`` (``cell`` runs, or the ``sweep`` parent runs) by status."""
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(suite_key)
    out: dict[str, list] = {}
    for run in client.search_runs([exp.experiment_id]) if exp else []:
        if (run.data.tags.get("run_kind") == "sweep") == (kind == "sweep"):
            out.setdefault(run.info.status, []).append(run)
    return out


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def children(pid: int) -> list[int]:
    """Pids of the live child processes of ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_each_config_finished_once(uri: str, suite_key: str, specs) -> dict[str, list]:
    status = runs_by_status(uri, suite_key)
    finished = sorted(r.data.tags["config_hash"] for r in status.get("FINISHED", []))
    assert finished == sorted(s.config_hash for s in specs)  # none lost, none duplicated
    assert "RUNNING" not in status  # none stuck
    return status


@pytest.mark.slow
def test_two_runners_on_a_fresh_store_compute_each_run_once(tmp_path, tiny_suite):
    uri = f"sqlite:///{tmp_path}/fresh/mlflow.db"
    (tmp_path / "fresh").mkdir()
    args = [str(tiny_suite), "--profile", "smoke", "--device", "cpu", "--tracking-uri", uri]
    procs = [pflbench(*args, cwd=tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    specs = load_suite(tiny_suite).expand("smoke")
    status = assert_each_config_finished_once(uri, "tiny/mini", specs)
    assert set(status) == {"FINISHED"}
    computed = [int(re.search(r"(\d+) finished, 0 failed", out).group(1)) for out in outs]
    assert sum(computed) == len(specs)  # split between the two, none computed twice


def long_tiny_suite(tmp_path):
    """The tiny MLR suite (conftest), one seed, its smoke runs lengthened to 100 rounds (about a second
    each): a signal sent once a run is claimed lands while runs are in progress."""
    data = tiny_suite_dict()
    data["profiles"]["smoke"].update(seeds=[0])
    data["profiles"]["smoke"]["set"]["federation.rounds"] = 100
    return write_suite(tmp_path / "suites" / "tiny" / "long.yaml", data)


@pytest.mark.slow
def test_ctrl_c_kills_workers_marks_runs_killed_and_resume_finishes(tmp_path):
    uri = f"sqlite:///{tmp_path}/store.db"
    suite = long_tiny_suite(tmp_path)
    key = load_suite(suite).key
    args = [str(suite), "--profile", "smoke", "--device", "cpu", "--tracking-uri", uri, "--jobs", "2"]
    proc = pflbench(*args, cwd=tmp_path)
    wait_for(lambda: "RUNNING" in runs_by_status(uri, key), 300, "a claimed run")
    workers = wait_for(lambda: children(proc.pid), 60, "the worker processes")
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, out
    assert "interrupted by SIGINT" in out and "run the same command again to resume" in out
    assert "Traceback" not in out
    wait_for(lambda: not any(alive(w) for w in workers), 10, "the workers to exit")
    status = runs_by_status(uri, key)
    assert "RUNNING" not in status and status.get("KILLED")
    assert all("interrupted by SIGINT" in r.data.tags["failure_reason"] for r in status["KILLED"])
    again = pflbench(*args, cwd=tmp_path)
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out
    assert_each_config_finished_once(uri, key, load_suite(suite).expand("smoke"))


@pytest.mark.parametrize("first_spawn", ["resource tracker", "worker"])
def test_a_signal_while_a_process_starts_waits_until_its_start_up_data_is_written(monkeypatch, first_spawn):
    """The race behind a Ctrl-C traceback ("Ran out of input" in a worker): SIGINT landing between
    the spawn of a process (a pool worker, or the resource tracker its queues start) and the write
    of its start-up data. The pool holds the signal until the process has it."""
    import multiprocessing.resource_tracker
    import multiprocessing.util
    if first_spawn == "worker":
        multiprocessing.resource_tracker.ensure_running()
    spawn = multiprocessing.util.spawnv_passfds

    def spawn_then_signal(*args):
        pid = spawn(*args)
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the parent's next bytecode
        return pid

    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", spawn_then_signal)
    with pytest.raises(Interrupted) as caught, signals_interrupt():
        for _ in LocalExecutor(jobs=2).map(os.getpid, [("a", ()), ("b", ())]):
            pass
    frames = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert "_launch" not in frames and "shielded" in frames, frames


@pytest.mark.slow
def test_kill_9_of_the_runner_takes_its_workers_and_the_next_start_recomputes(tmp_path):
    uri = f"sqlite:///{tmp_path}/store.db"
    suite = long_tiny_suite(tmp_path)
    key = load_suite(suite).key
    args = [str(suite), "--profile", "smoke", "--device", "cpu", "--tracking-uri", uri, "--jobs", "2"]
    proc = pflbench(*args, cwd=tmp_path)
    wait_for(lambda: "RUNNING" in runs_by_status(uri, key), 300, "a claimed run")
    workers = wait_for(lambda: children(proc.pid), 60, "the worker processes")
    proc.kill()
    proc.communicate(timeout=60)
    wait_for(lambda: not any(alive(w) for w in workers), 10, "the orphaned workers to die")
    assert "RUNNING" in runs_by_status(uri, key)  # what kill -9 leaves behind ...
    again = pflbench(*args, cwd=tmp_path)
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out
    assert "left RUNNING by a runner that died marked KILLED" in out  # ... is cleaned at the next start
    status = assert_each_config_finished_once(uri, key, load_suite(suite).expand("smoke"))
    assert all(r.data.tags["failure_reason"].startswith("stale:") for r in status["KILLED"])
    sweeps = runs_by_status(uri, key, "sweep")  # the killed runner's parent run is closed too
    assert "RUNNING" not in sweeps and len(sweeps["KILLED"]) == 1 and len(sweeps["FINISHED"]) == 1
    assert "a process that died" in sweeps["KILLED"][0].data.tags["failure_reason"]


@pytest.mark.slow
def test_a_dead_worker_fails_its_run_only_and_the_sweep_goes_on(tmp_path, tiny_suite, monkeypatch):
    """A worker SIGKILLed once is retried and finishes; one killed at every attempt is FAILED with the
    reason; the pool is rebuilt and every other run finishes."""
    suite = load_suite(tiny_suite)
    specs = suite.expand("smoke", seeds=[0], only={"setting": ["iid"]})
    armed = tmp_path / "armed"
    armed.mkdir()
    (armed / specs[0].config_hash).touch()
    (armed / f"{specs[1].config_hash}.always").touch()
    monkeypatch.setenv(KILL_HOOK_ENV, str(armed))
    tracker = Tracker(*store(tmp_path / "store"))
    summary = run_sweep(suite, specs, tracker, device="cpu", echo=lambda *_: None,
                        executor=LocalExecutor(jobs=2))
    assert (summary.finished, summary.failed) == (len(specs) - 1, 1)
    runs = {r.data.tags["config_hash"]: r for r in tracker.runs(suite.key, status=None)}
    assert len(runs) == len(specs)
    poisoned = runs[specs[1].config_hash]
    assert poisoned.info.status == "FAILED"
    assert poisoned.data.tags["failure_reason"].startswith("WorkerDied: the worker process died 2 time(s)")
    assert {runs[s.config_hash].info.status for s in specs if s is not specs[1]} == {"FINISHED"}
    assert not (armed / specs[0].config_hash).exists()  # it was killed once, then finished


# -- tuning: stale trials and trials missing from MLflow ----------------------------------------------
@pytest.mark.slow
def test_tune_fails_stale_trials_reruns_them_and_logs_every_trial(tmp_path):
    """A kill -9 left one trial RUNNING (its owner process is dead) and one COMPLETE trial that never
    reached MLflow (killed between Optuna's record and MLflow's) plus a half-written RUNNING MLflow
    run of it. The next ``tune`` fails the stale trial (not counted in the budget), logs both, and
    runs the trials still lacking: every Optuna trial has exactly one finished MLflow run."""
    import optuna

    from benchmarks.tuning.tune import tune
    from benchmarks.tuning.study import load_study
    from benchmarks.tuning.study import TrialLogger, TuneOptions, study_name
    from conftest import tiny_suite_dict, write_suite
    from test_claims import dead_pid

    data = tiny_suite_dict()
    data["base"]["federation"]["batch_size"] = 100
    suite_path = write_suite(tmp_path / "suites" / "tiny" / "stale.yaml", data)
    suite = load_suite(suite_path)
    uri, storage = f"sqlite:///{tmp_path}/mlflow.db", f"sqlite:///{tmp_path}/optuna.db"
    opts = TuneOptions(profile="smoke", trials=3, storage=storage, seeds=(1000,), device="cpu",
                       tracking_uri=uri, echo=None)
    cell = {"setting": "dir", "method": "fedavg"}
    name = study_name(suite, "setting=dir,method=fedavg", "fedavg", "smoke")
    study = load_study(name, storage, opts, 2, 0)
    study.set_user_attr("objective", None)  # set for real by tune below
    complete = study.ask()
    study.tell(complete, 0.5)  # in Optuna, never logged to MLflow
    half = Tracker(uri).client.create_run(Tracker(uri).experiment_id(f"{suite.key}/tuning"),
                                          tags={"study": name, "trial": "0"})  # a half-written log
    stale = study.ask()
    stale.set_user_attr("owner", f"{socket.gethostname()}:{dead_pid()}:")
    (result,) = tune(suite_path, methods=["fedavg"], cells={"setting": ["dir"]}, opts=opts)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    states = {t.number: t.state.name for t in trials}
    assert states[stale.number] == "FAIL"
    assert trials[stale.number].user_attrs["failure_reason"].startswith("stale: left RUNNING by")
    assert len(trials) == 4  # 3 counted + the stale one, run again
    assert "RUNNING" not in states.values()
    runs = Tracker(uri).runs(f"{suite.key}/tuning", status=None)
    assert sorted(int(r.data.tags["trial"]) for r in runs) == [t.number for t in trials]
    assert "RUNNING" not in {r.info.status for r in runs}
    assert half.info.run_id not in {r.info.run_id for r in runs}
    assert result.n_complete + result.n_pruned + result.n_failed == 4


def test_a_trial_killed_before_it_recorded_its_owner_is_failed_too(tmp_path):
    """Issue 29, item 5: kill -9 between Optuna creating a trial (RUNNING) and the objective's first
    line leaves a trial with no owner; a resumed study fails it once it is older than
    ``OWNERLESS_STALE_S`` (a live worker records its owner at once), so none stays RUNNING. A
    trial of a live owner is never failed."""
    import optuna

    from benchmarks.store.claims import this_owner
    from benchmarks.tuning.study import OWNERLESS_STALE_S, fail_stale_trials

    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path}/optuna.db")
    ownerless = study.ask()
    alive = study.ask()
    alive.set_user_attr("owner", this_owner())
    assert OWNERLESS_STALE_S > 0 and fail_stale_trials(study) == 0  # it may be a live worker's new trial
    assert fail_stale_trials(study, ownerless_after_s=0) == 1
    states = {t.number: t for t in study.get_trials()}
    assert states[ownerless.number].state.name == "FAIL"
    assert states[ownerless.number].user_attrs["failure_reason"].startswith("stale: left RUNNING with no owner")
    assert states[ownerless.number].user_attrs["stale"] is True
    assert states[alive.number].state.name == "RUNNING"


def test_the_objective_records_its_owner_before_anything_slow(monkeypatch):
    """The window in which a kill leaves an owner-less trial is the objective's first statement."""
    import ast
    import inspect
    import textwrap

    from benchmarks.tuning.tune import Objective

    body = ast.parse(textwrap.dedent(inspect.getsource(Objective.__call__))).body[0].body
    first_calls = [node for node in body[:3] if isinstance(node, ast.Expr)]
    assert first_calls and "set_user_attr" in ast.unparse(first_calls[0]) and "owner" in ast.unparse(first_calls[0])
