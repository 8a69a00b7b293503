"""pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020): personalized FL with Moreau envelopes.

Each client i approximately solves the Moreau-envelope problem
``theta_i(w_i) = argmin_theta f_i(theta) + lam/2 ||theta - w_i||^2`` with K_p gradient steps on one
mini-batch, then moves its local copy ``w_i <- w_i - lr * lam * (w_i - theta_i)`` (pFedMe paper,
Algorithm 1; docs/papers/cgpfl.md). After
R such local rounds the server mixes ``w <- (1 - beta) w + beta * avg_i w_i``.

The mechanism is written once, as :func:`moreau_inner_solve` and :func:`prox_local_rounds`, and CGPFL
(:mod:`pfl_core.algorithms.cgpfl`) calls the same functions with the anchor set to the client's
context model: CGPFL with K = 1 *is* this code path (CGPFL paper, Eq. 2 remark: "K = 1 ... equivalent
to ... pFedMe").

Known behaviours of the authors' code (CharlieDinh/pFedMe), each a named switch (docs/papers/cgpfl.md and
"Code-vs-paper differences" 9, 10, 12):

* ``hidden_l2`` (default 0.0): the pFedMe optimizer's hidden ``mu * theta`` term (mu = 0.001 in
  the code, in neither paper). 0.001 reproduces the code.
* ``predictor`` (default ``"local"``): the scored model. ``"local"`` evaluates the local model w_i
  after the client's R local rounds, which is what the authors' code reports as "PM": its
  personalized-parameter list aliases the model parameters, which ``update_parameters(local_model)``
  overwrites with w_i at the end of ``UserpFedMe.train`` (issue #5). ``"theta"`` evaluates theta_i,
  the last inner solve on one 20-sample batch (pFedMe paper, CGPFL Algorithm 1 output). With
  personal_lr * (L + lam) > 2 theta oscillates around the proximal optimum, so the two differ.
* ``theta_start`` (default ``"received"``): where theta_i starts each communication round. The
  code's theta *is* the model's parameter list, which ``set_parameters`` overwrites with the new
  global model at the start of every round (``send_parameters`` goes to all users), so theta starts
  at the received model each round and carries over only between the R local rounds of one round.
  ``"persist"`` carries theta_i over from the client's previous round instead.
* ``weighting`` (default ``"samples"``): the code weights w_i by training-sample counts;
  ``"uniform"`` gives the plain mean (what CGPFL uses inside a context, p_{k,j} = 1/|C_k|).
* Participation: the code trains all users and aggregates only S sampled ones. The harness trains
  and aggregates the clients the federation loop samples; CGPFL's setup uses all 40 clients
  (``federation.clients_per_round: 0``), where both coincide.

State kept per client (``client.state``): ``theta`` (theta_i after the last local round, for
``predictor="theta"`` and ``theta_start="persist"``) and ``local`` (w_i after the last round, for
``predictor="local"``). Within a round theta is never reset to w between local rounds (code).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable, Literal

import torch
from torch import nn

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import HyperParams, PROX_LR, Tune
from pfl_core.fields import NonNegativeFloat, PositiveFloat, PositiveInt
from pfl_core.engine.plans import Plan
from pfl_core.training import Params, gradients

Predictor = Literal["theta", "local"]
ThetaStart = Literal["received", "persist"]


def prox_gradient_steps(
    grad_fn: Callable[[Params], tuple[Params, torch.Tensor]],
    theta: Params,
    anchor: Params,
    steps: int,
    lr: float,
    lam: float,
    hidden_l2: float = 0.0,
) -> tuple[Params, torch.Tensor]:
    """``steps`` gradient steps on ``h(theta) = f(theta) + lam/2 ||theta - anchor||^2
    (+ hidden_l2/2 ||theta||^2)``, where ``grad_fn(theta)`` returns (grad f, f): the
    delta-approximate solve of the pFedMe paper (Eq. 7) and of CGPFL's Algorithm 1, lines 7-9
    (theta <- theta - eta grad F_i(theta)).

    The update is ``theta <- theta - lr * (grad f + lam (theta - anchor) + hidden_l2 theta)``, the
    pFedMe optimizer's step. Returns the new theta and the mean of f over the steps.
    """
    if steps < 1:
        raise ValueError("prox_gradient_steps: steps must be >= 1")
    losses = []
    for _ in range(steps):
        grads, loss = grad_fn(theta)
        losses.append(loss)
        with torch.no_grad():
            theta = {name: prox_update(p, grads[name], anchor[name], lr, lam, hidden_l2)
                     for name, p in theta.items()}
    return theta, torch.stack(losses).mean()


def prox_update(p: torch.Tensor, grad: torch.Tensor, anchor: torch.Tensor, lr: float, lam: float,
                hidden_l2: float) -> torch.Tensor:
    """``p - lr * (grad + lam (p - anchor) + hidden_l2 p)``, the pFedMe optimizer's step, as
    ``lerp(p, anchor, lr*lam) - lr*grad [- lr*hidden_l2*p]``: the same value up to float rounding in
    two passes over the parameters instead of five (on a stack of 40 clients' DNN weights the step
    is memory-bound; ``benchmarks.timing.speed`` workload ``cgpfl-mnist``). Out of place, so ``p`` and
    ``anchor`` may be one tensor shared by a vmapped stack while ``grad`` is per client."""
    out = torch.sub(torch.lerp(p, anchor, lr * lam), grad, alpha=lr)
    return out.sub_(p, alpha=lr * hidden_l2) if hidden_l2 else out


def moreau_inner_solve(
    model: nn.Module,
    theta: Params,
    anchor: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    lr: float,
    lam: float,
    hidden_l2: float = 0.0,
) -> tuple[Params, torch.Tensor]:
    """:func:`prox_gradient_steps` with f = the model's mean cross-entropy on ONE batch (x, y),
    reused for every step (pFedMe code convention)."""
    return prox_gradient_steps(lambda t: gradients(model, t, x, y), theta, anchor, steps, lr, lam, hidden_l2)


def pull_toward(w: Params, theta: Params, rate: float) -> Params:
    """``w <- w - rate * (w - theta)``: pFedMe's local update with rate = lr * lam (pFedMe paper,
    Algorithm 1 line 8) and CGPFL's omega update, Algorithm 1 line 10, with rate = beta * 2/N in
    the paper-literal reading."""
    with torch.no_grad():  # one pass: lerp(w, theta, rate) = w + rate * (theta - w)
        return {name: torch.lerp(p, theta[name], rate) for name, p in w.items()}


def prox_plan(client: ClientContext, hp: ProxHyper) -> Plan:
    """R train batches, one per local round (drawn from the cyclic stream in order)."""
    return {"train": [client.next_index() for _ in range(hp.local_rounds)]}


def prox_local_rounds(model: nn.Module, carry: dict, batches: tuple, hp: ProxHyper) -> tuple[dict, torch.Tensor]:
    """R local rounds of (next batch; K_p inner steps on it; pull the anchor toward theta), from
    ``carry = {"theta": theta_i, "w": w_{i,0}}`` over the R batches ``(xs, ys)``.

    The shared body of pFedMe's and CGPFL's client program (CGPFL Algorithm 1, lines 6-11); a pure
    tensor function (vmapped on the batched path). Returns ``{"theta", "w": w_{i,R}}`` and the mean
    data loss.
    """
    theta, w = carry["theta"], carry["w"]
    xs, ys = batches
    losses = []
    for r in range(len(xs)):  # one batch per local round, reused for all inner steps
        theta, loss = moreau_inner_solve(model, theta, w, xs[r], ys[r], hp.inner_steps, hp.personal_lr, hp.lam,
                                         hp.hidden_l2)
        w = pull_toward(w, theta, hp.pull_rate)
        losses.append(loss)
    return {"theta": theta, "w": w}, torch.stack(losses).mean()


def mix(old: Params, new: Params, beta: float) -> Params:
    """``(1 - beta) old + beta new``: pFedMe's server step (beta = 2 over-relaxes) and CGPFL's
    Algorithm 1 line 14 with beta = alpha."""
    with torch.no_grad():
        return {name: (1.0 - beta) * old[name] + beta * new[name] for name in new}


@dataclass
class ProxHyper(HyperParams):
    """The proximal local-training hyperparameters shared by pFedMe and CGPFL; defaults are the
    CGPFL Table 1 setting for MNIST/FMNIST MLR."""

    lr: Annotated[PositiveFloat, PROX_LR] = 0.005
    """eta, the local-model step ``w <- w - lr*lam*(w - theta)`` (CGPFL Table 1: lr = 0.005 for
    MNIST/FMNIST, 0.03 for CIFAR10; pFedMe README MNIST: 0.005)."""
    personal_lr: Annotated[PositiveFloat, Tune(1e-3, 0.5, log=True, order=1)] = 0.1
    """The inner (personal) step on theta (pFedMe README: 0.1 MLR, 0.09 DNN, 0.01 CNN; docs/papers/cgpfl.md
    harness default)."""
    lam: Annotated[NonNegativeFloat, Tune(0.1, 50.0, log=True, order=2)] = 12.0
    """lambda, the proximal regularization (CGPFL Table 1 caption: 12; pFedMe code: 15)."""
    inner_steps: PositiveInt = 5
    """Inner theta steps per local round: pFedMe's K_p (--K 5) = CGPFL's S (Table 1 caption: 5)."""
    local_rounds: PositiveInt = 10
    """R, local rounds per communication round, one mini-batch each (CGPFL Fig. 1/2 captions: 10;
    pFedMe code local_epochs = 20, issue #6)."""
    hidden_l2: float = 0.0
    """The pFedMe optimizer's hidden mu*theta term (code: 0.001; neither paper: 0, the default)."""
    predictor: Predictor = "local"
    """The scored model: ``local`` = w_i after the R local rounds, what the pFedMe authors' code
    reports as "PM" (issue #5, parameter aliasing; the default, as the published pFedMe numbers);
    ``theta`` = theta_i, the last inner solve (pFedMe paper Eq. 7, CGPFL Algorithm 1 output
    Theta^T_I; a former harness choice)."""
    theta_start: ThetaStart = "received"
    """Where theta_i starts each round: ``received`` = the model the client receives this round
    (pFedMe code: ``set_parameters`` overwrites theta, the model's parameters, every round);
    ``persist`` = theta_i from the client's previous round (pFedMe paper Algorithm 1 and CGPFL
    Algorithm 1 leave it open; a former harness choice)."""

    def __post_init__(self) -> None:
        if self.inner_steps < 1 or self.local_rounds < 1:
            raise ValueError("inner_steps and local_rounds must be >= 1")

    @property
    def pull_rate(self) -> float:
        """The rate of the local-model step ``w <- w - rate*(w - theta)``: lr*lam (pFedMe paper,
        Algorithm 1 line 8)."""
        return self.lr * self.lam


@dataclass
class PFedMeHyper(ProxHyper):
    """pFedMe hyperparameters (the shared proximal ones plus the server step)."""

    beta: Annotated[PositiveFloat, Tune(1.0, 2.0, order=3)] = 1.0
    """Server mixing w <- (1-beta) w + beta avg (pFedMe paper settings: 1; 'fine-tuned': 2)."""
    weighting: Weighting = "samples"
    """Aggregation weights: ``samples`` (n_i / n_S, pFedMe code) or ``uniform``."""


class ProxProgram(Algorithm):
    """The plan and local update pFedMe and CGPFL share (:func:`prox_plan`, :func:`prox_local_rounds`);
    subclasses say where theta and w start (``carry_in``) and what is uploaded (``carry_out``)."""

    def start_carry(self, client: ClientContext, anchor: Params) -> dict:
        """``{"theta", "w"}`` at the start of a round whose anchor (w_{i,0}) is ``anchor``: theta
        from ``anchor`` (``theta_start="received"``, pFedMe code) or from the client's last round
        (``"persist"``; the first round starts at ``anchor``)."""
        theta = client.state.get("theta", anchor) if self.hp.theta_start == "persist" else anchor
        return {"theta": theta, "w": anchor}

    def draw(self, client: ClientContext, round_idx: int) -> Plan:
        return prox_plan(client, self.hp)

    def local_update(self, carry, batches, masks):
        return prox_local_rounds(self.model, carry, batches["train"], self.hp)


@METHODS.register("pfedme")
class PFedMe(ProxProgram):
    """pFedMe; uploads w_{i,R}, evaluates w_i (or theta_i with ``predictor="theta"``)."""

    hyper_class = PFedMeHyper

    # -- the client program: R local rounds from the global model (prox_local_rounds) -------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        """w_{i,0} = the global model; theta_i per ``theta_start`` (:meth:`ProxProgram.start_carry`)."""
        return self.start_carry(client, server["params"])

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        client.state.update(theta=carry["theta"], local=carry["w"])
        return ClientUpdate(carry["w"], client.num_samples("train"), loss)

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        avg = self.average_uploads(updates)
        return server if avg is None else {**server, "params": mix(server["params"], avg, self.hp.beta)}

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        return personal_predictor(self.hp, server["params"], client)


def personal_predictor(hp: ProxHyper, fallback: Params, client: ClientContext) -> Params:
    """theta_i or w_i per ``hp.predictor``; ``fallback`` for a client that never trained."""
    key = "theta" if hp.predictor == "theta" else "local"
    return client.state.get(key, fallback)
