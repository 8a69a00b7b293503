"""One suite's profiles side by side: per cell the paper's number and, per profile, ours with its
verdict; per profile a conclusion line (does the paper's best method hold in each column, and
Kendall's tau of the orderings), the compute its runs took and, where a profile takes tuned
values, which.

A profile's cell is the runs whose config hash its expansion gives, from any of the snapshots (as
every report reads them, :func:`benchmarks.reporting.collect.collect_runs`): a cell the profile does
not change is the first profile's runs (``paper``, by custom), and the table says so (``=``). Each profile is aggregated
and judged by its own metric (``pfedme_code``: the maximum over rounds).

    python -m benchmarks.reporting.profiles_side suites/cgpfl/table1.yaml \
        reports/reproduced/cgpfl/table1.snapshot.json reports/reproduced/cgpfl/table1.profiles.snapshot.json \
        --profile paper --profile pfedme_code --profile tuned --out reports/reproduced/cgpfl/table1_profiles.md
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from benchmarks.reporting.snapshot import SnapshotTracker
from benchmarks.reporting.table import SuiteReport, build_suite_report
from benchmarks.reporting.text import fmt
from benchmarks.suite.spec import Suite, cell_id, load_suite


@dataclass
class ProfileColumn:
    """One profile's report over the union of the snapshots, and what it shares with ``paper``."""

    name: str
    report: SuiteReport
    same_as_first: set[str] = field(default_factory=set)
    """Cell ids whose runs are the first profile's (same config hashes); empty for the first."""
    compute_s: float = 0.0
    """Seconds of compute of the runs this profile adds (a lockstep group's wall-clock counted once)."""
    tuned: dict[str, dict] = field(default_factory=dict)
    """Cell id -> the tuned values and their provenance, for cells that take them."""
    untuned: set[str] = field(default_factory=set)
    """Cell ids of a method the suite tunes but without a study for this profile yet, in a profile
    that has studies: not the profile's cell yet (shown, not judged)."""


def union(paths: list[Path]) -> SnapshotTracker:
    """The runs of several snapshots of one suite, as one tracker (a run id once)."""
    trackers = [SnapshotTracker.load(p) for p in paths]
    keys = {t.suite_key for t in trackers}
    if len(keys) != 1:
        raise SystemExit(f"snapshots of different suites: {sorted(keys)}")
    records, seen = [], set()
    for tracker in trackers:
        for record in tracker.records:
            if record["run_id"] not in seen:
                seen.add(record["run_id"])
                records.append(record)
    return SnapshotTracker(keys.pop(), {}, records)


def _hashes(specs: list) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for spec in specs:
        out.setdefault(spec.cell_id, set()).add(spec.config_hash)
    return out


def build(suite: Suite, tracker: SnapshotTracker, profiles: list[str]) -> list[ProfileColumn]:
    first = _hashes(suite.expand(profiles[0]))
    by_id = {r["run_id"]: r for r in tracker.records}
    columns = []
    for name in profiles:
        report = build_suite_report(suite, tracker, name)
        specs = suite.expand(name)
        hashes = _hashes(specs)
        column = ProfileColumn(name, report, {c for c, h in hashes.items() if name != profiles[0] and h == first.get(c)})
        own = report.runs[~report.runs["cell"].isin(column.same_as_first)] if not report.runs.empty else report.runs
        for run_id in own.get("run_id", []):
            record = by_id[run_id]
            column.compute_s += record["metrics"].get("wall_s", 0.0) / max(1, int(record["tags"].get("lockstep_runs") or 1))
        for spec in specs:
            if spec.tuned:
                column.tuned.setdefault(spec.cell_id, spec.tuned)
        if column.tuned:
            column.untuned = {s.cell_id for s in specs if suite.uses_tuned(s.method) and s.cell_id not in column.tuned}
        columns.append(column)
    return columns


def _cell(row: pd.Series | None, same: bool, untuned: bool = False) -> list[str]:
    if row is None or not row["n_seeds"]:
        return ["not run", ""]
    if untuned:
        return [fmt(row["mean"], row["pm"]) + (" =" if same else "") + " (no study yet)", ""]
    value = fmt(row["mean"], row["pm"]) + (" =" if same else "") + (" †" if row.get("tuned") else "")
    seeds = f" ({int(row['n_seeds'])}/{int(row['expected_seeds'])})" if row["n_seeds"] < row["expected_seeds"] else ""
    return [value + seeds, str(row.get("label") or row.get("verdict") or "")]


def missing_methods(column: ProfileColumn) -> dict[str, tuple[list[str], int]]:
    """Report column label -> (the methods with a published number but no finished run there, or
    no study yet, how many methods have a published number there), for columns missing some."""
    report, out = column.report, {}
    method = report.method_axis
    others = [a for a in report.axes if a != method]
    for _, row in report.table.iterrows():
        if not pd.isna(row["published_mean"]):
            missing, total = out.setdefault(", ".join(f"{row[a]}" for a in others), ([], [0]))
            total[0] += 1
            if not row["n_seeds"]:
                missing.append(row[method])
            elif cell_id({a: row[a] for a in report.axes}) in column.untuned:
                missing.append(f"{row[method]} (no study)")
    return {label: (missing, total[0]) for label, (missing, total) in out.items() if missing}


