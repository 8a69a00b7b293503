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
Search space
    The method's whole space (:mod:`benchmarks.suite.search_spaces`), or only the dotted keys the
    suite's ``tuned.params`` lists for it (``{perfedavg: [method.params.beta]}``: a value the paper
    leaves unpublished, every other parameter at the cell's value); the space's name, with those keys,
    is part of the stored objective, so a study never resumes under another space.
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
    ``--executor ray`` makes them N Ray tasks (:class:`benchmarks.running.executors.RayExecutor`), each opening
    the study by name from the storage URL, so a cluster needs a database server every node reaches
    (PostgreSQL), not a SQLite file. Ray workers write no MLflow: the parent logs each finished trial
    that has no MLflow run yet when a worker ends.
Tracking
    Every trial is an MLflow run of experiment ``<suite key>/tuning``, tagged ``study``, ``trial``,
    ``state``, ``value``, ``params`` (JSON), ``cell``, ``method``, ``profile`` and, when it failed,
    ``failure_reason``; its parameters are MLflow params and its intermediate values the metric
    ``objective`` (step as above). It is named ``<method> · <cell> · trial <n>``, described (method,
    cell, trial, parameters, objective: ``mlflow.note.content``) and nested under its study's parent
    run ``study <method> · <cell>`` (``run_kind=study``: counts, best value and parameters), one per
    study, reused when the study is resumed (:func:`benchmarks.tuning.study.open_study_run`).
Tuned values
    The best trial's parameters (dotted config keys) are written with their provenance to
    ``<suite dir>/<suite stem>.tuned.yml`` (see :func:`write_tuned`); a suite opts in per method
    with its ``tuned`` key (:mod:`benchmarks.suite.spec`), and its runs are tagged ``tuned=true``.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import optuna

from pfl_core.evaluation import EVAL_KEY_PREFIXES, EVAL_KEYS

from benchmarks.suite.search_spaces import get_space
from benchmarks.suite.spec import RunSpec, Suite, _apply, cell_id, load_suite
from benchmarks.suite.tuned_values import tuned_params, tuned_profiles, tuned_spec
from benchmarks.suite.schema import SuiteError, validate_config
from benchmarks.tuning.tuned_file import write_tuned
from benchmarks.tuning.study import (StudyResult, TrialLogger, TuneError, TuneOptions, close_study_run,
                                     default_storage, fail_stale_trials, finished_trials, load_study,
                                     log_unlogged_trials, make_pruner, make_sampler, open_study_run, public_url,
                                     random_startup_note, study_name, trials_seconds, utc_now)




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
        get_space(method, tuned_params(suite.raw, method))  # fail before anything runs
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
        self.space = get_space(method, tuned_params(suite.raw, method))
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
        from benchmarks.store.claims import this_owner

        # first, before the slow imports: a RUNNING trial of a dead owner is failed later
        trial.set_user_attr("owner", this_owner())
        try:
            configs = self.configs(trial)
        except SuiteError as err:
            trial.set_user_attr("failure_reason", str(err)[:2000])
            raise
        bar = self.progress_bar(trial.number, len(configs))
        try:
            return self._run_seeds(trial, configs, bar)
        finally:
            bar.close()

    def progress_bar(self, number: int, seeds: int):
        """A per-round bar over the trial's seeds x rounds, as ``pflbench run --jobs 1`` shows for a
        run (a paper-scale trial takes minutes); off in pool or Ray workers (``echo`` None or ``jobs`` >
        1), whose bars would interleave."""
        from tqdm.auto import tqdm

        return tqdm(total=seeds * self.rounds, desc=f"  trial {number} ({self.method}, {seeds} seed(s))",
                    unit="round", leave=False, disable=self.opts.echo is None or self.opts.jobs > 1)

    def _run_seeds(self, trial, configs: list[dict], bar) -> float:
        """Each tuning seed's run in turn, reporting the metric every round (pruning); the mean of
        the seeds' final values."""
        from pfl_core.config import RunConfig
        from pfl_core.experiment import run_experiment
        from pfl_core.federation import DivergenceError

        finals = []
        for k, config in enumerate(configs):
            offset = k * self.rounds

            def on_round(round_idx: int, metrics: dict) -> None:
                bar.update(1)
                if self.metric not in metrics:
                    return
                bar.set_postfix({self.metric: f"{float(metrics[self.metric]):.4g}"}, refresh=False)
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


