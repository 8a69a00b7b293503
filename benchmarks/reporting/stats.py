"""Pure statistics over seeds: spreads, the CAFeMe curve statistic, best-validation selection.

Nothing here reads MLflow: every function takes plain numbers, so each convention is unit-tested
on hand-made values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def spread(values: Sequence[float], kind: str, ddof: int) -> float:
    """The paper's +- convention applied to our seeds: ``std`` or ``sem`` (std/sqrt(n)) with the
    given ddof; NaN for ``none`` or fewer than two seeds (one seed has no spread)."""
    x = np.asarray(list(values), dtype=float)
    n = len(x)
    if n < 2 or kind == "none" or n - ddof <= 0:
        return math.nan
    std = float(np.std(x, ddof=ddof))
    return std / math.sqrt(n) if kind == "sem" else std


def sem(values: Sequence[float]) -> float:
    """Standard error of the mean with the unbiased std (ddof=1): the verdict's statistic."""
    x = np.asarray(list(values), dtype=float)
    return float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) >= 2 else math.nan


def last3_of_seed_mean_curve(curves: Sequence[Sequence[float]], kind: str, ddof: int) -> tuple[float, float]:
    """(value, pm) of CAFeMe's statistic (docs/papers/cafeme.md, across runs).

    The per-seed curves (accuracy after 0..N personalization steps) are averaged over seeds; the
    value is the mean of the last three points of that mean curve, the pm the mean of the last three
    per-step spreads over seeds (population std, ddof 0, in the authors' code). A curve of one point
    (a method evaluated without fine-tuning) gives that point's mean and spread over seeds. Curves
    of unequal length are cut to the shortest.
    """
    if not curves:
        return math.nan, math.nan
    n_steps = min(len(c) for c in curves)
    if n_steps == 0:
        return math.nan, math.nan
    grid = np.array([list(c)[:n_steps] for c in curves], dtype=float)
    tail = grid[:, -3:]
    value = float(tail.mean(axis=0).mean())
    spreads = [spread(tail[:, k], kind, ddof) for k in range(tail.shape[1])]
    return value, float(np.mean(spreads)) if not any(map(math.isnan, spreads)) else math.nan


def per_seed_last3(curve: Sequence[float]) -> float:
    """One seed's share of the CAFeMe statistic: the mean of its curve's last three points."""
    tail = list(curve)[-3:]
    return float(np.mean(tail)) if tail else math.nan


@dataclass(frozen=True)
class Selection:
    round: int
    val: float
    test: float


def best_val_round(val: dict[int, float], test: dict[int, float], after: int = 0) -> Selection | None:
    """The test value at the evaluation round with the best validation value (docs/papers/metavers.md, model
    selection). Ties go to the earliest round, as a new best needs a
    strict improvement in the authors' code. Only rounds with both values count, and only rounds
    after ``after`` (a method's pretraining stage, the run's metric ``pretraining_rounds``:
    LG-FedAvg's FedAvg rounds score another model); None if none."""
    rounds = sorted(set(val) & set(test))
    rounds = [r for r in rounds if r > after and not math.isnan(val[r])]
    if not rounds:
        return None
    best = rounds[0]
    for r in rounds[1:]:
        if val[r] > val[best]:
            best = r
    return Selection(best, val[best], test[best])
