"""Budget-matched Optuna studies for every method of a suite, on validation data only.

``pflbench tune SUITE --method M [--cell AXIS=LABEL ...] --trials N --profile P`` runs one study per
(suite, cell, method, profile), named ``"<suite key>|<cell id>|<method>|<profile>"``.

Objective
    The cell's resolved run configuration (``Suite.expand(profile, use_tuned=False)``), with the
    trial's parameters set on top (as ``Suite.expand`` sets tuned values, after every override) and
    transformed for tuning: ``evaluation.target = "validation"``; the ``unseen`` protocol holds
    ``--validation-fraction`` (default 0.2) of the seen clients out of training as validation
    clients (the test clients are drawn first and are the same as without it); the ``seen``
    protocol evaluates a ``val`` split of each training client, carved out of its train part
    (``--val-split``, default 0.1, unless the suite already has one); ``federation.eval_every`` is
    set to give about ``--eval-points`` (default 5) evaluations. Test clients and test splits are
    never read (``pfl_core.evaluation``; ``tests/test_tuning.py`` proves it). The value is the
    suite's ``metric.key`` (``acc`` if the round summary has no such key) after the last round,
    averaged over the tuning seeds (default 1000 and 1001), which must differ from every seed of the
    suite's profiles.
Intermediate values and pruning
    The tuning seeds run one after the other; every evaluation round reports that seed's value at
    step ``seed_index * rounds + round``, so a step always compares the same (seed, round) across
    trials. The pruner (``median``, default; ``hyperband``; ``none``) cuts a trial whose curve falls
    below the others. A diverging trial (NaN) is PRUNED (so TPE learns to avoid the region) with its
    reason in the trial's user attribute ``failure_reason``; any other error FAILS the trial with its
    reason; the study goes on either way.
Budget and resume
    ``--trials N`` is the study's total budget: a study resumes where it stopped (``load_if_exists``)
    and runs only the trials it lacks (finished trials of any state count), so every method of a
    table gets the same budget, and raising ``--trials`` adds trials. The budget and ``--timeout``
    are study user attributes and go into the tuned file.
Storage and workers
    ``sqlite:///results/optuna.db`` by default; ``--storage`` takes any Optuna RDB URL (PostgreSQL)
    for several workers on several machines. ``--jobs N`` starts N worker processes (not threads:
    the GIL and torch's own threads) that share the storage and split the remaining trials;
    ``--executor ray`` makes them N Ray tasks (:class:`benchmarks.executors.RayExecutor`), each opening
    the study by name from the storage URL, so a cluster needs a database server every node reaches
    (PostgreSQL), not a SQLite file. Ray workers write no MLflow: the parent logs each finished trial
    that has no MLflow run yet when a worker ends.
Tracking
    Every trial is an MLflow run of experiment ``<suite key>/tuning``, tagged ``study``, ``trial``,
    ``state``, ``value``, ``params`` (JSON), ``cell``, ``method``, ``profile`` and, when it failed,
    ``failure_reason``; its parameters are MLflow params and its intermediate values the metric
    ``objective`` (step as above).
Tuned values
    The best trial's parameters (dotted config keys) are written with their provenance to
    ``<suite dir>/<suite stem>.tuned.yml`` (see :func:`write_tuned`); a suite opts in per method
    with its ``tuned`` key (:mod:`benchmarks.suite`), and its runs are tagged ``tuned=true``.
"""
from __future__ import annotations

import copy
import datetime as _dt
import fcntl
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import optuna
import yaml

from pfl_core.evaluation import EVAL_KEY_PREFIXES, EVAL_KEYS

from benchmarks.search_spaces import get_space
from benchmarks.stores import mask_uri, results_dir
from benchmarks.suite import RunSpec, Suite, _apply, cell_id, load_suite
from benchmarks.suite_schema import SuiteError, validate_config
from pfl_core.atomic_file import write_text

