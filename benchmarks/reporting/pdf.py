"""One PDF per paper (matplotlib's PdfPages, no TeX). Page 1 shows before it tells: one table's
difference-to-paper heat map with each cell's verdict, then its verdict count in one line
(:func:`front_page`); page 2 the title lines and the summary (:mod:`.summary`); then per suite its
table with the legend, verdicts and conclusions below it (on a page of their own when they do not
fit), figures, fidelity switches and exact setup. A suite whose numbers are not comparable with the
paper (non-paper profile, offline data) has a red notice on each of its own pages, beside its page-1
figure when it is the one shown, and named on the summary page; no other table's page carries it."""
from __future__ import annotations

import datetime as dt
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402
from matplotlib.backends.backend_pdf import PdfPages  # noqa: E402

from benchmarks.reporting import extras, fidelity, personalization, qualitative, summary  # noqa: E402
from benchmarks.reporting.figures import OURS, diff_grid, draw_diff  # noqa: E402
from benchmarks.reporting.table import SuiteReport  # noqa: E402
from benchmarks.reporting.text import conclusion_lines, legend_lines, notice, provenance_line, table_rows  # noqa: E402
from pfl_core.atomic_file import atomic_path  # noqa: E402

PAGE = (11.69, 8.27)  # A4 landscape, inches
ROWS_PER_PAGE = 24
LINES_PER_PAGE = 44
WRAP = 150
LINE_H = 7.5 * 1.35 / 72 / PAGE[1]  # one text line of text_pages, in figure height
TABLE_TOP, TABLE_H, ROW_H = 0.78, 0.70, 0.04  # the table's axes (figure) and row height (axes)
BOTTOM = 0.07
SUMMARY_LINE_H = 9 * 1.35 / 72 / PAGE[1]
FIGURE_LABELS = 0.07  # page 1: room under the heat map for its column labels


def _plain(line: str) -> str:
    return line.replace("**", "").replace("`", "")


class ReportPdf:
    """PdfPages with a running footer and, when set, a not-comparable notice (``warning``: that of
    the table whose pages are being written) on each page."""

    def __init__(self, path: Path, paper: str, warning: str):
        plt.rcParams.update({"pdf.fonttype": 42, "ps.fonttype": 42})  # extractable text
        self.pdf = PdfPages(path, metadata={"Title": f"pflbench report: {paper}"})
        self.paper, self.warning, self.pages = paper, warning, []

    def new_page(self, title: str):
        fig = plt.figure(figsize=PAGE)
        fig.text(0.04, 0.93, title, fontsize=14, weight="bold")
        return fig

    def save(self, fig, title: str) -> None:
        number = len(self.pages) + 1
        if self.warning:
            fig.text(0.5, 0.975, self.warning, ha="center", va="top", fontsize=8.5, color="white",
                     weight="bold", wrap=True, bbox={"facecolor": "#b00020", "edgecolor": "none", "pad": 3})
            fig.text(0.04, 0.045, "NOT COMPARABLE WITH THE PAPER (see the notice above)",
                     fontsize=7, color="#b00020", weight="bold")
        fig.text(0.04, 0.02, f"pflbench report: {self.paper} | {title}", fontsize=7, color="#555555")
        fig.text(0.96, 0.02, f"page {number}", fontsize=7, color="#555555", ha="right")
        self.pdf.savefig(fig)
        plt.close(fig)
        self.pages.append(title)

    @staticmethod
    def wrap(lines: list[str]) -> list[str]:
        return [w for line in lines for w in (textwrap.wrap(_plain(line), WRAP, subsequent_indent="    ") or [""])]

    def text_pages(self, title: str, lines: list[str], mono: bool = False) -> None:
        wrapped = self.wrap(lines)
        chunks = [wrapped[i:i + LINES_PER_PAGE] for i in range(0, len(wrapped), LINES_PER_PAGE)] or [[]]
        for k, chunk in enumerate(chunks):
            name = title if k == 0 else f"{title} (cont.)"
            fig = self.new_page(name)
            fig.text(0.04, 0.89, "\n".join(chunk), fontsize=7.5, va="top", linespacing=1.35,
                     family="monospace" if mono else "sans-serif")
            self.save(fig, name)

    def figure_page(self, title: str, figure) -> None:
        figure.set_size_inches(*PAGE)
        figure.subplots_adjust(top=0.84, bottom=0.16)
        figure.text(0.04, 0.93, title, fontsize=14, weight="bold")
        self.save(figure, title)

    def table_pages(self, title: str, intro: list[str], header: list[str], rows: list[list[str]],
                    below: list[str] = ()) -> bool:
        """The table, ROWS_PER_PAGE rows a page; ``below`` (the legend and conclusions) goes under
        the last rows when it fits there. Returns whether it did (else the caller gives it a page)."""
        chunks = [rows[i:i + ROWS_PER_PAGE] for i in range(0, len(rows), ROWS_PER_PAGE)] or [[]]
        folded = False
        for k, chunk in enumerate(chunks):
            name = title if k == 0 else f"{title} (cont.)"
            fig = self.new_page(name)
            text = "\n".join(w for line in intro for w in textwrap.wrap(_plain(line), 170))
            fig.text(0.04, 0.895, text, fontsize=8, va="top")
            ax = fig.add_axes([0.04, TABLE_TOP - TABLE_H, 0.92, TABLE_H])
            ax.axis("off")
            if chunk:
                table = ax.table(cellText=chunk, colLabels=header, loc="upper center", cellLoc="left")
                table.auto_set_font_size(False)
                table.set_fontsize(9 if len(header) <= 10 else 7)
                table.auto_set_column_width(list(range(len(header))))
                for (r, _), cell in table.get_celld().items():
                    cell.set_height(ROW_H)
                    if r == 0:
                        cell.set_facecolor("#e8e8e8")
            if k == len(chunks) - 1 and below:
                wrapped = self.wrap(list(below))
                top = TABLE_TOP - (len(chunk) + 1) * ROW_H * TABLE_H - 0.025
                if len(wrapped) * LINE_H <= top - BOTTOM:
                    fig.text(0.04, top, "\n".join(wrapped), fontsize=7.5, va="top", linespacing=1.35)
                    folded = True
            self.save(fig, name)
        return folded

    def close(self) -> None:
        self.pdf.close()


