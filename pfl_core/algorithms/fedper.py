"""FedPer (Arivazhagan et al., 2019): base layers shared and averaged, a personal classifier head.

Every parameter is trained locally (momentum SGD from the server's base and the client's own
head); only the base is uploaded and averaged (FedPer, Sec. 3). A client that never trained
predicts with the server's base and its initial head. Hyperparameters: the pFedHN code's client
optimiser (:class:`~pfl_core.algorithms.local_sgd.MomentumSGDHyper`), head = ``fc3.`` of
``lenet`` (MetaVers gives no FedPer values; pFedHN and pFedGP compare with FedPer on this LeNet).
"""
from __future__ import annotations

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.split_fedavg import SplitFedAvg


@METHODS.register("fedper")
class FedPer(SplitFedAvg):
    personal_part = "head"
    trained_part = "all"
