"""Local SGD on one client, shared by FedAvg, FedAvg-FT, IFCA and Local: the plan, the update."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pfl_core.algorithms.base import ClientContext
from pfl_core.config import NonNegativeInt, PositiveFloat
from pfl_core.engine import masked_mean, masked_update
from pfl_core.engine.plans import Plan
from pfl_core.training import Params, sgd_step


@dataclass
class LocalSGDHyper:
    """Local training shared by FedAvg-style methods."""

    lr: PositiveFloat = 0.001
    """Local SGD learning rate (CAFeMe code baselines: ``lr_outer`` = 0.001)."""
    local_epochs: NonNegativeInt = 5
    """Full passes over the client's train split per round (CAFeMe code: S = 5 epochs)."""
    local_steps: NonNegativeInt = 0
    """If > 0, take this many batches from the cyclic stream instead of ``local_epochs`` passes."""


def local_sgd_plan(client: ClientContext, hp: LocalSGDHyper) -> Plan:
    """``local_steps`` batches of the cyclic stream, or ``local_epochs`` full passes."""
    if hp.local_steps > 0:
        batches = [client.next_index() for _ in range(hp.local_steps)]
    else:
        batches = [index for _ in range(hp.local_epochs) for index in client.epoch_index()]
    if not batches:
        raise ValueError(f"client {client.cid}: local training took no step (local_epochs=0?)")
    return {"train": batches}


def local_sgd(model: nn.Module, params: Params, batches: dict, masks: dict, lr: float) -> tuple[Params, torch.Tensor]:
    """Plain SGD from ``params`` over the plan's ``train`` batches; returns (params, mean loss)."""
    xs, ys = batches["train"]
    mask = masks.get("train")
    losses = []
    for step in range(len(xs)):
        new, loss = sgd_step(model, params, xs[step], ys[step], lr)
        params = masked_update(mask, step, new, params)
        losses.append(loss)
    return params, masked_mean(losses, mask)
