"""L2P: FedL2P without federated learning (docs/papers/fedl2p.md; code switch
``federated_learning: false``). Each client learns its own lambda with FedL2P's ClientFit
(:mod:`pfl_core.algorithms.fedl2p`), keeps it in its state and uploads nothing; the server's lambda
stays at its initial value. The code trains every client once, at evaluation, for a budget of
ceil(T_max x clients_per_round x 3 / C) outer epochs: run it with one round in which every client
takes part (``federation.rounds: 1``, ``clients_per_round: 0``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pfl_core.algorithms import METHODS
from pfl_core.engine.contract import ClientContext, ServerState
from pfl_core.algorithms.fedl2p import FedL2P, FedL2PHyper
from pfl_core.fields import NonNegativeInt, PositiveInt
from pfl_core.training import Params


@dataclass
class L2PHyper(FedL2PHyper):
    outer_epochs: PositiveInt = 150
    """L2P's budget of outer epochs per client: ceil(T_max x clients_per_round x 3 / C)
    (docs/papers/fedl2p.md: CIFAR-10 500 x 100 x 3 / 1000 = 150; :func:`l2p_outer_epochs`). Run it with one
    round in which every client takes part, as the code trains each client once, at evaluation."""
    patience: NonNegativeInt = 0
    """No early stopping: nothing is federated."""


def l2p_outer_epochs(rounds: int, clients_per_round: int, num_clients: int, outer_epochs: int = 3) -> int:
    """L2P's per-client budget: the outer epochs a client gets on average in FedL2P."""
    return math.ceil(rounds * clients_per_round * outer_epochs / num_clients)


@METHODS.register("l2p")
class L2P(FedL2P):
    """FedL2P without FL (code ``federated_learning: false``): each client learns its own lambda,
    kept in its state and never uploaded; the server's lambda stays at its initial value."""

    hyper_class = L2PHyper
    federated = False

    def start_lambda(self, server: ServerState, client: ClientContext) -> Params:
        return client.state.get("lambda", server["lambda"])

    def personal_lambda(self, server: ServerState, client: ClientContext | None) -> Params:
        if client is None or "lambda" not in client.state:
            raise ValueError("l2p personalizes with the client's own lambda: the client has not been trained "
                             "(run one round with every client: federation.clients_per_round = 0)")
        return client.state["lambda"]
