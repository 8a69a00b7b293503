"""The two-stage pipeline in the harness (FedL2P, issue 14): stage 1 once per config hash, in MLflow.

A run whose ``model.pretrained`` describes a stage-1 run starts from that run's final state. Before
any stage-2 run of a sweep starts, :func:`resolve_stage1` resolves every distinct stage-1
configuration of the pending runs, once each:

* **stored**: the newest FINISHED run of the ``pretraining`` experiment tagged with the stage-1
  config hash (:func:`benchmarks.suite.spec.stage1_hash`) that still holds the artifact
  ``pretrained/state.pt`` is reused, whatever suite or sweep trained it (Tables 1, 2, 5 and
  Figures 2-5 share their CIFAR-10 models);
* **missing**: it is trained as its own MLflow run in that experiment (tags ``stage=pretrain``,
  ``config_hash``, ``suite``/``sweep_run_id`` of the sweep that needed it, ``run_kind=cell``),
  with its state logged as ``pretrained/state.pt`` before the run is marked FINISHED. Each distinct
  configuration is one unit of work of the sweep's executor (``--jobs N``, Ray), claimed like any
  run (:mod:`benchmarks.store.claims`), so no two workers or runners train the same stage 1; a runner
  that loses a claim waits for the winner's state.

A FINISHED stage-1 run whose artifact was deleted is *orphaned* (its ``config_hash`` tag moves to
``orphaned_config_hash``: earlier stage-2 runs still name it, nothing reuses it) and stage 1 runs
again, once. A deleted run is simply not found. Stage 2 then gets a
:class:`~benchmarks.store.pretrained.StoredPretraining` provider: each stage-2 run loads the state
by hash (a local copy; the state itself for Ray tasks on other machines), records the stage-1 hash
and run id (tags ``pretrained.config_hash``, ``pretrained.run_id``; ``run_info.json``), and fails
with the reason when its stage 1 failed. Only pending stage-2 runs need a stage 1: a sweep whose
runs all FINISHED trains nothing.

A stage 1 of a KLD-BN model evaluated by ``seen`` scores it with BatchNorm in train mode (each test
batch normalised with its own statistics): its accuracies are not the paper's Global Accuracy
(method ``global_model``). Such a run is named so (tag ``bn_evaluation=train``, its run name and
description, :data:`benchmarks.store.tracking.TRAIN_MODE_NOTE`) and the sweep's log says it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchmarks.store import mlflow_ui as ui
from benchmarks.store.claims import LEASE_S, Claim, ClaimBook
from benchmarks.store.pretrained import StoredPretraining, StoredState, _load
from benchmarks.suite.spec import RunSpec, stage1_hash
from benchmarks.store.tracking import (BN_EVALUATION_TAG, STATE_DIR, STATE_FILE, TRAIN_MODE_NOTE, Tracker,
                                 bn_evaluation)
from benchmarks.running.worker import WorkerArgs, execute_specs
from pfl_core.config import RunConfig

PRETRAIN_EXPERIMENT = "pretraining"
"""The MLflow experiment of every stage-1 run, shared by all suites (a stage 1 is found by its
config hash alone, so one pretrained model serves every suite that names the same stage 1)."""
STATE_PATH = f"{STATE_DIR}/{STATE_FILE}"
ORPHANED_TAG = "orphaned_config_hash"
WAIT_S = 1.0


def stage1_specs(specs: list[RunSpec]) -> list[RunSpec]:
    """One :class:`RunSpec` per distinct stage-1 configuration of ``specs`` (in order), a run of
    the ``pretraining`` experiment (cell: ``stage=pretrain``, the method and the dataset)."""
    out: dict[str, RunSpec] = {}
    for spec in specs:
        wanted = stage1_hash(spec.config)
        if wanted is None or wanted in out:
            continue
        config = RunConfig.from_dict(spec.config["model"]["pretrained"]).to_dict()
        cell = {"stage": "pretrain", "method": config["method"]["name"], "dataset": config["data"]["dataset"]}
        out[wanted] = RunSpec(PRETRAIN_EXPERIMENT, cell, config["seed"], spec.profile, config, wanted,
                              stage="pretrain")
    return list(out.values())


def stored_run(tracker: Tracker, wanted: str, echo: Callable = print):
    """The newest FINISHED stage-1 run of hash ``wanted`` that holds its state (None: none). A
    FINISHED run without the artifact is orphaned on the way (see the module docstring)."""
    exp = tracker.experiment_id(PRETRAIN_EXPERIMENT, create=False)
    if exp is None:
        return None
    runs = tracker.client.search_runs([exp], f"tags.config_hash = '{wanted}' and attributes.status = 'FINISHED'",
                                      order_by=["attributes.start_time DESC"], max_results=1000)
    for run in runs:
        if any(f.path == STATE_PATH for f in tracker.client.list_artifacts(run.info.run_id, STATE_DIR)):
            return run
        tracker.client.set_tag(run.info.run_id, ORPHANED_TAG, wanted)
        tracker.client.delete_tag(run.info.run_id, "config_hash")
        echo(f"pretraining: run {run.info.run_id} (stage 1 {wanted}) has no {STATE_PATH} any more; "
             f"training that stage 1 again")
    return None


@dataclass
class Resolution:
    """What :func:`resolve_stage1` found and did: the provider for stage 2 and the counts."""

    provider: StoredPretraining | None
    reused: int = 0
    trained: int = 0
    failed: int = 0
    states: dict[str, StoredState] = field(default_factory=dict)


def _stored_state(tracker: Tracker, run, folder: Path, in_memory: bool) -> StoredState:
    wanted = run.data.tags["config_hash"]
    path = tracker.client.download_artifacts(run.info.run_id, STATE_PATH, str(folder / wanted))
    if in_memory:  # Ray tasks may run on machines that do not see this folder
        return StoredState(wanted, run.info.run_id, state=_load(path))
    return StoredState(wanted, run.info.run_id, path=path)


def resolve_stage1(specs: list[RunSpec], tracker: Tracker, executor, folder: Path, run_args: WorkerArgs,
                   meta: dict, git: tuple[str, bool], command: str, sweep: dict[str, str],
                   lease_s: float = LEASE_S, echo: Callable = print) -> Resolution:
    """Every distinct stage 1 of the pending ``specs``: reused from the store, else trained (each
    once, by ``executor`` with the sweep's worker arguments ``run_args``) and logged;
    the states are copied under ``folder`` (or held in memory for a remote executor)."""
    needed = stage1_specs(specs)
    if not needed:
        return Resolution(None)
    result = Resolution(None)
    pending = []
    for spec in needed:
        run = stored_run(tracker, spec.config_hash, echo)
        if run is None:
            pending.append(spec)
        else:
            result.states[spec.config_hash] = _stored_state(tracker, run, folder, executor.remote)
            result.reused += 1
    echo(f"pretraining: {len(needed)} distinct stage-1 model(s): {result.reused} stored, {len(pending)} to train")
    train_mode = sum(bn_evaluation(spec.config) == "train" for spec in needed)
    if train_mode:
        echo(f"pretraining: {train_mode} of them evaluated with BatchNorm in train mode: {TRAIN_MODE_NOTE} "
             f"(tag {BN_EVALUATION_TAG}=train)")
    claims = ClaimBook(tracker, PRETRAIN_EXPERIMENT, lease_s)
    claims.reap_stale()
    try:
        while pending:
            pending = _train(pending, tracker, executor, claims, folder, run_args, meta, git, command, sweep,
                             result, echo)
    except BaseException:
        claims.release_all("interrupted while training stage 1; the next sweep trains it")
        raise
    finally:
        claims.close()
    result.provider = StoredPretraining(dict(result.states))
    return result


def _train(pending: list[RunSpec], tracker: Tracker, executor, claims: ClaimBook, folder: Path, run_args: WorkerArgs,
           meta: dict, git: tuple[str, bool], command: str, sweep: dict[str, str], result: Resolution,
           echo: Callable) -> list[RunSpec]:
    """Claim and train the pending stage 1s; return those another runner holds, after waiting for
    them (they are looked up again: stored by then, or to claim again if that runner died)."""
    held, others = {}, []
    for spec in pending:
        tags = {**tracker.run_tags(spec, meta, {}, git, None, command), **sweep}
        run_id = claims.claim(spec.config_hash, tags)
        if run_id is None:
            others.append(spec)
        else:
            held[spec.config_hash] = (spec, run_id)
    calls = (((wanted,), ([spec], *run_args)) for wanted, (spec, _) in held.items())  # stage 1: no provider
    for (wanted,), outcomes, error in executor.map(execute_specs, calls):
        spec, run_id = held[wanted]
        outcome = outcomes[0] if error is None else {
            "started": time.time(), "ended": time.time(), "error": f"{type(error).__name__}: {error}"}
        tracker.log(spec, meta, outcome, git, run_id=run_id, command=command)
        claims.done(run_id)
        if run_args.checkpoints is not None:
            run_args.checkpoints.discard(spec)
        if "error" in outcome:
            result.failed += 1
            result.states[wanted] = StoredState(wanted, run_id, error=outcome["error"])
            echo(f"FAILED pretraining {spec.cell_id} (stage 1 {wanted}): {outcome['error']}")
        else:
            result.trained += 1
            run = tracker.client.get_run(run_id)
            result.states[wanted] = _stored_state(tracker, run, folder, executor.remote)
    waiting = []
    for spec in others:
        while (run := stored_run(tracker, spec.config_hash, echo)) is None and _claimed_elsewhere(tracker, spec):
            time.sleep(WAIT_S)
        if run is None:
            waiting.append(spec)  # its runner died or failed: claim it again
        else:
            result.states[spec.config_hash] = _stored_state(tracker, run, folder, executor.remote)
            result.reused += 1
    return waiting


def _claimed_elsewhere(tracker: Tracker, spec: RunSpec) -> bool:
    """Whether another runner holds a live claim of this stage 1 (a dead runner's claim is not)."""
    exp = tracker.experiment_id(PRETRAIN_EXPERIMENT)
    running = tracker.client.search_runs(
        [exp], f"tags.config_hash = '{spec.config_hash}' and attributes.status = 'RUNNING'", max_results=100)
    now = time.time()
    return any(Claim.of(run).live(now) for run in running)


def sweep_tags(suite_key: str, parent: str | None) -> dict[str, str]:
    """Tags of a stage-1 run naming the sweep that trained it (another experiment: not nested)."""
    tags = {"needed_by_suite": suite_key, ui.RUN_KIND_TAG: ui.CELL}
    if parent:
        tags["sweep_run_id"] = parent
    return tags
