"""Functional training primitives: parameters live in a dict and models are called through
``torch.func.functional_call`` (DESIGN.md, "Algorithms"). A client update is a pure function of
(parameters, batches): meta-learning methods differentiate through it, and the batched engine
(:mod:`pfl_core.engine`) vectorises it over a stack of clients with ``torch.func.vmap``.

:func:`value_and_grad` is the one gradient primitive of the core: eager ``torch.autograd.grad`` on
one model (the sequential path, cheapest there) and ``torch.func.grad_and_value`` inside a
``torch.func`` transform (the batched path), so a method's update is written once for both."""
from __future__ import annotations

import inspect
from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_map

Params = dict[str, torch.Tensor]


def model_params(model: nn.Module) -> Params:
    """Detached copies of a module's parameters (the module itself stays a stateless template)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def clone_params(params: Mapping[str, torch.Tensor]) -> Params:
    return {name: p.detach().clone() for name, p in params.items()}


def forward(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return functional_call(model, dict(params), (x,))


def embed(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The model's feature embedding of ``x`` (``forward(x, embed=True)``): the layer prototype
    methods and the ``-Proto`` evaluation read (e.g. ReLU(fc2) of ``lenet``)."""
    if "embed" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"model {type(model).__name__} has no feature embedding: its forward takes no "
            "``embed`` flag (prototype methods and -Proto evaluation need one, e.g. model lenet)"
        )
    return functional_call(model, dict(params), (x,), {"embed": True})


def batch_loss(model: nn.Module, params: Mapping[str, torch.Tensor], x, y) -> torch.Tensor:
    """Mean cross-entropy of the model with ``params`` on one batch."""
    return F.cross_entropy(forward(model, params, x), y)


def in_transform() -> bool:
    """True inside a ``torch.func`` transform (``vmap``, ``grad``): eager autograd cannot run there."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def value_and_grad(loss_fn: Callable[..., torch.Tensor], params: Params, *args,
                   has_aux: bool = False) -> tuple[Params, torch.Tensor]:
    """(d loss_fn(params, *args) / d params, loss) with the loss detached.

    Outside any transform: ``torch.autograd.grad`` on detached leaf copies (the sequential path,
    unchanged numbers). Inside one: ``torch.func.grad_and_value``, which composes with ``vmap``
    over stacked clients and with an outer ``grad`` (second-order methods).

    ``has_aux``: ``loss_fn`` returns ``(loss, aux)`` (a pytree of tensors, e.g. a statistic the
    loss computed on the way); the result is then ``(grads, (loss, aux))``, both detached."""
    detach = lambda out: tree_map(lambda t: t.detach(), out)
    if in_transform():
        grads, out = torch.func.grad_and_value(loss_fn, has_aux=has_aux)(dict(params), *args)
        return grads, detach(out)
    with torch.enable_grad():
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        out = loss_fn(leaves, *args)
        grads = torch.autograd.grad(out[0] if has_aux else out, list(leaves.values()))
    return dict(zip(leaves, grads)), detach(out)


def gradients(model: nn.Module, params: Params, x, y) -> tuple[Params, torch.Tensor]:
    """(d loss / d params, loss) at ``params`` on one batch; the loss is returned detached."""
    return value_and_grad(lambda p, x, y: batch_loss(model, p, x, y), params, x, y)


def sgd_step(
    model: nn.Module,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    prox_mu: float = 0.0,
    prox_anchor: Mapping[str, torch.Tensor] | None = None,
) -> tuple[Params, torch.Tensor]:
    """One SGD step ``p <- p - lr * (grad + mu * (p - anchor))``; the proximal term is optional.

    Returns the new (detached) parameters and the loss before the step.
    """
    grads, loss = gradients(model, params, x, y)
    with torch.no_grad():
        new = {}
        for name, p in params.items():
            g = grads[name]
            if prox_mu:
                g = g + prox_mu * (p - prox_anchor[name])
            new[name] = p - lr * g
    return new, loss


def average_params(updates: Iterable[Mapping[str, torch.Tensor]], weights: Iterable[float]) -> Params:
    """Weighted average of parameter dicts; weights are normalised to sum to one."""
    updates, weights = list(updates), [float(w) for w in weights]
    if not updates:
        raise ValueError("cannot average zero updates")
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"aggregation weights must sum to a positive number, got {weights}")
    with torch.no_grad():
        return {
            name: sum(w / total * u[name] for u, w in zip(updates, weights))
            for name in updates[0]
        }


def all_finite(params: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in params.values())
