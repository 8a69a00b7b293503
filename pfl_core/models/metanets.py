"""FedL2P's meta-nets (docs/papers/fedl2p.md; paper Appendix E; code ``weight_net.py``).

* BNNet: xi (one KL divergence per BN layer) -> one beta per BN layer in [0, 1].
* LRNet: x (mean and std of every learnable module's input) -> one multiplier per parameter tensor
  in [0, 1000]; the learning rate of tensor j is eta_j = m_j * eta_tilde_j.

Both are Linear -> ReLU -> Linear -> ReLU -> Linear (two hidden layers of 100, the code; the paper's
"one hidden layer" in Section 3.2 is docs/papers/fedl2p.md) ending in a clamp with a straight-through
estimator. Every Linear weight is xavier_normal (gain 0.1); biases are 0.5 (BNNet) and 1.0 (LRNet),
so beta starts near 0.5 and m near 1. For ResNet-18: BNNet 20 -> 20 (14,220 parameters), LRNet
82 -> 62 (24,662), eta_tilde 62: lambda = 38,944 scalars.
"""
from __future__ import annotations

import torch
import torch.nn as nn

HIDDEN = 100


def ste_clamp(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Clamp in the forward pass, identity in the backward pass (straight-through estimator):
    the gradient flows even where the value was clamped (docs/papers/fedl2p.md)."""
    return x + (x.clamp(low, high) - x).detach()


def _mlp(d_in: int, d_out: int, bias: float) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(d_in, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                        nn.Linear(HIDDEN, d_out))
    for layer in net:
        if isinstance(layer, nn.Linear):
            nn.init.xavier_normal_(layer.weight, gain=0.1)
            nn.init.constant_(layer.bias, bias)
    return net


class BNNet(nn.Module):
    """xi [num_bn] -> beta [num_bn], clamped to [0, 1] with the STE."""

    def __init__(self, num_bn: int):
        super().__init__()
        self.net = _mlp(num_bn, num_bn, 0.5)

    def forward(self, xi: torch.Tensor) -> torch.Tensor:
        return ste_clamp(self.net(xi), 0.0, 1.0)


class LRNet(nn.Module):
    """x [2 * num_modules] -> lr multipliers [num_tensors], clamped to [0, 1000] with the STE."""

    def __init__(self, num_modules: int, num_tensors: int):
        super().__init__()
        self.net = _mlp(2 * num_modules, num_tensors, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ste_clamp(self.net(x), 0.0, 1000.0)


class MetaNets(nn.Module):
    """lambda: BNNet, LRNet and eta_tilde (one learnable post-multiplier per parameter tensor,
    initialised to ``eta_init``: 1e-3 CIFAR-10/10-C, 1e-2 Office, DomainNet, Speech Commands; not
    constrained to be positive). ``bn_net=False`` / ``lr_net=False`` leave a part out (Table 5's
    ablations); eta_tilde exists with the LRNet only. Used through ``functional_call`` on a dict
    of lambda's tensors."""

    def __init__(self, num_bn: int, num_modules: int, num_tensors: int, eta_init: float = 1e-3,
                 bn_net: bool = True, lr_net: bool = True):
        super().__init__()
        self.bn_net = BNNet(num_bn) if bn_net else None
        self.lr_net = LRNet(num_modules, num_tensors) if lr_net else None
        self.eta_tilde = nn.Parameter(torch.full((num_tensors,), float(eta_init))) if lr_net else None

    def forward(self, xi: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(betas or None, per-tensor learning rates eta = LRNet(x) * eta_tilde or None)."""
        betas = self.bn_net(xi) if self.bn_net is not None else None
        lrs = self.lr_net(x) * self.eta_tilde if self.lr_net is not None else None
        return betas, lrs