def conclusion_line(column: ProfileColumn) -> str:
    """Per profile: in how many complete columns the paper's best method is ours too, and the mean
    tau; a column where some method has no run is named, not judged."""
    missing = missing_methods(column)
    found = [c for c in column.report.conclusions if c.column not in missing]
    partial = [f"{label} (no run)" if len(methods) == total else f"{label} (missing: {', '.join(methods)})"
               for label, (methods, total) in missing.items()]
    skipped = f" Not judged: {'; '.join(partial)}." if partial else ""
    if not found:
        return f"- **{column.name}**: no column has every method run.{skipped}"
    holds = [c for c in found if c.best_holds]
    taus = [c.tau for c in found if not math.isnan(c.tau)]
    parts = "; ".join(f"{c.column}: best {c.best_ours} (paper {c.best_paper}), tau "
                      + ("n/a" if math.isnan(c.tau) else f"{c.tau:+.2f}") for c in found)
    verdict = "holds" if len(holds) == len(found) else ("holds in part" if holds else "does not hold")
    mean_tau = f", mean tau {sum(taus) / len(taus):+.2f}" if taus else ""
    return (f"- **{column.name}**: the paper's ranking {verdict} (its best method is ours in {len(holds)} of "
            f"{len(found)} columns{mean_tau}). {parts}.{skipped}")


def markdown(suite: Suite, columns: list[ProfileColumn]) -> str:
    axes = [a for a in columns[0].report.axes]
    tables = {c.name: {tuple(r[a] for a in axes): r for _, r in c.report.table.iterrows()} for c in columns}
    keys = list(tables[columns[0].name])
    head = ["| " + " | ".join(axes) + " | published | " + " | ".join(f"{c.name} | verdict" for c in columns) + " |",
            "|" + " --- |" * (len(axes) + 1 + 2 * len(columns))]
    rows = []
    for key in keys:
        first = tables[columns[0].name][key]
        published = fmt(first["published_mean"], first["published_pm"]) if not pd.isna(first["published_mean"]) else ""
        cid, cells = cell_id(dict(zip(axes, key))), []
        for c in columns:
            cells += _cell(tables[c.name].get(key), cid in c.same_as_first, cid in c.untuned)
        rows.append("| " + " | ".join([*map(str, key), published, *cells]) + " |")
    metrics = "; ".join(f"`{c.name}`: {c.report.metric.aggregate} of `{c.report.metric.key}`" for c in columns)
    lines = [f"# {suite.raw.get('table', suite.key)} ({suite.key}): profiles side by side", "",
             f"Each profile aggregated and judged by its own metric ({metrics}); mean ± spread over seeds, "
             "the seeds finished shown where fewer than the profile's. `=`: the profile does not change this "
             f"cell, so these are the `{columns[0].name}` profile's runs; †: tuned values (below); no study yet: a "
             "method the profile tunes, not tuned in this cell yet (its untuned run shown, not judged); not run: no "
             "finished run in the snapshots.", "", *head, *rows, "", "## Does the paper's ranking hold?", ""]
    lines += [conclusion_line(c) for c in columns]
    lines += ["", "## Compute", ""]
    for c in columns:
        own = len(c.report.runs) - int(c.report.runs["cell"].isin(c.same_as_first).sum()) if not c.report.runs.empty else 0
        studies = sum(float(t.get("trial_seconds") or 0.0) for t in c.tuned.values())
        tuning = (f", and {studies / 3600:.2f} h of its {len(c.tuned)} tuning studies' trials (the tuned file's "
                  "trial_seconds)") if c.tuned else ""
        lines.append(f"- **{c.name}**: {c.compute_s / 3600:.2f} CPU-h of runs of its own ({own} runs; a lockstep "
                     f"group counted once){tuning}")
    tuned = [(c.name, cell, t) for c in columns for cell, t in c.tuned.items()]
    if tuned:
        lines += ["", "## Tuned values", ""]
        for name, cell, t in tuned:
            params = ", ".join(f"`{k}` = {v:.4g}" if isinstance(v, float) else f"`{k}` = {v}" for k, v in t["params"].items())
            trials = t.get("trials") or {}
            lines.append(f"- {name}, {cell}: {params} (study trial {t.get('trial')} of {t.get('n_trials')}: "
                         f"{trials.get('complete', '?')} complete, {trials.get('pruned', '?')} pruned; validation "
                         f"{t.get('metric')} {t.get('value', math.nan):.4f}, tuning seeds {t.get('tuning_seeds')})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reporting.profiles_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", help="the suite file")
    parser.add_argument("snapshots", nargs="+", help="snapshot files of the suite (their runs are pooled)")
    parser.add_argument("--profile", action="append", required=True, help="a profile to show (in order; repeat)")
    parser.add_argument("--out", required=True, help="the Markdown file to write")
    args = parser.parse_args(argv)
    suite = load_suite(args.suite)
    columns = build(suite, union([Path(p) for p in args.snapshots]), args.profile)
    Path(args.out).write_text(markdown(suite, columns))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