def title_lines(paper: str, reports: list[SuiteReport]) -> list[str]:
    """Paper, code commit, date, device, profile, number of runs, total compute time."""
    runs = [r.runs for r in reports if not r.runs.empty]
    allruns = pd.concat(runs) if runs else None

    def uniq(col: str) -> str:
        if allruns is None:
            return "no runs"
        return ", ".join(sorted(set(map(str, allruns[col])) - {""})) or "unknown"
    finished = int((allruns["status"] == "FINISHED").sum()) if allruns is not None else 0
    failed = int((allruns["status"] == "FAILED").sum()) if allruns is not None else 0
    expected = sum(r.expected_seeds * len(r.table) for r in reports)
    wall = float(allruns["wall_s"].sum()) if allruns is not None else 0.0
    dirty = allruns is not None and bool(allruns["git_dirty"].any())
    profiles = ", ".join(sorted({r.profile for r in reports}))
    return [
        f"Paper: {paper}",
        f"Suites: {', '.join(r.suite.key for r in reports)}",
        f"Code commit: {uniq('git_commit')}" + (" (working tree had uncommitted changes)" if dirty else ""),
        f"Date rendered: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"Device: {uniq('device')}",
        f"Profile: {profiles}",
        f"Runs: {finished} finished, {failed} failed, of {expected} expected",
        f"Total compute time: {wall:.1f} s ({wall / 3600:.2f} h, sum of the runs' wall_s)",
    ]


def setup_lines(report: SuiteReport) -> list[str]:
    """The suite's exact setup: base, grid, method overrides, seeds and the profile's overrides."""
    raw = report.suite.raw
    keep = {k: raw[k] for k in ("base", "grid", "methods", "seeds") if k in raw}
    if report.profile != "paper":
        keep["profiles"] = {report.profile: (raw.get("profiles") or {}).get(report.profile)}
    text = yaml.safe_dump(keep, sort_keys=False, default_flow_style=None, width=140)
    return [f"Suite file: {report.suite.path}", ""] + text.splitlines()


def fidelity_lines(report: SuiteReport) -> list[str]:
    lines = ["Deviations from the published setup:"]
    lines += [f"  - {d}" for d in fidelity.deviations(report.profile, report.offline)] or ["  - none"]
    notes = report.suite.raw.get("notes")
    if notes:
        lines += ["", "Suite notes:"] + [f"  {line}" for line in str(notes).strip().splitlines()]
    lines += extras.markdown_lines(report)
    lines += ["", "Fidelity switches per cell (non-default method hyperparameters and model parameters):"]
    for _, r in report.table.iterrows():
        lines.append(f"  - {'/'.join(str(r[a]) for a in report.axes)}: {r['switches'] or 'defaults (paper values)'}")
    failures = report.table[report.table["failure_reason"] != ""]
    if not failures.empty:
        lines += ["", "Failed runs:"] + [f"  - {'/'.join(str(r[a]) for a in report.axes)}: {r['failure_reason']}"
                                         for _, r in failures.iterrows()]
    return lines


