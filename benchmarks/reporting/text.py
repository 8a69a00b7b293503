"""Tables as text: Markdown (GitHub), LaTeX (booktabs) and the tidy CSV.

The Markdown and PDF tables share :data:`COLUMNS` (after the grid's axes): a new column is one
:class:`Column` appended there; a new footnote is one function appended to :data:`LEGEND_PARTS`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import pandas as pd

from benchmarks.reporting import extras, personalization, qualitative
from benchmarks.reporting.table import SuiteReport, column_label
from benchmarks.reporting.verdict import LABEL_RULE, LEGEND, PARTIAL, RULES, VERDICTS


def isnan(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt(mean, pm=None) -> str:
    if isnan(mean):
        return "—"
    return f"{mean:.2f}" if isnan(pm) else f"{mean:.2f} ± {pm:.2f}"


def seeds_text(row) -> str:
    text = f"{row['n_seeds']}/{row['expected_seeds']}"
    return text + (f" ({row['failed']} failed)" if row["failed"] else "")


def diff_text(diff) -> str:
    return "—" if isnan(diff) else f"{diff:+.2f}"


def bound_text(row, prefix: str = "") -> str:
    bound = row[f"{prefix}bound"]
    return "—" if isnan(bound) else f"±{bound:.2f} ({row[f'{prefix}rule']})"


def verdict_text(row, prefix: str = "") -> str:
    verdict = row[f"{prefix}verdict"]
    return f"{verdict} {row[f'{prefix}verdict_detail']}" if verdict == PARTIAL else (verdict or "—")


def notice(report: SuiteReport) -> str:
    """Why the numbers are not comparable with the paper ('' when they are)."""
    why = []
    if report.profile != "paper":
        cut = ((report.suite.raw.get("profiles") or {}).get(report.profile) or {}).get("description")
        why.append(f"it was run with the `{report.profile}` profile"
                   + (f" ({str(cut).strip().rstrip('.')})" if cut else "") + ", not the published setup")
    if report.offline:
        why.append("it ran on offline data (generated or bundled), not the paper's dataset")
    return f"Not comparable with the paper: {'; '.join(why)}." if why else ""


def provenance_line(report: SuiteReport) -> str:
    """'Data provenance: ...' naming each copy the runs used that is not the official archive (tag
    ``data_provenance``, e.g. the CIFAR-10 reconstruction) and how many runs used it; '' for none."""
    runs = report.runs
    if runs.empty or "data_provenance" not in runs:
        return ""
    used = runs[runs["data_provenance"] != ""]
    if used.empty:
        return ""
    parts = [f"{text} ({n} of {len(runs)} runs)" for text, n in used.groupby("data_provenance").size().items()]
    return f"Data provenance: {'; '.join(parts)}."


def always(_report: SuiteReport) -> bool:
    return True


def with_code_reference(report: SuiteReport) -> bool:
    return report.has_code_reference


@dataclass(frozen=True)
class Column:
    """One column of the Markdown/PDF table: its header, its text per cell row, and whether a
    report shows it (e.g. the code-reference columns only where the suite has such values)."""

    header: str
    text: Callable[[pd.Series], str]
    shown: Callable[[SuiteReport], bool] = always


COLUMNS: list[Column] = [
    Column("seeds", seeds_text),
    Column("ours", lambda r: fmt(r["mean"], r["pm"])),
    Column("sample SD", lambda r: "—" if isnan(r["std"]) else f"{r['std']:.2f}", lambda report: report.metric.sample_sd),
    Column("paper", lambda r: fmt(r["published_mean"], r["published_pm"])),
    Column("diff", lambda r: diff_text(r["diff"])),
    Column("bound (rule)", bound_text),
    Column("verdict", verdict_text),
    Column("code ref", lambda r: fmt(r["code_mean"], r["code_pm"])
           + ("" if isnan(r["code_seeds"]) else f" ({int(r['code_seeds'])} seed{'s' * (r['code_seeds'] != 1)})"),
           with_code_reference),
    Column("diff (code)", lambda r: diff_text(r["code_diff"]), with_code_reference),
    Column("bound (code)", lambda r: bound_text(r, "code_"), with_code_reference),
    Column("verdict (code)", lambda r: verdict_text(r, "code_"), with_code_reference),
    Column("label", lambda r: r["label"], with_code_reference),
]


def also_columns(report: SuiteReport) -> list[Column]:
    """``ours (<aggregate>)`` for each of the suite's ``metric.also`` (e.g. ``max_over_rounds``)."""
    return [Column(f"ours ({a})", lambda r, a=a: fmt(r[f"mean_{a}"], r[f"pm_{a}"])) for a in report.metric.also]


