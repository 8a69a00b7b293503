"""Functional training primitives: parameters live in a dict and models are called through
``torch.func.functional_call`` (docs/adding-a-method.md). A client update is a pure function of
(parameters, batches): meta-learning methods differentiate through it, and the batched engine
(:mod:`pfl_core.engine`) vectorises it over a stack of clients with ``torch.func.vmap``.

Models with BatchNorm state (KLD-BN, :mod:`pfl_core.models.kld_bn`) also carry their running
statistics as a dict of tensors beside the parameters; :func:`bn_gradients` is the train-mode
gradient of such a model and returns the statistics after the batch. Models without BN state
never reach it (their methods pass ``buffers=None`` and take the functions below as before).

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

from pfl_core.models.kld_bn import RUNNING, Buffers, bn_mode, bn_names, forward_bn, has_bn_state


class DivergenceError(RuntimeError):
    """Training or evaluation fine-tuning produced a non-finite loss or parameters: the run FAILS;
    its accuracy never reaches a table."""


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


def partial_gradients(model: nn.Module, params: Params, trainable: list[str], x, y) -> tuple[Params, torch.Tensor]:
    """(d loss / d params[trainable], loss): the other parameters enter as constants."""
    frozen = {k: v for k, v in params.items() if k not in set(trainable)}
    return value_and_grad(lambda part, x, y: batch_loss(model, {**frozen, **part}, x, y),
                          {k: params[k] for k in trainable}, x, y)


def state_loss(model: nn.Module, params: Mapping[str, torch.Tensor], buffers: Buffers | None, x, y
               ) -> tuple[torch.Tensor, Buffers | None]:
    """(mean CE, buffers after the batch). ``buffers`` given (a model with BN state): train mode,
    batch statistics normalise and each layer's running statistics move toward them (momentum
    0.1, unbiased variance: :func:`~pfl_core.models.kld_bn.forward_bn`), as a forward of
    ``torch.nn.BatchNorm2d`` in train mode does. None: :func:`batch_loss` and None."""
    if buffers is None:
        return batch_loss(model, params, x, y), None
    with bn_mode(model, "train"):
        logits, new = forward_bn(model, params, buffers, x)
    return F.cross_entropy(logits, y), new


def bn_gradients(model: nn.Module, params: Params, buffers: Buffers, x, y,
                 trainable: list[str] | None = None) -> tuple[Params, torch.Tensor, Buffers]:
    """(d loss / d params[trainable], loss, buffers after the batch) of a model with BN state, in
    train mode (:func:`state_loss`): one step of a BatchNorm network in train mode. ``trainable``
    None: every parameter; otherwise the others enter as constants (a frozen part). Loss and
    buffers come back detached."""
    names = list(params) if trainable is None else list(trainable)
    frozen = {k: v for k, v in params.items() if k not in set(names)}
    grads, (loss, new) = value_and_grad(lambda part, b, x, y: state_loss(model, {**frozen, **part}, b, x, y),
                                        {k: params[k] for k in names}, buffers, x, y, has_aux=True)
    return grads, loss, new


def state_gradients(model: nn.Module, params: Params, buffers: Buffers | None, x, y,
                    trainable: list[str] | None = None) -> tuple[Params, torch.Tensor, Buffers | None]:
    """(grads, loss, buffers) of one training batch: :func:`bn_gradients` for a model with BN state
    (``buffers`` given); ``buffers`` None: :func:`gradients` (``trainable`` None) or the gradient of
    the ``trainable`` part alone, exactly as before, and None for the buffers."""
    if buffers is not None:
        return bn_gradients(model, params, buffers, x, y, trainable)
    if trainable is None:
        return (*gradients(model, params, x, y), None)
    return (*partial_gradients(model, params, trainable, x, y), None)


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


def initial_bn_state(model: nn.Module) -> Buffers | None:
    """Copies of the running statistics a model with BN state starts from (per layer
    ``running_mean`` 0, ``running_var`` 1, ``num_batches_tracked`` 0, as ``torch.nn.BatchNorm2d``);
    None for a model without BN state. The other KLD-BN buffers (``init_running_*``, ``beta`` = 1:
    plain BatchNorm) are not carried: :func:`~pfl_core.models.kld_bn.forward_bn` reads the module's."""
    if not has_bn_state(model):
        return None
    buffers = dict(model.named_buffers())
    return {f"{n}.{k}": buffers[f"{n}.{k}"].detach().clone() for n in bn_names(model) for k in RUNNING}


def average_buffers(updates: Iterable[Mapping[str, torch.Tensor]], weights: Iterable[float]) -> Buffers:
    """Weighted average of BN running statistics, as the FedL2P code's server averages them: its
    flwr client uploads the whole ``state_dict`` (``ClassificationClient.get_parameters``:
    parameters *and* buffers) and flwr's FedAvg takes the n_k-weighted mean of every array.
    Float statistics: :func:`average_params`. Integer counters (``num_batches_tracked``): the
    floor of the weighted mean, as the code's float mean copied into the int64 buffer by
    ``load_state_dict`` truncates (exact here: computed in float64 from integer counts)."""
    updates, weights = list(updates), [float(w) for w in weights]
    floats = [{k: v for k, v in u.items() if v.is_floating_point()} for u in updates]
    average = average_params(floats, weights) if floats[0] else {}
    total = sum(weights)
    for name, value in updates[0].items():
        if not value.is_floating_point():
            mean = sum(w * u[name].double() for u, w in zip(updates, weights)) / total
            average[name] = torch.floor(mean).to(value.dtype)
    return {name: average[name] for name in updates[0]}


def all_finite(params: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in params.values())
