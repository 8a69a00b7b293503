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
output; ``local``: with the client's w_i after its last local step), ``weighting``, and three that
read APFL's official code (MLOPTPSU/FedTorch) where it differs from Algorithm 1: ``alpha_update``
(``once_a_round``: FedTorch's alpha step at the round's first local step, with its factor and
penalty), ``alpha_penalty`` (FedTorch 0.02) and ``step_order`` (``w_first``: FedTorch steps w
before taking v's gradient at the mixture). The defaults are Algorithm 1's. FedTorch's defaults
fix alpha (``--fed_personal_alpha 0.5``, ``--fed_adaptive_alpha False``: ``fedtorch/parameters.py``
L68-71; its README's APFL command, L131, passes ``-pa 0.5`` without ``-pd``) and average the
uploads uniformly (``fedtorch/comms/algorithms/federated/fedavg.py`` L24). Not emulated: FedTorch
mixes the two models' *outputs* (``inference_personal``, ``fedtorch/comms/utils/eval.py`` L31-39),
the harness their parameters (the same for a linear model such as MLR, not for a DNN), and its SGD
adds weight decay 5e-4 by default (``parameters.py`` L175) into the gradients the alpha rule reads.

The Ditto authors' code has an "APFL" baseline too (litian96/ditto, ``flearn/trainers_MTL/apfl.py``):
a *fixed* alpha (``--alpha``, default 0.5), the plain mean of the uploads and v_bar = alpha v +
(1 - alpha) w_global at evaluation, i.e. ``adaptive_alpha: false, alpha_init: 0.5,
weighting: uniform, mix_with: global`` here. One difference is not emulated: that code keeps the
interpolation v_bar of the client's last step across rounds, so the first step of a round takes
v's gradient at alpha v + (1 - alpha) w_i(previous round) rather than at the new global model.
The CGPFL paper describes APFL as mixing "with an adaptive weight" (Section 2), so the CGPFL suites
keep the adaptive default and offer the fixed-alpha reading as the ``ditto_code_baselines`` profile,
and FedTorch's (fixed alpha, uniform mean, ``step_order: w_first``, ``mix_with: local``) as Table 1's
``pfedme_code`` profile (docs/papers/cgpfl.md, code conventions).
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
    """Step size of the alpha update; 0 = ``lr`` (APFL Algorithm 1 uses the same eta; FedTorch the
    local optimizer's current rate, ``fedtorch/comms/trainings/federated/apfl.py`` L85, L120)."""
    alpha_update: Literal["every_step", "once_a_round"] = "every_step"
    """When an adaptive alpha_i moves (``adaptive_alpha``): ``every_step``, by the gradient
    <v_i - w_i, grad f_i(v_bar_i)> at every local step (APFL paper, Algorithm 1); ``once_a_round``,
    at the round's first local step only, after that step's updates of w_i and v_i, by FedTorch's
    rule (APFL's official code, MLOPTPSU/FedTorch: ``fedtorch/comms/trainings/federated/apfl.py``
    L118-120, ``alpha_update`` in ``fedtorch/comms/utils/flow_utils.py`` L240-250):
    alpha <- clip_[0,1](alpha - alpha_lr * (<v' - w', alpha g_v + (1 - alpha) g_w> + alpha_penalty * alpha)),
    v', w' after the step, g_v = alpha G and g_w = (1 - alpha) G the gradients of the mixed loss
    with respect to v and w (the ``.grad`` the code reads), G its gradient at the step's mixture."""
    alpha_penalty: NonNegativeFloat = 0.0
    """lambda of an extra term lambda * alpha in the alpha gradient, under either ``alpha_update``
    (FedTorch: 0.02, ``flow_utils.py`` L247); 0 = none (APFL paper)."""
    step_order: Literal["simultaneous", "w_first"] = "simultaneous"
    """``simultaneous``: v_i's gradient at alpha v_i + (1 - alpha) w_i with the step's starting w_i
    (Algorithm 1); ``w_first``: w_i steps first and v_i's gradient is taken at the mixture with the
    new w_i, as FedTorch orders them (``apfl.py`` L95-116: the optimizer steps w before
    ``inference_personal`` reads it)."""
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
              adaptive: bool = True, rule: str = "every_step", penalty: float = 0.0,
              w_first: bool = False) -> tuple[Params, Params, torch.Tensor, torch.Tensor]:
    """One APFL local step on batch (x, y); returns (w, v, alpha, loss at v_bar).

    ``adaptive``: alpha moves at this step, by ``rule`` (``every_step`` or ``once_a_round``: the
    two rules of :class:`APFLHyper.alpha_update`) with ``penalty`` (``alpha_penalty``);
    ``w_first``: v's gradient at the mixture with the stepped w (``step_order``).

    ``alpha`` is a float64 0-d tensor (the reference code kept a Python float): the inner product
    is summed per parameter tensor in its dtype and accumulated in float64, and the clip is a
    ``torch.clamp`` - the same numbers, with no host sync (it runs under ``vmap``)."""
    grad_w, _ = gradients(model, w, x, y)
    with torch.no_grad():
        new_w = {k: w[k] - lr * grad_w[k] for k in w}
    v_bar = mixture(v, new_w if w_first else w, alpha)
    grad_bar, loss = gradients(model, v_bar, x, y)
    with torch.no_grad():
        new_v = {k: v[k] - lr * alpha * grad_bar[k] for k in v}
        if adaptive and rule == "every_step":
            dot = sum(((v[k] - w[k]) * grad_bar[k]).sum().to(alpha.dtype) for k in v)
            grad_alpha = dot + penalty * alpha if penalty else dot
            alpha = torch.clamp(alpha - alpha_lr * grad_alpha, 0.0, 1.0)
        elif adaptive:  # once_a_round: FedTorch's alpha_update after the step
            dot = sum(((new_v[k] - new_w[k]) * grad_bar[k]).sum().to(alpha.dtype) for k in v)
            grad_alpha = (alpha * alpha + (1.0 - alpha) * (1.0 - alpha)) * dot + penalty * alpha
            alpha = torch.clamp(alpha - alpha_lr * grad_alpha, 0.0, 1.0)
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
            adaptive = hp.adaptive_alpha and (hp.alpha_update == "every_step" or step == 0)
            w, v, alpha, loss = apfl_step(self.model, w, v, alpha, xs[step], ys[step], hp.lr, hp.alpha_lr or hp.lr,
                                          adaptive, hp.alpha_update, hp.alpha_penalty, hp.step_order == "w_first")
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
