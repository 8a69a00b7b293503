"""KLD-BatchNorm (docs/papers/fedl2p.md; paper Eq. 2) and functional BatchNorm state.

Unlike the project's other models (``pfl_core.models``: BatchNorm without running statistics),
FedL2P's ResNets keep BatchNorm statistics, and they are *state*, carried beside the parameters:

* ``init_running_mean`` / ``init_running_var``: the pretrained model's statistics (mu_pt, sigma2_pt);
* ``running_mean`` / ``running_var``: the client's statistics (momentum 0.1, unbiased batch variance);
* ``beta`` (0-d): the mixing ratio of the layer; 1 is plain BatchNorm, 0 the pretrained statistics.

Train mode normalises with (1-beta) mu_pt + beta mu_batch and (1-beta) sigma2_pt + beta sigma2_batch
(biased batch variance); eval mode with (1-beta) mu_pt + beta running_mean (and likewise the
variance); *init* mode (:func:`bn_mode`) with mu_pt, sigma2_pt alone (meta-net inputs, the server's
centralised test). Plain BatchNorm, as pretraining uses it, is beta = 1.

The layer never updates a buffer in place: :func:`forward_bn` calls the model functionally and
returns the updated running statistics, so a training step is a pure function that runs under
``torch.func.vmap`` (stacked clients, each with its own statistics) and ``torch.func.grad``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Literal, Mapping

import torch
import torch.nn as nn
from torch.func import functional_call

Buffers = dict[str, torch.Tensor]
BNMode = Literal["train", "eval", "init"]
#: the per-layer statistics a client carries (``<layer>.<name>``)
RUNNING = ("running_mean", "running_var", "num_batches_tracked")


class KLDBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose statistics mix the pretrained and the client's by ``beta`` (paper Eq. 2).

    A subclass of :class:`torch.nn.BatchNorm2d` so that its parameters and running statistics keep
    torchvision's names and initialisation (weight 1, bias 0); it adds ``init_running_mean``,
    ``init_running_var`` and ``beta`` buffers and replaces the forward (no in-place updates)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.register_buffer("init_running_mean", torch.zeros(num_features))
        self.register_buffer("init_running_var", torch.ones(num_features))
        self.register_buffer("beta", torch.tensor(1.0))
        self.init_mode = False
        #: (mean, unbiased variance) of the last train-mode batch, read by :func:`forward_bn`
        self.batch_stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"KLDBatchNorm2d expects (N, C, H, W) inputs, got shape {tuple(x.shape)}")
        if self.init_mode:
            mean, var = self.init_running_mean, self.init_running_var
        elif self.training:
            batch_mean = x.mean(dim=(0, 2, 3))
            batch_var = x.var(dim=(0, 2, 3), unbiased=False)
            n = x.numel() // x.shape[1]
            self.batch_stats = (batch_mean.detach(), batch_var.detach() * (n / max(n - 1, 1)))
            mean = (1 - self.beta) * self.init_running_mean + self.beta * batch_mean
            var = (1 - self.beta) * self.init_running_var + self.beta * batch_var
        else:
            mean = (1 - self.beta) * self.init_running_mean + self.beta * self.running_mean
            var = (1 - self.beta) * self.init_running_var + self.beta * self.running_var
        scale = self.weight * torch.rsqrt(var + self.eps)
        return x * scale[None, :, None, None] + (self.bias - mean * scale)[None, :, None, None]


def buffer_key(layer: str, name: str) -> str:
    """The functional-call key of buffer ``name`` of BN layer ``layer`` ("" for the model itself)."""
    return f"{layer}.{name}" if layer else name


def bn_layers(model: nn.Module) -> list[tuple[str, KLDBatchNorm2d]]:
    """The model's KLD-BN layers with their names, in registration order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, KLDBatchNorm2d)]


def bn_names(model: nn.Module) -> list[str]:
    return [name for name, _ in bn_layers(model)]


def has_bn_state(model: nn.Module) -> bool:
    """Whether the model keeps BatchNorm statistics (has KLD-BN layers)."""
    return any(isinstance(m, KLDBatchNorm2d) for m in model.modules())


def keeps_bn_state(builder):
    """Mark a registered model builder whose models have KLD-BN layers (:func:`has_bn_state`), so
    that a configuration can be checked before any model is built
    (:func:`pfl_core.models.model_keeps_bn_state`; tested against the built models)."""
    builder.keeps_bn_state = True
    return builder


