"""MLflow tracking: one experiment per suite, one run per (cell, seed, profile).

The default store is SQLite in :func:`benchmarks.store.location.results_dir` (the checkout's ``results/``
or ``$PFLBENCH_RESULTS_DIR``, whatever the current directory); ``--tracking-uri`` or
``MLFLOW_TRACKING_URI`` point elsewhere (a shared tracking server, checked to answer first; its
password is kept out of everything printed, see :mod:`benchmarks.store.location`). All writes go through :class:`Tracker` in the parent
process, so worker processes never contend for the store.
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from benchmarks.store import mlflow_ui as ui
from benchmarks.store.location import check_reachable, mask_uri, results_dir, use_credentials
from benchmarks.store.run_tags import (BN_EVALUATION_TAG, DATA_PROVENANCE_TAG, STAGE_TAG, TRAIN_MODE_LABEL,  # noqa: F401
                                  TRAIN_MODE_NOTE, bn_evaluation, command_line, flatten, git_state, run_tags,
                                  stage_tags)
from benchmarks.suite.spec import RunSpec, Suite

STATE_DIR, STATE_FILE = "pretrained", "state.pt"
"""A stage-1 run's artifact ``pretrained/state.pt``: its :data:`pfl_core.pretrained.PretrainedState`."""
METRIC_BATCH = 1000
PARAM_BATCH = 100  # MLflow's limit of params per log_batch
PARAM_VALUE_LIMIT = 6000
STORE_RETRIES = 12


