"""Per-FedAvg (Fallah et al., 2020) as the CAFeMe code runs it (docs/papers/cafeme.md: Per-FedAvg; code
``PerFedAvg_Client``).

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

The pFedMe code (CharlieDinh/pFedMe, on which CGPFL's setup builds; docs/papers/cgpfl.md) evaluates
Per-FedAvg otherwise: before each round's training every client takes one SGD step at its learning
rate (alpha) and a second at beta, each on its next *test* batch of the training batch size, is
scored, then restored (``FLAlgorithms/users/userperavg.py`` L73-88; ``evaluate_one_step``,
``FLAlgorithms/servers/serverbase.py`` L241-262, called at ``serverperavg.py`` L48). The evaluation
protocol's switches reproduce it: ``evaluation.params: {steps: 2, step_lrs: [alpha, beta],
adapt_split: evaluated, adapt_batches: continue}`` (:class:`pfl_core.evaluation.EvalConfig`;
``adapt_split: evaluated`` is a leak, never a default). That code's Per-FedAvg *training* is first
order (``userperavg.py`` L39-71, ``variant: fo``); the CGPFL suites keep the HF update the paper
names.

FedL2P stage 1 (PerFedAvg(HF) pretraining of Table 1; docs/papers/fedl2p.md): with a model that keeps BN
state (KLD-BN ResNet, beta 1 = plain BatchNorm) every
train-mode forward of an iteration updates the running statistics, in order, as one BatchNorm
module in train mode would: b1 at theta, b2 at theta~, then the Hessian-vector product's forwards
on b3 (two for the central difference, one for the exact product); the server averages them with
the parameters' weights. Neither the FedL2P paper ("recommended hyperparameters used by the
authors") nor its code gives the values (docs/papers/cafeme.md); the FedL2P suites take those of the
Per-FedAvg paper's experiments (Fallah et al., 2020, Sec. 5): alpha = 0.001, beta = 0.001,
tau = 10 local iterations, delta = 0.001, and no logging batch (``skip_logging_batch: false``;
that batch is a CAFeMe-code artefact). These defaults below stay the CAFeMe code's.

Note: on ReLU/max-pool networks the code's central difference (delta = 1e-3 along an unnormalised
gradient) crosses activation kinks, so it can differ from the exact product by O(1) in relative
norm (observed on ``cafeme_cnn_a``); ``hvp`` is therefore a switch that matters, not a detail.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_map

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import HyperParams, Tune
from pfl_core.fields import PositiveFloat, PositiveInt
from pfl_core.models.kld_bn import Buffers
from pfl_core.training import Params, batch_loss, in_transform, state_gradients, state_loss


@dataclass
class PerFedAvgHyper(HyperParams):
    alpha: Annotated[PositiveFloat, Tune(1e-4, 0.5, log=True)] = 0.05
    """Inner (personalization) SGD step of theta~ (CAFeMe code ``lr_inner``: 0.05; FEMNIST 0.01)."""
    beta: Annotated[PositiveFloat, Tune(1e-5, 0.1, log=True, order=1)] = 0.001
    """Outer plain-SGD step on theta (CAFeMe code ``lr_outer`` = 0.001)."""
    local_steps: Annotated[PositiveInt, Tune(1, 10, order=2)] = 5
    """S, meta-iterations per round (CAFeMe code ``adapt_steps``: 5; FEMNIST 8)."""
    variant: Literal["hf", "fo"] = "hf"
    """``hf``: Hessian-free update with the Hessian-vector product (CAFeMe code, published
    numbers); ``fo``: first-order Per-FedAvg, theta <- theta - beta * g1 (Per-FedAvg paper)."""
    hvp: Literal["exact", "finite_difference"] = "finite_difference"
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
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")


def hessian_vector_product(model: nn.Module, params: Params, x, y, v: Params,
                           mode: str = "exact", delta: float = 1e-3) -> Params:
    """H v, with H the Hessian of the batch loss at ``params``.

    ``exact``: grad_theta <grad_theta l(theta), v> (double backward); parameters on which the
    gradient does not depend get zeros. ``finite_difference``: the CAFeMe code's
    [grad l(theta + delta v) - grad l(theta - delta v)] / (2 delta).
    """
    return state_hessian_vector_product(model, params, None, x, y, v, mode, delta)[0]


def state_hessian_vector_product(model: nn.Module, params: Params, buffers: Buffers | None, x, y, v: Params,
                                 mode: str = "exact", delta: float = 1e-3) -> tuple[Params, Buffers | None]:
    """(:func:`hessian_vector_product`, buffers after its forward passes). A model with BN state
    (``buffers`` given) runs them in train mode, and each updates the running statistics as a
    BatchNorm module in train mode would: ``finite_difference`` two forwards (theta + delta v,
    then theta - delta v), ``exact`` one (at theta). ``buffers`` None: no BN state, as before."""
    if mode == "finite_difference":
        plus, _, buffers = state_gradients(model, {k: p + delta * v[k] for k, p in params.items()}, buffers, x, y)
        minus, _, buffers = state_gradients(model, {k: p - delta * v[k] for k, p in params.items()}, buffers, x, y)
        return {k: (plus[k] - minus[k]) / (2 * delta) for k in params}, buffers
    if mode != "exact":
        raise ValueError(f"unknown hvp mode {mode!r}")
    tangents = {k: v[k] for k in params}
    if in_transform() and buffers is None:  # batched path: forward-over-reverse, exact as well
        grad_fn = torch.func.grad(lambda p: batch_loss(model, p, x, y))
        return torch.func.jvp(grad_fn, (dict(params),), (tangents,))[1], None
    if in_transform():
        grad_fn = torch.func.grad(lambda p: state_loss(model, p, buffers, x, y), has_aux=True)
        _, hv, new = torch.func.jvp(grad_fn, (dict(params),), (tangents,), has_aux=True)
        return hv, tree_map(lambda t: t.detach(), new)
    leaves = {k: p.detach().requires_grad_(True) for k, p in params.items()}
    loss, new = state_loss(model, leaves, buffers, x, y)
    grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=True)
    dot = sum((g * v[k]).sum() for k, g in zip(leaves, grads))
    hv = torch.autograd.grad(dot, list(leaves.values()), allow_unused=True)
    new = None if new is None else tree_map(lambda t: t.detach(), new)
    return {k: torch.zeros_like(p) if h is None else h for (k, p), h in zip(leaves.items(), hv)}, new


@METHODS.register("perfedavg")
class PerFedAvg(Algorithm):
    hyper_class = PerFedAvgHyper
    keeps_bn_state = True
    finetune_at_eval = True
    train_streams = ("b1", "b2", "b3")

    def meta_step(self, theta: Params, b1: tuple, b2: tuple, b3: tuple | None,
                  buffers: Buffers | None = None) -> tuple[Params, torch.Tensor, Buffers | None]:
        """One Per-FedAvg iteration (steps 1-3 above); returns the new theta, l(theta~; b2) and the
        BN running statistics after its forward passes (None without BN state)."""
        hp = self.hp
        g0, _, buffers = state_gradients(self.model, theta, buffers, *b1)
        tilde = {k: p - hp.alpha * g0[k] for k, p in theta.items()}
        g1, loss, buffers = state_gradients(self.model, tilde, buffers, *b2)
        if hp.variant == "fo":
            return {k: p - hp.beta * g1[k] for k, p in theta.items()}, loss, buffers
        hv, buffers = state_hessian_vector_product(self.model, theta, buffers, *b3, g1, hp.hvp, hp.fd_delta)
        return {k: p - hp.beta * g1[k] + hp.beta * hp.alpha * hv[k] for k, p in theta.items()}, loss, buffers

    # -- the client program: S iterations from the global model -----------------------------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        return {"params": server["params"], **self.round_carry(server, round_idx)}

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
        theta, buffers, losses = carry["params"], carry.get("buffers"), []
        (x1, y1), (x2, y2), (x3, y3) = batches["b1"], batches["b2"], batches["b3"]
        for i in range(len(x1)):
            b3 = (x3[i], y3[i]) if self.hp.variant == "hf" else None
            theta, loss, buffers = self.meta_step(theta, (x1[i], y1[i]), (x2[i], y2[i]), b3, buffers)
            losses.append(loss)
        return {"params": theta, **({} if buffers is None else {"buffers": buffers})}, torch.stack(losses).mean()

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        return ClientUpdate(carry["params"], client.num_samples("train"), loss, buffers=carry.get("buffers"))


@dataclass
class PerFedAvgFOHyper(PerFedAvgHyper):
    variant: Literal["hf", "fo"] = "fo"
    """First-order Per-FedAvg by default (Per-FedAvg paper's FO; not in the CAFeMe code)."""


@METHODS.register("perfedavg_fo")
class PerFedAvgFO(PerFedAvg):
    """Per-FedAvg (FO): ``perfedavg`` with ``variant="fo"`` as the default."""

    hyper_class = PerFedAvgFOHyper
