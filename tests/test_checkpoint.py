"""Checkpoints (pfl_core.checkpoint; issue 15, item 10): a run stopped after a checkpoint and
resumed from it gives exactly the numbers of an uninterrupted run - in one process, in lockstep on
the batched path, and after a real SIGKILL of a ``pflbench run`` process."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

import pfl_core.checkpoint as checkpoint
import pfl_core.experiment as experiment
from pfl_core.checkpoint import Checkpointing
from pfl_core.config import RunConfig
from pfl_core.experiment import run_experiments
from benchmarks.reporting.snapshot import SnapshotTracker, provenance_markdown
from benchmarks.running.worker import KILL_HOOK_ENV
from benchmarks.store.tracking import read_json_artifact
from benchmarks.suite.spec import load_suite
from conftest import tiny_suite_dict, write_suite

ROUNDS = 6


def _config(method: str, seed: int) -> RunConfig:
    params = {"lr": 0.05, "global_lr": 0.05, "personal_steps": 2, "global_steps": 2} if method == "ditto" else \
        {"lr": 0.05, "local_steps": 2}
    return RunConfig.from_dict({
        "data": {"dataset": "digits28", "num_clients": 8, "unseen_fraction": 0.0, "client_splits": {"test": 0.2},
                 "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 20}},
        "model": {"name": "mlr"},
        "method": {"name": method, "params": params},
        "federation": {"rounds": ROUNDS, "clients_per_round": 3, "batch_size": 10, "reshuffle": True, "eval_every": 2},
        "evaluation": {"protocol": "seen", "params": {"steps": 2, "lr": 0.05}},
        "seed": seed,
    })


class Stop(Exception):
    pass


def _stop_after(round_no: int):
    def on_round(round_idx: int, _metrics: dict) -> None:
        if round_idx + 1 == round_no:
            raise Stop
    return on_round


def _same(a, b) -> None:
    assert a.metrics == b.metrics
    assert a.history == b.history
    assert a.clients == b.clients
    assert a.curve_mean == b.curve_mean


@pytest.mark.parametrize("method,seeds,execution", [("ditto", [0], "sequential"), ("fedavg", [0, 1], "batched")])
def test_resumed_run_equals_uninterrupted_run(tmp_path, method, seeds, execution):
    """Ditto keeps per-client personal models and optimiser state; the batched lockstep case saves
    and resumes two seeds together. Stopped after round 5, resumed from the checkpoint of round 4."""
    cfgs = [_config(method, s) for s in seeds]
    reference = run_experiments(cfgs, device="cpu", execution=execution)
    saving = Checkpointing([tmp_path / f"run{s}.pt" for s in seeds], every=2)
    with pytest.raises(Stop):
        run_experiments(cfgs, device="cpu", execution=execution, on_round=_stop_after(5), checkpointing=saving)
    assert all(p.is_file() for p in saving.paths)
    assert {torch.load(p, weights_only=False)["next_round"] for p in saving.paths} == {4}
    elapsed = torch.load(saving.paths[0], weights_only=False)["elapsed_s"]  # the first process's seconds
    assert elapsed > 0
    resumed = run_experiments(cfgs, device="cpu", execution=execution, checkpointing=saving)
    for ref, res in zip(reference, resumed):
        _same(ref, res)
        assert res.info["resumed_from_round"] == 4 and "resumed_from_round" not in ref.info
        assert res.info["wall_s_before_resume"] == elapsed and "wall_s_before_resume" not in ref.info
        assert res.info["wall_s"] > elapsed / len(seeds)  # the whole compute time, not the last process's


def test_a_checkpoint_without_elapsed_seconds_resumes_with_them_unknown(tmp_path):
    """A checkpoint written before ``elapsed_s`` existed: the run resumes, its earlier seconds are
    said to be unknown (None), and its own saves stay without the field (nothing to add to)."""
    cfg = _config("fedavg", 0)
    saving = Checkpointing([tmp_path / "run0.pt"], every=2)
    with pytest.raises(Stop):
        run_experiments([cfg], device="cpu", on_round=_stop_after(3), checkpointing=saving)
    state = torch.load(saving.paths[0], weights_only=False)
    del state["elapsed_s"]
    torch.save(state, saving.paths[0])
    (result,) = run_experiments([cfg], device="cpu", checkpointing=saving)
    assert result.info["resumed_from_round"] == 2 and result.info["wall_s_before_resume"] is None
    assert saving.elapsed_s() is None


def test_resume_skips_the_warm_start_and_still_matches(tmp_path, monkeypatch):
    cfg = RunConfig.from_dict({**_config("fedavg", 0).to_dict(),
                               "model": {"name": "mlr", "warm_start": [{"name": "fedavg", "params": {"lr": 0.05}}]}})
    reference = run_experiments([cfg], device="cpu")
    saving = Checkpointing([tmp_path / "run.pt"], every=2)
    with pytest.raises(Stop):
        run_experiments([cfg], device="cpu", on_round=_stop_after(3), checkpointing=saving)
    calls = []
    real = experiment.warm_start
    monkeypatch.setattr(experiment, "warm_start", lambda *a, **k: calls.append(1) or real(*a, **k))
    _same(reference[0], run_experiments([cfg], device="cpu", checkpointing=saving)[0])
    assert calls == []


def test_incomplete_checkpoints_start_again(tmp_path):
    cfgs = [_config("fedavg", s) for s in (0, 1)]
    saving = Checkpointing([tmp_path / "a.pt", tmp_path / "b.pt"], every=2)
    with pytest.raises(Stop):
        run_experiments(cfgs, device="cpu", on_round=_stop_after(3), checkpointing=saving)
    saving.paths[1].unlink()  # one run of the lockstep group lost its file
    assert saving.available() is None
    saving.paths[0].write_bytes(b"truncated")
    assert Checkpointing([saving.paths[0]], every=2).available() is None
    result = run_experiments(cfgs, device="cpu", checkpointing=saving)
    assert all("resumed_from_round" not in r.info for r in result)
    assert not Checkpointing([tmp_path / "x.pt"], every=2).due(5, 6)  # never after the last round
    with pytest.raises(ValueError, match="checkpoint every must be >= 1"):
        Checkpointing([tmp_path / "x.pt"], every=0)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_metrics(tmp_path):
    """A real ``pflbench run`` process (--jobs 1: the run computes in it) gets SIGUSR1 after round 4
    of a 6-round run (checkpoints every 100 rounds: none but the one it asks for) and SIGKILLs itself
    after round 5; the next ``pflbench run`` marks the stale run KILLED, resumes it from round 4, and
    logs exactly the metrics of an uninterrupted run."""
    data = tiny_suite_dict()
    data["profiles"]["smoke"]["set"]["federation.rounds"] = ROUNDS
    data["profiles"]["smoke"]["seeds"] = [0]
    suite_path = write_suite(tmp_path / "mini.yaml", data)
    (spec,) = load_suite(suite_path).expand("smoke", only={"setting": ["dir"], "method": ["fedavg_ft"]})
    armed = tmp_path / "armed"
    armed.mkdir()
    (armed / f"{spec.config_hash}.save4").touch()
    (armed / f"{spec.config_hash}.round5").touch()

    def pflbench(store: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "benchmarks.cli", "run", str(suite_path), "--profile", "smoke",
               "--only", "setting=dir", "--only", "method=fedavg_ft", "--device", "cpu",
               "--tracking-uri", f"sqlite:///{tmp_path}/{store}/mlflow.db", "--checkpoint-every", "100"]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env={**os.environ, **(env_extra or {})})

    (tmp_path / "killed").mkdir()
    (tmp_path / "plain").mkdir()
    killed = pflbench("killed", {KILL_HOOK_ENV: str(armed)})
    assert killed.returncode == -9, killed.stdout + killed.stderr  # really SIGKILLed
    assert (tmp_path / "killed" / "checkpoints" / f"{spec.config_hash}.pt").is_file()
    screen = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", killed.stderr)  # the bar's cursor moves
    lines = re.split(r"[\r\n]", screen)  # written above the progress bar, not after its text
    assert any(line.startswith("checkpoint saved on request after round 4") for line in lines), killed.stderr
    resumed = pflbench("killed")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert not (tmp_path / "killed" / "checkpoints" / f"{spec.config_hash}.pt").exists()  # deleted once logged
    plain = pflbench("plain")
    assert plain.returncode == 0, plain.stdout + plain.stderr

    def finished(store: str):
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/{store}/mlflow.db")
        exp = client.get_experiment_by_name("tiny/mini").experiment_id
        runs = client.search_runs([exp], "tags.run_kind = 'cell'")  # not the sweeps' parent runs
        done = [r for r in runs if r.info.status == "FINISHED"]
        assert len(done) == 1
        history = {key: [(m.step, m.value) for m in client.get_metric_history(done[0].info.run_id, key)]
                   for key in ("round/train_loss", "curve/acc")}
        return runs, done[0], history

    runs, after, after_history = finished("killed")
    assert sorted(r.info.status for r in runs) == ["FINISHED", "KILLED"]
    assert after.data.tags["resumed_from_round"] == "4"
    info = read_json_artifact(MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/killed/mlflow.db"),
                              after.info.run_id, "run_info.json")
    assert info["wall_s_before_resume"] > 0  # the killed process's seconds up to its checkpoint
    assert after.data.metrics["wall_s"] >= info["wall_s"]  # the logged wall-clock counts them too
    assert after.data.tags["wall_s_before_resume"] == f"{info['wall_s_before_resume']:.1f}"
    _, reference, reference_history = finished("plain")
    assert "resumed_from_round" not in reference.data.tags
    drop = {"wall_s"}
    assert {k: v for k, v in after.data.metrics.items() if k not in drop} == \
        {k: v for k, v in reference.data.metrics.items() if k not in drop}
    assert sorted(after_history["round/train_loss"]) == sorted(reference_history["round/train_loss"])
    assert sorted(after_history["curve/acc"]) == sorted(reference_history["curve/acc"])


def test_a_requested_save_comes_at_the_end_of_the_current_round_once(tmp_path, monkeypatch):
    """request_save (SIGUSR1 in pflbench run): the next round end saves, whatever ``every``, and the
    request is then spent; never after the last round."""
    saving = Checkpointing([tmp_path / "x.pt"], every=50)
    monkeypatch.setattr(checkpoint._SaveRequest, "pending", False)
    assert not saving.due(2, 10)
    checkpoint.request_save()
    assert not saving.due(9, 10)  # the last round: the run is about to be logged
    assert saving.due(2, 10)
    saving.save([], 2)  # no federation: the request is spent all the same
    assert not saving.due(3, 10) and saving.due(49, 100)


FORWARDING = """
import multiprocessing, os, signal, time
import pfl_core.checkpoint as checkpoint
from benchmarks.running import lifecycle
from benchmarks.running.executors import new_pool