def suite_section(doc: ReportPdf, index: int, report: SuiteReport, figures: dict) -> None:
    suite = report.suite
    title = f"{index}. {suite.raw.get('table', suite.name)} ({suite.key})"
    intro = [suite.raw.get("caption", "").strip(),
             f"Metric: {report.metric.key} ({report.metric.label}), x{report.metric.scale:g}, "
             f"profile {report.profile}. Cell value: {report.metric.describe()}. {report.metric.averaging}",
             provenance_line(report)]
    header, rows = table_rows(report)
    verdicts = (["Legend (verdicts and the rule applied per cell, column 'bound (rule)'):"] + legend_lines(report)
                + ["", "Does the paper's conclusion hold? (best method per column; Kendall tau of the "
                   "method orderings, ours vs paper)"] + conclusion_lines(report))
    if not doc.table_pages(title, [i for i in intro if i], header, rows, verdicts):
        doc.text_pages(f"{title}: verdicts and conclusions", verdicts)
    names = {"bars": "ours vs paper", "diff": "difference to the paper", "figure": "reproduced figure"}
    if report.metric.figure in qualitative.KINDS:
        names["figure"] = f"{qualitative.KINDS[report.metric.figure][2]} (qualitative)"
    if report.metric.figure in personalization.KINDS:
        kind = personalization.KINDS[report.metric.figure][0]
        names.update({key: kind + ("" if key == "figure" else f" ({key.split('_')[1]})")
                      for key in figures if key.startswith("figure")})
    for key, figure in figures.items():
        doc.figure_page(f"{title}: {names.get(key, key)}", figure)
    figure_notes = qualitative.markdown_lines(report)
    if figure_notes:
        doc.text_pages(f"{title}: figure notes (qualitative)", [n for n in figure_notes if not n.startswith("![")])
    personalization_notes = personalization.markdown_lines(report)
    if personalization_notes:
        doc.text_pages(f"{title}: {personalization.KINDS[report.metric.figure][0]}",
                       [n for n in personalization_notes if not n.startswith("![")])
    doc.text_pages(f"{title}: fidelity switches and deviations", fidelity_lines(report))
    doc.text_pages(f"{title}: exact setup", setup_lines(report), mono=True)


def _block_height(lines: list[str], size: float) -> float:
    return len(lines) * size * 1.3 / 72 / PAGE[1] + 0.012


def _lines_at(fig, y: float, lines: list[str], size: float = 9, **style) -> float:
    """Write ``lines`` from ``y`` down; return the y under them."""
    if lines:
        fig.text(0.04, y, "\n".join(lines), fontsize=size, va="top", linespacing=1.3, **style)
    return y - _block_height(lines, size)


def _headline_figure(fig, report: SuiteReport, top: float, room: float) -> float:
    """Page 1's figure of ``report`` in at most ``room`` (figure height) under ``top``: the heat map
    of ours − paper with each cell's verdict (an image), or, where no cell has both numbers, ours
    per cell as bars. Returns the y under it (and its column labels)."""
    methods, columns, _, _ = diff_grid(report)
    rows = len(methods)
    height = max(0.16, min(0.055 * rows, room - FIGURE_LABELS))
    width = min(0.56, max(0.22, 0.14 * len(columns)))
    ax = fig.add_axes([0.22, top - height, width, height])
    image = draw_diff(ax, report, verdicts=True, fontsize=10 if rows <= 10 else max(5.0, 100 / rows))
    if image is not None:
        fig.colorbar(image, cax=fig.add_axes([0.22 + width + 0.015, top - height, 0.012, height]),
                     label="ours − paper", extend="both")
        return top - height - FIGURE_LABELS
    labels = [" / ".join(str(r[a]) for a in report.axes) for _, r in report.table.iterrows()]
    ax.barh(labels, report.table["mean"].fillna(0), xerr=report.table["pm"].fillna(0), color=OURS)
    ax.invert_yaxis()
    ax.tick_params(labelsize=8)
    ax.set_xlabel(report.metric.label, fontsize=8)
    return top - height - FIGURE_LABELS


