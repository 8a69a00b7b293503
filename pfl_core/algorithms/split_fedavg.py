"""FedAvg whose model is split into a head and a body (:mod:`pfl_core.algorithms._lib.parts`), the
common mechanism of the MetaVers baselines FedPer, LG-FedAvg, FedBABU and kNN-Per (issue 13).

A subclass says which part stays with the client (``personal_part``: none, the head, the body)
and which part local training changes (``trained_part``: all, or the body with the head frozen).
A sampled client starts from the server's parameters with its own personal part on top (the
server's own copy of that part before it has one), trains with the pFedHN client optimiser
(:func:`pfl_core.algorithms.local_sgd.momentum_sgd`), keeps its personal part and uploads the
rest of what it trained; the server averages the uploads into its parameters. A client
predicts with the same combination it trains from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pfl_core.algorithms.base import Algorithm, Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import HyperParams
from pfl_core.algorithms.local_sgd import MomentumSGDHyper, local_sgd_plan, momentum_sgd
from pfl_core.algorithms._lib.parts import split_names
from pfl_core.algorithms._lib.round_lr import RoundLR
from pfl_core.training import Params, state_gradients


@dataclass
class SplitFedAvgHyper(MomentumSGDHyper, RoundLR, HyperParams):
    head_prefixes: list[str] = field(default_factory=lambda: ["fc3."])
    """Parameters whose names start with one of these form the head: ``fc3.``, the classifier of
    ``lenet`` (pFedHN's target LeNet, the MetaVers baselines' model)."""
    weighting: Weighting = "samples"
    """Server average of the uploads: ``samples`` (n_k / n, FedAvg) or ``uniform``."""


class SplitFedAvg(Algorithm):
    """The mechanism; subclasses set ``personal_part`` and ``trained_part``. Client state:
    ``personal`` (the personal part's parameters, once the client has trained)."""

    hyper_class = SplitFedAvgHyper
    keeps_bn_state = True
    maskable_streams = ("train",)
    train_streams = ("train",)
    personal_part: ClassVar[Literal["none", "head", "body"]] = "none"
    trained_part: ClassVar[Literal["all", "body"]] = "all"

    def __init__(self, model, hp):
        super().__init__(model, hp)
        self.head_names, self.body_names = split_names(model, hp.head_prefixes, type(self).__name__)
        self.trained_names = self.body_names if self.trained_part == "body" else self.head_names + self.body_names

    def personal_names(self, server: ServerState) -> list[str]:
        """The parameters a client keeps this round (LG-FedAvg: none while pretraining)."""
        return {"none": [], "head": self.head_names, "body": self.body_names}[self.personal_part]

    # -- the client program ---------------------------------------------------------------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        return {"params": self.client_params(server, client), **self.round_carry(server, round_idx)}

    def draw(self, client: ClientContext, round_idx: int):
        return local_sgd_plan(client, self.hp)

    def local_update(self, carry, batches, masks):
        """The pFedHN client optimiser on the trained part (the frozen head of FedBABU gets no
        gradient: lr 0, as the FedL2P code's FedBABU ``exclude_layers``); a model with BN state
        updates its running statistics at every step; a scheduled lr comes in the carry."""
        trainable = None if self.trained_part == "all" else self.trained_names

        def loss_and_grads(params, x, y, buffers=None):
            grads, loss, new = state_gradients(self.model, params, buffers, x, y, trainable)
            return (grads, loss) if buffers is None else (grads, loss, new)

        params, loss, _, buffers = momentum_sgd(loss_and_grads, carry["params"], batches, masks, self.hp,
                                                buffers=carry.get("buffers"), lr=carry.get("lr"))
        return {"params": params, **({} if buffers is None else {"buffers": buffers})}, loss

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        params = carry["params"]
        personal = self.personal_names(server)
        if personal:
            client.state["personal"] = {n: params[n] for n in personal}
        upload = {n: params[n] for n in self.trained_names if n not in set(personal)}
        return ClientUpdate(upload, client.num_samples("train"), loss, buffers=carry.get("buffers"))

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        """The average of the uploaded part replaces it on the server; the rest is unchanged."""
        average = self.average_uploads(updates)
        return self.aggregate_buffers({**server, "params": {**server["params"], **(average or {})}}, updates)

    def client_params(self, server: ServerState, client: ClientContext) -> Params:
        """The server's parameters with the client's personal part on top."""
        return {**server["params"], **client.state.get("personal", {})}

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        return self.client_params(server, client)
