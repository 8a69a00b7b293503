"""The two-stage pipeline in the harness (issue 14, "Done when"): a stage-2 run finds its stage 1 by
config hash in a real MLflow store (tmp), never retrains it, and a deleted artifact (or run) makes
stage 1 run again, once. Tiny: digits28, MLR, FedAvg stage 1, FedAvg / zero-round stage 2."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

import benchmarks.running.sweep as runner
import benchmarks.running.worker as worker
from benchmarks.running.sweep import run_sweep
from benchmarks.running.executors import LocalExecutor
from benchmarks.running.stages import ORPHANED_TAG, PRETRAIN_EXPERIMENT, STATE_PATH
from benchmarks.suite.spec import config_hash, load_suite, stage1_hash
from benchmarks.suite.schema import SuiteError
from benchmarks.store.tracking import Tracker, read_json_artifact
from pfl_core.config import RunConfig
from pfl_core.experiment import run_experiment
from conftest import store

FAKE_GIT = ("0123456789abcdef0123456789abcdef01234567", False)

SUITE = """\
paper: tiny
name: {name}
table: Two stages
metric: {{key: acc, label: accuracy}}
base:
  data: {{dataset: digits28, num_clients: 6, subsample: 240, client_splits: {{test: 0.25}}}}
  model:
    name: mlr
    pretrained: &stage1
      data: {{dataset: digits28, num_clients: 8, subsample: 400}}
      model: {{name: mlr}}
      method: {{name: fedavg, params: {{lr: 0.1, local_steps: 3}}}}
      federation: {{rounds: 3, clients_per_round: 4, batch_size: 20}}
      evaluation: {{protocol: seen}}
      seed: 7
  method: {{name: fedavg, params: {{lr: 0.05, local_steps: 1}}}}
  federation: {{rounds: 1, clients_per_round: 2, batch_size: 20}}
  evaluation: {{protocol: seen}}
grid:
  - name: method
    values:
      - {{label: global, set: {{federation.rounds: 0}}}}
      - {{label: fedavg, set: {{model.pretrained: *stage1}}}}
{extra_axis}seeds: [0, 1]
profiles:
  more: {{seeds: [2]}}
  again: {{seeds: [3]}}
"""
ALPHA_AXIS = """\
  - name: stage1_seed
    values:
      - {label: s7, set: {model.pretrained.seed: 7}}
      - {label: s8, set: {model.pretrained.seed: 8}}
