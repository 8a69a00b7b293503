"""Early stopping on the validation history (MetaVers spec, "Early stopping"; switch
``federation.early_stopping``, off by default).

The rule is a pure function of the evaluations so far, so a run resumed from a checkpoint (whose
history is saved) decides exactly as the uninterrupted run.
"""
from __future__ import annotations

import math
from typing import Iterable, Literal

PatienceRule = Literal["drop", "no_best"]


def stop_round(evaluations: Iterable[tuple[int, float]], rule: PatienceRule = "drop",
               patience: int = 10, after: int = 101) -> int | None:
    """The evaluation round at which training stops, or None (``evaluations``: (round, val) in
    order). A strictly higher value than every earlier one is a new best and resets the counter;
    otherwise the counter grows by one when ``rule`` is

    * ``drop``: the value is lower than at the *previous* evaluation (MetaVers ``trainer.py``; an
      equal or higher value that is no new best leaves the counter as it is);
    * ``no_best``: always (``trainer_novel_class.py``, Table 6).

    Training stops at the first evaluation where counter > ``patience`` and round > ``after``
    (MetaVers: 10 and 101; Table 6: 10 and 0). A NaN value is never a best nor a drop."""
    best, previous, counter = -math.inf, None, 0
    for round_, value in evaluations:
        if value > best:
            best, counter = value, 0
        elif rule == "no_best" or (previous is not None and value < previous):
            counter += 1
        previous = value
        if counter > patience and round_ > after:
            return round_
    return None
