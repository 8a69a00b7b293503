"""FedAvg (McMahan et al., 2017): local SGD from the global model, then a weighted parameter mean.

With ``weighting="uniform"`` the server takes the plain mean the CAFeMe code uses
(CAFeMe spec, "Baselines as implemented in the code": FedAvg).
"""
from __future__ import annotations

from dataclasses import dataclass

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, ClientContext, ClientUpdate, HyperParams, ServerState, Weighting
from pfl_core.algorithms.local_sgd import LocalSGDHyper, local_sgd, local_sgd_plan


@dataclass
class FedAvgHyper(LocalSGDHyper, HyperParams):
    weighting: Weighting = "samples"
    """``samples``: weight client k by n_k (FedAvg paper); ``uniform``: plain mean (CAFeMe code)."""


@METHODS.register("fedavg")
class FedAvg(Algorithm):
    hyper_class = FedAvgHyper
    maskable_streams = ("train",)

    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int) -> dict:
        return {"params": server["params"]}

    def draw(self, client: ClientContext, round_idx: int):
        return local_sgd_plan(client, self.hp)

    def local_update(self, carry, batches, masks):
        params, loss = local_sgd(self.model, carry["params"], batches, masks, self.hp.lr)
        return {"params": params}, loss

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        return ClientUpdate(carry["params"], client.num_samples("train"), loss)


@METHODS.register("fedavg_ft")
class FedAvgFT(FedAvg):
    """FedAvg whose global model is fine-tuned by the evaluation protocol (the "-FT" baseline)."""

    finetune_at_eval = True
