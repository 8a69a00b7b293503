"""FedBABU (Oh et al., 2022): the head stays at its random initialisation during federated
training; only the body is trained (head frozen, FedBABU Algorithm 1) and averaged. At
evaluation the protocol fine-tunes the whole model (``finetune_at_eval``; FedBABU Sec. 4: the
entire network is fine-tuned): MetaVers uses 10 fine-tuning steps at test, i.e.
``evaluation.params.steps: 10`` for this method in the suite.

Local training: the pFedHN code's client optimiser (MetaVers gives no FedBABU values). The head
is ``fc3.`` of ``lenet``.

FedL2P stage 1 (FedBABU pretraining; docs/papers/fedl2p.md): the FedL2P
code trains FedAvg's recipe with the classifier at lr 0 (``exclude_layers: [net.fc.weight,
net.fc.bias]``), which is this method with ``head_prefixes: [fc.]`` (the ResNets' classifier),
``momentum: 0``, ``weight_decay: 0``, ``lr: 0.1``, ``lr_milestones: [250, 375]``,
``local_epochs: 1``, ``local_steps: 0``: the head never moves, the body and every BN affine
parameter train, and a model with BN state updates and averages its running statistics.
"""
from __future__ import annotations

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.split_fedavg import SplitFedAvg


@METHODS.register("fedbabu")
class FedBABU(SplitFedAvg):
    personal_part = "none"
    trained_part = "body"
    finetune_at_eval = True