# -- running a study --------------------------------------------------------------------------------
def _optimize(suite_path: str, cell: dict, method: str, opts: TuneOptions, name: str, storage: str,
              n_trials: int, offset: int, threads: int | None = None, log: bool = True,
              parent: str | None = None) -> None:
    """One worker: load the study and run ``n_trials`` trials, logged under the study's ``parent``
    run (also the body of --jobs workers and of Ray tasks, which do not ``log`` to MLflow: the
    parent process logs their trials)."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    suite = load_suite(suite_path)
    objective = Objective(suite, cell, method, opts)
    study = load_study(name, storage, opts, len(opts.seeds) * objective.rounds, offset)
    callbacks = [TrialLogger(suite, cell, method, opts, storage, objective.describe(), parent)] if log else []
    study.optimize(objective, n_trials=n_trials, timeout=opts.timeout, catch=(Exception,), callbacks=callbacks)


def tune_cell(suite: Suite, cell: dict[str, str], method: str, opts: TuneOptions, executor=None) -> StudyResult:
    """Create or resume the study of (suite, cell, method, profile), run the trials its budget
    still lacks, and write the best parameters to the suite's tuned file. ``executor``
    (:mod:`benchmarks.running.sweep`) runs the workers; default ``LocalExecutor(opts.jobs)``."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = opts.storage or default_storage()
    cid = cell_id(cell)
    name = study_name(suite, cid, method, opts.profile)
    objective = Objective(suite, cell, method, opts)
    describe = objective.describe()
    try:
        study = load_study(name, storage, opts, len(opts.seeds) * objective.rounds, 0)
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
    done = finished_trials(study)
    if stored is None:
        study.set_user_attr("objective", describe)
        study.set_user_attr("suite", suite.key)
        study.set_user_attr("cell", cid)
        study.set_user_attr("method", method)
        study.set_user_attr("profile", opts.profile)
        study.set_user_attr("created", utc_now())
    budget = {"n_trials": opts.trials, "timeout": opts.timeout, "sampler": opts.sampler, "pruner": opts.pruner}
    history = list(study.user_attrs.get("budget_history", []))
    history.append({**budget, "date": utc_now(), "finished_before": done})
    study.set_user_attr("budget", budget)
    study.set_user_attr("budget_history", history)
    remaining = max(0, opts.trials - done)
    echo(f"study {name}: {done} finished trial(s), budget {opts.trials}, running {remaining}; "
         f"storage {public_url(storage)}")
    if remaining and (note := random_startup_note(opts)):
        echo(note)
    from benchmarks.store import mlflow_ui as ui
    from benchmarks.store.tracking import Tracker

    # the MLflow store and experiment exist before any worker logs (no migration race); the
    # experiment opens as model training with its description and saved view (benchmarks.store.mlflow_ui)
    tracker = Tracker(opts.tracking_uri)
    tracker.describe_experiment(f"{suite.key}/tuning", ui.tuning_description(suite.key), ui.TUNING_COLUMNS, "value")
    parent = open_study_run(tracker, suite.key, cell, method, opts.profile, name, storage, describe)
    try:
        _run_trials(suite, cell, method, opts, name, storage, describe, parent, remaining, done, executor)
    except BaseException as err:
        with contextlib.suppress(Exception):  # the error itself is what the caller must see
            close_study_run(tracker, parent, load_study(name, storage, opts, 1, 0), err)
        raise
    close_study_run(tracker, parent, load_study(name, storage, opts, 1, 0))
    return _result(suite, cid, cell, method, opts, name, storage, describe)