DEFAULT_TRIALS = 20
DEFAULT_SEEDS = (1000, 1001)
TUNED_HEADER = ("# Written by `pflbench tune` (benchmarks/tuning.py): the best parameters per cell, method and\n"
                "# tuning profile, with their provenance. A suite uses them for the methods its `tuned` key\n"
                "# lists (benchmarks/suite.py). Edit by re-tuning, not by hand.\n")


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
    """``sqlite:///<results dir>/optuna.db`` (:func:`benchmarks.stores.results_dir`)."""
    folder = folder or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder.resolve() / 'optuna.db'}"


def public_url(url: str) -> str:
    """The storage URL without its password (for provenance, tags and messages)."""
    return mask_uri(url)


def study_name(suite: Suite, cid: str, method: str, profile: str) -> str:
    return f"{suite.key}|{cid}|{method}|{profile}"


# -- which cells ------------------------------------------------------------------------------------
def select(suite: Suite, methods: list[str] | None, cells: dict[str, list[str]] | None,
           profile: str) -> list[tuple[dict[str, str], str]]:
    """(cell, method) pairs to tune. ``methods``: method names (``method.name``) or labels of a
    ``method`` axis; ``all`` = every method; None = the suite's ``tuned.methods``, else all."""
    specs = suite.expand(profile, seeds=[0], only=cells or None, use_tuned=False)
    available = list(dict.fromkeys(s.method for s in specs))
    if not methods:
        listed = (suite.raw.get("tuned") or {})
        listed = listed if isinstance(listed, (list, str)) else listed.get("methods")
        methods = available if not listed or listed == "all" else list(listed)
    if "all" in methods:
        methods = available
    chosen, unknown = [], []
    for want in methods:
        hits = [s for s in specs if want in (s.method, s.cell.get("method"))]
        if not hits:
            unknown.append(want)
        chosen += [(s.cell, s.method) for s in hits]
    if unknown:
        raise TuneError(f"{suite.path}: no cell with method {unknown}"
                        f"{' among --cell ' + str(cells) if cells else ''}; methods of the suite: {available}")
    seen, out = set(), []
    for cell, method in chosen:
        if (cell_id(cell), method) not in seen:
            seen.add((cell_id(cell), method))
            out.append((cell, method))
    for _, method in out:
        get_space(method)  # fail before anything runs
    return out


def check_seeds(suite: Suite, seeds: tuple[int, ...]) -> None:
    table = {int(s) for s in suite.raw["seeds"]}
    for prof in (suite.raw.get("profiles") or {}).values():
        table |= {int(s) for s in (prof or {}).get("seeds", [])}
    overlap = sorted(table & {int(s) for s in seeds})
    if overlap:
        raise TuneError(f"{suite.path}: tuning seeds {list(seeds)} overlap the suite's table seeds "
                        f"{sorted(table)} ({overlap}); pick others with --seeds")
    if not seeds:
        raise TuneError("--seeds: at least one tuning seed is needed")


# -- the objective --------------------------------------------------------------------------------
def tuning_config(config: dict, opts: TuneOptions) -> tuple[dict, dict]:
    """(config, notes): the run config made to evaluate on validation data only (module doc)."""
    cfg = copy.deepcopy(config)
    notes: dict[str, Any] = {"protocol": cfg["evaluation"]["protocol"]}
    cfg["evaluation"]["target"] = "validation"
    data = cfg["data"]
    if cfg["evaluation"]["protocol"] == "unseen":
        if not data.get("validation_fraction"):
            data["validation_fraction"] = opts.validation_fraction
        notes["validation_fraction"] = data["validation_fraction"]
        seen = data["num_clients"] - int(round(data["num_clients"] * data.get("unseen_fraction", 0.0)))
        train = seen - int(round(seen * data["validation_fraction"]))
        per_round = cfg["federation"]["clients_per_round"]
        if per_round > train:
            cfg["federation"]["clients_per_round"] = train
            notes["clients_per_round"] = train
    else:
        splits = dict(data.get("client_splits") or {})
        if "val" not in splits:
            if data.get("remainder", "train") != "train":
                if "train" not in splits or splits["train"] <= opts.val_split:
                    raise TuneError(f"cannot carve a val split out of the train part of {splits} "
                                    f"(remainder {data.get('remainder')!r}): add data.client_splits.val")
                splits["train"] = round(splits["train"] - opts.val_split, 10)
            splits["val"] = opts.val_split
            data["client_splits"] = splits
        notes["val_split"] = splits["val"]
    rounds = cfg["federation"]["rounds"]
    cfg["federation"]["eval_every"] = max(1, math.ceil(rounds / max(1, opts.eval_points)))
    notes["eval_every"] = cfg["federation"]["eval_every"]
    return cfg, notes


