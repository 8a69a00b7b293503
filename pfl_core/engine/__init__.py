"""The execution engine: how the sampled clients of a round (and the seeds of a cell) are run.

See :mod:`pfl_core.engine.executor` for the program interface a method implements once to get
both the sequential (reference) and the batched (vmapped) path.
"""
from pfl_core.engine.executor import EXECUTIONS, Executor, WorkItem, run_program
from pfl_core.engine.steps import masked_mean, masked_update

__all__ = ["EXECUTIONS", "Executor", "WorkItem", "masked_mean", "masked_update", "run_program"]