@contextmanager
def bn_mode(model: nn.Module, mode: BNMode) -> Iterator[nn.Module]:
    """Put ``model`` in ``train``, ``eval`` or ``init`` mode (eval with the pretrained statistics
    alone, "init mode") for the block, and restore its modes afterwards."""
    if mode not in ("train", "eval", "init"):
        raise ValueError(f"bn mode must be train, eval or init, got {mode!r}")
    training = {m: m.training for m in model.modules()}
    layers = [m for _, m in bn_layers(model)]
    init = [m.init_mode for m in layers]
    model.train(mode == "train")
    for m in layers:
        m.init_mode = mode == "init"
    try:
        yield model
    finally:
        for m, was in training.items():
            m.training = was
        for m, was in zip(layers, init):
            m.init_mode = was


def model_buffers(model: nn.Module) -> Buffers:
    """Detached copies of the model's BN buffers (its initial state: statistics 0/1, beta 1)."""
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def forward_bn(model: nn.Module, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
               x: torch.Tensor) -> tuple[torch.Tensor, Buffers]:
    """Logits of ``model`` with ``params`` and ``buffers`` on ``x``, and the buffers after the call.

    In train mode each layer's ``running_mean``/``running_var`` move toward the batch statistics
    with its momentum (0.1; unbiased variance, as ``torch.nn.BatchNorm2d``) and
    ``num_batches_tracked`` counts the batch; in eval and init mode the buffers are returned as
    given. Missing buffer keys fall back to the module's own. Nothing passed in is modified."""
    out = functional_call(model, {**params, **buffers}, (x,))
    layers = bn_layers(model)
    if not model.training or not layers or layers[0][1].init_mode:
        return out, dict(buffers)
    new = dict(buffers)
    for name, m in layers:
        batch_mean, batch_var = m.batch_stats
        m.batch_stats = None
        mean, var = (buffers.get(buffer_key(name, k), getattr(m, k)) for k in ("running_mean", "running_var"))
        new[buffer_key(name, "running_mean")] = (1 - m.momentum) * mean + m.momentum * batch_mean
        new[buffer_key(name, "running_var")] = (1 - m.momentum) * var + m.momentum * batch_var
        new[buffer_key(name, "num_batches_tracked")] = buffers.get(buffer_key(name, "num_batches_tracked"), m.num_batches_tracked) + 1
    return out, new


def running_stats(model: nn.Module, buffers: Mapping[str, torch.Tensor]) -> Buffers:
    """The ``running_mean``/``running_var`` entries of ``buffers`` (what a pretrained state keeps)."""
    return {buffer_key(n, k): buffers[buffer_key(n, k)] for n in bn_names(model) for k in ("running_mean", "running_var")}


def set_betas(buffers: Mapping[str, torch.Tensor], names: list[str], betas: torch.Tensor) -> Buffers:
    """``buffers`` with layer ``names[j]``'s ``beta`` set to ``betas[j]`` (may carry a gradient)."""
    if betas.shape[-1] != len(names):
        raise ValueError(f"{betas.shape[-1]} betas for {len(names)} BN layers")
    return {**buffers, **{buffer_key(name, "beta"): betas[..., j] for j, name in enumerate(names)}}


def load_pretrained(model: nn.Module, state: Mapping, running_init: Literal["reset", "pretrained"] = "reset"
                    ) -> tuple[dict[str, torch.Tensor], Buffers]:
    """(params, buffers) of a client starting from a pretrained state (contract: ``{"params",
    "buffers"}`` with each layer's ``running_mean``/``running_var``).

    The pretrained statistics become ``init_running_mean``/``init_running_var`` (mu_pt, sigma2_pt).
    The client's running statistics restart at (0, 1) with the counter at 0 (``reset``: the
    FedL2P code's KLD-BN, docs/papers/fedl2p.md) or at the pretrained statistics (``pretrained``:
    the plain fine-tuning client, FT (BN C)). beta starts at 1."""
    if running_init not in ("reset", "pretrained"):
        raise ValueError(f"running_init must be 'reset' or 'pretrained', got {running_init!r}")
    stats, buffers = state["buffers"], {}
    for name, m in bn_layers(model):
        mean, var = stats[buffer_key(name, "running_mean")], stats[buffer_key(name, "running_var")]
        buffers[buffer_key(name, "init_running_mean")] = mean.detach().clone()
        buffers[buffer_key(name, "init_running_var")] = var.detach().clone()
        fresh = running_init == "reset"
        buffers[buffer_key(name, "running_mean")] = torch.zeros_like(mean) if fresh else mean.detach().clone()
        buffers[buffer_key(name, "running_var")] = torch.ones_like(var) if fresh else var.detach().clone()
        buffers[buffer_key(name, "num_batches_tracked")] = torch.zeros_like(m.num_batches_tracked)
        buffers[buffer_key(name, "beta")] = torch.ones((), dtype=mean.dtype, device=mean.device)
    params = {k: v.detach().clone() for k, v in state["params"].items()}
    return params, buffers