def objective_key(suite: Suite) -> str:
    """The summary key a study maximises: the suite's own metric (``acc_pooled`` for FedL2P, ...),
    which must be one an evaluation protocol logs; never a silent substitute."""
    key = suite.metric["key"]
    if key in EVAL_KEYS or key.startswith(EVAL_KEY_PREFIXES):
        return key
    raise SuiteError(f"{suite.path}: metric.key {key!r} is not an evaluation summary key, so it cannot be "
                     f"tuned on a validation split; tunable keys: {sorted(EVAL_KEYS)}")


class Objective:
    """The study's objective for one (cell, method): mean over tuning seeds of the validation metric."""

    def __init__(self, suite: Suite, cell: dict[str, str], method: str, opts: TuneOptions):
        self.suite, self.cell, self.method, self.opts = suite, cell, method, opts
        only = {axis: [label] for axis, label in cell.items()}
        self.specs: list[RunSpec] = [s for s in suite.expand(opts.profile, seeds=list(opts.seeds), only=only,
                                                            use_tuned=False) if s.method == method]
        if len(self.specs) != len(opts.seeds):
            raise TuneError(f"{suite.path}: cell {cell_id(cell)} of method {method} did not expand to "
                            f"one run per tuning seed")
        self.space = get_space(method)
        self.metric = objective_key(suite)
        self.rounds = self.specs[0].config["federation"]["rounds"]
        _, self.notes = tuning_config(self.specs[0].config, opts)
        from pfl_core.experiment import InProcessPretraining  # imported late, as in __call__

        #: a stage-1 ``model.pretrained`` is trained once per study process, not once per trial
        self.pretrained = InProcessPretraining(opts.device, opts.data_dir)

    def describe(self) -> dict:
        """What the objective is (stored on the study; a resumed study must match)."""
        return {"metric": self.metric, "target": "validation", "seeds": list(self.opts.seeds),
                "validation": self.notes, "rounds": self.rounds, "search_space": self.space.__name__}

    def configs(self, trial) -> list[dict]:
        params = self.space(trial, self.specs[0].config)
        out = []
        for spec in self.specs:
            config = copy.deepcopy(spec.config)
            _apply(config, params, f"trial {trial.number}")
            config, _ = tuning_config(config, self.opts)
            out.append(validate_config(config, f"{self.suite.path}: cell {cell_id(self.cell)} (tuning)"))
        return out

    def __call__(self, trial) -> float:
        from benchmarks.claims import this_owner

        # first, before the slow imports: a RUNNING trial of a dead owner is failed later
        trial.set_user_attr("owner", this_owner())
        from pfl_core.config import RunConfig
        from pfl_core.experiment import run_experiment
        from pfl_core.federation import DivergenceError

        try:
            configs = self.configs(trial)
        except SuiteError as err:
            trial.set_user_attr("failure_reason", str(err)[:2000])
            raise
        finals = []
        for k, config in enumerate(configs):
            offset = k * self.rounds

            def on_round(round_idx: int, metrics: dict) -> None:
                if self.metric not in metrics:
                    return
                trial.report(float(metrics[self.metric]), offset + round_idx + 1)
                if trial.should_prune():
                    trial.set_user_attr("pruned_at", {"seed": config["seed"], "round": round_idx + 1})
                    raise optuna.TrialPruned(f"pruned at seed {config['seed']}, round {round_idx + 1}")

            try:
                result = run_experiment(RunConfig.from_dict(config), device=self.opts.device,
                                        data_dir=self.opts.data_dir, on_round=on_round, pretrained=self.pretrained)
            except DivergenceError as err:
                reason = f"diverged (seed {config['seed']}): {err}"
                trial.set_user_attr("failure_reason", reason)
                raise optuna.TrialPruned(reason) from None
            except optuna.TrialPruned:
                raise
            except Exception as err:
                trial.set_user_attr("failure_reason", f"{type(err).__name__}: {err}"[:2000])
                raise
            value = float(result.metrics[self.metric])
            if not math.isfinite(value):
                trial.set_user_attr("failure_reason", f"non-finite {self.metric} (seed {config['seed']})")
                raise optuna.TrialPruned(f"non-finite {self.metric}")
            finals.append(value)
            trial.set_user_attr("seed_values", finals)
        return sum(finals) / len(finals)


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