def front_page(doc: ReportPdf, paper: str, reports: list[SuiteReport], front_note: str = "") -> None:
    """Page 1 shows before it tells: the figure of one table (:func:`.summary.headline`: a committed
    snapshot shown beside, else the first table with published numbers), its verdicts in one line,
    its notice beside it when it has one, ``front_note`` (which table is which), then one line per
    other table, naming its section. Other tables' notices stay beside their own tables."""
    k = summary.headline(reports)
    report = reports[k]
    blocks = [(textwrap.wrap(summary.verdict_line(report), 100, subsequent_indent="    "), 13, {"weight": "bold"})]
    rest = summary.uncompared(report)
    if rest:
        blocks.append(([f"{rest[1:-1]}; every cell with its rule: section {k + 1}"], 9.5, {}))
    if notice(report):
        blocks.append((textwrap.wrap(notice(report).replace("`", ""), 140), 9.5,
                       {"color": "#b00020", "weight": "bold"}))
    if front_note:
        blocks.append(([w for part in front_note.split("\n") for w in textwrap.wrap(part, 150)], 9,
                       {"color": "#0b3d91", "weight": "bold"}))
    others = [" ".join(filter(None, [summary.verdict_line(other), summary.uncompared(other)])) + f" - section {i}"
              + ("; its own notice, beside its table, says how its setup differs from the paper's"
                 if notice(other) else "")
              for i, other in enumerate(reports, start=1) if other is not report]
    lines = [w for line in (["Also in this report:"] + others if others else []) +
             ["Runs, code commit, device, compute time, labels and Kendall tau per table: page 2 (summary)."]
             for w in textwrap.wrap(line, 150, subsequent_indent="    ")]
    text_h = sum(_block_height(b[0], b[1]) for b in blocks) + _block_height(lines, 9)
    top = 0.85
    fig = doc.new_page(f"Reproduction report: {paper}")
    shows = ("ours − paper per cell (blue: ours higher, red: lower), its verdict under each value"
             if report.table["diff"].notna().any() else
             f"ours per cell (mean ± {report.metric.pm}); the paper prints no number to compare with")
    fig.text(0.04, 0.885, f"{report.suite.raw.get('table', report.suite.name)} ({report.suite.key}), section "
             f"{k + 1}: {shows}", fontsize=9.5, va="top")
    y = _headline_figure(fig, report, top, top - BOTTOM - text_h)
    for block, size, style in blocks:
        y = _lines_at(fig, y, block, size, **style)
    room = int((y - BOTTOM) / (9 * 1.3 / 72 / PAGE[1]))
    if len(lines) > room:
        lines = lines[:max(room - 1, 0)] + ["... (page 2 lists every table)"]
    _lines_at(fig, y, lines)
    doc.save(fig, "overview")


def summary_page(doc: ReportPdf, paper: str, reports: list[SuiteReport], beside: int = 0) -> None:
    """Page 2: the title lines, each table's notice (named), then the summary: verdict counts per
    table, the labels, Kendall's tau per table and the switches in force (:mod:`.summary`), cut to
    fit one page. The title lines count the paper's own runs only (the first ``beside`` reports are
    tables shown beside them)."""
    fig = doc.new_page(f"Summary: {paper}")
    lines = title_lines(paper, reports[beside:])
    fig.text(0.04, 0.885, "\n".join(lines), fontsize=9, va="top", linespacing=1.45)
    y = 0.885 - len(lines) * 9 * 1.45 / 72 / PAGE[1] - 0.02
    notices = [f"{r.suite.key}: {notice(r)}".replace("`", "") for r in reports if notice(r)]
    y = _lines_at(fig, y, [w for n in notices for w in textwrap.wrap(n, 150)], 9, color="#b00020", weight="bold")
    fig.text(0.04, y, "Verdicts per table", fontsize=12, weight="bold", va="top")
    y -= 0.035
    rows = summary.count_rows(reports)
    height = (len(rows) + 1) * 0.028
    ax = fig.add_axes([0.04, y - height, 0.92, height])
    ax.axis("off")
    table = ax.table(cellText=rows, colLabels=summary.HEADER, loc="upper center", cellLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.auto_set_column_width(list(range(len(summary.HEADER))))
    for (r, _), cell in table.get_celld().items():
        if r == 0:
            cell.set_facecolor("#e8e8e8")
    y -= height + 0.02
    text = [w for line in summary.label_lines(reports) + summary.tau_lines(reports) + summary.switch_lines(reports)
            for w in textwrap.wrap(_plain(line), 125, subsequent_indent="    ")]
    room = int((y - BOTTOM) / SUMMARY_LINE_H)
    if len(text) > room:
        text = text[:max(room - 1, 0)] + ["... (cut to fit one page: each table's pages give the rest)"]
    fig.text(0.04, y, "\n".join(text), fontsize=9, va="top", linespacing=1.35)
    doc.save(fig, "summary")


def write_pdf(path: Path, paper: str, reports: list[SuiteReport], figures: list[dict],
              beside: int = 0, front_note: str = "") -> list[str]:
    """Render the paper's PDF; return the page titles. Page 1 is the overview (:func:`front_page`),
    page 2 the summary; then each table's section, whose pages carry that table's own notice (if
    any). The first ``beside`` reports are tables rendered beside the paper's own (a committed
    snapshot, ``pflbench run --beside-snapshot``)."""
    with atomic_path(path) as tmp:
        doc = ReportPdf(tmp, paper, "")
        front_page(doc, paper, reports, front_note)
        summary_page(doc, paper, reports, beside)
        for i, (report, figs) in enumerate(zip(reports, figures), start=1):
            doc.warning = notice(report).replace("`", "")
            suite_section(doc, i, report, figs)
        doc.close()
    return doc.pages
