"""Does the paper's conclusion hold? Best method per column and Kendall's tau of the orderings.

A "column" is one combination of the suite's non-method axes (e.g. dataset x partition); within it
the methods are ranked by our mean and by the paper's. Only methods with both numbers count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from scipy.stats import kendalltau


@dataclass(frozen=True)
class Conclusion:
    column: str
    methods: int
    best_ours: str
    best_paper: str
    tau: float

    @property
    def best_holds(self) -> bool:
        return self.best_ours == self.best_paper


def column_conclusion(column: str, ours: dict[str, float], paper: dict[str, float],
                      higher_is_better: bool = True) -> Conclusion | None:
    """Best method on each side (the highest value, or the lowest for a lower-is-better metric) and
    Kendall's tau-b between the orderings (NaN for < 2 methods or a constant side); None when no
    method has both numbers."""
    both = [m for m in ours if m in paper and not math.isnan(ours[m]) and not math.isnan(paper[m])]
    if not both:
        return None
    pick = max if higher_is_better else min
    best_ours = pick(both, key=lambda m: ours[m])
    best_paper = pick(both, key=lambda m: paper[m])
    tau = math.nan
    if len(both) >= 2:
        tau = float(kendalltau([ours[m] for m in both], [paper[m] for m in both]).statistic)
    return Conclusion(column, len(both), best_ours, best_paper, tau)
