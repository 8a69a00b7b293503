"""Local SGD on one client, shared by FedAvg, FedAvg-FT, IFCA and Local: the plan, the update; and
momentum SGD with weight decay (the pFedHN client optimiser) for the MetaVers baselines."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from pfl_core.engine.contract import ClientContext
from pfl_core.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, SGD_LR, Tune
from pfl_core.engine import masked_mean, masked_update
from pfl_core.engine.plans import Plan
from pfl_core.algorithms._lib.optim import sgd_momentum_step
from pfl_core.models.kld_bn import Buffers
from pfl_core.training import Params, bn_gradients, sgd_step


@dataclass
class LocalSGDHyper:
    """Local training shared by FedAvg-style methods."""

    lr: Annotated[PositiveFloat, SGD_LR] = 0.001
    """Local SGD learning rate (CAFeMe code baselines: ``lr_outer`` = 0.001)."""
    local_epochs: Annotated[NonNegativeInt, Tune(1, 5, order=1)] = 5
    """Full passes over the client's train split per round (CAFeMe code: S = 5 epochs)."""
    local_steps: Annotated[NonNegativeInt, Tune(1, 50, log=True, order=1)] = 0
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


def local_sgd(model: nn.Module, params: Params, batches: dict, masks: dict, lr: float | torch.Tensor,
              buffers: Buffers | None = None) -> tuple[Params, Buffers | None, torch.Tensor]:
    """Plain SGD from ``params`` over the plan's ``train`` batches; returns (params, buffers, mean
    loss). ``lr``: a float, or a 0-d tensor (a round's scheduled lr, :mod:`round_lr`).
    ``buffers``: the BN running statistics of a model with BN state, updated at every step (train
    mode, :func:`~pfl_core.training.bn_gradients`); None (a model without): :func:`sgd_step` as ever."""
    xs, ys = batches["train"]
    mask = masks.get("train")
    losses = []
    for step in range(len(xs)):
        if buffers is None:
            new, loss = sgd_step(model, params, xs[step], ys[step], lr)
            params = masked_update(mask, step, new, params)
        else:
            grads, loss, new_buffers = bn_gradients(model, params, buffers, xs[step], ys[step])
            with torch.no_grad():
                new = {k: p - lr * grads[k] for k, p in params.items()}
            params, buffers = masked_update(mask, step, (new, new_buffers), (params, buffers))
        losses.append(loss)
    return params, buffers, masked_mean(losses, mask)


@dataclass
class MomentumSGDHyper(LocalSGDHyper):
    """Local SGD with momentum and weight decay, a fresh optimiser every round: the pFedHN code's
    client training of its target LeNet (``inner_optim = SGD(lr=--inner-lr 5e-3, momentum=0.9,
    weight_decay=--inner-wd 5e-5)``, ``--inner-steps 50`` batches of ``--batch-size 64``), which the
    MetaVers baselines without values of their own take (issue 13: pFedHN / pFedGP values)."""

    lr: Annotated[PositiveFloat, SGD_LR] = 0.005
    """Local SGD learning rate (pFedHN code ``--inner-lr`` 5e-3)."""
    local_epochs: Annotated[NonNegativeInt, Tune(1, 5, order=1)] = 0
    """Full passes per round instead of ``local_steps`` (0: use ``local_steps``)."""
    local_steps: Annotated[NonNegativeInt, Tune(1, 50, log=True, order=1)] = 50
    """Batches per round from the cyclic stream (pFedHN code ``--inner-steps`` 50)."""
    momentum: NonNegativeFloat = 0.9
    """SGD momentum, buffer reset every round (pFedHN code: 0.9)."""
    weight_decay: NonNegativeFloat = 5e-5
    """L2 added to the gradient, ``torch.optim.SGD``'s ``weight_decay`` (pFedHN code ``--inner-wd`` 5e-5)."""


def momentum_sgd(loss_and_grads: Callable, params: Params, batches: dict, masks: dict,
                 hp: MomentumSGDHyper, observe: Callable | None = None, buffers: Buffers | None = None,
                 lr: float | torch.Tensor | None = None) -> tuple[Params, torch.Tensor, Any, Buffers | None]:
    """``torch.optim.SGD(lr, momentum, weight_decay)`` (no dampening, no Nesterov), created fresh,
    over the plan's ``train`` batches. ``loss_and_grads(params, x, y)`` returns (gradients of the
    trained parameters, loss); the other parameters are not changed. ``observe(params, x, y)``
    (optional) returns a pytree of tensors at each step, before the step; their sum over the real
    (unmasked) steps is returned. Returns (params, mean loss, observed sum or None, buffers).

    ``buffers``: the BN running statistics of a model with BN state; ``loss_and_grads`` is then
    called as ``(params, x, y, buffers)`` and returns (gradients, loss, buffers after the batch)
    (:func:`~pfl_core.training.state_gradients`). None: no BN state, as before. ``lr``: the round's
    scheduled lr (float or 0-d tensor, :mod:`round_lr`) instead of ``hp.lr``.

    The momentum buffer starts at zero, so its first value is the gradient itself, as in torch."""
    xs, ys = batches["train"]
    mask = masks.get("train")
    lr = hp.lr if lr is None else lr
    velocity, losses, observed = None, [], None
    for step in range(len(xs)):
        if observe is not None:
            seen = observe(params, xs[step], ys[step])
            if mask is not None:
                seen = tree_map(lambda v: v * mask[step].to(v.dtype), seen)
            observed = seen if observed is None else tree_map(torch.add, observed, seen)
        if buffers is None:
            grads, loss = loss_and_grads(params, xs[step], ys[step])
            new_buffers = None
        else:
            grads, loss, new_buffers = loss_and_grads(params, xs[step], ys[step], buffers)
        if velocity is None:
            velocity = {k: torch.zeros_like(g) for k, g in grads.items()}
        new, new_velocity = sgd_momentum_step(params, grads, velocity, lr, hp.momentum, hp.weight_decay)
        params, velocity, buffers = masked_update(mask, step, (new, new_velocity, new_buffers),
                                                  (params, velocity, buffers))
        losses.append(loss)
    return params, masked_mean(losses, mask), observed, buffers
