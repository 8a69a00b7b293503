"""What an evaluation returns: per-client curves and their summaries."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pfl_core.training import DivergenceError


@dataclass
class ClientResult:
    """One client's evaluation: accuracy and loss after 0..steps personalization steps."""

    cid: int
    num_samples: int
    acc: list[float]
    loss: list[float]


@dataclass
class EvalResult:
    clients: list[ClientResult]
    summary: dict[str, float] = field(default_factory=dict)
    curve_mean: list[float] = field(default_factory=list)
    curve_weighted: list[float] = field(default_factory=list)
    arrays: dict[str, dict] = field(default_factory=dict)
    """Per-client arrays by artifact name (numpy arrays; logged as ``<name>.npz`` with the run)."""


def check_finite_results(results: list[ClientResult]) -> None:
    """Raise :class:`DivergenceError` at the first client and step whose evaluation loss is not
    finite (NaN parameters give a finite accuracy from argmax, so the loss is the witness)."""
    for result in results:
        for step, loss in enumerate(result.loss):
            if not math.isfinite(loss):
                raise DivergenceError(f"non-finite evaluation loss ({loss}) of client {result.cid} after "
                                      f"fine-tuning step {step} (0 = before fine-tuning)")


#: the scalar summaries of an evaluation (:func:`summarise`), logged per evaluation round and at the end
SUMMARY_KEYS = ("acc", "acc_weighted", "acc_last3", "acc_last3_weighted", "acc_step0", "eval_loss")


def summarise(results: list[ClientResult]) -> EvalResult:
    """Per-step unweighted client mean and sample-weighted mean, plus scalar summaries:
    ``acc`` / ``acc_weighted`` at the last step and ``acc_last3`` / ``acc_last3_weighted``, the
    mean of the last three steps (CAFeMe's table statistic, per seed)."""
    steps = len(results[0].acc)
    total = sum(r.num_samples for r in results)
    mean = [sum(r.acc[k] for r in results) / len(results) for k in range(steps)]
    weighted = [sum(r.acc[k] * r.num_samples for r in results) / total for k in range(steps)]
    loss = sum(r.loss[-1] for r in results) / len(results)
    summary = {
        "acc": mean[-1],
        "acc_weighted": weighted[-1],
        "acc_last3": sum(mean[-3:]) / len(mean[-3:]),
        "acc_last3_weighted": sum(weighted[-3:]) / len(weighted[-3:]),
        "acc_step0": mean[0],
        "eval_loss": loss,
    }
    return EvalResult(results, summary, mean, weighted)
