"""Per-FedAvg (Fallah et al., 2020) as the CAFeMe code runs it (CAFeMe spec, "Baselines as
implemented in the code": Per-FedAvg; code ``PerFedAvg_Client``).

From the global model theta, for each of S iterations, on successive train batches b1, b2, b3:

1. theta~ = theta - alpha * grad l(theta; b1)                      (a temporary copy)
2. g1 = grad l(theta~; b2)
3. HF (Hessian-free, the code): Hv = H l(theta; b3) @ g1, by the code's central difference
   [grad l(theta + delta g1; b3) - grad l(theta - delta g1; b3)] / (2 delta), delta = 1e-3,
   or exactly (``hvp="exact"``: double backward);
   theta <- theta - beta * g1 + beta * alpha * Hv                    (plain SGD; the code builds an
   Adam it never uses)
   FO (first order, ``variant="fo"``, not in the code): theta <- theta - beta * g1, no b3.
4. The code then draws one more batch only to log a loss; it still advances the batch stream
   (``skip_logging_batch``).

Server: uniform mean. At evaluation the code does not run Per-FedAvg's one-step adaptation: its
``perfl_eval`` is the common protocol (SGD at ``lr_ft`` over all parameters, decayed x0.8 every 5
steps, 50 steps), so ``finetune_at_eval`` is True and alpha plays no role at test time.

Note: on ReLU/max-pool networks the code's central difference (delta = 1e-3 along an unnormalised
gradient) crosses activation kinks, so it can differ from the exact product by O(1) in relative
norm (observed on ``cafeme_cnn_a``); ``hvp`` is therefore a switch that matters, not a detail.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, ClientContext, ClientUpdate, HyperParams, ServerState, Weighting
from pfl_core.config import PositiveFloat, PositiveInt
from pfl_core.training import Params, batch_loss, gradients, in_transform


@dataclass
class PerFedAvgHyper(HyperParams):
    alpha: PositiveFloat = 0.05
    """Inner (personalization) SGD step of theta~ (CAFeMe code ``lr_inner``: 0.05; FEMNIST 0.01)."""
    beta: PositiveFloat = 0.001
    """Outer plain-SGD step on theta (CAFeMe code ``lr_outer`` = 0.001)."""
    local_steps: PositiveInt = 5
    """S, meta-iterations per round (CAFeMe code ``adapt_steps``: 5; FEMNIST 8)."""
    variant: str = "hf"
    """``hf``: Hessian-free update with the Hessian-vector product (CAFeMe code, published
    numbers); ``fo``: first-order Per-FedAvg, theta <- theta - beta * g1 (Per-FedAvg paper)."""
    hvp: str = "finite_difference"
    """How ``hf`` computes H v: ``finite_difference`` = central difference with ``fd_delta``
    (CAFeMe code, published numbers); ``exact`` = automatic differentiation (double backward)."""
    fd_delta: PositiveFloat = 1e-3
    """delta of the central difference (CAFeMe code: 1e-3)."""
    skip_logging_batch: bool = True
    """True: after every iteration, advance the train stream past one batch, as the code does when
    it draws a batch only to log a loss (reproduces the code's batch consumption; nothing is
    computed on it). False: no extra batch."""
    weighting: Weighting = "uniform"
    """Server aggregation: ``uniform`` = plain mean (CAFeMe code); ``samples`` = weighted by n_k."""

    def __post_init__(self) -> None:
        if self.variant not in ("hf", "fo"):
            raise ValueError(f"variant must be 'hf' or 'fo', got {self.variant!r}")
        if self.hvp not in ("exact", "finite_difference"):
            raise ValueError(f"hvp must be 'exact' or 'finite_difference', got {self.hvp!r}")
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")


def hessian_vector_product(model: nn.Module, params: Params, x, y, v: Params,
                           mode: str = "exact", delta: float = 1e-3) -> Params:
    """H v, with H the Hessian of the batch loss at ``params``.

    ``exact``: grad_theta <grad_theta l(theta), v> (double backward); parameters on which the
    gradient does not depend get zeros. ``finite_difference``: the CAFeMe code's
    [grad l(theta + delta v) - grad l(theta - delta v)] / (2 delta).
    """
    if mode == "finite_difference":
        plus, _ = gradients(model, {k: p + delta * v[k] for k, p in params.items()}, x, y)
        minus, _ = gradients(model, {k: p - delta * v[k] for k, p in params.items()}, x, y)
        return {k: (plus[k] - minus[k]) / (2 * delta) for k in params}
    if mode != "exact":
        raise ValueError(f"unknown hvp mode {mode!r}")
    if in_transform():  # batched path: forward-over-reverse, exact as well
        grad_fn = torch.func.grad(lambda p: batch_loss(model, p, x, y))
        return torch.func.jvp(grad_fn, (dict(params),), ({k: v[k] for k in params},))[1]
    leaves = {k: p.detach().requires_grad_(True) for k, p in params.items()}
    grads = torch.autograd.grad(batch_loss(model, leaves, x, y), list(leaves.values()), create_graph=True)
    dot = sum((g * v[k]).sum() for k, g in zip(leaves, grads))
    hv = torch.autograd.grad(dot, list(leaves.values()), allow_unused=True)
    return {k: torch.zeros_like(p) if h is None else h for (k, p), h in zip(leaves.items(), hv)}


@METHODS.register("perfedavg")
class PerFedAvg(Algorithm):
    hyper_class = PerFedAvgHyper
    finetune_at_eval = True

    def meta_step(self, theta: Params, b1: tuple, b2: tuple, b3: tuple | None) -> tuple[Params, torch.Tensor]:
        """One Per-FedAvg iteration (steps 1-3 above); returns the new theta and l(theta~; b2)."""
        hp = self.hp
        g0, _ = gradients(self.model, theta, *b1)
        tilde = {k: p - hp.alpha * g0[k] for k, p in theta.items()}
        g1, loss = gradients(self.model, tilde, *b2)
        if hp.variant == "fo":
            return {k: p - hp.beta * g1[k] for k, p in theta.items()}, loss
        hv = hessian_vector_product(self.model, theta, *b3, g1, hp.hvp, hp.fd_delta)
        return {k: p - hp.beta * g1[k] + hp.beta * hp.alpha * hv[k] for k, p in theta.items()}, loss

    # -- the client program: S iterations from the global model -----------------------------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int) -> dict:
        return {"params": server["params"]}

    def draw(self, client: ClientContext, round_idx: int):
        """Per iteration: b1, b2, b3 (``hf`` only), then the code's logging batch (skipped)."""
        plan = {"b1": [], "b2": [], "b3": []}
        for _ in range(self.hp.local_steps):
            for name in ("b1", "b2", "b3") if self.hp.variant == "hf" else ("b1", "b2"):
                plan[name].append(client.next_index())
            if self.hp.skip_logging_batch:
                client.next_index()
        return plan

    def local_update(self, carry, batches, masks):
        """The reported loss is the mean of l(theta~; b2) (the code logs the loss on its extra
        batch instead, which is never computed here)."""
        theta, losses = carry["params"], []
        (x1, y1), (x2, y2), (x3, y3) = batches["b1"], batches["b2"], batches["b3"]
        for i in range(len(x1)):
            b3 = (x3[i], y3[i]) if self.hp.variant == "hf" else None
            theta, loss = self.meta_step(theta, (x1[i], y1[i]), (x2[i], y2[i]), b3)
            losses.append(loss)
        return {"params": theta}, torch.stack(losses).mean()

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        return ClientUpdate(carry["params"], client.num_samples("train"), loss)


@dataclass
class PerFedAvgFOHyper(PerFedAvgHyper):
    variant: str = "fo"
    """First-order Per-FedAvg by default (Per-FedAvg paper's FO; not in the CAFeMe code)."""


@METHODS.register("perfedavg_fo")
class PerFedAvgFO(PerFedAvg):
    """Per-FedAvg (FO): ``perfedavg`` with ``variant="fo"`` as the default."""

    hyper_class = PerFedAvgFOHyper
