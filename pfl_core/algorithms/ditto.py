"""Ditto (Li et al., 2021) as the CAFeMe code runs it (docs/papers/cafeme.md: Ditto; code ``Ditto_Client``).

Client update = personal step, then global step, on successive batches of the client's cyclic
train stream:

1. Personal: ``personal_steps`` (S) batches of proximal SGD on the personal model p,
   ``p <- p - lr * (grad l(p) + mu * (p - w))`` (code ``PerturbedGradientDescent``). The anchor w is,
   in the code, the client's **own last local copy** of the global model (what it uploaded at its
   previous participation, or the initial model); ``anchor="global"`` uses the current global model
   instead (the Ditto paper's objective).
2. Global: ``global_steps`` (S) batches of Adam (lr 0.001) on a copy of the current global model;
   the Adam object belongs to the client and persists across its participations (code).

``schedule="interleaved"`` is the Ditto authors' own code (litian96/ditto,
``flearn/trainers_MTL/ditto.py``): for each of its ``local_iters`` iterations it draws ONE batch and
takes the personal step and then the global (plain SGD) step on that same batch.

The client uploads its global copy; the server takes the uniform mean. At evaluation the code
fine-tunes the **global** model (personal models are unused; test clients never had one);
``evaluate_personal=True`` predicts with the personal model instead (the paper's intent).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import ADAM_LR, HyperParams, SGD_LR, Tune
from pfl_core.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat
from pfl_core.algorithms._lib.optim import client_optimizer_state, optimizer_step
from pfl_core.training import Params, gradients, sgd_step


@dataclass
class DittoHyper(HyperParams):
    lr: Annotated[PositiveFloat, SGD_LR] = 0.001
    """Personal proximal-SGD learning rate (CAFeMe code: ``lr_outer`` = 0.001)."""
    global_lr: Annotated[PositiveFloat, ADAM_LR.at(1)] = 0.001
    """Learning rate of the global step (CAFeMe code: Adam, ``lr_outer`` = 0.001)."""
    global_optimizer: Literal["adam", "sgd"] = "adam"
    """Optimiser of the global step: ``adam`` (CAFeMe code) or ``sgd`` (plain FedAvg-style local SGD,
    the Ditto paper's global objective; CGPFL's Table 1 baseline)."""
    mu: Annotated[NonNegativeFloat, Tune(1e-3, 10.0, log=True, order=2)] = 0.1
    """Proximal weight mu (CAFeMe code ``mu`` = 0.1, every dataset)."""
    personal_steps: Annotated[NonNegativeInt, Tune(1, 10, order=3)] = 5
    """S, personal-model batches per round (CAFeMe code ``adapt_steps``: 5; FEMNIST 8)."""
    global_steps: NonNegativeInt = 5
    """S, global-model batches per round (CAFeMe code ``adapt_steps``: 5; FEMNIST 8)."""
    anchor: Literal["local_copy", "global"] = "local_copy"
    """Proximal anchor w: ``local_copy`` = the client's last local copy of the global model, or the
    initial model before its first participation (CAFeMe code, produced the published numbers,
    docs/papers/cafeme.md); ``global`` = the current global model (Ditto paper)."""
    persist_optimizer: bool = True
    """The client's Adam moments and step count carry over between its rounds (CAFeMe code: one
    Adam object per client, created once). False: a fresh Adam every round."""
    evaluate_personal: bool = False
    """False: predict with the global model (CAFeMe code, published numbers). True: seen clients
    predict with their personal model (Ditto paper); unseen clients, having none, use the global
    model. The protocol's fine-tuning steps apply in both cases (set evaluation steps to 0 for the
    paper's direct evaluation)."""
    weighting: Weighting = "uniform"
    """Server aggregation: ``uniform`` = plain mean (CAFeMe code); ``samples`` = weighted by n_k."""
    schedule: Literal["personal_then_global", "interleaved"] = "personal_then_global"
    """``personal_then_global``: ``personal_steps`` batches on p, then ``global_steps`` further
    batches on the global copy (CAFeMe code, published CAFeMe numbers). ``interleaved``: per
    iteration one batch, the personal step then the global step on that same batch (the Ditto
    authors' code, ``trainers_MTL/ditto.py``; needs personal_steps == global_steps)."""

    def __post_init__(self) -> None:
        if self.global_steps < 1:
            raise ValueError(f"global_steps must be >= 1, got {self.global_steps}")
        if self.schedule == "interleaved" and self.personal_steps != self.global_steps:
            raise ValueError(f"schedule 'interleaved' steps both models on the same batches: personal_steps "
                             f"({self.personal_steps}) must equal global_steps ({self.global_steps})")


@METHODS.register("ditto")
class Ditto(Algorithm):
    """Ditto; client state: ``personal`` (p), ``local`` (the last local global copy, the code's
    anchor) and ``global_opt`` (the persistent optimiser).

    Server state: ``{"params": global model, "init": initial model}``; ``init`` is the personal
    model's start and the ``local_copy`` anchor of a client's first participation (in the code
    each client deep-copies the model when it is built, before any training).
    """

    hyper_class = DittoHyper
    finetune_at_eval = True

    def init_server(self, params: Params) -> ServerState:
        return {"params": params, "init": params}

    # -- the client program: personal step, then global step --------------------------------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        anchor = server["params"] if self.hp.anchor == "global" else client.state.get("local", server["init"])
        optimizer = client_optimizer_state(client.state, "global_opt", self.hp.global_optimizer,
                                           server["params"], persist=self.hp.persist_optimizer)
        return {"personal": client.state.get("personal", server["init"]), "anchor": anchor,
                "params": server["params"], "optimizer": optimizer}

    def draw(self, client: ClientContext, round_idx: int):
        personal = [client.next_index() for _ in range(self.hp.personal_steps)]
        if self.hp.schedule == "interleaved":  # the global steps reuse the personal steps' batches
            return {"personal": personal, "global": list(personal)}
        return {"personal": personal, "global": [client.next_index() for _ in range(self.hp.global_steps)]}

    def local_update(self, carry, batches, masks):
        """S proximal SGD steps on p (the Ditto personal step; docs/papers/cafeme.md), then S optimiser steps
        (Adam by
        default) on a copy of the global model (the Ditto global step). The two chains do not
        read each other within a round (p's anchor is fixed), so running them one after the other
        equals the Ditto code's alternation; ``schedule`` only decides their batches (:meth:`draw`)."""
        personal, params, optimizer = carry["personal"], carry["params"], carry["optimizer"]
        xs, ys = batches["personal"]
        for step in range(len(xs)):
            personal, _ = sgd_step(self.model, personal, xs[step], ys[step], self.hp.lr, self.hp.mu, carry["anchor"])
        xs, ys = batches["global"]
        losses = []
        for step in range(len(xs)):
            grads, loss = gradients(self.model, params, xs[step], ys[step])
            params, optimizer = optimizer_step(self.hp.global_optimizer, params, grads, optimizer, self.hp.global_lr)
            losses.append(loss)
        return {"personal": personal, "params": params, "optimizer": optimizer}, torch.stack(losses).mean()

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        client.state["personal"] = carry["personal"]
        client.state["local"] = carry["params"]
        if self.hp.persist_optimizer:
            client.state["global_opt"] = carry["optimizer"]
        return ClientUpdate(carry["params"], client.num_samples("train"), loss)

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        if self.hp.evaluate_personal:
            return client.state.get("personal", server["params"])
        return server["params"]
