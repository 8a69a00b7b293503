"""Tables as text: Markdown (GitHub), LaTeX (booktabs) and the tidy CSV."""
from __future__ import annotations

import math
import re

import pandas as pd

from benchmarks.reporting import extras
from benchmarks.reporting.table import SuiteReport, column_label
from benchmarks.reporting.verdict import LEGEND, PARTIAL, RULES, VERDICTS


def isnan(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt(mean, pm=None) -> str:
    if isnan(mean):
        return "—"
    return f"{mean:.2f}" if isnan(pm) else f"{mean:.2f} ± {pm:.2f}"


def seeds_text(row) -> str:
    text = f"{row['n_seeds']}/{row['expected_seeds']}"
    return text + (f" ({row['failed']} failed)" if row["failed"] else "")


def bound_text(row) -> str:
    return "—" if isnan(row["bound"]) else f"±{row['bound']:.2f} ({row['rule']})"


def verdict_text(row) -> str:
    return f"{row['verdict']} {row['verdict_detail']}" if row["verdict"] == PARTIAL else row["verdict"]


def notice(report: SuiteReport) -> str:
    """Why the numbers are not comparable with the paper ('' when they are)."""
    why = []
    if report.profile != "paper":
        why.append(f"it was run with the `{report.profile}` profile, not the published setup")
    if report.offline:
        why.append("it ran on offline data (generated or bundled), not the paper's dataset")
    return f"Not comparable with the paper: {'; '.join(why)}." if why else ""


def table_rows(report: SuiteReport) -> tuple[list[str], list[list[str]]]:
    """Header and rows shared by Markdown and the PDF."""
    also = list(report.metric.also)
    header = report.axes + ["seeds", "ours", *(f"ours ({a})" for a in also), "paper", "diff", "bound (rule)",
                            "verdict"]
    rows = []
    for _, r in report.table.iterrows():
        diff = "—" if isnan(r["diff"]) else f"{r['diff']:+.2f}"
        labels = [str(r[a]) for a in report.axes]
        if r.get("tuned"):
            labels[-1] += " †"
        rows.append(labels
                    + [seeds_text(r), fmt(r["mean"], r["pm"]), *(fmt(r[f"mean_{a}"], r[f"pm_{a}"]) for a in also),
                       fmt(r["published_mean"], r["published_pm"]),
                       diff, bound_text(r), verdict_text(r)])
    return header, rows


def legend_lines(report: SuiteReport) -> list[str]:
    used = set(report.table["verdict"])
    rules = sorted(set(report.table["rule"]) - {""})
    lines = [f"- **{v}**: {LEGEND[v]}" for v in VERDICTS if v in used]
    lines += [f"- rule **{r}**: {RULES[r]}" for r in rules]
    tuned = report.table[report.table["tuned"]] if "tuned" in report.table else report.table.iloc[:0]
    if not tuned.empty:
        lines.append("- **†**: the cell ran with values found by `pflbench tune` (on validation data), "
                     "not the paper's: " + "; ".join(f"{'/'.join(str(r[a]) for a in report.axes)} "
                                                     f"({r['tuned_source']})" for _, r in tuned.iterrows()))
    return lines


def conclusion_lines(report: SuiteReport) -> list[str]:
    if not report.conclusions:
        return ["No column has both our and the paper's numbers for a method: no conclusion to check."]
    lines = []
    for c in report.conclusions:
        tau = "n/a" if math.isnan(c.tau) else f"{c.tau:+.2f}"
        holds = "holds" if c.best_holds else "does not hold"
        lines.append(f"- {c.column}: best ours **{c.best_ours}**, best paper **{c.best_paper}** "
                     f"({holds}); Kendall τ = {tau} over {c.methods} methods")
    return lines


def render_markdown(report: SuiteReport) -> str:
    suite, metric = report.suite, report.metric
    lines = [f"# {suite.raw.get('table', suite.name)} ({suite.key})", ""]
    if suite.raw.get("caption"):
        lines += [suite.raw["caption"].strip(), ""]
    if notice(report):
        lines += [f"> **{notice(report)}**", ""]
    lines += [f"Metric: `{metric.key}` ({metric.label}), x{metric.scale:g}, profile `{report.profile}`. "
              f"Cell value: {metric.describe()}. {metric.averaging}", ""]
    header, rows = table_rows(report)
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Legend:", ""] + legend_lines(report)
    lines += ["", "Does the paper's conclusion hold?", ""] + conclusion_lines(report)
    lines += extras.markdown_lines(report)
    switched = report.table[report.table["switches"] != ""]
    if not switched.empty:
        lines += ["", "Fidelity switches (non-default hyperparameters) per cell:", ""]
        lines += [f"- {'/'.join(str(r[a]) for a in report.axes)}: {r['switches']}" for _, r in switched.iterrows()]
    failures = report.table[report.table["failure_reason"] != ""]
    if not failures.empty:
        lines += ["", "Failed runs:", ""]
        lines += [f"- {'/'.join(str(r[a]) for a in report.axes)}: {r['failure_reason']}"
                  for _, r in failures.iterrows()]
    return "\n".join(lines) + "\n"


def tidy_csv(report: SuiteReport) -> pd.DataFrame:
    """One row per cell, every number unrounded, plus profile, metric and aggregation."""
    return report.table.assign(profile=report.profile, metric=report.metric.key,
                               aggregate=report.metric.aggregate, pm_kind=report.metric.pm,
                               ddof=report.metric.ddof)


# ---------------------------------------------------------------- LaTeX

LATEX_SPECIAL = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
                 "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}"}