def make_pruner(opts: TuneOptions, max_steps: int) -> optuna.pruners.BasePruner:
    if opts.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=opts.pruner_startup, n_warmup_steps=0)
    if opts.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(1, max_steps), reduction_factor=3)
    if opts.pruner == "none":
        return optuna.pruners.NopPruner()
    raise TuneError(f"--pruner must be median, hyperband or none, got {opts.pruner!r}")


FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)


def _finished(study: optuna.Study) -> int:
    """Finished trials that count against the budget: all but those failed as stale (their worker
    died; :func:`fail_stale_trials`), which are run again."""
    return sum(not t.user_attrs.get("stale") for t in study.get_trials(deepcopy=False, states=FINISHED))


OWNERLESS_STALE_S = 60.0
"""Harness choice (issue 29, item 5): a RUNNING trial that never recorded its ``owner`` (a kill
between Optuna creating the trial and the objective's first line) is stale once it started this
many seconds ago; the same span as a run claim's lease (``benchmarks.claims.LEASE_S``), within which
a live worker of another ``pflbench tune`` has long recorded its owner."""


def _stale_reason(trial: optuna.trial.FrozenTrial, ownerless_after_s: float) -> str | None:
    """Why RUNNING ``trial`` is stale (its owner died on this host, or it has no owner and started
    over ``ownerless_after_s`` ago), None while it may still be running."""
    from benchmarks.claims import owner_dead

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
    from benchmarks.claims import this_owner

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


def _load_study(name: str, storage: str, opts: TuneOptions, max_steps: int, offset: int) -> optuna.Study:
    return optuna.create_study(study_name=name, storage=storage, direction="maximize",
                               sampler=make_sampler(opts, offset), pruner=make_pruner(opts, max_steps),
                               load_if_exists=True)


# -- MLflow: one run per trial ------------------------------------------------------------------------
class TrialLogger:
    """Optuna callback: log each finished trial as a run of experiment ``<suite key>/tuning``."""

    def __init__(self, suite: Suite, cell: dict[str, str], method: str, opts: TuneOptions, storage: str,
                 describe: dict):
        self.suite_key, self.cell, self.method = suite.key, cell, method
        self.profile, self.uri, self.storage, self.describe = opts.profile, opts.tracking_uri, storage, describe
        self.echo = opts.echo
        self._tracker = None
        self._git = None

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        from mlflow.entities import Metric, Param

        from benchmarks.tracking import Tracker, git_state

        if self._tracker is None:
            self._tracker, self._git = Tracker(self.uri), git_state()
        client = self._tracker.client
        exp = self._tracker.experiment_id(f"{self.suite_key}/tuning")
        value = trial.value if trial.state == optuna.trial.TrialState.COMPLETE else None
        tags = {
            "study": study.study_name, "trial": str(trial.number), "state": trial.state.name,
            "value": "" if value is None else repr(value), "params": json.dumps(trial.params, sort_keys=True),
            "suite": self.suite_key, "cell": cell_id(self.cell), "method": self.method, "profile": self.profile,
            "storage": public_url(self.storage), "objective": json.dumps(self.describe, sort_keys=True),
            "git_commit": self._git[0], "git_dirty": str(self._git[1]).lower(),
            "mlflow.runName": f"{cell_id(self.cell)} trial {trial.number}",
            **{f"cell.{k}": v for k, v in self.cell.items()},
        }
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