if __name__ == "__main__":
    pool = new_pool(1)
    print("worker handler:", pool.submit(signal.getsignal, signal.SIGUSR1).result(timeout=120) is lifecycle.save_on_signal)
    bystander = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    bystander.start()
    lifecycle.save_on_signal(signal.SIGUSR1, None)
    bystander.join(timeout=30)
    print("bystander exit:", bystander.exitcode)
    print("requested here:", checkpoint._SaveRequest.pending)
    print("worker lives on:", pool.submit(os.getpid).result(timeout=60) > 0)
    bystander.kill()
    pool.shutdown()
"""


def test_sigusr1_reaches_the_worker_processes_which_request_a_save(tmp_path):
    """The parent's handler requests a save and passes the signal on to its worker processes, whose
    initializer installs the same handler (a worker left with the default action would die). In a
    fresh interpreter: the handler signals every multiprocessing child of its process."""
    script = tmp_path / "forwarding.py"
    script.write_text(FORWARDING)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["worker handler: True", f"bystander exit: {-signal.SIGUSR1}",
                                        "requested here: True", "worker lives on: True"], done.stdout + done.stderr


def test_a_save_killed_midway_leaves_a_temporary_file_the_next_run_removes(tmp_path, dead_and_live_pids):
    """``.run0.<pid>.tmp.pt``: a save killed before its rename. The next run of that checkpoint
    removes it when its writer is gone; a live writer's file and other runs' files are kept."""
    dead, live = dead_and_live_pids
    saving = Checkpointing([tmp_path / "run0.pt"], every=2)
    stale, writing, other = (tmp_path / f".run0.{dead}.tmp.pt", tmp_path / f".run0.{live}.tmp.pt",
                             tmp_path / f".run1.{dead}.tmp.pt")
    for path in (stale, writing, other):
        path.write_bytes(b"half a checkpoint")
    run_experiments([_config("fedavg", 0)], device="cpu", checkpointing=saving)
    assert not stale.exists() and writing.exists() and other.exists()


def test_a_resumed_runs_progress_bar_starts_at_the_resumed_round(tmp_path, monkeypatch):
    """Resumed from the checkpoint of round 4 of 6, the run's bar goes 5/6, 6/6 (not 1/6, 2/6, ending
    as if it stopped halfway), and its rate counts only the rounds run now."""
    import benchmarks.running.worker as worker

    data = tiny_suite_dict()
    data["profiles"]["smoke"]["set"]["federation.rounds"] = ROUNDS
    (spec,) = load_suite(write_suite(tmp_path / "mini.yaml", data)).expand(
        "smoke", only={"setting": ["dir"], "method": ["fedavg"]}, seeds=(0,))
    plan = worker.CheckpointPlan(str(tmp_path / "checkpoints"), every=2)
    with pytest.raises(Stop):
        run_experiments([RunConfig.from_dict(spec.config)], device="cpu", on_round=_stop_after(5),
                        checkpointing=plan.for_runs([spec]))
    shown = []

    class Recording(worker.tqdm):
        def update(self, n=1):
            super().update(n)
            shown.append((self.n - self.initial, self.n, self.total))

    monkeypatch.setattr(worker, "tqdm", Recording)
    (outcome,) = worker.execute_specs([spec], "cpu", None, progress=True, checkpoints=plan)
    assert outcome["info"]["resumed_from_round"] == 4
    assert shown == [(1, 5, ROUNDS), (2, 6, ROUNDS)]


def test_provenance_says_which_resumed_runs_miss_their_earlier_seconds():
    """A run resumed from a checkpoint older than its ``elapsed_s`` logs the last process's seconds
    only: the compute line counts such runs; a resumed run with known seconds, and a run never
    resumed, are not counted."""
    def record(run_id: str, **tags) -> dict:
        return {"run_id": run_id, "status": "FINISHED", "metrics": {"wall_s": 100.0}, "tags": tags}

    snap = SnapshotTracker("s/t", {}, [record("a"), record("b", resumed_from_round="150", wall_s_before_resume="812.5"),
                                       record("c", resumed_from_round="350", wall_s_before_resume="unknown"),
                                       record("d", resumed_from_round="50")])  # logged before the tag existed
    text = provenance_markdown(snap, Path("t.md"))
    assert "0.11 h (400 s)" in text and "; 2 run(s) resumed from a checkpoint" in text
    assert "resumed from a checkpoint" not in provenance_markdown(SnapshotTracker("s/t", {}, [record("a")]), Path("t.md"))
