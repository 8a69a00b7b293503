"""FedRep (Collins et al., 2021) as the CAFeMe code runs it (docs/papers/cafeme.md: FedRep; code
``FedRep_Client``).

Parameters split into a head (names starting with one of ``head_prefixes``: the whole ``fc`` stack
of the CAFeMe CNNs) and a body (everything else: the conv blocks). Per round, from the global
model:

1. ``head_steps`` (S) Adam steps on the head only, one train batch each, body frozen;
2. ``body_steps`` (1) Adam step(s) on the body only, head frozen.

Each part has its own Adam, owned by the client and kept across its participations (the code
creates both once per client). In the code the **full** model, head included, is reloaded from
the global model and averaged, so heads are not personal (published numbers).
``personal_head=True`` is the FedRep paper's intent: the head stays with the client, only the body
is uploaded and averaged. At evaluation all parameters are fine-tuned by the protocol.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import torch

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import ADAM_LR, HyperParams, Tune
from pfl_core.fields import NonNegativeInt, PositiveFloat
from pfl_core.algorithms._lib.optim import client_optimizer_state, optimizer_step
from pfl_core.algorithms._lib.parts import split_names
from pfl_core.training import Params, partial_gradients


@dataclass
class FedRepHyper(HyperParams):
    lr: Annotated[PositiveFloat, ADAM_LR] = 0.001
    """Adam learning rate of both head and body steps (CAFeMe code: ``lr_outer`` = 0.001)."""
    head_steps: Annotated[NonNegativeInt, Tune(1, 10, order=1)] = 5
    """S, head-only Adam steps per round, one batch each (CAFeMe code ``adapt_steps``: 5; FEMNIST 8)."""
    body_steps: Annotated[NonNegativeInt, Tune(1, 5, order=2)] = 1
    """Body-only Adam steps per round, one batch each (CAFeMe code: 1)."""
    head_prefixes: list[str] = field(default_factory=lambda: ["fc."])
    """A parameter whose name starts with one of these is in the head. ``fc.`` is the whole dense
    stack of ``cafeme_cnn_a`` / ``cafeme_cnn_b`` (CAFeMe code: ``head = model.fc``); ``dnn`` needs
    ``["3."]``."""
    personal_head: bool = False
    """False: heads are reloaded from and averaged into the global model like the body (CAFeMe code,
    published numbers). True: each client keeps its head (FedRep paper); only the body is
    uploaded and averaged; seen clients predict with global body + own head."""
    persist_optimizer: bool = True
    """Head and body Adam moments and step counts carry over between the client's rounds (CAFeMe
    code: both optimisers are created once per client). False: fresh optimisers every round."""
    weighting: Weighting = "uniform"
    """Server aggregation: ``uniform`` = plain mean (CAFeMe code); ``samples`` = weighted by n_k."""

    def __post_init__(self) -> None:
        if self.head_steps + self.body_steps < 1:
            raise ValueError("FedRep needs head_steps + body_steps >= 1")


@METHODS.register("fedrep")
class FedRep(Algorithm):
    """FedRep; client state: ``head_adam`` / ``body_adam`` (and ``head`` with ``personal_head``)."""

    hyper_class = FedRepHyper
    finetune_at_eval = True

    def __init__(self, model, hp):
        super().__init__(model, hp)
        self.head_names, self.body_names = split_names(model, hp.head_prefixes, "fedrep")

    def _phase(self, params: Params, optimizer: dict, names: list[str], batches: tuple) -> tuple[Params, dict, list]:
        """Adam steps on ``params[names]`` (the rest frozen), one per batch; returns the new full
        dict, the optimiser state and the losses."""
        xs, ys = batches
        losses = []
        for step in range(len(xs)):
            grads, loss = partial_gradients(self.model, params, names, xs[step], ys[step])
            params, optimizer = optimizer_step("adam", params, grads, optimizer, self.hp.lr)
            losses.append(loss)
        return params, optimizer, losses

    # -- the client program: head steps, then body steps ------------------------------------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        params = self.predictor(server, client)
        persist = self.hp.persist_optimizer
        return {"params": params,
                "head_adam": client_optimizer_state(client.state, "head_adam", "adam",
                                                    {n: params[n] for n in self.head_names}, persist),
                "body_adam": client_optimizer_state(client.state, "body_adam", "adam",
                                                    {n: params[n] for n in self.body_names}, persist)}

    def draw(self, client: ClientContext, round_idx: int):
        return {"head": [client.next_index() for _ in range(self.hp.head_steps)],
                "body": [client.next_index() for _ in range(self.hp.body_steps)]}

    def local_update(self, carry, batches, masks):
        params, head_adam, head_losses = self._phase(carry["params"], carry["head_adam"], self.head_names,
                                                     batches["head"])
        params, body_adam, body_losses = self._phase(params, carry["body_adam"], self.body_names, batches["body"])
        loss = torch.stack(body_losses or head_losses).mean()  # the code reports the body-step loss
        return {"params": params, "head_adam": head_adam, "body_adam": body_adam}, loss

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        params = carry["params"]
        if self.hp.persist_optimizer:
            for key, steps in (("head_adam", self.hp.head_steps), ("body_adam", self.hp.body_steps)):
                if steps:  # a phase without steps never creates its optimiser (code)
                    client.state[key] = carry[key]
        if self.hp.personal_head:
            client.state["head"] = {n: params[n] for n in self.head_names}
            params = {n: params[n] for n in self.body_names}
        return ClientUpdate(params, client.num_samples("train"), loss)

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        """Mean of the uploads; with personal heads only the body is uploaded and the server keeps
        its (initial) head, which unseen clients start from."""
        new = super().aggregate(server, updates)
        return {**new, "params": {**server["params"], **new["params"]}}

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        if self.hp.personal_head and "head" in client.state:
            return {**server["params"], **client.state["head"]}
        return server["params"]
