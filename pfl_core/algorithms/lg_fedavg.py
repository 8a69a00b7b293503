"""LG-FedAvg (Liang et al., 2020): local representations, a global head.

Each client keeps its own body (the representation layers) and trains it with the global head;
only the head (``head_prefixes``, ``fc3.`` of ``lenet``) is uploaded and averaged. As in the
LG-FedAvg code and MetaVers' protocol ("LG-FedAvg requires extra 200 rounds after pretraining the
FedAvg model via 1,000 rounds", Sec. 4.1), the run first trains plain FedAvg for
``pretrain_rounds`` rounds (everything uploaded and averaged, same local training); from then on
a client's body starts from that pretrained global body and stays with it. So the MetaVers
setting is ``federation.rounds: 1200`` with the default ``pretrain_rounds: 1000``.

Local training: the pFedHN code's client optimiser (MetaVers gives no LG-FedAvg values; pFedHN
and pFedGP compare with LG-FedAvg on this LeNet); the LG-FedAvg code's own CIFAR-10 script uses
SGD lr 0.1, one local epoch of batches of 50. After each round the LG-FedAvg code copies the
averaged global layers into every client's model, which is what starting from the server's
global part does here; its per-client "best round" selection on test data is not reproduced.
Best-validation selection (MetaVers' model selection) and early stopping consider only the
LG-FedAvg evaluations, after round ``pretrain_rounds`` (:meth:`LGFedAvg.pretraining_rounds`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Weighting
from pfl_core.engine.contract import ClientUpdate, ServerState
from pfl_core.algorithms.split_fedavg import SplitFedAvg, SplitFedAvgHyper
from pfl_core.fields import NonNegativeInt
from pfl_core.training import Params


@dataclass
class LGFedAvgHyper(SplitFedAvgHyper):
    head_prefixes: list[str] = field(default_factory=lambda: ["fc3."])
    """The **global** layers (everything else is local). ``fc3.``: a global classifier on local
    representations, as the LG-FedAvg paper describes it. The LG-FedAvg code's CIFAR-10 run keeps
    the last ``--num_layers_keep 2`` entries of ``weight_keys`` = [fc1, fc2, fc3, conv2, conv1]
    global, i.e. the convolutions: ``["conv1.", "conv2."]`` reproduces that."""
    weighting: Weighting = "uniform"
    """Average of the uploads: ``uniform``, the LG-FedAvg code's plain mean over the sampled clients."""
    pretrain_rounds: NonNegativeInt = 1000
    """Rounds of plain FedAvg before local representations (MetaVers Sec. 4.1: 1000, then 200
    LG-FedAvg rounds). 0: LG-FedAvg from the first round, from the initial model."""


@METHODS.register("lg_fedavg")
class LGFedAvg(SplitFedAvg):
    """Server state: ``params``, ``round`` (rounds aggregated so far) and, for a model with BN
    state, ``buffers`` (averaged like SplitFedAvg's)."""

    hyper_class = LGFedAvgHyper
    personal_part = "body"
    trained_part = "all"

    def init_server(self, params: Params) -> ServerState:
        """The base state (``params``, and ``buffers`` for a model with BN state) and ``round``."""
        return {**super().init_server(params), "round": 0}

    def personal_names(self, server: ServerState) -> list[str]:
        return [] if server["round"] < self.hp.pretrain_rounds else super().personal_names(server)

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        new = super().aggregate(server, updates)
        return {**new, "round": server["round"] + 1}

    def pretraining_rounds(self) -> int:
        """The FedAvg stage: evaluations up to round ``pretrain_rounds`` (that round's included: no
        client has a body of its own yet) score the FedAvg model, not LG-FedAvg's."""
        return self.hp.pretrain_rounds

    def run_info(self, server: ServerState) -> dict:
        """Where the FedAvg stage ended: evaluations up to this round scored the FedAvg model."""
        return {"lg_fedavg_pretrain_rounds": self.hp.pretrain_rounds}
