"""One Optuna study of ``pflbench tune``: its options and result, sampler and pruner, the trials a
killed worker left RUNNING (failed on resume), and the logging of every trial to MLflow."""
from __future__ import annotations

import datetime as _dt
import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna

DEFAULT_TRIALS = 20


DEFAULT_SEEDS = (1000, 1001)



from benchmarks.store.location import mask_uri, results_dir
from benchmarks.suite.spec import Suite, cell_id
from benchmarks.suite.schema import SuiteError


class TuneError(SuiteError):
    """Bad tuning input (method, cell, seeds, storage); the message names the fix."""


@dataclass
class TuneOptions:
    profile: str = "paper"
    trials: int = DEFAULT_TRIALS
    """The study's total budget (finished trials of any state)."""
    timeout: float | None = None
    """Seconds per worker for this invocation (Optuna's ``timeout``)."""
    storage: str | None = None
    """Optuna RDB URL; None = ``sqlite:///<abs>/results/optuna.db``."""
    jobs: int = 1
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    validation_fraction: float = 0.2
    val_split: float = 0.1
    eval_points: int = 5
    sampler: str = "tpe"
    sampler_seed: int = 0
    pruner: str = "median"
    pruner_startup: int = 5
    """Trials completed before the median pruner prunes (Optuna's ``n_startup_trials``)."""
    device: str = "auto"
    data_dir: str | None = None
    tracking_uri: str | None = None
    write: bool = True
    """Write the best parameters to the suite's tuned file."""
    echo: Callable[[str], None] | None = print


@dataclass
class StudyResult:
    study_name: str
    cell: dict[str, str]
    method: str
    n_complete: int
    n_pruned: int
    n_failed: int
    best_value: float | None = None
    best_trial: int | None = None
    best_params: dict = field(default_factory=dict)
    tuned_file: str | None = None


# -- storage ----------------------------------------------------------------------------------------
def default_storage(folder: Path | None = None) -> str:
    """``sqlite:///<results dir>/optuna.db`` (:func:`benchmarks.store.location.results_dir`)."""
    folder = folder or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder.resolve() / 'optuna.db'}"


def public_url(url: str) -> str:
    """The storage URL without its password (for provenance, tags and messages)."""
    return mask_uri(url)


def study_name(suite: Suite, cid: str, method: str, profile: str) -> str:
    return f"{suite.key}|{cid}|{method}|{profile}"


# -- samplers, pruners, studies ---------------------------------------------------------------------
def make_sampler(opts: TuneOptions, offset: int = 0) -> optuna.samplers.BaseSampler:
    """Seeded; ``offset`` (finished trials, worker index) keeps a resumed study from replaying the
    random start-up suggestions it already tried."""
    seed = opts.sampler_seed + offset
    if opts.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if opts.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    raise TuneError(f"--sampler must be tpe or random, got {opts.sampler!r}")


def random_startup_note(opts: TuneOptions) -> str | None:
    """One line when a TPE budget never leaves the sampler's random start-up (Optuna's
    ``n_startup_trials``, read from its signature): such a study is a seeded random search, and
    every cell's study of a method tries the same candidates."""
    startup = inspect.signature(optuna.samplers.TPESampler).parameters["n_startup_trials"].default
    if opts.sampler != "tpe" or opts.trials > startup:
        return None
    return (f"note: {opts.trials} trial(s) <= TPE's {startup} random start-up trials: a seeded random search, "
            f"the same candidates in every cell (--sampler-seed {opts.sampler_seed}; more --trials for TPE proper)")


def make_pruner(opts: TuneOptions, max_steps: int) -> optuna.pruners.BasePruner:
    if opts.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=opts.pruner_startup, n_warmup_steps=0)
    if opts.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(1, max_steps), reduction_factor=3)
    if opts.pruner == "none":
        return optuna.pruners.NopPruner()
    raise TuneError(f"--pruner must be median, hyperband or none, got {opts.pruner!r}")


FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)


def finished_trials(study: optuna.Study) -> int:
    """Finished trials that count against the budget: all but those failed as stale (their worker
    died; :func:`fail_stale_trials`), which are run again."""
    return sum(not t.user_attrs.get("stale") for t in study.get_trials(deepcopy=False, states=FINISHED))


OWNERLESS_STALE_S = 60.0


def trials_seconds(study: optuna.Study) -> float:
    """The summed duration of the study's finished trials, leaving out those failed as stale: their
    span runs from the dead worker's start until the death was noticed (hours, not compute)."""
    return round(sum((t.datetime_complete - t.datetime_start).total_seconds()
                     for t in study.get_trials(deepcopy=False, states=FINISHED)
                     if t.datetime_complete and t.datetime_start and not t.user_attrs.get("stale")), 1)