"""


def quiet(*_args, **_kwargs):
    pass


@pytest.fixture(autouse=True)
def _isolated(isolated, monkeypatch):
    monkeypatch.setattr(runner, "git_state", lambda: FAKE_GIT)
    return isolated


def write(tmp_path, name="stages", extra_axis=""):
    path = tmp_path / "suites" / "tiny" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SUITE.format(name=name, extra_axis=extra_axis))
    return load_suite(path)


def sweep(suite, tracker, profile="paper", **kw):
    return run_sweep(suite, suite.expand(profile), tracker, device="cpu", echo=quiet, **kw)


def pretraining_runs(tracker, status=None):
    return tracker.runs(PRETRAIN_EXPERIMENT, status=status)


def test_suite_anchor_shares_one_stage1_hash_and_the_stage2_hash_follows_it(tmp_path):
    suite = write(tmp_path)
    specs = suite.expand("paper")
    hashes = {stage1_hash(s.config) for s in specs}
    assert len(hashes) == 1 and None not in hashes
    written = RunConfig.from_dict(specs[0].config["model"]["pretrained"]).to_dict()
    assert hashes == {config_hash(written)}  # the normal config hash of the stage-1 run
    assert len({s.config_hash for s in specs}) == 4
    # an explicit default in the stage-1 block changes neither hash; another stage-1 seed changes both
    explicit = {**specs[0].config, "model": {**specs[0].config["model"], "pretrained": {
        **specs[0].config["model"]["pretrained"], "federation": {
            **specs[0].config["model"]["pretrained"]["federation"], "reshuffle": False}}}}
    assert config_hash(explicit) == specs[0].config_hash
    other = write(tmp_path, "other", ALPHA_AXIS).expand("paper")
    assert len({stage1_hash(s.config) for s in other}) == 2
    s8 = [s for s in other if s.cell["stage1_seed"] == "s8"]
    assert stage1_hash(s8[0].config) not in hashes


def test_a_bad_stage1_key_names_the_suite_entry(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(SUITE.format(name="bad", extra_axis="").replace("num_clients: 8", "num_clients: eight"))
    with pytest.raises(SuiteError, match=r"base\.model\.pretrained\.data\.num_clients.*integer"):
        load_suite(path)
    path.write_text(SUITE.format(name="bad", extra_axis="").replace("method: {name: fedavg, params: {lr: 0.1",
                                                                    "method: {name: fedavgg, params: {lr: 0.1"))
    with pytest.raises(SuiteError, match=r"model\.pretrained.*fedavgg"):
        load_suite(path)


@pytest.mark.slow
def test_stage1_runs_once_is_reused_and_reruns_once_when_its_artifact_is_deleted(tmp_path):
    uri, art = store(tmp_path / "store")
    tracker = Tracker(uri, art)
    suite = write(tmp_path)
    first = sweep(suite, tracker)
    (stage1,) = pretraining_runs(tracker)
    specs = suite.expand("paper")
    assert (first.finished, first.failed, first.pretrained_trained, first.pretrained_reused) == (4, 0, 1, 0)
    assert stage1.info.status == "FINISHED"
    assert stage1.data.tags["stage"] == "pretrain"
    assert stage1.data.tags["config_hash"] == stage1_hash(specs[0].config)
    assert stage1.data.tags["needed_by_suite"] == suite.key and stage1.data.tags["sweep_run_id"] == first.parent_run_id
    assert stage1.data.params["seed"] == "7"
    # the artifact is the stage-1 run's final state: the same run in-process gives the same tensors
    state = torch.load(tracker.client.download_artifacts(stage1.info.run_id, STATE_PATH, str(tmp_path / "dl")),
                       weights_only=True)
    again = run_experiment(RunConfig.from_dict(specs[0].config["model"]["pretrained"]), device="cpu")
    assert set(state["params"]) == set(again.final_state["params"]) == {"1.weight", "1.bias"}
    assert all(torch.equal(state["params"][k], again.final_state["params"][k]) for k in state["params"])
    # every stage-2 run records its stage 1; the zero-round cell evaluates exactly the pretrained model
    stage2 = tracker.runs(suite.key, "FINISHED")
    assert len(stage2) == 4
    for run in stage2:
        assert run.data.tags["pretrained.config_hash"] == stage1.data.tags["config_hash"]
        assert run.data.tags["pretrained.run_id"] == stage1.info.run_id
        assert read_json_artifact(tracker.client, run.info.run_id, "run_info.json")["pretrained"] == {
            "config_hash": stage1.data.tags["config_hash"], "run_id": stage1.info.run_id}
    global_acc = [float(r.data.metrics["acc"]) for r in stage2 if r.data.tags["cell"] == "method=global"]
    own_init = run_experiment(RunConfig.from_dict({**specs[0].config, "model": {"name": "mlr"}}), device="cpu")
    assert min(global_acc) > own_init.metrics["acc"] + 0.2  # trained weights, not the model's own init

    # the same sweep again: nothing to run, no stage 1; another suite naming the same stage 1 reuses it
    # (--no-reuse: with reuse its four runs, the same configurations, would be copied, benchmarks.store.reuse)
    assert sweep(suite, tracker).pretrained_trained == 0
    other = sweep(write(tmp_path, "stages_b"), tracker, reuse=False)
    assert (other.finished, other.pretrained_trained, other.pretrained_reused) == (4, 0, 1)
    assert len(pretraining_runs(tracker)) == 1

    # the artifact deleted: the next sweep with pending runs trains stage 1 once, the old run is orphaned
    Path(urlparse(stage1.info.artifact_uri).path, STATE_PATH).unlink()
    more = sweep(suite, tracker, "more")
    assert (more.finished, more.pretrained_trained) == (2, 1)
    runs = pretraining_runs(tracker)
    assert len(runs) == 2
    old = tracker.client.get_run(stage1.info.run_id)
    assert "config_hash" not in old.data.tags and old.data.tags[ORPHANED_TAG] == stage1.data.tags["config_hash"]
    new = next(r for r in runs if r.info.run_id != stage1.info.run_id)
    assert new.data.tags["config_hash"] == stage1.data.tags["config_hash"]
    assert {r.data.tags["pretrained.run_id"] for r in tracker.runs(suite.key, "FINISHED")
            if r.data.tags["seed"] == "2"} == {new.info.run_id}
    # the run deleted: once more, exactly one new stage-1 run
    tracker.client.delete_run(new.info.run_id)
    assert sweep(suite, tracker, "again").pretrained_trained == 1
    assert len(pretraining_runs(tracker)) == 2  # the deleted one is not listed


@pytest.mark.slow
def test_a_failed_stage1_fails_its_stage2_runs_with_the_reason(tmp_path, monkeypatch):
    real = worker.run_experiment

    def stage1_crashes(cfg, **kw):
        if not cfg.model.pretrained:
            raise RuntimeError("stage one exploded")
        return real(cfg, **kw)

    monkeypatch.setattr(worker, "run_experiment", stage1_crashes)
    tracker = Tracker(*store(tmp_path / "store"))
    suite = write(tmp_path)
    summary = sweep(suite, tracker)
    assert (summary.finished, summary.failed, summary.pretrained_failed) == (0, 4, 1)
    (stage1,) = pretraining_runs(tracker)
    assert stage1.info.status == "FAILED" and "stage one exploded" in stage1.data.tags["failure_reason"]
    for run in tracker.runs(suite.key, "FAILED"):
        assert "stage 1" in run.data.tags["failure_reason"] and "stage one exploded" in run.data.tags["failure_reason"]
    monkeypatch.setattr(worker, "run_experiment", real)
    fixed = sweep(suite, tracker)  # the next sweep trains it (once) and runs the four
    assert (fixed.finished, fixed.pretrained_trained) == (4, 1)


@pytest.mark.slow
def test_worker_processes_train_each_distinct_stage1_once(tmp_path):
    """--jobs 2: two stage-1 configurations, each trained by one worker, four cells x 2 seeds."""
    tracker = Tracker(*store(tmp_path / "store"))
    suite = write(tmp_path, "two", ALPHA_AXIS)
    summary = run_sweep(suite, suite.expand("paper"), tracker, device="cpu", echo=quiet,
                        executor=LocalExecutor(jobs=2))
    assert (summary.finished, summary.failed, summary.pretrained_trained) == (8, 0, 2)
    runs = pretraining_runs(tracker)
    assert sorted(r.data.params["seed"] for r in runs) == ["7", "8"]
    by_hash = {r.data.tags["config_hash"]: r.info.run_id for r in runs}
    for run in tracker.runs(suite.key, "FINISHED"):
        assert run.data.tags["pretrained.run_id"] == by_hash[run.data.tags["pretrained.config_hash"]]


def test_round_timing_counts_each_distinct_stage1_once(tmp_path, monkeypatch, capsys):
    import benchmarks.timing.round_timing as timing

    suite = write(tmp_path, "timed", ALPHA_AXIS)  # 2 x 2 cells, 2 seeds, 2 distinct stage 1s
    timed = []

    def fake_time_cell(config, rounds, device, data_dir, execution="auto", clock="wall"):
        timed.append(config)
        return 360.0, 0.0  # 6 minutes a round, free evaluations

    monkeypatch.setattr(timing, "time_cell", fake_time_cell)
    assert timing.main([str(suite.path), "--rounds", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert len(timed) == 4 + 2 and sorted(c["seed"] for c in timed[4:]) == [7, 8]
    # stage 2: 4 fedavg runs x 1 round; stage 1: 2 distinct x 3 rounds (not 8 x 3): 3600 s
    assert "projected wall-clock of 8 runs (paper profile" in out and ": 1.0 h" in out
    assert "2 distinct pretraining run(s)" in out


def test_round_timing_never_trains_a_stage1_inside_a_stage2_cell(tmp_path, monkeypatch, capsys):
    import pfl_core.experiment as experiment

    def no_training(self, stage1):
        raise AssertionError("a stage-2 timing trained its stage 1")

    monkeypatch.setattr(experiment.InProcessPretraining, "__call__", no_training)
    from benchmarks.timing.round_timing import main

    suite = write(tmp_path)
    assert main([str(suite.path), "--only", "method=fedavg", "--rounds", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "method=fedavg " in out and "pretrain " in out


def test_the_report_names_the_stage1_a_cell_starts_from(tmp_path):
    from benchmarks.reporting.fidelity import switches

    spec = write(tmp_path).expand("paper")[0]
    wanted = stage1_hash(spec.config)
    assert f"model.pretrained=fedavg on digits28, seed 7, 3 rounds (stage 1 {wanted})" in switches(spec.config)
    imagenet = {**spec.config, "model": {**spec.config["model"], "pretrained": {"source": "imagenet"}}}
    assert "model.pretrained=imagenet" in switches(imagenet)
    plain = {**spec.config, "model": {"name": "mlr", "params": {}, "warm_start": [], "pretrained": {}}}
    assert not any("pretrained" in s for s in switches(plain))


class RemoteLike(LocalExecutor):
    """An in-process executor that says its workers may be on other machines (as Ray's)."""

    remote = True


def test_remote_workers_get_the_state_itself_not_a_local_path(tmp_path):
    from benchmarks.running.stages import resolve_stage1
    from benchmarks.running.worker import WorkerArgs

    tracker = Tracker(*store(tmp_path / "store"))
    specs = write(tmp_path).expand("paper")
    args = WorkerArgs("cpu", None, 1, False, "auto", None, False)
    resolution = resolve_stage1(specs, tracker, RemoteLike(), tmp_path / "states", args, {"paper": "tiny"},
                                FAKE_GIT, "test", {}, echo=quiet)
    (stored,) = resolution.provider.states.values()
    assert stored.path is None and set(stored.state["params"]) == {"1.weight", "1.bias"}
    stage1 = RunConfig.from_dict(specs[0].config["model"]["pretrained"])
    assert resolution.provider(stage1) is stored.state
    assert resolution.provider.provenance(stage1)["run_id"] == stored.run_id
    with pytest.raises(RuntimeError, match="was not resolved"):
        resolution.provider(RunConfig.from_dict({**stage1.to_dict(), "seed": 99}))


def test_two_runners_on_one_store_train_the_shared_stage1_once(tmp_path):
    """Two sweeps of the same suite at once (threads, each with its own store client): one stage-1
    run; the other runner waits for it; every run of the suite finishes once."""
    import threading

    uri, art = store(tmp_path / "store")
    suite = write(tmp_path)
    Tracker(uri, art)  # create the store once
    summaries, errors = [], []

    def one_runner():
        try:
            summaries.append(run_sweep(suite, suite.expand("paper"), Tracker(uri, art), device="cpu", echo=quiet))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=one_runner) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    tracker = Tracker(uri, art)
    assert len(pretraining_runs(tracker, "FINISHED")) == 1 and len(pretraining_runs(tracker)) == 1
    assert sum(s.pretrained_trained for s in summaries) == 1
    assert sum(s.finished for s in summaries) == 4
    assert len(tracker.runs(suite.key, "FINISHED")) == 4


