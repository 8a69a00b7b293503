"""Local training: every client trains its own model from the common initialisation and never
communicates. The server state is never changed."""
from __future__ import annotations

from dataclasses import dataclass

from pfl_core.algorithms import METHODS
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import HyperParams
from pfl_core.algorithms.fedavg import FedAvg
from pfl_core.algorithms.local_sgd import LocalSGDHyper
from pfl_core.training import Params


@dataclass
class LocalHyper(LocalSGDHyper, HyperParams):
    pass


@METHODS.register("local")
class Local(FedAvg):
    """Each sampled client continues training its own model (kept in ``client.state``).

    A client that never trained (an unseen client) predicts with the initial model, and the
    protocol's personalization steps train it from there: for Local that *is* local training, so
    ``finetune_at_eval`` is True.
    """

    hyper_class = LocalHyper
    keeps_bn_state = False  # its own model per client, no BN state carried
    finetune_at_eval = True

    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        return {"params": client.state.get("params", server["params"])}

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        client.state["params"] = carry["params"]
        return ClientUpdate(None, client.num_samples("train"), loss)

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        return server

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        return client.state.get("params", server["params"])
