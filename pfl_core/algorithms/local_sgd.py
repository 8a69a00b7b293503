"""Local SGD on one client, shared by FedAvg, FedAvg-FT and Local."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pfl_core.algorithms.base import ClientContext
from pfl_core.training import Params, sgd_step


@dataclass
class LocalSGDHyper:
    """Local training shared by FedAvg-style methods."""

    lr: float = 0.001
    """Local SGD learning rate (CAFeMe code baselines: ``lr_outer`` = 0.001)."""
    local_epochs: int = 5
    """Full passes over the client's train split per round (CAFeMe code: S = 5 epochs)."""
    local_steps: int = 0
    """If > 0, take this many batches from the cyclic stream instead of ``local_epochs`` passes."""


def local_sgd(model: nn.Module, params: Params, client: ClientContext, hp: LocalSGDHyper) -> tuple[Params, torch.Tensor]:
    """Plain SGD from ``params`` on the client's train split; returns (params, mean loss)."""
    if hp.local_steps > 0:
        batches = (client.next_batch() for _ in range(hp.local_steps))
    else:
        batches = (batch for _ in range(hp.local_epochs) for batch in client.epoch())
    losses = []
    for x, y in batches:
        params, loss = sgd_step(model, params, x, y, hp.lr)
        losses.append(loss)
    if not losses:
        raise ValueError(f"client {client.cid}: local training took no step (local_epochs=0?)")
    return params, torch.stack(losses).mean()
