"""Optimisers over parameter dicts whose state persists per client across rounds.

The CAFeMe code keeps one ``torch.optim.Adam`` object per client: its moments and step counter
carry over between that client's participations, while the parameter values are reloaded from the
server model each round (CAFeMe spec, "CAFeMe client update", step 5). :class:`ClientOptimizer`
does exactly that on top of torch's own optimisers.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from pfl_core.training import Params

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


class ClientOptimizer:
    """A torch optimiser bound to leaf copies of a parameter dict.

    ``load(params)`` copies new values into the leaves (keeping the optimiser state);
    ``step(grads)`` applies one update and returns detached copies of the new values.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], name: str = "adam", **kwargs):
        if name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; allowed: {sorted(OPTIMIZERS)}")
        self.leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        self.optimizer = OPTIMIZERS[name](list(self.leaves.values()), **kwargs)

    def load(self, params: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, leaf in self.leaves.items():
                leaf.copy_(params[name])

    def step(self, grads: Mapping[str, torch.Tensor]) -> Params:
        for name, leaf in self.leaves.items():
            leaf.grad = grads[name].detach().clone() if name in grads else None
        self.optimizer.step()
        return {k: v.detach().clone() for k, v in self.leaves.items()}


def client_optimizer(state: dict, key: str, params: Mapping[str, torch.Tensor], persist: bool = True,
                     name: str = "adam", **kwargs) -> ClientOptimizer:
    """The client's optimiser stored under ``state[key]`` (created on first use), loaded with
    ``params``. With ``persist=False`` a fresh optimiser is made every call (no state carried)."""
    opt = state.get(key) if persist else None
    if opt is None:
        opt = ClientOptimizer(params, name, **kwargs)
        if persist:
            state[key] = opt
    else:
        opt.load(params)
    return opt
