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
    #: methods with a published number but no value of ours in this column (not run yet)
    not_run: tuple[str, ...] = ()
    #: the paper's best over every method it reports in the column, run or not
    paper_top: str = ""
    #: other methods whose value of ours equals ``best_ours`` exactly (e.g. CGPFL-Heur choosing K = 4
    #: computes what CGPFL-K4 computes); the paper's best among them is named ``best_ours``
    tied: tuple[str, ...] = ()

    @property
    def best_ours_text(self) -> str:
        """``best_ours``, with the methods tied with it."""
        return self.best_ours + (f" (tied with {', '.join(self.tied)})" if self.tied else "")

    @property
    def best_holds(self) -> bool:
        """The best of ours is the paper's best among the methods that have both numbers."""
        return self.best_ours == self.best_paper

    @property
    def provisional(self) -> bool:
        """No verdict yet: one method alone has both numbers (nothing is ranked), or the paper's best
        method in this column has no run of ours (the comparison is among the methods run so far and
        can change once it runs)."""
        return self.methods < 2 or self.paper_top != self.best_paper


def column_conclusion(column: str, ours: dict[str, float], paper: dict[str, float],
                      higher_is_better: bool = True) -> Conclusion | None:
    """Best method on each side (the highest value, or the lowest for a lower-is-better metric) and
    Kendall's tau-b between the orderings (NaN for < 2 methods or a constant side); None when no
    method has both numbers. Methods the paper reports that have no value of ours are kept by name
    (``not_run``), and the paper's best over all of them (``paper_top``)."""
    both = [m for m in ours if m in paper and not math.isnan(ours[m]) and not math.isnan(paper[m])]
    if not both:
        return None
    pick = max if higher_is_better else min
    published = [m for m in paper if not math.isnan(paper[m])]
    not_run = tuple(m for m in published if m not in both)
    best_ours = pick(both, key=lambda m: ours[m])
    best_paper = pick(both, key=lambda m: paper[m])
    ties = [m for m in both if ours[m] == ours[best_ours]]
    if best_paper in ties:  # a tie with the paper's best is not a miss: name the paper's best
        best_ours = best_paper
    tied = tuple(m for m in ties if m != best_ours)
    tau = math.nan
    if len(both) >= 2:
        tau = float(kendalltau([ours[m] for m in both], [paper[m] for m in both]).statistic)
    return Conclusion(column, len(both), best_ours, best_paper, tau, not_run,
                      pick(published, key=lambda m: paper[m]), tied)