def _run_trials(suite: Suite, cell: dict[str, str], method: str, opts: TuneOptions, name: str, storage: str,
                describe: dict, parent: str, remaining: int, done: int, executor) -> None:
    """Log the trials a killed call left unlogged, then run ``remaining`` trials on ``executor``."""
    # a trial is in MLflow once it is in Optuna: catch up on those a killed call left unlogged
    log_unlogged_trials(name, storage, TrialLogger(suite, cell, method, opts, storage, describe, parent))
    if remaining:
        from benchmarks.running.executors import LocalExecutor

        executor = executor or LocalExecutor(opts.jobs)
        if executor.in_process:
            _optimize(str(suite.path), cell, method, opts, name, storage, remaining, done, executor.threads,
                      parent=parent)
        else:
            jobs = min(opts.jobs, remaining)
            shares = [remaining // jobs + (1 if k < remaining % jobs else 0) for k in range(jobs)]
            # Ray workers may run elsewhere: an absolute suite path, and the parent logs their trials
            worker_opts = TuneOptions(**{**asdict(opts), "echo": None if executor.remote else print})
            logger = TrialLogger(suite, cell, method, opts, storage, describe, parent) if executor.remote else None
            calls = [(str(suite.path.resolve()), cell, method, worker_opts, name, storage, share,
                      done + 7919 * (k + 1), executor.threads, not executor.remote, parent)
                     for k, share in enumerate(shares)]
            for _, _, error in executor.map(_optimize, enumerate(calls)):
                if logger:
                    log_unlogged_trials(name, storage, logger)
                if error is not None:
                    raise error


def _result(suite: Suite, cid: str, cell: dict[str, str], method: str, opts: TuneOptions, name: str,
            storage: str, describe: dict) -> StudyResult:
    """The study's counts and best trial, written to the suite's tuned file (``opts.write``)."""
    study = load_study(name, storage, opts, 1, 0)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    result = StudyResult(name, cell, method, states.count(optuna.trial.TrialState.COMPLETE),
                         states.count(optuna.trial.TrialState.PRUNED), states.count(optuna.trial.TrialState.FAIL))
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not complete:
        return result
    best = study.best_trial
    result.best_value, result.best_trial, result.best_params = best.value, best.number, dict(best.params)
    if opts.write:
        from benchmarks.store.tracking import git_state

        commit, dirty = git_state()
        provenance = {
            "study": name, "storage": public_url(storage), "trial": best.number, "value": best.value,
            "metric": describe["metric"], "target": "validation", "direction": "maximize",
            "n_trials": opts.trials, "timeout": opts.timeout,
            "trials": {"complete": result.n_complete, "pruned": result.n_pruned, "failed": result.n_failed},
            "tuning_seeds": list(opts.seeds), "seed_values": best.user_attrs.get("seed_values"),
            "validation": describe["validation"], "search_space": describe["search_space"],
            "sampler": opts.sampler, "pruner": opts.pruner, "date": utc_now(), "git_commit": commit,
            "trial_seconds": trials_seconds(study),
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
    allowed = tuned_profiles(suite.raw)
    source = tuned_spec(suite.raw).get("profile")
    if allowed is not None and opts.profile not in allowed and opts.profile != source:
        raise TuneError(f"{suite.path}: tuned.profiles is {allowed}: only those profiles' runs take tuned values, "
                        f"so a study for profile {opts.profile!r} would be used by none; tune with --profile "
                        f"{source or allowed[0]}")
    check_seeds(suite, opts.seeds)
    make_sampler(opts), make_pruner(opts, 1)
    return [tune_cell(suite, cell, method, opts, executor)
            for cell, method in select(suite, methods, cells, opts.profile)]