def test_a_method_without_a_global_model_cannot_be_a_stage1(tmp_path):
    from benchmarks.running.stages import stage1_specs
    from pfl_core.experiment import RunResult

    (spec,) = stage1_specs(write(tmp_path).expand("paper"))
    assert spec.stage == "pretrain" and spec.cell == {"stage": "pretrain", "method": "fedavg", "dataset": "digits28"}
    hypernetwork_only = RunResult({"acc": 0.5}, [], [], final_state=None)  # pFedHN's server: no "params"
    outcome = worker._outcome(0.0, hypernetwork_only, spec)
    assert "cannot be the stage 1" in outcome["error"] and "state" not in outcome


@pytest.mark.slow
def test_a_runner_that_loses_the_stage1_claim_waits_for_the_winners_state(tmp_path):
    """Another runner holds a live claim of the stage 1: this one trains nothing, waits, and uses
    the state the other logs (then marks FINISHED)."""
    import threading
    import time

    from torch import nn

    from benchmarks.store.claims import LEASE, OWNER, STATE, TICKET, this_owner
    from benchmarks.running.stages import resolve_stage1
    from benchmarks.running.worker import WorkerArgs
    from pfl_core.pretrained import state_of

    tracker = Tracker(*store(tmp_path / "store"))
    specs = write(tmp_path).expand("paper")
    wanted = stage1_hash(specs[0].config)
    exp = tracker.experiment_id(PRETRAIN_EXPERIMENT)
    other = tracker.client.create_run(exp, tags={"config_hash": wanted, OWNER: this_owner(), STATE: "chosen",
                                                 LEASE: repr(time.time() + 600), TICKET: "1"}).info.run_id
    found = {}
    args = WorkerArgs("cpu", None, 1, False, "auto", None, False)
    waiter = threading.Thread(target=lambda: found.update(resolution=resolve_stage1(
        specs, tracker, LocalExecutor(), tmp_path / "states", args, {"paper": "tiny"}, FAKE_GIT, "test", {},
        echo=quiet)))
    waiter.start()
    time.sleep(3.0)
    assert waiter.is_alive()  # waiting for the other runner
    path = tmp_path / "state.pt"
    torch.save(state_of(nn.Sequential(nn.Flatten(), nn.Linear(784, 10))), path)
    tracker.client.log_artifact(other, str(path), "pretrained")
    tracker.client.set_terminated(other, "FINISHED")
    waiter.join(timeout=60)
    resolution = found["resolution"]
    assert (resolution.trained, resolution.reused) == (0, 1)
    assert resolution.provider.states[wanted].run_id == other
    assert [r.info.run_id for r in pretraining_runs(tracker)] == [other]  # the loser's claim run is gone
