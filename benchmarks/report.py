"""A first report: per cell, our mean +- spread over seeds beside the published value.

Reads the FINISHED runs of one suite and profile from MLflow and writes
``reports/<paper>/<name>.md`` and ``.csv``. The tabulated metric, its scale and the paper's
convention for +- (std or SEM, ddof) come from the suite's ``metric`` section.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from benchmarks.suite import Suite, cell_id
from benchmarks.tracking import Tracker

REPORTS_DIR = Path("reports")


def collect_runs(suite: Suite, tracker: Tracker, profile: str) -> pd.DataFrame:
    """One row per run of the suite's current ``profile`` expansion: cell, seed, status, metric.

    Runs are selected by config hash, not by tag: a run of an older version of the suite (edited
    since) is left out, and a run shared with another profile (same resolved config, so skipped by
    the runner) is counted.
    """
    metric = suite.metric
    wanted = {spec.config_hash: spec for spec in suite.expand(profile)}
    rows = []
    for run in tracker.runs(suite.key, status=None):
        tags = run.data.tags
        spec = wanted.get(tags.get("config_hash"))
        if spec is None:
            continue
        value = run.data.metrics.get(metric["key"])
        rows.append({
            "cell": spec.cell_id, "seed": spec.seed, "status": run.info.status,
            "value": None if value is None else value * metric["scale"],
            "failure_reason": tags.get("failure_reason", ""),
            "offline_data": tags.get("offline_data") == "true",
            "config_hash": spec.config_hash, "end_time": run.info.end_time or 0,
        })
    frame = pd.DataFrame(rows, columns=["cell", "seed", "status", "value", "failure_reason",
                                        "offline_data", "config_hash", "end_time"])
    # a run re-executed after a failure appears twice: keep the newest per config hash
    return frame.sort_values("end_time").drop_duplicates(["config_hash"], keep="last")


def spread(values: pd.Series, kind: str, ddof: int) -> float:
    """The paper's +- convention applied to our seeds: std or SEM with the given ddof
    (NaN for fewer than two seeds: one seed has no spread)."""
    n = len(values)
    if n < 2 or kind == "none" or n - ddof <= 0:
        return math.nan
    std = float(values.std(ddof=ddof))
    return std / math.sqrt(n) if kind == "sem" else std


def summarise(suite: Suite, runs: pd.DataFrame, expected_seeds: int) -> pd.DataFrame:
    """Per cell: mean, std (ddof=1), the paper-convention spread, seeds finished, published value."""
    metric = suite.metric
    published = {cell_id(p["cell"]): p for p in suite.published}
    rows = []
    for cell in suite.cells():
        key = cell_id(cell)
        mine = runs[runs["cell"] == key] if not runs.empty else runs
        done = mine[mine["status"] == "FINISHED"]["value"].dropna()
        failed = mine[mine["status"] == "FAILED"]
        pub = published.get(key, {})
        mean = float(done.mean()) if len(done) else math.nan
        rows.append({
            **cell,
            "n_seeds": len(done), "expected_seeds": expected_seeds, "failed": len(failed),
            "mean": mean,
            "std": float(done.std(ddof=1)) if len(done) > 1 else math.nan,
            "pm": spread(done, metric["pm"], int(metric["ddof"])),
            "published_mean": pub.get("mean", math.nan),
            "published_pm": pub.get("pm", math.nan),
            "published_pm_kind": pub.get("pm_kind", ""),
            "published_source": pub.get("source", ""),
            "diff": mean - pub["mean"] if "mean" in pub and len(done) else math.nan,
            "failure_reason": "; ".join(sorted(set(failed["failure_reason"]))),
        })
    return pd.DataFrame(rows)


def _fmt(mean: float, pm: float) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "—"
    return f"{mean:.2f}" if pm is None or math.isnan(pm) else f"{mean:.2f} ± {pm:.2f}"


def render_markdown(suite: Suite, table: pd.DataFrame, profile: str, offline: bool) -> str:
    metric = suite.metric
    axes = [a.name for a in suite.axes]
    lines = [f"# {suite.raw.get('table', suite.name)} ({suite.key})", ""]
    if suite.raw.get("caption"):
        lines += [suite.raw["caption"].strip(), ""]
    if profile != "paper" or offline:
        why = []
        if profile != "paper":
            why.append(f"it was run with the `{profile}` profile, not the published setup")
        if offline:
            why.append("it ran on offline data (generated or bundled), not the paper's dataset")
        lines += [f"> **Not comparable with the paper:** {'; '.join(why)}.", ""]
    lines += [
        f"Metric: `{metric['key']}` ({metric['label']}), x{metric['scale']:g}. "
        f"Ours: mean ± {metric['pm']} (ddof={metric['ddof']}) over seeds. {metric['averaging']}",
        "",
        "| " + " | ".join(axes + ["seeds", "ours", "paper", "diff"]) + " |",
        "|" + "---|" * (len(axes) + 4),
    ]
    for _, row in table.iterrows():
        seeds = f"{row['n_seeds']}/{row['expected_seeds']}" + (f" ({row['failed']} failed)" if row["failed"] else "")
        diff = "—" if math.isnan(row["diff"]) else f"{row['diff']:+.2f}"
        cells = [str(row[a]) for a in axes] + [seeds, _fmt(row["mean"], row["pm"]),
                                               _fmt(row["published_mean"], row["published_pm"]), diff]
        lines.append("| " + " | ".join(cells) + " |")
    failures = table[table["failure_reason"] != ""]
    if not failures.empty:
        lines += ["", "Failed runs:", ""]
        lines += [f"- {'/'.join(str(r[a]) for a in axes)}: {r['failure_reason']}" for _, r in failures.iterrows()]
    return "\n".join(lines) + "\n"


def write_report(suite: Suite, tracker: Tracker, profile: str = "paper",
                 out_dir: Path = REPORTS_DIR) -> tuple[Path, Path, pd.DataFrame]:
    """Write ``<out_dir>/<paper>/<name>.md`` and ``.csv``; return their paths and the table."""
    runs = collect_runs(suite, tracker, profile)
    expected = len(suite.expand(profile)) // max(len(suite.cells()), 1)
    table = summarise(suite, runs, expected)
    offline = bool(runs["offline_data"].any()) if not runs.empty else False
    folder = out_dir / suite.paper
    folder.mkdir(parents=True, exist_ok=True)
    md, csv = folder / f"{suite.name}.md", folder / f"{suite.name}.csv"
    md.write_text(render_markdown(suite, table, profile, offline))
    table.assign(profile=profile, metric=suite.metric["key"]).to_csv(csv, index=False)
    return md, csv, table