def _stale_reason(trial: optuna.trial.FrozenTrial, ownerless_after_s: float) -> str | None:
    """Why RUNNING ``trial`` is stale (its owner died on this host, or it has no owner and started
    over ``ownerless_after_s`` ago), None while it may still be running."""
    from benchmarks.store.claims import owner_dead

    owner = trial.user_attrs.get("owner")
    if owner:
        return f"left RUNNING by {owner}, which died" if owner_dead(owner) else None
    started = trial.datetime_start or _dt.datetime.now()
    age = (_dt.datetime.now() - started).total_seconds()
    return f"left RUNNING with no owner since {started:%H:%M:%S} ({age:.0f} s)" if age >= ownerless_after_s else None


def fail_stale_trials(study: optuna.Study, ownerless_after_s: float | None = None) -> int:
    """Mark FAIL every stale RUNNING trial (:func:`_stale_reason`): kill -9 or Ctrl-C left it
    RUNNING. They get ``failure_reason`` and ``stale``, do not count against the budget, and are
    logged to MLflow like any finished trial. Return how many."""
    from benchmarks.store.claims import this_owner

    after = OWNERLESS_STALE_S if ownerless_after_s is None else ownerless_after_s
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    stale = [(t, why) for t in running if (why := _stale_reason(t, after))]
    storage = study._storage
    for trial, why in stale:
        reason = f"stale: {why}; failed by {this_owner()}"
        storage.set_trial_user_attr(trial._trial_id, "failure_reason", reason)
        storage.set_trial_user_attr(trial._trial_id, "stale", True)
        storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
    return len(stale)


def load_study(name: str, storage: str, opts: TuneOptions, max_steps: int, offset: int) -> optuna.Study:
    return optuna.create_study(study_name=name, storage=storage, direction="maximize",
                               sampler=make_sampler(opts, offset), pruner=make_pruner(opts, max_steps),
                               load_if_exists=True)


# -- MLflow: one parent run per study, one child run per trial -----------------------------------------
def _study_tags(suite_key: str, cell: dict[str, str], method: str, profile: str, name: str, storage: str,
                describe: dict) -> dict[str, str]:
    """The tags a study's parent run and its trial runs share."""
    return {"study": name, "suite": suite_key, "cell": cell_id(cell), "method": method, "profile": profile,
            "storage": public_url(storage), "objective": json.dumps(describe, sort_keys=True),
            **{f"cell.{k}": v for k, v in cell.items()}}


def open_study_run(tracker, suite_key: str, cell: dict[str, str], method: str, profile: str, name: str,
                   storage: str, describe: dict) -> str:
    """The parent run of study ``name`` in experiment ``<suite key>/tuning`` (``run_kind=study``,
    named ``study <method> · <cell>``), created by the study's first call and set RUNNING again by
    the next. Two calls creating it at once both keep the older one (creation time, then run id):
    the later creator sees both and deletes its own."""
    from mlflow.entities import RunTag

    from benchmarks.store import mlflow_ui as ui
    from benchmarks.store.tracking import git_state

    def found():
        runs = [r for r in tracker.runs(f"{suite_key}/tuning", status=None, kind=ui.STUDY)
                if r.data.tags.get("study") == name]
        return min(runs, key=lambda r: (r.info.start_time, r.info.run_id)) if runs else None

    run = found()
    if run is None:
        git = git_state()
        tags = {**_study_tags(suite_key, cell, method, profile, name, storage, describe),
                ui.RUN_KIND_TAG: ui.STUDY, "git_commit": git[0], "git_dirty": str(git[1]).lower(),
                "mlflow.runName": ui.study_run_name(cell, method),
                ui.NOTE_TAG: ui.study_description(method, cell_id(cell), name, describe)}
        mine = tracker.client.create_run(tracker.experiment_id(f"{suite_key}/tuning"), tags=tags).info.run_id
        run = found()
        if run.info.run_id != mine:
            tracker.client.delete_run(mine)
        return run.info.run_id
    if run.info.status != "RUNNING":
        tracker.client.update_run(run.info.run_id, status="RUNNING")
    tracker.client.log_batch(run.info.run_id, tags=[RunTag("objective", json.dumps(describe, sort_keys=True))])
    return run.info.run_id


def close_study_run(tracker, run_id: str, study: optuna.Study, error: BaseException | None = None) -> None:
    """Record a study's counts (tags and metrics ``trials_<state>``) and its best trial (metric
    ``best_value``, tags ``best_trial``, ``best_params``) on its parent run, then end it FINISHED,
    FAILED after an ``error`` or KILLED after an interrupt."""
    from mlflow.entities import Metric, RunTag

    now = int(time.time() * 1000)
    trials = study.get_trials(deepcopy=False, states=FINISHED)
    counts = {f"trials_{state.name.lower()}": sum(t.state == state for t in trials) for state in FINISHED}
    metrics = [Metric(k, float(v), now, 0) for k, v in counts.items()]
    tags = [RunTag(k, str(v)) for k, v in counts.items()]
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        metrics.append(Metric("best_value", float(best.value), now, 0))
        tags += [RunTag("best_trial", str(best.number)), RunTag("best_params", json.dumps(best.params, sort_keys=True))]
    tracker.client.log_batch(run_id, metrics=metrics, tags=tags)
    status = "FINISHED" if error is None else "FAILED" if isinstance(error, Exception) else "KILLED"
    tracker.client.set_terminated(run_id, status=status)


