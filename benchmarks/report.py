"""Compatibility entry point: the reporting layer lives in :mod:`benchmarks.reporting`."""
from benchmarks.reporting import (REPORTS_DIR, collect_runs, paper_suites, render_paper,  # noqa: F401
                                  render_suite, sibling_suites, spread, write_report)