def cell_name(report: SuiteReport, row) -> str:
    return "/".join(str(row[a]) for a in report.axes)


def table_rows(report: SuiteReport) -> tuple[list[str], list[list[str]]]:
    """Header and rows shared by Markdown and the PDF: the axes, then every shown :data:`COLUMNS`,
    with the suite's extra aggregates (``metric.also``) right after ours."""
    columns = []
    for column in COLUMNS:
        if column.shown(report):
            columns.append(column)
            if column.header == "ours":
                columns += also_columns(report)
    header = report.axes + [c.header for c in columns]
    rows = []
    for _, r in report.table.iterrows():
        labels = [str(r[a]) for a in report.axes]
        if r.get("tuned"):
            labels[-1] += " †"
        if r.get("marks"):
            labels[-1] += f" {r['marks']}"
        rows.append(labels + [c.text(r) for c in columns])
    return header, rows


def verdict_legend(report: SuiteReport) -> list[str]:
    table = report.table
    used = set(table["verdict"]) | (set(table["code_verdict"]) if "code_verdict" in table else set())
    rules = sorted((set(table["rule"]) | set(table.get("code_rule", []))) - {""})
    return ([f"- **{v}**: {LEGEND[v]}" for v in VERDICTS if v in used]
            + [f"- rule **{r}**: {RULES[r]}" for r in rules])


def tuned_legend(report: SuiteReport) -> list[str]:
    tuned = report.table[report.table["tuned"]] if "tuned" in report.table else report.table.iloc[:0]
    if tuned.empty:
        return []
    return ["- **†**: the cell ran with values found by `pflbench tune` (on validation data), not the "
            "paper's: " + "; ".join(f"{cell_name(report, r)} ({r['tuned_source']})" for _, r in tuned.iterrows())]


def marks_legend(report: SuiteReport) -> list[str]:
    """One line per mark of the suite's ``marks`` that some cell carries: the mark, its text and
    how many cells carry it (e.g. MetaVers' baselines with their own paper's hyperparameters)."""
    lines, seen = [], {}
    for cell in report.suite.cells():
        for mark, text in report.suite.marks(cell):
            seen.setdefault((mark, text), 0)
            seen[(mark, text)] += 1
    for (mark, text), count in seen.items():
        lines.append(f"- **{mark}**: {text} ({count} cell{'s' * (count != 1)})")
    return lines


def code_reference_legend(report: SuiteReport) -> list[str]:
    """What the code-reference column is, where its values come from, and the comparison rule."""
    if not report.has_code_reference:
        return []
    lines = ["- **code ref**: a second reference beside the paper: the values a re-run of the authors' "
             "released code gave (mean ± the paper's spread convention over its seeds), from the suite's "
             "`code_reference`; the provenance of each:"]
    for ref in report.suite.code_references.values():
        lines.append(f"  - {'/'.join(ref.cell.values())}: {ref.describe()}")
    lines += ["- method note: ours vs the code reference uses the same rule as ours vs the paper (two "
              "combined standard errors, rule 2SE): the code's SE is the SEM (ddof 1) of its per-seed values; "
              "with one seed of the code, its SE is unknown and the rule falls back as for a paper without "
              "spread (tol, else 2SE(ours)). The code's seeds are not ours (its seed also draws the partition "
              "and it does not seed its initial model): two distributions are compared, never seed by seed.",
              f"- {LABEL_RULE}"]
    return lines


