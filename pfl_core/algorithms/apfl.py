"""APFL (Deng, Kamani, Mahdavi, 2020): adaptive personalized federated learning.

Each client keeps a personal model v_i and a mixing weight alpha_i; its personalized model is
``v_bar_i = alpha_i v_i + (1 - alpha_i) w_i``, where w_i is its copy of the global model (APFL paper,
Algorithm 1; docs/papers/cgpfl.md, APFL). Every local step, on one mini-batch xi and at the
*current* values (the three updates are simultaneous):

* ``w_i <- w_i - lr * grad f_i(w_i; xi)``;
* ``v_i <- v_i - lr * alpha_i * grad f_i(v_bar_i; xi)``   (chain rule: d f(v_bar)/d v);
* ``alpha_i <- clip_[0,1](alpha_i - alpha_lr * <v_i - w_i, grad f_i(v_bar_i; xi)>)``
  (d f(v_bar)/d alpha; the inner product runs over all parameters).

The server averages w_i every tau = ``local_steps`` local steps (one communication round); w_i is
reset to the global model at the start of each round, v_i and alpha_i persist. v_i starts at the
first model the client receives.

Switches: ``alpha_init`` (0.5, a harness choice), ``adaptive_alpha`` (True: the update above;
False keeps alpha fixed), ``alpha_lr`` (0 = use ``lr``), ``mix_with`` (``global``: evaluate
alpha_i v_i + (1 - alpha_i) w with the current global w, the synchronized w_i of the APFL paper's
output; ``local``: with the client's w_i after its last local step), ``weighting``.

The Ditto authors' code has an "APFL" baseline too (litian96/ditto, ``flearn/trainers_MTL/apfl.py``):
a *fixed* alpha (``--alpha``, default 0.5), the plain mean of the uploads and v_bar = alpha v +
(1 - alpha) w_global at evaluation, i.e. ``adaptive_alpha: false, alpha_init: 0.5,
weighting: uniform, mix_with: global`` here. One difference is not emulated: that code keeps the
interpolation v_bar of the client's last step across rounds, so the first step of a round takes
v's gradient at alpha v + (1 - alpha) w_i(previous round) rather than at the new global model.
The CGPFL paper describes APFL as mixing "with an adaptive weight" (Section 2), so the CGPFL suites
keep the adaptive default and offer the fixed-alpha reading as the ``ditto_code_baselines`` profile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import HyperParams, PROX_LR, Tune
from pfl_core.fields import NonNegativeFloat, PositiveFloat, PositiveInt, Probability
from pfl_core.engine.plans import Plan
from pfl_core.training import Params, gradients


@dataclass
class APFLHyper(HyperParams):
    lr: Annotated[PositiveFloat, PROX_LR] = 0.005
    """Local step size for w and v (CGPFL Table 1 lr for MNIST/FMNIST; a harness choice)."""
    local_steps: Annotated[PositiveInt, Tune(1, 20, order=2)] = 10
    """tau, local steps between synchronizations (a harness choice: tau = R = 10)."""
    alpha_init: Annotated[Probability, Tune(0.05, 0.95, order=1)] = 0.5
    """Initial mixing weight alpha_i (a harness choice 0.5; not given by the CGPFL paper)."""
    adaptive_alpha: bool = True
    """Update alpha_i by its gradient (APFL's adaptive variant); False keeps alpha_init."""
    alpha_lr: NonNegativeFloat = 0.0
    """Step size of the alpha update; 0 = ``lr`` (APFL Algorithm 1 uses the same eta)."""
    mix_with: Literal["global", "local"] = "global"
    """Which w the personalized model mixes at evaluation: ``global`` (server w) or ``local`` (w_i)."""
    weighting: Weighting = "samples"
    """Server average of w_i: ``samples`` (n_i weights) or ``uniform``."""

    def __post_init__(self) -> None:
        if not 0 <= self.alpha_init <= 1:
            raise ValueError(f"alpha_init must be in [0, 1], got {self.alpha_init}")
        if self.local_steps < 1:
            raise ValueError("local_steps must be >= 1")


def mixture(v: Params, w: Params, alpha: torch.Tensor) -> Params:
    """``alpha v + (1 - alpha) w``."""
    with torch.no_grad():
        return {k: alpha * v[k] + (1.0 - alpha) * w[k] for k in v}


def apfl_step(model, w: Params, v: Params, alpha: torch.Tensor, x, y, lr: float, alpha_lr: float,
              adaptive: bool = True) -> tuple[Params, Params, torch.Tensor, torch.Tensor]:
    """One simultaneous APFL local step on batch (x, y); returns (w, v, alpha, loss at v_bar).

    ``alpha`` is a float64 0-d tensor (the reference code kept a Python float): the inner product
    is summed per parameter tensor in its dtype and accumulated in float64, and the clip is a
    ``torch.clamp`` - the same numbers, with no host sync (it runs under ``vmap``)."""
    grad_w, _ = gradients(model, w, x, y)
    v_bar = mixture(v, w, alpha)
    grad_bar, loss = gradients(model, v_bar, x, y)
    with torch.no_grad():
        new_w = {k: w[k] - lr * grad_w[k] for k in w}
        new_v = {k: v[k] - lr * alpha * grad_bar[k] for k in v}
        if adaptive:
            dot = sum(((v[k] - w[k]) * grad_bar[k]).sum().to(alpha.dtype) for k in v)
            alpha = torch.clamp(alpha - alpha_lr * dot, 0.0, 1.0)
    return new_w, new_v, alpha, loss


@METHODS.register("apfl")
class APFL(Algorithm):
    """APFL: uploads w_i, keeps v_i and alpha_i in ``client.state``; predicts with v_bar_i."""

    hyper_class = APFLHyper

    # -- the client program: tau simultaneous steps on (w_i, v_i, alpha_i) ------------------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        """w_i = the global model; v_i and alpha_i persist (v_i starts at the first model received)."""
        w = server["params"]
        alpha = client.state.get("alpha")
        if alpha is None:
            alpha = torch.tensor(self.hp.alpha_init, dtype=torch.float64, device=next(iter(w.values())).device)
        return {"w": w, "v": client.state.get("v", w), "alpha": alpha}

    def draw(self, client: ClientContext, round_idx: int) -> Plan:
        return {"train": [client.next_index() for _ in range(self.hp.local_steps)]}

    def local_update(self, carry, batches, masks):
        hp = self.hp
        w, v, alpha = carry["w"], carry["v"], carry["alpha"]
        xs, ys = batches["train"]
        losses = []
        for step in range(len(xs)):
            w, v, alpha, loss = apfl_step(self.model, w, v, alpha, xs[step], ys[step], hp.lr, hp.alpha_lr or hp.lr,
                                          hp.adaptive_alpha)
            losses.append(loss)
        return {"w": w, "v": v, "alpha": alpha}, torch.stack(losses).mean()

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        client.state.update(v=carry["v"], alpha=carry["alpha"], w=carry["w"])
        return ClientUpdate(carry["w"], client.num_samples("train"), loss)

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        if "v" not in client.state:
            return server["params"]
        w = server["params"] if self.hp.mix_with == "global" else client.state["w"]
        return mixture(client.state["v"], w, client.state["alpha"])
