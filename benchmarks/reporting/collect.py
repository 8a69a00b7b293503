"""Read a suite's runs from the MLflow store: one row per run, with the histories the metric needs.

Runs are selected by config hash, not by tag: a run of an older version of the suite (edited since)
is left out, and a run shared with another profile (same resolved config, skipped by the runner) is
counted. A run re-executed after a failure appears twice; the newest per config hash is kept. A run
copied from another suite of the store (:mod:`benchmarks.store.reuse`) carries its source run and
experiment (``reused_from``, ``reused_from_experiment``; empty for a run computed here). A kept
FINISHED run with an artifact cut short on disk is refused (:mod:`benchmarks.store.artifact_faults`).
"""
from __future__ import annotations

import math

import pandas as pd

from benchmarks.store.artifact_faults import refuse_damaged
from benchmarks.reporting.metric import MetricSpec
from benchmarks.store.reuse import SOURCE_EXPERIMENT, SOURCE_RUN
from benchmarks.suite.spec import RunSpec, Suite
from benchmarks.store.tracking import DATA_PROVENANCE_TAG, Tracker

#: the run metric of a method's pretraining stage (:meth:`pfl_core.algorithms.base.Algorithm.pretraining_rounds`):
#: best-validation selection skips the evaluations up to that round
PRETRAINING_ROUNDS = "pretraining_rounds"

COLUMNS = ["cell", "seed", "status", "value", "also", "failure_reason", "offline_data", "data_provenance", "config_hash",
           "end_time", "wall_s", "git_commit", "git_dirty", "device", "run_id", "histories", "short_train_clients",
           "reused_from", "reused_from_experiment"]


def history(tracker: Tracker, run_id: str, key: str) -> dict[int, float]:
    """{step: value} of one logged metric history (the last value per step)."""
    return {m.step: m.value for m in sorted(tracker.client.get_metric_history(run_id, key),
                                            key=lambda m: m.timestamp)}


def run_value(metric: MetricSpec, final: dict[str, float], histories: dict[str, dict[int, float]],
              aggregate: str | None = None) -> float:
    """One run's number in the metric's unit, by ``aggregate`` (default ``metric.aggregate``; NaN
    if it was not logged)."""
    from benchmarks.reporting.stats import best_val_round, per_seed_last3

    aggregate = aggregate or metric.aggregate
    if aggregate == "max_over_rounds":
        rounds = histories.get(metric.round_key) or {}
        raw = max(rounds.values()) if rounds else math.nan
    elif aggregate == "last3_of_seed_mean_curve":
        curve = histories.get(metric.curve_metric) or {}
        raw = per_seed_last3([curve[k] for k in sorted(curve)]) if curve else math.nan
    elif aggregate == "best_val_round":
        pick = best_val_round(histories.get(metric.select_metric) or {}, histories.get(metric.key) or {},
                              after=int(final.get(PRETRAINING_ROUNDS, 0)))
        raw = math.nan if pick is None else pick.test
    else:
        raw = final.get(metric.key, math.nan)
    return raw * metric.scale


def collect_runs(suite: Suite, tracker: Tracker, profile: str, metric: MetricSpec,
                 extra_histories: tuple[str, ...] = (), specs: list[RunSpec] | None = None) -> pd.DataFrame:
    """One row per run of the suite's current ``profile`` expansion (see module docstring)."""
    specs = suite.expand(profile) if specs is None else specs
    wanted: dict[str, RunSpec] = {spec.config_hash: spec for spec in specs}
    keys = list(dict.fromkeys([*metric.history_keys, *extra_histories]))
    rows, finished_runs = [], {}
    for run in tracker.runs(suite.key, status=None):
        tags = run.data.tags
        spec = wanted.get(tags.get("config_hash"))
        if spec is None:
            continue
        finished = run.info.status == "FINISHED"
        if finished:
            finished_runs[run.info.run_id] = run
        hists = {k: history(tracker, run.info.run_id, k) for k in keys} if finished else {}
        rows.append({
            "cell": spec.cell_id, "seed": spec.seed, "status": run.info.status,
            "value": run_value(metric, run.data.metrics, hists) if finished else math.nan,
            "also": {a: run_value(metric, run.data.metrics, hists, a) if finished else math.nan for a in metric.also},
            "failure_reason": tags.get("failure_reason", ""),
            "offline_data": tags.get("offline_data") == "true",
            "data_provenance": tags.get(DATA_PROVENANCE_TAG, ""),
            "config_hash": spec.config_hash, "end_time": run.info.end_time or 0,
            "wall_s": run.data.metrics.get("wall_s", math.nan),
            "git_commit": tags.get("git_commit", "unknown"), "git_dirty": tags.get("git_dirty") == "true",
            "device": tags.get("device", ""), "run_id": run.info.run_id, "histories": hists,
            "short_train_clients": run.data.metrics.get("short_train_clients", math.nan),
            "reused_from": tags.get(SOURCE_RUN, ""), "reused_from_experiment": tags.get(SOURCE_EXPERIMENT, ""),
        })
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame = frame.sort_values("end_time").drop_duplicates(["config_hash"], keep="last").reset_index(drop=True)
    refuse_damaged([finished_runs[i] for i in frame["run_id"] if i in finished_runs], suite.path, profile)
    return frame