LATEX_MARK = {"reproduced": "", "above": r"$^{\uparrow}$", "below": r"$^{\downarrow}$",
              "partial": r"$^{p}$", "undecided": r"$^{?}$"}


def tex(text) -> str:
    return re.sub(r"[&%$#_{}~^\\]", lambda m: LATEX_SPECIAL[m.group()], str(text))


def _tex_value(mean, pm, bold: bool) -> str:
    if isnan(mean):
        return "--"
    text = f"{mean:.2f}" if isnan(pm) else f"{mean:.2f} $\\pm$ {pm:.2f}"
    return f"\\textbf{{{text}}}" if bold else text


def _best(values: pd.Series) -> float:
    clean = values.dropna()
    return clean.max() if len(clean) else math.nan


def render_latex(report: SuiteReport) -> str:
    """A booktabs table: one row per method, per column (non-method axes) ours and paper side by
    side, the best of each side per column in bold, a verdict mark after ours."""
    method = report.method_axis
    table = report.table
    columns = report.column_axes if method else report.axes
    groups = list(table.groupby(columns, sort=False)) if columns else [((), table)]
    methods = list(dict.fromkeys(table[method])) if method else ["value"]
    spec = "l" + "rr" * len(groups)
    lines = [r"\begin{table}[t]", r"\centering", r"\small", f"\\begin{{tabular}}{{{spec}}}", r"\toprule"]
    heads = [f"\\multicolumn{{2}}{{c}}{{{tex(column_label(g.iloc[0], columns))}}}" for _, g in groups]
    lines.append(" & ".join([""] + heads) + r" \\")
    lines.append("".join(f"\\cmidrule(lr){{{2 + 2 * i}-{3 + 2 * i}}}" for i in range(len(groups))))
    lines.append(" & ".join([tex(method or "")] + ["Ours & Paper"] * len(groups)) + r" \\")
    lines.append(r"\midrule")
    for m in methods:
        cells = [tex(m)]
        for _, g in groups:
            row = g[g[method] == m].iloc[0] if method else g.iloc[0]
            ours = _tex_value(row["mean"], row["pm"], row["mean"] == _best(g["mean"]))
            ours += LATEX_MARK.get(row["verdict"], "") if ours != "--" else ""
            if row["verdict"] == "failed":
                ours = "failed"
            paper = _tex_value(row["published_mean"], row["published_pm"],
                               row["published_mean"] == _best(g["published_mean"]))
            cells += [ours, paper]
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    caption = (f"{tex(report.suite.raw.get('table', report.suite.name))}: {tex(report.metric.label)}. "
               f"Ours: mean $\\pm$ {tex(report.metric.pm)} (ddof {report.metric.ddof}) over seeds, "
               f"profile {tex(report.profile)}. Bold: best per column and side. "
               r"$^{\uparrow}$/$^{\downarrow}$: above/below the paper beyond two combined standard "
               r"errors (or the tolerance); $^{p}$: partial seeds; no mark: reproduced or no reference.")
    if notice(report):
        caption += " " + tex(notice(report).replace("`", ""))
    lines += [f"\\caption{{{caption}}}", f"\\label{{tab:{re.sub(r'[^A-Za-z0-9]+', '-', report.suite.key)}}}",
              r"\end{table}"]
    return "\n".join(lines) + "\n"
