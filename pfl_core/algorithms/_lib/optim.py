"""Functional optimisers whose state persists per client across rounds.

The CAFeMe code keeps one ``torch.optim.Adam`` object per client: its moments and step counter
carry over between that client's participations, while the parameter values are reloaded from the
server model each round (docs/papers/cafeme.md, step 5). Here that state is a dict of
tensors (``step``, ``exp_avg``, ``exp_avg_sq``) kept in the client's state, and :func:`optimizer_step`
is a pure function of (parameters, gradients, state): the same code runs for one client
(sequential path) and vmapped over a stack of clients whose step counts differ (batched path).
It follows ``torch.optim.Adam`` / ``torch.optim.SGD`` with their default settings
(``tests/test_optim.py`` holds it against them).
"""
from __future__ import annotations

from typing import Mapping

import torch

from pfl_core.training import Params

OPTIMIZERS = ("adam", "sgd")
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def init_optimizer_state(name: str, params: Mapping[str, torch.Tensor]) -> dict:
    """A fresh state for ``params``: Adam's zero moments and step 0; SGD (no momentum) has none."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; allowed: {list(OPTIMIZERS)}")
    if name == "sgd":
        return {}
    device = next(iter(params.values())).device
    return {
        "step": torch.zeros((), dtype=torch.float64, device=device),
        "exp_avg": {k: torch.zeros_like(v) for k, v in params.items()},
        "exp_avg_sq": {k: torch.zeros_like(v) for k, v in params.items()},
    }


def optimizer_step(name: str, params: Params, grads: Mapping[str, torch.Tensor], state: dict,
                   lr: float, weight_decay: float = 0.0) -> tuple[Params, dict]:
    """One update of ``params`` (only the names in ``grads``); returns (new params, new state).

    ``weight_decay`` is torch's coupled L2 (``torch.optim.Adam(weight_decay=...)``, not AdamW):
    g <- g + weight_decay * p before the moments (the MetaVers code's CIFAR-10 optimizer).

    Adam, as ``torch.optim.Adam`` (single-tensor form): m <- lerp(m, g, 1 - b1);
    v <- b2 v + (1 - b2) g^2; p <- p - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps).
    The step count t is a tensor so that clients with different counts can be stacked.
    """
    with torch.no_grad():
        if weight_decay:
            grads = {k: g + weight_decay * params[k] for k, g in grads.items()}
        if name == "sgd":
            return {k: p - lr * grads[k] if k in grads else p for k, p in params.items()}, state
        if name != "adam":
            raise ValueError(f"unknown optimizer {name!r}; allowed: {list(OPTIMIZERS)}")
        beta1, beta2 = ADAM_BETAS
        step = state["step"] + 1
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
        new_params, exp_avg, exp_avg_sq = dict(params), {}, {}
        for k, g in grads.items():
            exp_avg[k] = torch.lerp(state["exp_avg"][k], g, 1 - beta1)
            exp_avg_sq[k] = state["exp_avg_sq"][k] * beta2 + (1 - beta2) * g * g
            denom = exp_avg_sq[k].sqrt() / bias_correction2_sqrt + ADAM_EPS
            new_params[k] = params[k] + (-step_size * exp_avg[k]) / denom
        return new_params, {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def client_optimizer_state(client_state: dict, key: str, name: str, params: Mapping[str, torch.Tensor],
                           persist: bool = True) -> dict:
    """The optimiser state stored under ``client_state[key]``, or a fresh one (first use, or
    ``persist=False``: no state carried between rounds)."""
    stored = client_state.get(key) if persist else None
    return stored if stored is not None else init_optimizer_state(name, params)


def clip_grad_norm(grads: Mapping[str, torch.Tensor], max_norm: float) -> Params:
    """``grads`` scaled as ``torch.nn.utils.clip_grad_norm_`` does: by min(1, max_norm /
    (total L2 norm + 1e-6)), as pure tensor code (no branching; runs under vmap). ``max_norm``
    0 returns ``grads`` unchanged."""
    if max_norm <= 0:
        return dict(grads)
    total = torch.sqrt(sum((g * g).sum() for g in grads.values()))
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    return {k: g * coef for k, g in grads.items()}


def sgd_momentum_step(params: Params, grads: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                      lr: float, momentum: float, weight_decay: float) -> tuple[Params, Params]:
    """One ``torch.optim.SGD(lr, momentum, weight_decay)`` step (dampening 0, no Nesterov) on the
    names in ``grads``; ``buffers`` start as zeros (equal to torch's first-step ``buf = g``).
    Returns (new params, new momentum buffers)."""
    with torch.no_grad():
        new_params, new_buffers = dict(params), {}
        for k, g in grads.items():
            d = g + weight_decay * params[k] if weight_decay else g
            new_buffers[k] = momentum * buffers[k] + d
            new_params[k] = params[k] - lr * new_buffers[k]
        return new_params, new_buffers
