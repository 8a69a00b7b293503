"""Early stopping on the validation history (docs/papers/metavers.md; switch
``federation.early_stopping``, off by default).

The rule is a pure function of the evaluations so far, so a run resumed from a checkpoint (whose
history is saved) decides exactly as the uninterrupted run.
"""
from __future__ import annotations

from typing import Iterable, Literal

PatienceRule = Literal["drop", "no_best"]


def stop_round(evaluations: Iterable[tuple[int, float]], rule: PatienceRule = "drop",
               patience: int = 10, after: int = 101, every: int = 0) -> int | None:
    """The evaluation round after which training stops, or None (``evaluations``: (round, val)
    in order, one every ``every`` rounds). As the code, the best and the previous value start at
    0; a value above the best is a new best and resets the counter; otherwise the counter grows
    by one when ``rule`` is

    * ``drop``: the value is lower than at the *previous* evaluation (MetaVers ``trainer.py``; an
      equal or higher value that is no new best leaves the counter as it is);
    * ``no_best``: always (``trainer_novel_class.py``, Table 6).

    The code checks ``counter > patience and epoch > after`` at the start of every epoch
    (MetaVers: 10 and ``min_epoch + 1`` = 101; Table 6: 10 and none), so once the counter exceeds
    ``patience`` at the evaluation of round r, no further evaluation happens if the next one
    (round r + ``every``) is above ``after``: training stops at r. A NaN value is never a best
    nor a drop."""
    best = previous = 0.0
    counter = 0
    for round_, value in evaluations:
        if value > best:
            best, counter = value, 0
        elif rule == "no_best" or value < previous:
            counter += 1
        previous = value
        if counter > patience and round_ + every > after:
            return round_
    return None
