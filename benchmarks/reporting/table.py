"""Per cell: our statistic computed the paper's way, the published value, the authors' code's value
(when the suite has one), a verdict against each, the plain-words label, switches.

A table row is a flat dict; each reference contributes its own group of columns (``published_*``,
``code_*``), so a new per-cell quantity is one more group merged in :func:`summarise` and one more
:class:`benchmarks.reporting.text.Column`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from benchmarks.reporting import extras, fidelity, personalization, qualitative
from benchmarks.reporting.collect import collect_runs
from benchmarks.reporting.conclusions import Conclusion, column_conclusion
from benchmarks.reporting.metric import MetricSpec, metric_spec
from benchmarks.reporting.stats import last3_of_seed_mean_curve, sem, spread
from benchmarks.reporting.verdict import Verdict, decide, label, paper_sem
from benchmarks.suite.spec import RunSpec, Suite, cell_id
from benchmarks.store.tracking import Tracker


@dataclass
class SuiteReport:
    """Everything rendered about one suite and profile."""

    suite: Suite
    metric: MetricSpec
    profile: str
    runs: pd.DataFrame
    table: pd.DataFrame
    expected_seeds: int
    offline: bool
    conclusions: list[Conclusion] = field(default_factory=list)
    panels: dict = field(default_factory=dict)
    """cell -> the arrays of a qualitative figure (``metric.figure`` tsne or dlg; :mod:`.qualitative`), or
    cell -> {seed: personalization arrays} (FedL2P's forms; :mod:`.personalization`)."""

    @property
    def comparable(self) -> bool:
        return self.profile == "paper" and not self.offline

    @property
    def axes(self) -> list[str]:
        return [a.name for a in self.suite.axes]

    @property
    def method_axis(self) -> str | None:
        return method_axis(self.suite)

    @property
    def column_axes(self) -> list[str]:
        return [a for a in self.axes if a != self.method_axis]

    @property
    def has_code_reference(self) -> bool:
        """Whether any cell has values from a re-run of the authors' code (issue 17)."""
        return bool(self.suite.code_references)


def method_axis(suite: Suite) -> str | None:
    """The grid axis that names the method: called ``method`` or setting ``method.name``."""
    for axis in suite.axes:
        if axis.name == "method" or all("method.name" in s for s in axis.settings):
            return axis.name
    return None


def column_label(row, axes: list[str]) -> str:
    return " / ".join(str(row[a]) for a in axes) if axes else "all"


def cell_statistics(metric: MetricSpec, done: pd.DataFrame) -> dict:
    """mean, std (ddof 1), SEM and the paper-convention pm of the finished runs of one cell."""
    values = done["value"].dropna().to_numpy(dtype=float)
    stats = {"mean": float(values.mean()) if len(values) else math.nan,
             "std": float(np.std(values, ddof=1)) if len(values) > 1 else math.nan,
             "sem": sem(values), "pm": spread(values, metric.pm, metric.ddof)}
    curves = []
    if metric.aggregate == "last3_of_seed_mean_curve" and len(done):
        curves = [[h[k] for k in sorted(h)] for h in (r.get(metric.curve_metric) or {} for r in done["histories"])]
        curves = [[v * metric.scale for v in c] for c in curves if c]
        stats["mean"], stats["pm"] = last3_of_seed_mean_curve(curves, metric.pm, metric.ddof)
    return {**stats, **extras.literal_statistics(metric, curves), "short_train_clients": extras.short_clients_text(done)}


def summarise(suite: Suite, runs: pd.DataFrame, metric: MetricSpec, expected: int,
              specs: list[RunSpec]) -> pd.DataFrame:
    """One row per cell of the grid (see the module docstring); ``specs``: the profile's runs."""
    published = {cell_id(p["cell"]): p for p in suite.published}
    configs, tuned = {}, {}
    for spec in specs:
        configs.setdefault(spec.cell_id, spec.config)
        if spec.tuned:
            tuned.setdefault(spec.cell_id, spec.tuned)
    rows = []
    for cell in suite.cells():
        key = cell_id(cell)
        mine = runs[runs["cell"] == key]
        done = mine[(mine["status"] == "FINISHED") & mine["value"].notna()]
        failed = mine[mine["status"] == "FAILED"]
        reasons = "; ".join(sorted(set(failed["failure_reason"])))
        stats = cell_statistics(metric, done)
        for agg in metric.also:  # one more mean and spread per extra aggregate
            extra = cell_statistics(replace(metric, aggregate=agg), done.assign(value=[a[agg] for a in done["also"]]))
            stats.update({f"mean_{agg}": extra["mean"], f"pm_{agg}": extra["pm"]})
        pub = published.get(key, {})
        se_pub = paper_sem(pub.get("pm"), pub.get("pm_kind"), pub.get("runs"), metric.ddof)

        def against(reference: float | None, se_reference: float) -> Verdict:
            return decide(finished=len(done), expected=expected, failed=len(failed), ours=stats["mean"],
                          se_ours=stats["sem"], paper=reference, se_paper=se_reference,
                          tolerance=metric.tolerance, failure_reason=reasons)

        v = against(pub.get("mean"), se_pub)
        code_ref = suite.code_references.get(key)
        code, code_verdict = code_fields(metric, code_ref, against)
        rows.append({
            **cell, "n_seeds": len(done), "expected_seeds": expected, "failed": len(failed), **stats,
            "published_mean": pub.get("mean", math.nan), "published_pm": pub.get("pm", math.nan),
            "published_pm_kind": pub.get("pm_kind", ""), "published_runs": pub.get("runs", math.nan),
            "published_sem": se_pub, "published_source": pub.get("source", ""),
            "diff": stats["mean"] - pub["mean"] if "mean" in pub and len(done) else math.nan,
            "bound": v.bound, "rule": v.rule, "verdict": v.verdict, "verdict_detail": v.detail,
            "failure_reason": reasons,
            "switches": "; ".join(fidelity.switches(configs[key])) if key in configs else "",
            "tuned": key in tuned,
            "tuned_source": (f"study {tuned[key].get('study', '?')}, trial {tuned[key].get('trial', '?')}"
                             if key in tuned else ""),
            "marks": " ".join(dict.fromkeys(mark for mark, _ in suite.marks(cell))),
            **code, "label": label(v, code_verdict),
        })
    return pd.DataFrame(rows)


CODE_COLUMNS = ("code_mean", "code_pm", "code_sem", "code_seeds", "code_source", "code_diff", "code_bound",
                "code_rule", "code_verdict", "code_verdict_detail")


def code_fields(metric: MetricSpec, ref, against) -> tuple[dict, Verdict | None]:
    """The ``code_*`` columns of one cell: the authors' code's values (mean, the paper-convention
    spread, SEM with ddof 1, number of seeds, source) and our verdict against them by the same rule
    as against the paper (``against(mean, se)``); with that verdict (None without a reference)."""
    if ref is None:
        return {**dict.fromkeys(CODE_COLUMNS, math.nan), "code_source": "", "code_rule": "",
                "code_verdict": "", "code_verdict_detail": ""}, None
    v = against(ref.mean, sem(ref.values))
    return {"code_mean": ref.mean, "code_pm": spread(ref.values, metric.pm, metric.ddof),
            "code_sem": sem(ref.values), "code_seeds": len(ref.values), "code_source": ref.short,
            "code_diff": v.diff, "code_bound": v.bound, "code_rule": v.rule, "code_verdict": v.verdict,
            "code_verdict_detail": v.detail}, v


def conclusions(report_axes: list[str], method: str | None, table: pd.DataFrame,
                higher_is_better: bool = True) -> list[Conclusion]:
    """Per column (combination of the non-method axes): best method and Kendall's tau."""
    if method is None or table.empty:
        return []
    columns = [a for a in report_axes if a != method]
    out = []
    groups = table.groupby(columns, sort=False) if columns else [((), table)]
    for _, group in groups:
        label = column_label(group.iloc[0], columns)
        ours = dict(zip(group[method], group["mean"]))
        paper = dict(zip(group[method], group["published_mean"]))
        found = column_conclusion(label, ours, paper, higher_is_better)
        if found is not None:
            out.append(found)
    return out


def build_suite_report(suite: Suite, tracker: Tracker, profile: str = "paper") -> SuiteReport:
    """Collect the suite's runs of ``profile`` from the store and compute every cell."""
    metric = metric_spec(suite, profile)
    extra = metric.figure_histories
    specs = suite.expand(profile)
    runs = collect_runs(suite, tracker, profile, metric, extra, specs)
    expected = len(specs) // max(len(suite.cells()), 1)
    offline = (bool(runs["offline_data"].any()) if not runs.empty else False) or any(
        fidelity.dataset_is_offline(name) for name in {s.config["data"]["dataset"] for s in specs})
    table = summarise(suite, runs, metric, expected, specs)
    report = SuiteReport(suite, metric, profile, runs, table, expected, offline)
    report.conclusions = conclusions(report.axes, report.method_axis, table, metric.higher_is_better)
    if metric.figure in qualitative.KINDS and not runs.empty:
        report.panels = qualitative.collect_panels(tracker, runs, metric.figure)
    if metric.figure in personalization.KINDS and not runs.empty:
        report.panels = personalization.collect(tracker, runs)
    return report