# -- running a study --------------------------------------------------------------------------------
def _optimize(suite_path: str, cell: dict, method: str, opts: TuneOptions, name: str, storage: str,
              n_trials: int, offset: int, threads: int | None = None, log: bool = True) -> None:
    """One worker: load the study and run ``n_trials`` trials (also the body of --jobs workers and
    of Ray tasks, which do not ``log`` to MLflow: the parent logs their trials)."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    suite = load_suite(suite_path)
    objective = Objective(suite, cell, method, opts)
    study = _load_study(name, storage, opts, len(opts.seeds) * objective.rounds, offset)
    callbacks = [TrialLogger(suite, cell, method, opts, storage, objective.describe())] if log else []
    study.optimize(objective, n_trials=n_trials, timeout=opts.timeout, catch=(Exception,), callbacks=callbacks)


def log_unlogged_trials(name: str, storage: str, logger: TrialLogger) -> None:
    """Log every finished trial of the study that has no complete MLflow run yet: Ray workers write
    no MLflow, and a worker killed between Optuna's record and MLflow's leaves a trial unlogged or
    its run RUNNING (deleted here and logged again)."""
    from benchmarks.tracking import Tracker

    tracker = Tracker(logger.uri)
    logged = set()
    for run in tracker.runs(f"{logger.suite_key}/tuning", status=None):
        if run.data.tags.get("study") != name:
            continue
        if run.info.status == "RUNNING":
            tracker.client.delete_run(run.info.run_id)
        else:
            logged.add(run.data.tags.get("trial"))
    study = optuna.load_study(study_name=name, storage=storage)
    for trial in study.get_trials(deepcopy=False, states=FINISHED):
        if str(trial.number) not in logged:
            logger(study, trial)


def tune_cell(suite: Suite, cell: dict[str, str], method: str, opts: TuneOptions, executor=None) -> StudyResult:
    """Create or resume the study of (suite, cell, method, profile), run the trials its budget
    still lacks, and write the best parameters to the suite's tuned file. ``executor``
    (:mod:`benchmarks.runner`) runs the workers; default ``LocalExecutor(opts.jobs)``."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = opts.storage or default_storage()
    cid = cell_id(cell)
    name = study_name(suite, cid, method, opts.profile)
    objective = Objective(suite, cell, method, opts)
    describe = objective.describe()
    try:
        study = _load_study(name, storage, opts, len(opts.seeds) * objective.rounds, 0)
    except Exception as err:  # noqa: BLE001 - a bad URL or unreachable server: one clear line
        raise TuneError(f"--storage {public_url(storage)}: cannot open the Optuna storage: {err}") from None
    stored = study.user_attrs.get("objective")
    if stored is not None and stored != json.loads(json.dumps(describe)):
        raise TuneError(f"study {name!r} in {public_url(storage)} was created with objective {stored}; this "
                        f"call asks for {describe}: pass the same --seeds/validation options, or another --storage")
    echo = opts.echo or (lambda _msg: None)
    stale = fail_stale_trials(study)
    if stale:
        echo(f"study {name}: {stale} trial(s) left RUNNING by a dead worker marked FAIL; running them again")
    done = _finished(study)
    if stored is None:
        study.set_user_attr("objective", describe)
        study.set_user_attr("suite", suite.key)
        study.set_user_attr("cell", cid)
        study.set_user_attr("method", method)
        study.set_user_attr("profile", opts.profile)
        study.set_user_attr("created", _now())
    budget = {"n_trials": opts.trials, "timeout": opts.timeout, "sampler": opts.sampler, "pruner": opts.pruner}
    history = list(study.user_attrs.get("budget_history", []))
    history.append({**budget, "date": _now(), "finished_before": done})
    study.set_user_attr("budget", budget)
    study.set_user_attr("budget_history", history)
    remaining = max(0, opts.trials - done)
    echo(f"study {name}: {done} finished trial(s), budget {opts.trials}, running {remaining}; "
         f"storage {public_url(storage)}")
    from benchmarks import mlflow_ui as ui
    from benchmarks.tracking import Tracker

    # the MLflow store and experiment exist before any worker logs (no migration race); the
    # experiment opens as model training with its description and saved view (benchmarks.mlflow_ui)
    Tracker(opts.tracking_uri).describe_experiment(f"{suite.key}/tuning", ui.tuning_description(suite.key),
                                                   ui.TUNING_COLUMNS, "value")
    # a trial is in MLflow once it is in Optuna: catch up on those a killed call left unlogged
    log_unlogged_trials(name, storage, TrialLogger(suite, cell, method, opts, storage, describe))
    if remaining:
        from benchmarks.executors import LocalExecutor

        executor = executor or LocalExecutor(opts.jobs)
        if executor.in_process:
            _optimize(str(suite.path), cell, method, opts, name, storage, remaining, done, executor.threads)
        else:
            jobs = min(opts.jobs, remaining)
            shares = [remaining // jobs + (1 if k < remaining % jobs else 0) for k in range(jobs)]
            # Ray workers may run elsewhere: an absolute suite path, and the parent logs their trials
            worker_opts = TuneOptions(**{**asdict(opts), "echo": None if executor.remote else print})
            logger = TrialLogger(suite, cell, method, opts, storage, describe) if executor.remote else None
            calls = [(str(suite.path.resolve()), cell, method, worker_opts, name, storage, share,
                      done + 7919 * (k + 1), executor.threads, not executor.remote) for k, share in enumerate(shares)]
            for _, _, error in executor.map(_optimize, enumerate(calls)):
                if logger:
                    log_unlogged_trials(name, storage, logger)
                if error is not None:
                    raise error
    study = _load_study(name, storage, opts, 1, 0)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    result = StudyResult(name, cell, method, states.count(optuna.trial.TrialState.COMPLETE),
                         states.count(optuna.trial.TrialState.PRUNED), states.count(optuna.trial.TrialState.FAIL))
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not complete:
        return result
    best = study.best_trial
    result.best_value, result.best_trial, result.best_params = best.value, best.number, dict(best.params)
    if opts.write:
        from benchmarks.tracking import git_state

        commit, dirty = git_state()
        provenance = {
            "study": name, "storage": public_url(storage), "trial": best.number, "value": best.value,
            "metric": describe["metric"], "target": "validation", "direction": "maximize",
            "n_trials": opts.trials, "timeout": opts.timeout,
            "trials": {"complete": result.n_complete, "pruned": result.n_pruned, "failed": result.n_failed},
            "tuning_seeds": list(opts.seeds), "seed_values": best.user_attrs.get("seed_values"),
            "validation": describe["validation"], "search_space": describe["search_space"],
            "sampler": opts.sampler, "pruner": opts.pruner, "date": _now(), "git_commit": commit,
            "git_dirty": dirty,
        }
        result.tuned_file = str(write_tuned(suite.tuned_path, suite.key, cid, method, opts.profile,
                                            dict(best.params), provenance))
    return result


def tune(suite_path: str | Path, methods: list[str] | None = None, cells: dict[str, list[str]] | None = None,
         opts: TuneOptions | None = None, executor=None) -> list[StudyResult]:
    """Tune every selected (cell, method) of a suite, one study each, with the same budget."""
    opts = opts or TuneOptions()
    opts.seeds = tuple(int(s) for s in opts.seeds)
    if opts.trials < 1:
        raise TuneError("--trials must be >= 1")
    suite = load_suite(suite_path)
    suite._profile(opts.profile)
    check_seeds(suite, opts.seeds)
    make_sampler(opts), make_pruner(opts, 1)
    return [tune_cell(suite, cell, method, opts, executor)
            for cell, method in select(suite, methods, cells, opts.profile)]


# -- the tuned-parameters file --------------------------------------------------------------------
def write_tuned(path: Path, suite_key: str, cid: str, method: str, profile: str, params: dict,
                provenance: dict) -> Path:
    """Set ``cells[cid][method][profile] = {params, provenance}`` in the tuned file (locked
    read-modify-write, so concurrent ``pflbench tune`` calls of other methods keep their entries)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:  # the file itself is replaced
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
        data["suite"] = suite_key
        entry = {"params": {k: _plain(v) for k, v in params.items()}, "provenance": _plain(provenance)}
        data.setdefault("cells", {}).setdefault(cid, {}).setdefault(method, {})[profile] = entry
        write_text(path, TUNED_HEADER + yaml.safe_dump(data, sort_keys=False, width=110))
    return path


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
