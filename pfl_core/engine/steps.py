"""Helpers for writing a :meth:`local_update` once for one client and for a padded stack."""
from __future__ import annotations

from typing import Any

import torch

from pfl_core.engine.trees import tree_where


def masked_update(mask: torch.Tensor | None, step: int, new: Any, old: Any) -> Any:
    """The state after step ``step``: ``new``, or ``old`` where the step is padding (``mask[step]``
    False, batched path with unequal step counts). No mask: ``new`` (no extra work)."""
    return new if mask is None else tree_where(mask[step], new, old)


def masked_mean(losses: list[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of the per-step losses over the real (unmasked) steps."""
    stacked = torch.stack(losses)
    if mask is None:
        return stacked.mean()
    weights = mask[: len(losses)].to(stacked.dtype)
    return (stacked * weights).sum() / weights.sum()
