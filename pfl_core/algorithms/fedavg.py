"""FedAvg (McMahan et al., 2017): local SGD from the global model, then a weighted parameter mean.

With ``weighting="uniform"`` the server takes the plain mean the CAFeMe code uses
(docs/papers/cafeme.md: FedAvg).

FedL2P's stage 1 (docs/papers/fedl2p.md) pretrains a ResNet with standard
BatchNorm: with a model that keeps BN state, every local step updates the running statistics
(train mode, momentum 0.1) and the server averages them with the parameters, as the FedL2P code
averages the whole state_dict; its lr schedules are ``lr_milestones``/``lr_decay``
(:mod:`~pfl_core.algorithms._lib.round_lr`).
"""
from __future__ import annotations

from dataclasses import dataclass

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import HyperParams
from pfl_core.algorithms.local_sgd import LocalSGDHyper, local_sgd, local_sgd_plan
from pfl_core.algorithms._lib.round_lr import RoundLR


@dataclass
class FedAvgHyper(LocalSGDHyper, RoundLR, HyperParams):
    weighting: Weighting = "samples"
    """``samples``: weight client k by n_k (FedAvg paper); ``uniform``: plain mean (CAFeMe code)."""


@METHODS.register("fedavg")
class FedAvg(Algorithm):
    hyper_class = FedAvgHyper
    keeps_bn_state = True
    maskable_streams = ("train",)
    train_streams = ("train",)

    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        return {"params": server["params"], **self.round_carry(server, round_idx)}

    def draw(self, client: ClientContext, round_idx: int):
        return local_sgd_plan(client, self.hp)

    def local_update(self, carry, batches, masks):
        params, buffers, loss = local_sgd(self.model, carry["params"], batches, masks, carry.get("lr", self.hp.lr),
                                          carry.get("buffers"))
        return {"params": params, **({} if buffers is None else {"buffers": buffers})}, loss

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        return ClientUpdate(carry["params"], client.num_samples("train"), loss, buffers=carry.get("buffers"))


@METHODS.register("fedavg_ft")
class FedAvgFT(FedAvg):
    """FedAvg whose global model is fine-tuned by the evaluation protocol (the "-FT" baseline)."""

    finetune_at_eval = True
