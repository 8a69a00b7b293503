"""The inputs of FedL2P's meta-nets, computed once per client on its training data (docs/papers/fedl2p.md;
paper Eq. 3 and 4).

The pretrained model runs in init mode (eval mode with the pretrained BN statistics,
:func:`pfl_core.models.kld_bn.bn_mode`) over the client's batches, and hooks read the *input* of
layers, merging batches with the exact parallel mean/variance formula (Chan et al.):

* xi (BNNet, one value per BN layer): per channel, the client's mean and unbiased variance of the
  layer's input over (N, H, W) against the pretrained statistics, as the symmetric divergence
  0.5 KL(P||Q) + 0.5 KL(Q||P) of P = N(mu_client, sigma_client), Q = N(mu_pt, sigma_pt), sigma =
  sqrt(var + 1e-5), averaged over channels. The code *prepends* each layer's value, so entry j is
  BN layer L-1-j (kept for weight-level parity).
* x (LRNet, two values per learnable module): the scalar mean and sqrt(unbiased variance + 1e-5)
  of all elements of the module's input, [mean, std] per module in registration order.

Pure tensor code: the batches are a list of tensors (they may differ in size), so the function
runs per client or under ``torch.func.vmap`` over stacked clients.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

from pfl_core.models.kld_bn import bn_layers, bn_mode
from pfl_core.models.resnet import learnable_modules

EPS = 1e-5


class _Moments:
    """Count, mean and sum of squared deviations, merged batch by batch (Chan's parallel formula)."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, None, None

    def add(self, values: torch.Tensor, dims: tuple[int, ...]) -> None:
        n = 1
        for d in dims:
            n *= values.shape[d]
        mean = values.mean(dim=dims)
        m2 = ((values - mean.reshape(_broadcast(values, dims))) ** 2).sum(dim=dims)
        if self.mean is None:
            self.n, self.mean, self.m2 = n, mean, m2
            return
        total = self.n + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta ** 2 * (self.n * n / total)
        self.n = total

    def variance(self) -> torch.Tensor:
        """The unbiased variance of everything added."""
        return self.m2 / max(self.n - 1, 1)


def _broadcast(values: torch.Tensor, dims: tuple[int, ...]) -> list[int]:
    """The shape that broadcasts a mean over ``dims`` back against ``values``."""
    return [1 if d in dims else s for d, s in enumerate(values.shape)]


def symmetric_kl(mu_p: torch.Tensor, var_p: torch.Tensor, mu_q: torch.Tensor, var_q: torch.Tensor) -> torch.Tensor:
    """0.5 KL(P||Q) + 0.5 KL(Q||P) for Gaussians with std sqrt(var + 1e-5), elementwise;
    KL(N(m1, s1^2) || N(m2, s2^2)) = log(s2/s1) + (s1^2 + (m1-m2)^2) / (2 s2^2) - 1/2."""
    s_p, s_q = (var_p + EPS).sqrt(), (var_q + EPS).sqrt()

    def kl(m1, s1, m2, s2):
        return torch.log(s2 / s1) + (s1 ** 2 + (m1 - m2) ** 2) / (2 * s2 ** 2) - 0.5

    return 0.5 * kl(mu_p, s_p, mu_q, s_q) + 0.5 * kl(mu_q, s_q, mu_p, s_p)


def meta_inputs(model: nn.Module, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                batches: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(xi [num_bn], x [2 * num_modules]) of one client: ``params``/``buffers`` are the pretrained
    model's (``buffers`` hold ``init_running_mean/var``, :func:`pfl_core.models.kld_bn.load_pretrained`),
    ``batches`` the client's (augmented) training images."""
    if not batches:
        raise ValueError("meta_inputs needs at least one batch of the client's training data")
    bns = bn_layers(model)
    modules = learnable_modules(model)
    channel = {name: _Moments() for name, _ in bns}
    scalar = {name: _Moments() for name, _ in modules}
    hooks = []

    def watch(name: str, per_channel: bool):
        def hook(_module, args):
            inp = args[0]
            if per_channel:
                channel[name].add(inp, (0, 2, 3))
            scalar[name].add(inp.reshape(-1), (0,))
        return hook

    for name, m in modules:
        hooks.append(m.register_forward_pre_hook(watch(name, name in channel)))
    try:
        with bn_mode(model, "init"):
            for x in batches:
                functional_call(model, {**params, **buffers}, (x,))
    finally:
        for h in hooks:
            h.remove()
    xi = []
    for name, m in bns:
        mu_pt = buffers.get(f"{name}.init_running_mean", m.init_running_mean)
        var_pt = buffers.get(f"{name}.init_running_var", m.init_running_var)
        xi.append(symmetric_kl(channel[name].mean, channel[name].variance(), mu_pt, var_pt).mean())
    x = []
    for name, _ in modules:
        x += [scalar[name].mean, (scalar[name].variance() + EPS).sqrt()]
    return torch.stack(xi[::-1]), torch.stack(x)
