"""FedL2P's fine-tuning baselines FT (BN C), FT (BN G) and FT (BN I) (docs/papers/fedl2p.md): no
federated training of their own; the ``finetune_pretrained`` protocol fine-tunes every client from
the pretrained model with the FT lr (``evaluation.params.lr``: 1e-3 CIFAR-10/10-C, 1e-2 Office,
DomainNet and Speech Commands) for e epochs, with the statistics each baseline names.

The mapping of the authors' code knobs (harness reading, docs/papers/fedl2p.md):

* ``ft_bn_c``: client statistics, "beta = 1 in Eq. 2": the plain FT client, standard BN whose
  running statistics start from the pretrained ones, train-mode fine-tuning, eval-mode test.
  ``running_init: reset`` is the alternative reading (KLD-BN with beta 1, running statistics from
  (0, 1)).
* ``ft_bn_g``: pretrained statistics, beta = 0 (the plain FT client with ``freeze_bn_buffer``).
* ``ft_bn_i``: incoming batch statistics in fine-tuning and test (FedBABU's choice).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import HyperParams, Tune
from pfl_core.algorithms._lib.finetune import FinetuneRecipe, MetaInputs, PretrainedState
from pfl_core.models.kld_bn import bn_names


class PretrainedOnly(Algorithm):
    """A stage-2 method that trains nothing federatedly (run it with ``federation.rounds: 0``; a
    round leaves the server as it is). Its whole effect is :meth:`finetune_recipe`."""

    keeps_bn_state = True  # trains nothing: the protocol fine-tunes from the pretrained statistics

    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        return {"loss": torch.zeros((), device=next(iter(server["params"].values())).device)}

    def draw(self, client: ClientContext, round_idx: int) -> dict:
        return {}

    def local_update(self, carry: dict, batches: dict, masks: dict) -> tuple[dict, torch.Tensor]:
        return carry, carry["loss"]

    def carry_out(self, server: ServerState, client: ClientContext, carry: dict, loss: torch.Tensor) -> ClientUpdate:
        return ClientUpdate(None, client.num_samples("train"), loss)

    def betas(self, value: float) -> torch.Tensor:
        """``value`` for every BN layer of the model."""
        return torch.full((len(bn_names(self.model)),), float(value))

    def finetune_recipe(self, server: ServerState, pretrained: PretrainedState, inputs: MetaInputs,
                        client: ClientContext | None = None) -> FinetuneRecipe:
        """How every client fine-tunes (the same for all clients: no meta-net)."""
        raise NotImplementedError


FT_LR_GRID = Tune(choices=(1.0, 0.1, 0.01, 1e-3, 1e-4, 1e-5))
"""The FedL2P paper's fine-tuning lr grid {1, 0.1, ..., 1e-5} (docs/papers/fedl2p.md), searched by
``pflbench tune`` for the FT baselines on ``evaluation.params.lr``."""


@dataclass
class FTBNCHyper(HyperParams):
    running_init: Literal["pretrained", "reset"] = "pretrained"
    """Where the client's running statistics start: ``pretrained`` = the plain FT client of the
    authors' code (docs/papers/fedl2p.md, harness mapping); ``reset`` = KLD-BN with beta 1 and running
    statistics from (0, 1), the alternative reading (differs mostly at e = 5: a 0.9^10 residue)."""


@METHODS.register("ft_bn_c")
class FTBNC(PretrainedOnly):
    """FT (BN C): client statistics (beta 1), eval-mode test."""

    hyper_class = FTBNCHyper
    tune_evaluation = {"lr": FT_LR_GRID}

    def finetune_recipe(self, server, pretrained, inputs, client=None) -> FinetuneRecipe:
        return FinetuneRecipe(self.betas(1.0), None, running_init=self.hp.running_init)


@METHODS.register("ft_bn_g")
class FTBNG(PretrainedOnly):
    """FT (BN G): pretrained statistics (beta 0) in fine-tuning and test."""

    hyper_class = HyperParams
    tune_evaluation = {"lr": FT_LR_GRID}

    def finetune_recipe(self, server, pretrained, inputs, client=None) -> FinetuneRecipe:
        return FinetuneRecipe(self.betas(0.0), None, running_init="pretrained")


@METHODS.register("ft_bn_i")
class FTBNI(PretrainedOnly):
    """FT (BN I): each batch's own statistics (beta 1) in fine-tuning and in the test."""

    hyper_class = HyperParams
    tune_evaluation = {"lr": FT_LR_GRID}

    def finetune_recipe(self, server, pretrained, inputs, client=None) -> FinetuneRecipe:
        return FinetuneRecipe(self.betas(1.0), None, running_init="pretrained", test_mode="train")
