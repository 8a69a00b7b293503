"""Reports: reproduced vs published numbers as tables (Markdown, LaTeX, CSV), figures and one PDF
per paper, with a verdict per cell.

Modules, from pure to I/O: :mod:`.metric` (the suite's metric section), :mod:`.stats` (spreads, the
CAFeMe curve statistic, best-validation selection), :mod:`.verdict` (the verdict rule),
:mod:`.conclusions` (best method, Kendall tau), :mod:`.fidelity` (switches), :mod:`.collect`
(MLflow), :mod:`.table` (per-cell numbers against the paper and the authors' code), :mod:`.text`,
:mod:`.figures`, :mod:`.summary` (the PDF's first page), :mod:`.pdf`, :mod:`.build`.
"""
from benchmarks.reporting.build import (REPORTS_DIR, RenderedPaper, RenderedSuite, paper_suites,
                                        render_paper, render_suite, sibling_suites, write_report)
from benchmarks.reporting.collect import collect_runs
from benchmarks.reporting.stats import spread

__all__ = ["REPORTS_DIR", "RenderedPaper", "RenderedSuite", "collect_runs", "paper_suites",
           "render_paper", "render_suite", "sibling_suites", "spread", "write_report"]