def reuse_legend(report: SuiteReport) -> list[str]:
    """Which runs this suite did not compute: copies of another suite's runs of the same config hash
    (:mod:`benchmarks.store.reuse`), grouped by source experiment, each cell with its seeds."""
    runs = report.runs
    if runs.empty or "reused_from" not in runs:
        return []
    reused = runs[runs["reused_from"] != ""]
    if reused.empty:
        return []
    parts = []
    for experiment, group in reused.groupby("reused_from_experiment", sort=True):
        cells = "; ".join(f"{cell} seed{'s' * (len(g) > 1)} {','.join(str(s) for s in sorted(g['seed']))}"
                          for cell, g in group.groupby("cell", sort=False))
        parts.append(f"{len(group)} from `{experiment or 'another experiment'}` ({cells})")
    return [f"- **reused**: {len(reused)} of {len(runs)} runs were not computed for this suite: the same "
            f"configuration (config hash) had finished in another suite of the store, and its run was copied "
            f"here with its metrics and provenance (tags `reused_from.run_id`, `reused_from.experiment`): "
            + "; ".join(parts) + "."]


#: footnotes under the table, in order; each takes the report and returns Markdown lines
LEGEND_PARTS: list[Callable[[SuiteReport], list[str]]] = [verdict_legend, code_reference_legend, tuned_legend,
                                                          marks_legend, reuse_legend]


def legend_lines(report: SuiteReport) -> list[str]:
    return [line for part in LEGEND_PARTS for line in part(report)]


def conclusion_lines(report: SuiteReport) -> list[str]:
    if not report.conclusions:
        return ["No column has both our and the paper's numbers for a method: no conclusion to check."]
    lines = []
    for c in report.conclusions:
        if c.methods < 2:
            unrun = f" (not run: {', '.join(c.not_run)})" if c.not_run else ""
            lines.append(f"- {c.column}: only **{c.best_ours}** has both numbers: no ranking to check yet{unrun}")
            continue
        tau = "n/a" if math.isnan(c.tau) else f"{c.tau:+.2f}"
        holds = "holds" if c.best_holds else "does not hold"
        if c.provisional:
            lines.append(f"- {c.column}: over the {c.methods} methods run so far, best ours **{c.best_ours_text}**, "
                         f"best paper **{c.best_paper}** ({holds} so far); Kendall τ = {tau}. Provisional: the "
                         f"paper's best in this column, **{c.paper_top}**, has no run yet "
                         f"(not run: {', '.join(c.not_run)})")
            continue
        unrun = f"; not run: {', '.join(c.not_run)}" if c.not_run else ""
        lines.append(f"- {c.column}: best ours **{c.best_ours_text}**, best paper **{c.best_paper}** "
                     f"({holds}); Kendall τ = {tau} over {c.methods} methods{unrun}")
    return lines


def render_markdown(report: SuiteReport) -> str:
    suite, metric = report.suite, report.metric
    lines = [f"# {suite.raw.get('table', suite.name)} ({suite.key})", ""]
    if suite.raw.get("caption"):
        lines += [suite.raw["caption"].strip(), ""]
    if notice(report):
        lines += [f"> **{notice(report)}**", ""]
    if provenance_line(report):
        lines += [f"> {provenance_line(report)}", ""]
    lines += [f"Metric: `{metric.key}` ({metric.label}), x{metric.scale:g}, profile `{report.profile}`. "
              f"Cell value: {metric.describe()}. {metric.averaging}", ""]
    header, rows = table_rows(report)
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Legend:", ""] + legend_lines(report)
    lines += ["", "Does the paper's conclusion hold?", ""] + conclusion_lines(report)
    lines += extras.markdown_lines(report)
    lines += qualitative.markdown_lines(report)
    lines += personalization.markdown_lines(report)
    switched = report.table[report.table["switches"] != ""]
    if not switched.empty:
        lines += ["", "Fidelity switches (non-default hyperparameters) per cell:", ""]
        lines += [f"- {cell_name(report, r)}: {r['switches']}" for _, r in switched.iterrows()]
    failures = report.table[report.table["failure_reason"] != ""]
    if not failures.empty:
        lines += ["", "Failed runs:", ""]
        lines += [f"- {cell_name(report, r)}: {r['failure_reason']}" for _, r in failures.iterrows()]
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
CODE_MARK = {**LATEX_MARK, "reproduced": r"$^{=}$"}


def tex(text) -> str:
    return re.sub(r"[&%$#_{}~^\\]", lambda m: LATEX_SPECIAL[m.group()], str(text))


