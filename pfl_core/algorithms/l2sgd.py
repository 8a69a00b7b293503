"""L2SGD (Hanzely & Richtarik, 2020, "Federated learning of a mixture of global and local models").

Objective: min_x F(x) = (1/n) sum_i f_i(x_i) + (lam/2n) sum_i ||x_i - x_bar||^2 (the 1/n scaling is
the L2GD paper's; docs/papers/cgpfl.md, L2SGD). Loopless chain with step size a and aggregation
probability p; at each step one common coin is flipped:

* with probability 1 - p (local step), every client: ``x_i <- x_i - a/(n(1-p)) grad f_i(x_i)``
  (a stochastic mini-batch gradient);
* with probability p (aggregation step), every client: ``x_i <- (1 - c) x_i + c x_bar`` with
  ``c = a lam / (n p)``.

In expectation, ``E[x_i^+] = x_i - (a/n) (grad f_i(x_i) + lam (x_i - x_bar))``: one gradient step of
size a on F (:func:`expected_step`, tested).

Reading used here (harness, documented): the step sizes are parameterised by ``lr`` =
a/(n(1-p)) (a harness choice: equal to CGPFL Table 1's lr), so c = lr (1-p) lam / p and n
cancels; lam = 12 and p = 1/R (a harness choice). One *communication round* of the federation
loop is one stretch of the chain between communications: L local steps, then J >= 1 consecutive
aggregation steps (J ~ Geometric(1 - p), as the chain keeps flipping aggregation with probability
p). A stretch of aggregations ends with the first local flip, which opens the next round, so every
round after the first has L >= 1 (L ~ Geometric(p), mean 1/p); only the chain's first round may
open with an aggregation flip (L >= 0, L + 1 ~ Geometric(p), mean (1-p)/p). Consecutive
aggregations compound: x_i <- x_bar + (1 - c)^J (x_i - x_bar) (x_bar is unchanged by a mixing
step). The coin flips come from ``SeedSequence([run seed stream, coin_seed, round])``, common
to all clients.

Because the loop's server cannot write client state, the J aggregation steps of round t are
applied lazily: the server stores x_bar and (1 - c)^J, and the client applies them to its stored x_i
when it next trains (and :meth:`L2SGD.predictor` applies them for evaluation). The personalized
model is x_i. A round with L = 0 (the first only) takes no local step; its reported loss is the
loss at x_i on the next batch.

``variant="mean_regularized"`` is instead the "L2SGD" baseline of the Ditto authors' code
(litian96/ditto, ``flearn/trainers_MTL/l2sgd.py``, "mean-regularized multi-task learning"), which
has no coin: every round each client takes ``local_steps`` deterministic steps
``x_i <- x_i - lr (grad f_i(x_i) + lam (x_i - x_bar))`` with x_bar the global model received this
round, and the server sets x_bar to the plain mean of the uploaded x_i (the code's
``global += (S/N) mean(x_i - global)``, identical under full participation, S = N, which CGPFL
uses; with partial participation the harness takes the plain mean of the uploads). The CGPFL paper
cites Hanzely & Richtarik for L2SGD and publishes no code, so the loopless chain is the default;
which one CGPFL ran is unknown.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import HyperParams, PROX_LR, Tune
from pfl_core.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Probability
from pfl_core.engine.plans import Plan
from pfl_core.training import Params, batch_loss, sgd_step


@dataclass
class L2SGDHyper(HyperParams):
    variant: Literal["loopless", "mean_regularized"] = "loopless"
    """``loopless``: the L2GD/L2SGD chain of Hanzely & Richtarik (the paper CGPFL cites; default).
    ``mean_regularized``: the Ditto authors' code's "L2SGD" (deterministic local steps on
    f_i + lam/2 ||x_i - x_bar||^2, x_bar = the plain mean; see the module docstring)."""
    local_steps: PositiveInt = 10
    """``mean_regularized`` only: local steps per round (Ditto code ``local_iters``; CGPFL R = 10)."""
    lr: Annotated[PositiveFloat, PROX_LR] = 0.005
    """The local step a/(n(1-p)) (a harness choice: CGPFL Table 1's lr, 0.005 MNIST/FMNIST)."""
    lam: Annotated[NonNegativeFloat, Tune(0.1, 50.0, log=True, order=1)] = 12.0
    """lambda of the penalty (a harness choice: CGPFL's lambda = 12)."""
    p: Annotated[Probability, Tune(0.02, 0.5, log=True, order=2)] = 0.1
    """Aggregation probability (a harness choice p = 1/R, R = 10)."""
    coin_seed: int = 0
    """Base seed of the common coin flips (the algorithm does not see the run seed)."""
    max_local_steps: NonNegativeInt = 0
    """Cap on L per round (0 = no cap; the loopless chain as in the paper)."""
    weighting: Weighting = "uniform"
    """x_bar: ``uniform`` (the L2GD objective's plain mean) or ``samples``."""

    def __post_init__(self) -> None:
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")
        if self.variant == "mean_regularized":
            return  # no coin: p and the aggregation coefficient play no role
        if not 0 < self.p < 1:
            raise ValueError(f"p must be in (0, 1), got {self.p}")
        if not 0 < self.mix_rate <= 1:
            raise ValueError(
                f"aggregation coefficient c = lr(1-p)lam/p = {self.mix_rate:.4g} must be in (0, 1]; "
                "lower lr or lam, or raise p")

    @property
    def mix_rate(self) -> float:
        """c = a lam/(n p) with a/n = lr (1 - p)."""
        return self.lr * (1.0 - self.p) * self.lam / self.p


def local_branch(x: Params, grad: Params, lr: float) -> Params:
    """The local step ``x - lr * grad`` with lr = a/(n(1-p))."""
    with torch.no_grad():
        return {k: v - lr * grad[k] for k, v in x.items()}


def aggregation_branch(x: Params, x_bar: Params, c: float, times: int = 1) -> Params:
    """``times`` aggregation steps: ``x_bar + (1 - c)^times (x - x_bar)``."""
    keep = (1.0 - c) ** times
    with torch.no_grad():
        return {k: x_bar[k] + keep * (v - x_bar[k]) for k, v in x.items()}


def expected_step(x: Params, grad: Params, x_bar: Params, lr: float, lam: float, p: float) -> Params:
    """E[x^+] = x - (a/n)(grad + lam (x - x_bar)) with a/n = lr (1 - p)."""
    step = lr * (1.0 - p)
    with torch.no_grad():
        return {k: v - step * (grad[k] + lam * (v - x_bar[k])) for k, v in x.items()}


def coin_counts(seed: int | tuple[int, ...], round_idx: int, p: float, cap: int = 0) -> tuple[int, int]:
    """(L local steps, J aggregation steps) of round ``round_idx``; ``seed`` is an int or a tuple
    of ints (run seed stream, ``coin_seed``). L ~ Geometric(p) on {1, 2, ...} (the local flip that
    ended the last round's aggregations opens this one), except round 0: L + 1 ~ Geometric(p)."""
    seeds = list(seed) if isinstance(seed, tuple) else [seed]
    rng = np.random.default_rng(np.random.SeedSequence([*seeds, round_idx]))
    local = int(rng.geometric(p)) - (1 if round_idx == 0 else 0)
    aggregations = int(rng.geometric(1.0 - p))
    if cap:
        local = min(local, cap)
    return local, aggregations


@METHODS.register("l2sgd")
class L2SGD(Algorithm):
    """L2SGD (``variant``: the loopless chain, or the Ditto code's mean-regularized training);
    client state ``x`` (x_i) and ``round``; server state ``params`` (x_bar), ``round``, ``keep``."""

    hyper_class = L2SGDHyper

    def init_server(self, params: Params) -> ServerState:
        return {"params": params, "round": -1, "keep": 1.0}

    def _current(self, server: ServerState, client: ClientContext) -> Params | None:
        """x_i with the last round's aggregation steps applied (None: never trained)."""
        x = client.state.get("x")
        if x is None:
            return None
        if client.state.get("round") == server["round"] and server["keep"] != 1.0:
            keep = server["keep"]
            with torch.no_grad():
                return {k: server["params"][k] + keep * (v - server["params"][k]) for k, v in x.items()}
        return x

    # -- the client program: the round's L local steps (L common to all clients) -----------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        """x_i with the last aggregation applied (host side); the global model if it never trained."""
        x = self._current(server, client)
        return {"x": server["params"] if x is None else x, "x_bar": server["params"]}

    def draw(self, client: ClientContext, round_idx: int) -> Plan:
        """``train``: the round's L batches (L from the common coin flips; ``local_steps`` for
        ``mean_regularized``); ``loss``: with L = 0, one batch on which the loss at x_i is reported
        (no step)."""
        if self.hp.variant == "mean_regularized":
            return {"train": [client.next_index() for _ in range(self.hp.local_steps)], "loss": []}
        local, _ = coin_counts((self.seed, self.hp.coin_seed), round_idx, self.hp.p, self.hp.max_local_steps)
        train = [client.next_index() for _ in range(local)]
        return {"train": train, "loss": [] if train else [client.next_index()]}

    def local_update(self, carry, batches, masks):
        x, losses = carry["x"], []
        xs, ys = batches["train"]
        pull = self.hp.lam if self.hp.variant == "mean_regularized" else 0.0  # the penalty's gradient
        for step in range(len(xs)):
            x, loss = sgd_step(self.model, x, xs[step], ys[step], self.hp.lr, pull, carry["x_bar"])
            losses.append(loss)
        xs, ys = batches["loss"]
        with torch.no_grad():
            losses += [batch_loss(self.model, x, xs[step], ys[step]) for step in range(len(xs))]
        return {"x": x}, torch.stack(losses).mean()

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        """Keeps x_i and the round it enters (the next aggregation's round: ``_current`` applies it)."""
        client.state.update(x=carry["x"], round=server["round"] + 1)
        return ClientUpdate(carry["x"], client.num_samples("train"), loss)

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        x_bar = self.average_uploads(updates)
        if x_bar is None:
            return server
        round_idx = server["round"] + 1
        if self.hp.variant == "mean_regularized":
            return {"params": x_bar, "round": round_idx, "keep": 1.0}
        _, times = coin_counts((self.seed, self.hp.coin_seed), round_idx, self.hp.p, self.hp.max_local_steps)
        return {"params": x_bar, "round": round_idx, "keep": (1.0 - self.hp.mix_rate) ** times}

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        x = self._current(server, client)
        return server["params"] if x is None else x
