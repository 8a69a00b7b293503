"""Reuse across suites (issue 25, item 3): a configuration is computed once per store.

A pending run whose config hash already FINISHED in *another* suite's experiment of the same store
(FedL2P's Table 6 and figure suites re-train Table 3 runs, CAFeMe's figures repeat Table 1 cells)
is not recomputed: the newest such run is copied into this suite's experiment, as a run claimed
like any other (:mod:`benchmarks.store.claims`), so the suite's report finds it by its config hash like
its own runs. The copy holds

* this suite's identity tags (suite, cell, ``cell.*``, profile, tuned, parent sweep, command) and
  this suite's flattened config as params (the same configuration: same hash);
* the source's computation: every metric history (steps and timestamps), every artifact, its
  ``run_info.json``-derived tags (device, digests, execution, threads, stage 1) and its
  ``git_commit``/``git_dirty``; ``wall_s`` stays the source's compute time;
* provenance tags :data:`SOURCE_RUN`, :data:`SOURCE_EXPERIMENT` (the source suite's key) and
  :data:`SOURCE_EXPERIMENT_ID`, plus ``reused=true``. A copy of a copy names the original run.

Stage-1 runs (tag ``stage``, :mod:`benchmarks.running.stages`) and sweep parent runs are never sources.
``pflbench run --no-reuse`` computes everything again. A copy that fails half-way is marked FAILED
(``failure_reason``) and its configuration computed instead.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Callable

from mlflow.entities import Metric, RunTag

from benchmarks.store import mlflow_ui as ui
from benchmarks.store.artifact_faults import damaged_artifacts
from benchmarks.store.claims import ClaimBook
from benchmarks.suite.spec import RunSpec
from benchmarks.store.tracking import METRIC_BATCH, Tracker

REUSED_TAG = "reused"
SOURCE_RUN, SOURCE_EXPERIMENT, SOURCE_EXPERIMENT_ID = (
    "reused_from.run_id", "reused_from.experiment", "reused_from.experiment_id")
PROVENANCE = (SOURCE_RUN, SOURCE_EXPERIMENT, SOURCE_EXPERIMENT_ID)
DROPPED_PREFIXES = ("claim.", "cell.", "tuned.", "mlflow.")
"""Source tags that describe the source suite's claim, cell, tuning or MLflow view, not the computation."""


def other_experiments(tracker: Tracker, suite_key: str) -> dict[str, str]:
    """Id -> name of every active experiment of the store but ``suite_key``'s."""
    found, token = {}, None
    while True:
        page = tracker.client.search_experiments(max_results=1000, page_token=token)
        found.update({e.experiment_id: e.name for e in page if e.name != suite_key})
        token = page.token
        if not token:
            return found


def find_sources(tracker: Tracker, specs: list[RunSpec], suite_key: str) -> dict[str, object]:
    """Config hash -> the run to reuse for it: among the FINISHED cell runs of that hash in other
    experiments, an original before a copy, then the newest."""
    experiments = other_experiments(tracker, suite_key)
    if not experiments or not specs:
        return {}
    sources = {}
    for spec in specs:
        runs = tracker.client.search_runs(
            list(experiments), f"tags.config_hash = '{spec.config_hash}' and attributes.status = 'FINISHED'",
            order_by=["attributes.end_time DESC"], max_results=100)
        usable = [r for r in runs if not r.data.tags.get("stage") and r.data.tags.get(ui.RUN_KIND_TAG) != ui.SWEEP
                  and not damaged_artifacts(r)]  # a source with an artifact cut short is not copied
        usable.sort(key=lambda r: SOURCE_RUN in r.data.tags)  # stable: originals first, newest first within
        if usable:
            sources[spec.config_hash] = usable[0]
    return sources


def provenance(source, experiment_name: str) -> dict[str, str]:
    """The provenance tags of a copy of ``source``: the original run (a copy of a copy keeps it)."""
    tags = source.data.tags
    if SOURCE_RUN in tags:
        return {key: tags[key] for key in PROVENANCE if key in tags}
    return {SOURCE_RUN: source.info.run_id, SOURCE_EXPERIMENT: experiment_name,
            SOURCE_EXPERIMENT_ID: source.info.experiment_id}


def copy_tags(tracker: Tracker, spec: RunSpec, meta: dict, source, info: dict, experiment_name: str,
              parent: str | None, command: str | None) -> dict[str, str]:
    """This suite's tags of the run, the computation's tags of ``source`` (its ``info``, commit and
    any other tag it carries) and the provenance."""
    src = source.data.tags
    git = (src.get("git_commit", "unknown"), src.get("git_dirty", "true") == "true")
    ours = tracker.run_tags(spec, meta, {"info": info}, git, parent, command)
    kept = {k: v for k, v in src.items() if not k.startswith(DROPPED_PREFIXES) and k not in ours}
    return {**kept, **ours, **provenance(source, experiment_name), REUSED_TAG: "true"}


def copy_run(tracker: Tracker, spec: RunSpec, meta: dict, source, experiment_name: str, run_id: str,
             parent: str | None, command: str | None) -> None:
    """Fill the claimed RUNNING run ``run_id`` with ``source``'s results and mark it FINISHED."""
    client = tracker.client
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(client.download_artifacts(source.info.run_id, "", tmp))
        info_path = folder / "run_info.json"
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        tags = copy_tags(tracker, spec, meta, source, info, experiment_name, parent, command)
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        tracker.log_params(run_id, spec)
        metrics = [Metric(m.key, m.value, m.timestamp, m.step) for key in source.data.metrics
                   for m in client.get_metric_history(source.info.run_id, key)]
        for start in range(0, len(metrics), METRIC_BATCH):
            client.log_batch(run_id, metrics=metrics[start:start + METRIC_BATCH])
        if any(folder.iterdir()):
            client.log_artifacts(run_id, str(folder))
    client.set_terminated(run_id, status="FINISHED", end_time=int(time.time() * 1000))


def reuse_finished(todo: list[RunSpec], tracker: Tracker, claims: ClaimBook, meta: dict, git: tuple[str, bool],
                   parent: str | None, command: str | None, echo: Callable = print) -> tuple[list[RunSpec], int, int]:
    """Copy every spec of ``todo`` that another suite of the store finished; return (the specs still
    to compute, how many were reused, how many another runner claimed meanwhile)."""
    sources = find_sources(tracker, todo, claims.suite_key)
    if not sources:
        return todo, 0, 0
    names = other_experiments(tracker, claims.suite_key)
    left, reused, elsewhere = [], 0, 0
    for spec in todo:
        source = sources.get(spec.config_hash)
        if source is None:
            left.append(spec)
            continue
        run_id = claims.claim(spec.config_hash, tracker.run_tags(spec, meta, {}, git, parent, command))
        if run_id is None:
            elsewhere += 1
            continue
        try:
            copy_run(tracker, spec, meta, source, names.get(source.info.experiment_id, ""), run_id, parent, command)
            reused += 1
        except Exception as err:  # noqa: BLE001 - the store hiccuped or an artifact is gone: compute it instead
            tracker.client.set_tag(run_id, "failure_reason", f"reuse of run {source.info.run_id} failed: "
                                                             f"{type(err).__name__}: {err}; computed instead")
            tracker.client.set_terminated(run_id, status="FAILED")
            left.append(spec)
        finally:
            claims.done(run_id)
    if reused:
        echo(f"{claims.suite_key}: {reused} run(s) FINISHED in other suites of this store (same config hash) "
             f"reused with their provenance (tags {SOURCE_RUN}, {SOURCE_EXPERIMENT}), not recomputed")
    return left, reused, elsewhere
