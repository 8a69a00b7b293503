"""Round learning-rate schedules of local training (docs/papers/fedl2p.md).

The FedL2P code sets each round's client lr on the server (``classification_app.py``
``get_fit_config_fn``), with 1-indexed rounds r:

* **step decay** (CIFAR-10): lr_r = lr * gamma ** #{m in milestones : r > m}; milestones [250, 375]
  and gamma 0.1 give 0.1 for r <= 250, 0.01 for 251..375 and 0.001 after;
* **exponential decay** (Speech Commands, ``app_utils.update_lr``): lr_r = lr * decay ** r with
  decay = (end_lr / start_lr) ** (1 / num_rounds); 0.1 -> 0.01 over 500 rounds is
  decay = 0.1 ** (1 / 500), i.e. lr_r = 0.1 * 0.1 ** (r / 500).

The lr is constant within a round. A method reads it on the host (:meth:`RoundLR.round_lr`) and
passes it into its pure update as a 0-d tensor in the carry (:func:`round_lr_carry`), so stacked
clients of the batched path still run one program. With no schedule (the default) the carry has
no ``lr`` and the update uses the float ``hp.lr`` exactly as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pfl_core.fields import PositiveFloat


@dataclass
class RoundLR:
    """A per-round schedule of ``lr`` (a mixin of a method's hyperparameters, which define ``lr``)."""

    lr_milestones: list[int] = field(default_factory=list)
    """1-indexed rounds after which the lr is multiplied by ``lr_gamma`` (step decay; FedL2P code
    ``app.on_fit.lr_decay.steps``, CIFAR-10 [250, 375]: lr_r = lr * gamma ** #{m : r > m}).
    Empty (default): no step decay."""
    lr_gamma: PositiveFloat = 0.1
    """Factor of each milestone (FedL2P code ``lr_decay.factors``: 0.1 at both CIFAR-10 steps)."""
    lr_decay: PositiveFloat = 1.0
    """Exponential decay per round: lr_r = lr * lr_decay ** r (FedL2P code ``update_lr``, gamma =
    (end_lr / start_lr) ** (1 / num_rounds); Speech Commands 0.1 ** (1 / 500) =
    0.9954054173515269). 1 (default): none. Exclusive with ``lr_milestones``."""

    def __post_init__(self) -> None:
        if any(not isinstance(m, int) or m < 1 for m in self.lr_milestones):
            raise ValueError(f"lr_milestones must be positive round numbers, got {self.lr_milestones}")
        if list(self.lr_milestones) != sorted(set(self.lr_milestones)):
            raise ValueError(f"lr_milestones must be strictly increasing, got {self.lr_milestones}")
        if self.lr_milestones and self.lr_decay != 1.0:
            raise ValueError("set either lr_milestones (step decay) or lr_decay (exponential decay), not "
                             "both (the FedL2P code uses the steps when given, else the exponential)")

    @property
    def scheduled(self) -> bool:
        """Whether the lr changes over the rounds."""
        return bool(self.lr_milestones) or self.lr_decay != 1.0

    def round_lr(self, round_idx: int) -> float:
        """The local lr of round ``round_idx`` (0-indexed; the code's round r = round_idx + 1)."""
        r = round_idx + 1
        if self.lr_milestones:
            return self.lr * self.lr_gamma ** sum(r > m for m in self.lr_milestones)
        return self.lr * self.lr_decay ** r


def round_lr_carry(hp, round_idx: int, like: torch.Tensor) -> dict:
    """``{"lr": 0-d tensor}`` (dtype and device of ``like``) when ``hp`` schedules its lr, else
    ``{}``: the update then uses the float ``hp.lr``, the unscheduled path of old."""
    if not (isinstance(hp, RoundLR) and hp.scheduled):
        return {}
    return {"lr": torch.tensor(hp.round_lr(round_idx), dtype=like.dtype, device=like.device)}
