"""What the front of a paper's PDF says. Page 1: which table it shows as a figure (:func:`headline`)
and that table's verdicts in one line (:func:`verdict_line`, :func:`uncompared`). Page 2, the
one-page summary (issue 12, item 5): per table how many cells reproduced / above / below / not run,
the plain-words labels (issue 17) counted over the paper, Kendall's tau per table, and the switches
in force. Pure: reports in, rows and lines out."""
from __future__ import annotations

import math
from collections import Counter

from benchmarks.reporting.table import SuiteReport
from benchmarks.reporting.verdict import (ABOVE, BELOW, FAILED, NO_REFERENCE, NOT_RUN, PARTIAL, REPRODUCED,
                                          UNDECIDED)

COUNTED = (REPRODUCED, ABOVE, BELOW, PARTIAL, FAILED, NOT_RUN, NO_REFERENCE, UNDECIDED)
HEADER = ["table", "cells", *COUNTED, "best method holds"]


def verdict_counts(report: SuiteReport) -> Counter:
    """How many cells of the table got each verdict (against the paper)."""
    return Counter(report.table["verdict"])


def count_rows(reports: list[SuiteReport]) -> list[list[str]]:
    """One row per table: cells, the count of each verdict, columns whose best method holds; a
    last row of totals when there are several tables."""
    rows, total = [], Counter()
    holds = [0, 0, 0]
    for report in reports:
        counts = verdict_counts(report)
        total.update(counts)
        judged = [c for c in report.conclusions if not c.provisional]
        kept, provisional = sum(c.best_holds for c in judged), len(report.conclusions) - len(judged)
        holds = [holds[0] + kept, holds[1] + len(judged), holds[2] + provisional]
        rows.append([report.suite.key, str(len(report.table)), *(str(counts[v]) for v in COUNTED),
                     holds_cell(kept, len(judged), provisional)])
    if len(reports) > 1:
        rows.append(["all", str(sum(len(r.table) for r in reports)), *(str(total[v]) for v in COUNTED),
                     holds_cell(*holds)])
    return rows


def holds_cell(kept: int, judged: int, provisional: int) -> str:
    """``kept/judged`` over the columns with a verdict; provisional columns (one method alone with both
    numbers, or the paper's best method without a run: ``Conclusion.provisional``) are counted apart
    ("+N provisional"), never as a hold or a miss."""
    return f"{kept}/{judged}" + (f" (+{provisional} provisional)" if provisional else "")


def label_lines(reports: list[SuiteReport]) -> list[str]:
    """The plain-words labels counted over every table (most frequent first)."""
    counts = Counter(label for r in reports for label in r.table["label"])
    with_code = [r.suite.key for r in reports if r.has_code_reference]
    where = (f"tables with a code reference (a re-run of the authors' code): {', '.join(with_code)}"
             if with_code else "no table has a code reference: the labels read the paper only")
    return [f"Labels over all cells ({where}):"] + [f"  {n} x {label}" for label, n in counts.most_common()]


def tau_lines(reports: list[SuiteReport]) -> list[str]:
    """Kendall's tau between our and the paper's method ordering, per table and column."""
    lines = ["Kendall tau (ours vs paper method ordering) per table and column:"]
    for report in reports:
        parts = [f"{c.column} {'n/a' if math.isnan(c.tau) else f'{c.tau:+.2f}'} "
                 f"({c.methods} method{'s' * (c.methods != 1)})" for c in report.conclusions]
        lines.append(f"  {report.suite.key}: " + ("; ".join(parts) if parts else "no column with both numbers"))
    return lines


def switch_lines(reports: list[SuiteReport], limit: int = 12) -> list[str]:
    """The switches in force: each distinct non-default setting with the number of cells running it,
    the deviations from the published setup, and the tuned cells; at most ``limit`` switch lines."""
    cells: Counter = Counter()
    for report in reports:
        for text in report.table["switches"]:
            cells.update(s for s in text.split("; ") if s)
    lines = ["Switches in force (non-default method or model settings, cells running each):"]
    shown = cells.most_common(limit)
    lines += [f"  {switch}: {n} cell(s)" for switch, n in shown] or ["  none: every cell runs the defaults"]
    if len(cells) > limit:
        lines.append(f"  ... and {len(cells) - limit} more (each table's fidelity page lists them per cell)")
    tuned = sum(int(r.table["tuned"].sum()) for r in reports if "tuned" in r.table)
    if tuned:
        lines.append(f"  {tuned} cell(s) ran with values found by pflbench tune, not the paper's")
    return lines


def verdict_line(report: SuiteReport) -> str:
    """The table's verdicts against the paper in one line, e.g. "cgpfl/table1: 17 reproduced,
    8 above, 11 below of 36 cells compared"; :func:`uncompared` says what the other cells are."""
    counts = verdict_counts(report)
    compared = sum(counts[v] for v in (REPRODUCED, ABOVE, BELOW))
    if not compared:
        return f"{report.suite.key}: no cell compared with the paper"
    return (f"{report.suite.key}: {counts[REPRODUCED]} reproduced, {counts[ABOVE]} above, {counts[BELOW]} below "
            f"of {compared} cell{'s' * (compared != 1)} compared")


def uncompared(report: SuiteReport) -> str:
    """The cells :func:`verdict_line` leaves out, e.g. "(45 in all: 9 not run)"; '' when none."""
    counts = verdict_counts(report)
    rest = [f"{counts[v]} {v}" for v in COUNTED if v not in (REPRODUCED, ABOVE, BELOW) and counts[v]]
    return f"({len(report.table)} in all: {', '.join(rest)})" if rest else ""


def headline(reports: list[SuiteReport]) -> int:
    """Which table page 1 shows as a figure: the first with a cell that has both numbers (ours and the
    paper's), so a committed snapshot shown beside (it comes first) wins; else the first table."""
    return next((i for i, r in enumerate(reports) if r.table["diff"].notna().any()), 0)
