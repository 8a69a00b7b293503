"""Render a suite (tables, figures) and a paper (every suite, one PDF) from the MLflow store."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt

from benchmarks.reporting.figures import suite_figures
from benchmarks.reporting.pdf import write_pdf
from benchmarks.reporting.table import SuiteReport, build_suite_report
from benchmarks.reporting.text import render_latex, render_markdown, tidy_csv
from benchmarks.suite.spec import Suite, load_suite
from benchmarks.store.tracking import Tracker
from pfl_core.atomic_file import atomic_path, write_text

REPORTS_DIR = Path("reports")


@dataclass
class RenderedSuite:
    report: SuiteReport
    md: Path
    csv: Path
    tex: Path
    pngs: list[Path]
    figures: dict = field(default_factory=dict, repr=False)


@dataclass
class RenderedPaper:
    paper: str
    pdf: Path
    pages: list[str]
    suites: list[RenderedSuite]
    seconds: float


def render_suite(suite: Suite, tracker: Tracker, profile: str = "paper", out_dir: Path = REPORTS_DIR,
                 keep_figures: bool = False) -> RenderedSuite:
    """Write ``<out_dir>/<paper>/<name>.{md,csv,tex}`` and ``<name>_<figure>.png``."""
    report = build_suite_report(suite, tracker, profile)
    folder = Path(out_dir) / suite.paper
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / suite.name
    md, csv, tex = stem.with_suffix(".md"), stem.with_suffix(".csv"), stem.with_suffix(".tex")
    write_text(md, render_markdown(report))
    with atomic_path(csv) as tmp:
        tidy_csv(report).to_csv(tmp, index=False)
    write_text(tex, render_latex(report))
    figures = suite_figures(report)
    pngs = []
    for name, fig in figures.items():
        pngs.append(folder / f"{suite.name}_{name}.png")
        with atomic_path(pngs[-1]) as tmp:
            fig.savefig(tmp, dpi=110)
        if not keep_figures:
            plt.close(fig)
    return RenderedSuite(report, md, csv, tex, pngs, figures if keep_figures else {})


def write_report(suite: Suite, tracker: Tracker, profile: str = "paper", out_dir: Path = REPORTS_DIR):
    """Tables and figures of one suite; returns (Markdown path, CSV path, the cell table)."""
    done = render_suite(suite, tracker, profile, out_dir)
    return done.md, done.csv, done.report.table


def paper_suites(paper: str, suites_dir: Path | None = None) -> list[Path]:
    """Every suite file of ``<suites_dir>/<paper>/`` (sorted); by default of the first folder of
    :func:`benchmarks.suite.packaged.suite_folders` that has any (./suites, then the packaged)."""
    from benchmarks.suite.packaged import suite_folders

    for folder in [Path(suites_dir)] if suites_dir else suite_folders():
        found = sorted((folder / paper).glob("*.yaml"))
        if found:
            return found
    return []


def render_paper(paper: str, suites: list[Suite], tracker: Tracker, profile: str = "paper",
                 out_dir: Path = REPORTS_DIR, beside: list[tuple[Suite, Tracker]] = (),
                 front_note: str = "") -> RenderedPaper:
    """Every suite's tables and figures under ``<out_dir>/<paper>/`` and ``<out_dir>/<paper>.pdf``.

    ``beside``: (suite, tracker) pairs rendered first in the PDF, at their ``paper`` profile, with
    their files under ``<out_dir>/<paper>/beside/`` (never over the user's own reports of those
    papers): e.g. the demo shows a committed paper-scale snapshot beside its own offline numbers,
    ``front_note`` saying on page 1 which is which."""
    started = time.perf_counter()
    shown = [render_suite(s, t, "paper", Path(out_dir) / paper / "beside", keep_figures=True) for s, t in beside]
    rendered = [render_suite(s, tracker, profile, out_dir, keep_figures=True) for s in suites]
    pdf = Path(out_dir) / f"{paper}.pdf"
    both = shown + rendered
    pages = write_pdf(pdf, paper, [r.report for r in both], [r.figures for r in both], len(shown), front_note)
    for r in both:
        r.figures.clear()
    return RenderedPaper(paper, pdf, pages, rendered, time.perf_counter() - started)


def sibling_suites(suite: Suite, loaded: dict[Path, Suite] | None = None) -> list[Suite]:
    """The suites of the same paper in the suite's folder (the paper's PDF covers all of them);
    ``loaded`` caches suites by resolved path, so each file is loaded once."""
    loaded = {} if loaded is None else loaded
    loaded.setdefault(suite.path.resolve(), suite)
    out = []
    for path in sorted(suite.path.parent.glob("*.yaml")):
        key = path.resolve()
        if key not in loaded:
            loaded[key] = load_suite(path)
        if loaded[key].paper == suite.paper:
            out.append(loaded[key])
    return out