class TrialLogger:
    """Optuna callback: log each finished trial as a run of experiment ``<suite key>/tuning``, a child
    of the study's ``parent`` run (:func:`open_study_run`), with a description (method, cell, trial,
    parameters, objective)."""

    def __init__(self, suite: Suite, cell: dict[str, str], method: str, opts: TuneOptions, storage: str,
                 describe: dict, parent: str | None = None):
        self.suite_key, self.cell, self.method = suite.key, cell, method
        self.profile, self.uri, self.storage, self.describe = opts.profile, opts.tracking_uri, storage, describe
        self.parent = parent
        self.echo = opts.echo
        self._tracker = None
        self._git = None

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        from mlflow.entities import Metric, Param

        from benchmarks.store import mlflow_ui as ui
        from benchmarks.store.tracking import Tracker, git_state

        if self._tracker is None:
            self._tracker, self._git = Tracker(self.uri), git_state()
        client = self._tracker.client
        exp = self._tracker.experiment_id(f"{self.suite_key}/tuning")
        value = trial.value if trial.state == optuna.trial.TrialState.COMPLETE else None
        tags = {
            **_study_tags(self.suite_key, self.cell, self.method, self.profile, study.study_name, self.storage,
                          self.describe),
            "trial": str(trial.number), "state": trial.state.name,
            "value": "" if value is None else repr(value), "params": json.dumps(trial.params, sort_keys=True),
            "git_commit": self._git[0], "git_dirty": str(self._git[1]).lower(), ui.RUN_KIND_TAG: ui.TRIAL,
            "mlflow.runName": ui.trial_run_name(self.cell, self.method, trial.number),
            ui.NOTE_TAG: ui.trial_description(self.method, cell_id(self.cell), trial.number, trial.params,
                                              self.describe, trial.state.name, value),
        }
        if self.parent:
            tags[ui.PARENT_TAG] = self.parent
        if trial.user_attrs.get("failure_reason"):
            tags["failure_reason"] = str(trial.user_attrs["failure_reason"])[:5000]
        start = trial.datetime_start or _dt.datetime.now()
        end = trial.datetime_complete or _dt.datetime.now()
        run = client.create_run(exp, start_time=int(start.timestamp() * 1000), tags=tags)
        now = int(time.time() * 1000)
        metrics = [Metric("objective", float(v), now, int(step)) for step, v in sorted(trial.intermediate_values.items())]
        if value is not None:
            metrics.append(Metric("value", float(value), now, 0))
        for k, v in enumerate(trial.user_attrs.get("seed_values", [])):
            metrics.append(Metric("seed_value", float(v), now, k))
        params = [Param(k, str(v)) for k, v in trial.params.items()]
        client.log_batch(run.info.run_id, metrics=metrics, params=params)
        status = {"COMPLETE": "FINISHED", "PRUNED": "KILLED"}.get(trial.state.name, "FAILED")
        client.set_terminated(run.info.run_id, status=status, end_time=int(end.timestamp() * 1000))
        if self.echo:
            shown = ", ".join(f"{k.rsplit('.', 1)[-1]}={v:.4g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                              for k, v in trial.params.items())
            extra = f" ({trial.user_attrs['failure_reason']})" if trial.user_attrs.get("failure_reason") else ""
            self.echo(f"  trial {trial.number:3d} {trial.state.name:8s} "
                      f"{'' if value is None else f'value={value:.4f} '}{shown}{extra}")


def log_unlogged_trials(name: str, storage: str, logger: TrialLogger) -> None:
    """Log every finished trial of the study that has no complete MLflow run yet: Ray workers write
    no MLflow, and a worker killed between Optuna's record and MLflow's leaves a trial unlogged or
    its run RUNNING (deleted here and logged again). Trial runs logged before the study had a
    parent run are moved under it."""
    from benchmarks.store import mlflow_ui as ui
    from benchmarks.store.tracking import Tracker

    tracker = Tracker(logger.uri)
    logged = set()
    for run in tracker.runs(f"{logger.suite_key}/tuning", status=None):  # trials, not the studies' runs
        if run.data.tags.get("study") != name:
            continue
        if run.info.status == "RUNNING":
            tracker.client.delete_run(run.info.run_id)
            continue
        logged.add(run.data.tags.get("trial"))
        if logger.parent and run.data.tags.get(ui.PARENT_TAG) != logger.parent:
            tracker.client.set_tag(run.info.run_id, ui.PARENT_TAG, logger.parent)
    study = optuna.load_study(study_name=name, storage=storage)
    for trial in study.get_trials(deepcopy=False, states=FINISHED):
        if str(trial.number) not in logged:
            logger(study, trial)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
