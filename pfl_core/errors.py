"""Errors shared by the training loop and the evaluation protocols."""
from __future__ import annotations


class DivergenceError(RuntimeError):
    """Training or evaluation fine-tuning produced a non-finite loss or parameters: the run FAILS
    (docs/running-suites.md, "Failures"); its accuracy never reaches a table."""