def _tex_value(mean, pm, bold: bool) -> str:
    if isnan(mean):
        return "--"
    text = f"{mean:.2f}" if isnan(pm) else f"{mean:.2f} $\\pm$ {pm:.2f}"
    return f"\\textbf{{{text}}}" if bold else text


def _best(values: pd.Series, higher_is_better: bool = True) -> float:
    clean = values.dropna()
    if not len(clean):
        return math.nan
    return clean.max() if higher_is_better else clean.min()


def render_latex(report: SuiteReport) -> str:
    """A booktabs table: one row per method, per column (non-method axes) ours and paper side by
    side (and the authors' code where the suite has a code reference), the best of ours and of the
    paper per column in bold, a verdict mark after ours (vs the paper) and after the code's value
    (ours vs the code)."""
    method = report.method_axis
    table = report.table
    code = report.has_code_reference
    sides = 3 if code else 2
    columns = report.column_axes if method else report.axes
    groups = list(table.groupby(columns, sort=False)) if columns else [((), table)]
    methods = list(dict.fromkeys(table[method])) if method else ["value"]
    spec = "l" + "r" * sides * len(groups)
    lines = [r"\begin{table}[t]", r"\centering", r"\small", f"\\begin{{tabular}}{{{spec}}}", r"\toprule"]
    heads = [f"\\multicolumn{{{sides}}}{{c}}{{{tex(column_label(g.iloc[0], columns))}}}" for _, g in groups]
    lines.append(" & ".join([""] + heads) + r" \\")
    lines.append("".join(f"\\cmidrule(lr){{{2 + sides * i}-{1 + sides * (i + 1)}}}" for i in range(len(groups))))
    sides_head = "Ours & Paper" + (" & Code" if code else "")
    lines.append(" & ".join([tex(method or "")] + [sides_head] * len(groups)) + r" \\")
    lines.append(r"\midrule")
    for m in methods:
        rows = table[table[method] == m] if method else table
        marks = " ".join(dict.fromkeys(k for value in rows.get("marks", []) for k in str(value).split()))
        cells = [tex(m) + (f"\\textsuperscript{{{tex(marks)}}}" if marks else "")]
        for _, g in groups:
            row = g[g[method] == m].iloc[0] if method else g.iloc[0]
            higher = report.metric.higher_is_better
            ours = _tex_value(row["mean"], row["pm"], row["mean"] == _best(g["mean"], higher))
            ours += LATEX_MARK.get(row["verdict"], "") if ours != "--" else ""
            if row["verdict"] == "failed":
                ours = "failed"
            paper = _tex_value(row["published_mean"], row["published_pm"],
                               row["published_mean"] == _best(g["published_mean"], higher))
            cells += [ours, paper]
            if code:
                theirs = _tex_value(row["code_mean"], row["code_pm"], False)
                cells.append(theirs + (CODE_MARK.get(row["code_verdict"], "") if theirs != "--" else ""))
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    caption = (f"{tex(report.suite.raw.get('table', report.suite.name))}: {tex(report.metric.label)}. "
               f"Ours: mean $\\pm$ {tex(report.metric.pm)} (ddof {report.metric.ddof}) over seeds, "
               f"profile {tex(report.profile)}. Bold: best per column and side. "
               r"$^{\uparrow}$/$^{\downarrow}$: above/below the paper beyond two combined standard "
               r"errors (or the tolerance); $^{p}$: partial seeds; no mark: reproduced or no reference.")
    if code:
        sources = sorted({ref.short for ref in report.suite.code_references.values()})
        caption += (" Code: a re-run of the authors' released code (" + tex(", ".join(sources))
                    + r"), mean $\pm$ " + tex(report.metric.pm) + r" over its seeds; the mark after it "
                    r"compares ours with it by the same rule: $^{=}$ matches, $^{\uparrow}$/$^{\downarrow}$ "
                    r"ours above/below it.")
    for line in marks_legend(report):
        caption += " " + tex(line.removeprefix("- ").replace("**", "")) + "."
    if notice(report):
        caption += " " + tex(notice(report).replace("`", ""))
    if provenance_line(report):
        caption += " " + tex(provenance_line(report))
    lines += [f"\\caption{{{caption}}}", f"\\label{{tab:{re.sub(r'[^A-Za-z0-9]+', '-', report.suite.key)}}}",
              r"\end{table}"]
    return "\n".join(lines) + "\n"
