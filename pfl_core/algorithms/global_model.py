"""Global Accuracy (FedL2P Tables 2 and 4): the pretrained model itself, no fine-tuning, its BN
layers normalising with the pretrained statistics (beta 0, eval mode), tested by the
``finetune_pretrained`` protocol on every client's test split (pooled: for CIFAR-10 the whole
test set)."""
from __future__ import annotations

from pfl_core.algorithms import METHODS
from pfl_core.fields import HyperParams
from pfl_core.algorithms.ft_bn import PretrainedOnly
from pfl_core.algorithms._lib.finetune import FinetuneRecipe


@METHODS.register("global_model")
class GlobalModel(PretrainedOnly):
    hyper_class = HyperParams
    nothing_to_tune = "Global Accuracy evaluates the pretrained model as it is (no lr, no training)"

    def finetune_recipe(self, server, pretrained, inputs, client=None) -> FinetuneRecipe:
        return FinetuneRecipe(self.betas(0.0), 0.0, running_init="pretrained", finetune=False)