def default_tracking_uri(folder: Path | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<results dir>/mlflow.db``."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    folder = folder or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder.resolve() / 'mlflow.db'}"


def default_artifact_root(uri: str) -> Path:
    """Artifacts of a SQLite store live beside its database file (``mlartifacts/``), so a store in a
    temporary folder keeps its artifacts there too; other stores use ``results/mlartifacts`` only
    when the experiment is created here (a tracking server has its own artifact root)."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).parent / "mlartifacts"
    return results_dir() / "mlartifacts"


def retrying(action, what: str):
    """``action()``, retried with a growing pause when it raises: several runners starting on one
    store race to create its tables and experiments; the loser retries instead of crashing."""
    for attempt in range(STORE_RETRIES):
        try:
            return action()
        except Exception:  # noqa: BLE001 - another runner creating the tables or the experiment
            if attempt == STORE_RETRIES - 1:
                raise
            time.sleep(min(2.0, 0.2 * (attempt + 1)))
    raise AssertionError(what)  # unreachable


def open_client(uri: str) -> MlflowClient:
    """An MLflow client of ``uri``. A SQLite store is created (its tables migrated) under an
    exclusive file lock beside the database, so two runners on a fresh store do not both migrate it."""
    if uri.startswith("sqlite:///"):
        from benchmarks.store.faults import check_sqlite_store

        db = Path(uri[len("sqlite:///"):])
        check_sqlite_store(db)  # a fault a user can make: one line, before MLflow's traceback
        db.parent.mkdir(parents=True, exist_ok=True)
        with open(db.parent / f".{db.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return retrying(lambda: MlflowClient(tracking_uri=uri), "open the store")
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return retrying(lambda: MlflowClient(tracking_uri=uri), "open the store")


class Tracker:
    """Reads and writes the runs of one suite's experiment."""

    def __init__(self, tracking_uri: str | None = None, artifact_root: Path | None = None):
        self.uri = use_credentials(tracking_uri or default_tracking_uri())  # no password inside
        check_reachable(self.uri)  # seconds, not MLflow's minutes of retries
        self.client = open_client(self.uri)
        self.artifact_root = artifact_root or default_artifact_root(self.uri)
        self._experiments: dict[str, str] = {}

    @property
    def public_uri(self) -> str:
        """The store's address for messages, any password masked."""
        return mask_uri(self.uri)

    def experiment_id(self, suite_key: str, create: bool = True) -> str | None:
        """The experiment's id, created if ``create``, tagged as a model-training experiment
        (``mlflow.experimentKind``, see :mod:`benchmarks.store.mlflow_ui`) whether new or reused. Several runners may open a fresh store at
        once: MLflow's table creation or ``create_experiment`` can then fail in one of them, which
        retries (get-or-create) instead of crashing."""
        if suite_key not in self._experiments:
            found = retrying(lambda: self._get_or_create(suite_key, create), "get or create the experiment")
            if found is None:
                return None
            self._experiments[suite_key] = found
        return self._experiments[suite_key]

    def _get_or_create(self, suite_key: str, create: bool) -> str | None:
        experiment = self.client.get_experiment_by_name(suite_key)
        if experiment is None:
            if not create:
                return None
            location = None
            if self.uri.startswith("sqlite:"):
                self.artifact_root.mkdir(parents=True, exist_ok=True)
                location = self.artifact_root.resolve().as_uri()
            exp_id = self.client.create_experiment(suite_key, artifact_location=location,
                                                   tags={ui.EXPERIMENT_KIND_TAG: ui.TRAINING_KIND})
        else:
            exp_id = experiment.experiment_id
            if experiment.tags.get(ui.EXPERIMENT_KIND_TAG) != ui.TRAINING_KIND:
                self.set_experiment_tag(exp_id, ui.EXPERIMENT_KIND_TAG, ui.TRAINING_KIND)
        return exp_id

    def describe_experiment(self, name: str, description: str, columns: tuple[str, ...], metric: str) -> str:
        """Set experiment ``name``'s saved runs-table view (``columns`` tags and ``metric``, see
        :func:`benchmarks.store.mlflow_ui.saved_view`) and its description, unless someone wrote their own
        (one that does not start like ours, ``**<name>**``); returns its id."""
        exp = self.experiment_id(name)
        current = self.client.get_experiment(exp).tags.get(ui.NOTE_TAG)
        if current is None or current.startswith(f"**{name}**"):
            self.set_experiment_tag(exp, ui.NOTE_TAG, description)
        self.set_experiment_tag(exp, ui.SAVED_VIEW_PREFIX + ui.VIEW_ID, ui.saved_view(columns, metric))
        return exp

    def set_experiment_tag(self, exp: str, key: str, value: str, attempts: int = 4) -> None:
        """``client.set_experiment_tag``, again when another runner inserted the same tag between
        MLflow's read and its insert (a unique-constraint error; the retry updates the row)."""
        for attempt in range(attempts):
            try:
                self.client.set_experiment_tag(exp, key, value)
                return
            except Exception as err:  # noqa: BLE001 - MLflow wraps the store's error in its own types
                text = f"{type(err).__name__} {err}"
                if attempt == attempts - 1 or not ("IntegrityError" in text or "UNIQUE constraint" in text
                                                   or "duplicate key" in text):
                    raise
                time.sleep(0.05 * (attempt + 1))

    def runs(self, suite_key: str, status: str | None = "FINISHED", kind: str = ui.CELL):
        """The runs of a suite's experiment (optionally of one status), newest first: its (cell, seed)
        runs or tuning trials (``kind="cell"``: every run that is no parent), or with ``kind="sweep"``
        (``"study"``) the parent runs of its sweeps (tuning studies); ``kind=None``: all."""
        exp = self.experiment_id(suite_key, create=False)
        if exp is None:
            return []
        query = f"attributes.status = '{status}'" if status else ""
        runs, token = [], None
        while True:
            page = self.client.search_runs([exp], query, max_results=5000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
        if kind is None:
            return runs
        if kind in ui.PARENT_KINDS:
            return [r for r in runs if r.data.tags.get(ui.RUN_KIND_TAG) == kind]
        return [r for r in runs if r.data.tags.get(ui.RUN_KIND_TAG) not in ui.PARENT_KINDS]

    def finished_hashes(self, suite_key: str) -> set[str]:
        return {r.data.tags.get("config_hash") for r in self.runs(suite_key, "FINISHED")}

    run_tags = staticmethod(run_tags)

    def log(self, spec: RunSpec, suite_meta: dict, outcome: dict, git: tuple[str, bool],
            run_id: str | None = None, parent: str | None = None, command: str | None = None) -> str:
        """Record one finished or failed run with its params, metrics, tags and artifacts: into the
        RUNNING run ``run_id`` (a claim, :mod:`benchmarks.store.claims`), else a new run; nested under the
        sweep's ``parent`` run, with ``command`` as its source."""
        tags = self.run_tags(spec, suite_meta, outcome, git, parent, command)
        if run_id is None:
            exp = self.experiment_id(spec.suite)
            run_id = self.client.create_run(exp, start_time=int(outcome["started"] * 1000), tags=tags).info.run_id
        else:
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        self.log_params(run_id, spec)
        self._log_metrics(run_id, outcome)
        self._log_artifacts(run_id, spec, outcome)
        status = "FAILED" if "error" in outcome else "FINISHED"
        self.client.set_terminated(run_id, status=status, end_time=int(outcome["ended"] * 1000))
        return run_id

    def log_params(self, run_id: str, spec: RunSpec) -> None:
        """The run's params: its flattened config (values cut at MLflow's length limit)."""
        params = [Param(k, v[:PARAM_VALUE_LIMIT]) for k, v in flatten(spec.config).items()]
        for start in range(0, len(params), PARAM_BATCH):  # a stage-2 config holds its stage 1's keys too
            self.client.log_batch(run_id, params=params[start:start + PARAM_BATCH])

    def start_sweep(self, suite: Suite, profile: str, command: str, git: tuple[str, bool]) -> str:
        """Open the parent run of one ``pflbench run`` invocation and return its id; its cell runs are
        logged by :meth:`log` with ``parent=`` that id, then :meth:`end_sweep` closes it. Tags
        ``run_kind=sweep``, the suite, profile, command and commit; artifacts the suite file (and
        its tuned-values file, if any). The experiment's description and saved view are (re)set."""
        exp = self.experiment_id(suite.key)
        table = suite.raw.get("table", "")
        tags = {
            ui.RUN_KIND_TAG: ui.SWEEP, "paper": suite.paper, "table": table, "suite": suite.key,
            "profile": profile, "command": command, "git_commit": git[0], "git_dirty": str(git[1]).lower(),
            "mlflow.runName": f"sweep {profile} {time.strftime('%Y-%m-%d %H:%M:%S')}",
            ui.NOTE_TAG: f"{suite.paper}, {table or suite.name} | sweep of profile {profile} | {command}",
            ui.SOURCE_NAME_TAG: command, ui.SOURCE_TYPE_TAG: ui.SOURCE_TYPE,
        }
        run_id = self.client.create_run(exp, tags=tags).info.run_id
        metric = suite.metric
        description = ui.suite_description(suite.key, table or suite.name, metric["key"], metric["label"])
        self.describe_experiment(suite.key, description, ui.SUITE_COLUMNS, metric["key"])
        for path in (suite.path, suite.tuned_path):
            if path.is_file():
                self.client.log_artifact(run_id, str(path), "suite")
        return run_id

    def end_sweep(self, run_id: str, counts: dict[str, int], error: BaseException | None = None) -> None:
        """Close a sweep's parent run with its ``counts`` (metrics and tags ``runs_<name>``):
        FINISHED, FAILED after an ``error``, KILLED after an interrupt (KeyboardInterrupt, SystemExit)."""
        now = int(time.time() * 1000)
        named = {f"runs_{k}": v for k, v in counts.items()}
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in named.items()],
                              tags=[RunTag(k, str(v)) for k, v in named.items()])
        status = "FINISHED" if error is None else "FAILED" if isinstance(error, Exception) else "KILLED"
        self.client.set_terminated(run_id, status=status)

    def log_report(self, run_id: str, paths: list[Path]) -> None:
        """Attach the rendered report files (Markdown, LaTeX, CSV, figures, PDF) to a sweep's parent run."""
        for path in paths:
            if Path(path).is_file():
                self.client.log_artifact(run_id, str(path), "report")

    def _log_metrics(self, run_id: str, outcome: dict) -> None:
        now = int(time.time() * 1000)
        metrics = []
        for row in outcome.get("history", []):
            step = int(row["round"])
            metrics += [Metric(f"round/{k}", float(v), now, step) for k, v in row.items() if k != "round"]
        for k, v in enumerate(outcome.get("curve_mean", [])):
            metrics.append(Metric("curve/acc", float(v), now, k))
        for k, v in enumerate(outcome.get("curve_weighted", [])):
            metrics.append(Metric("curve/acc_weighted", float(v), now, k))
        metrics += [Metric(k, float(v), now, 0) for k, v in outcome.get("metrics", {}).items()]
        before = outcome.get("info", {}).get("wall_s_before_resume") or 0.0  # a resumed run's earlier processes
        metrics.append(Metric("wall_s", float(outcome["ended"] - outcome["started"] + before), now, 0))
        for start in range(0, len(metrics), METRIC_BATCH):
            self.client.log_batch(run_id, metrics=metrics[start:start + METRIC_BATCH])

    def _log_artifacts(self, run_id: str, spec: RunSpec, outcome: dict) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            files = {
                "config.json": spec.config,
                "clients.json": outcome.get("clients", []),
                "run_info.json": {**outcome.get("info", {}), "error": outcome.get("error")},
            }
            for name, content in files.items():
                path = Path(tmp) / name
                path.write_text(json.dumps(content, indent=1, default=str))
                self.client.log_artifact(run_id, str(path))
            for name, arrays in outcome.get("arrays", {}).items():  # post-run analyses (pfl_core.analysis)
                path = Path(tmp) / f"{name}.npz"
                np.savez_compressed(path, **arrays)
                self.client.log_artifact(run_id, str(path))
            if outcome.get("state") is not None:  # a stage-1 run: logged before the run is FINISHED
                path = Path(tmp) / STATE_FILE
                torch.save(outcome["state"], path)
                self.client.log_artifact(run_id, str(path), STATE_DIR)


def read_json_artifact(client: MlflowClient, run_id: str, name: str):
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(client.download_artifacts(run_id, name, tmp)).read_text())


def read_npz_artifact(client: MlflowClient, run_id: str, name: str) -> dict | None:
    """The arrays of a run's ``<name>.npz`` artifact (a post-run analysis), None if it has none."""
    if not any(f.path == f"{name}.npz" for f in client.list_artifacts(run_id)):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        with np.load(client.download_artifacts(run_id, f"{name}.npz", tmp)) as data:
            return {k: data[k] for k in data.files}

