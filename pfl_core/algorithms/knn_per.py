"""kNN-Per (Marfoq et al., 2022): a FedAvg global model interpolated with a kNN on local features.

Training is FedAvg (every parameter trained and averaged; the pFedHN code's client optimiser,
since MetaVers gives no kNN-Per values). At evaluation each client builds a datastore of the
global model's features (:func:`pfl_core.training.embed`, ReLU(fc2) of ``lenet``) of its whole
train split and predicts

    p(y | x) = weight * p_kNN(y | x) + (1 - weight) * softmax(model(x)),

p_kNN(y | x) = sum over the k nearest stored features f_i (squared Euclidean distance d_i) of
exp(-d_i / (D * scale)) [y_i = y], normalised (the kNN-Per code: FAISS L2 search, Gaussian kernel
scaled by the feature dimension D). The logits it reports are log p.

Deviation (named switch ``weight``): the kNN-Per paper picks the interpolation weight per client
on held-out data from a grid; here it is one fixed value for all clients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F

from pfl_core.algorithms import METHODS
from pfl_core.engine.contract import ClientContext, ServerState
from pfl_core.algorithms.split_fedavg import SplitFedAvg, SplitFedAvgHyper
from pfl_core.fields import FINETUNE_ORDER, PositiveFloat, PositiveInt, Probability, Tune
from pfl_core.prototypes import squared_distances
from pfl_core.training import Params, embed, forward

#: keys of the client's datastore inside the parameters :meth:`KNNPer.predictor` returns
FEATURES, LABELS = "knn_features", "knn_labels"


@dataclass
class KNNPerHyper(SplitFedAvgHyper):
    k: Annotated[PositiveInt, Tune(1, 20, log=True, order=FINETUNE_ORDER + 2)] = 7
    """Neighbours (kNN-Per code, ``paper_experiments/*/heterogeneity_effect.sh``: 7); at most the
    client's train size."""
    weight: Annotated[Probability, Tune(0.0, 1.0, order=FINETUNE_ORDER + 1)] = 0.5
    """lambda, the kNN share of the mixture. The paper tunes it per client on validation data
    (grid 0..1); here a fixed value (0.5, the middle of that grid)."""
    scale: PositiveFloat = 1.0
    """Kernel scale: similarity exp(-d / (D * scale)) (kNN-Per code default 1.0)."""


def knn_probabilities(query: torch.Tensor, keys: torch.Tensor, labels: torch.Tensor, num_classes: int,
                      k: int, scale: float) -> torch.Tensor:
    """[n, C] kNN class probabilities of ``query`` [n, D] against the datastore (``keys`` [m, D],
    ``labels`` [m]). Distances are shifted by the nearest one before the exponential (the
    normalised weights are unchanged; no 0/0 when every kernel value underflows)."""
    distances, index = squared_distances(query, keys).topk(min(k, keys.shape[0]), dim=1, largest=False)
    weights = torch.exp(-(distances - distances[:, :1]) / (keys.shape[1] * scale))  # [n, k]
    votes = F.one_hot(labels[index], num_classes).to(weights.dtype)  # [n, k, C]
    return (weights.unsqueeze(-1) * votes).sum(1) / weights.sum(1, keepdim=True)


@METHODS.register("knn_per")
class KNNPer(SplitFedAvg):
    """FedAvg training; kNN-interpolated prediction (sequential evaluation: each client's datastore
    has its own size)."""

    hyper_class = KNNPerHyper
    personal_part = "none"
    trained_part = "all"
    eval_batched_fallback = "kNN-Per's datastore (the client's train features) differs in size per client"

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        """The global parameters plus the client's datastore: the features of its train split."""
        params = server["params"]
        x, y = client.dataset.batch(client.client.splits["train"])
        with torch.no_grad():
            features = embed(self.model, params, x)
        return {**params, FEATURES: features, LABELS: y}

    def logits(self, params: Params, x: torch.Tensor, client: ClientContext) -> torch.Tensor:
        model_params = {k: v for k, v in params.items() if k not in (FEATURES, LABELS)}
        model_probs = forward(self.model, model_params, x).softmax(1)
        knn = knn_probabilities(embed(self.model, model_params, x), params[FEATURES], params[LABELS],
                                model_probs.shape[1], self.hp.k, self.hp.scale)
        mixture = self.hp.weight * knn + (1 - self.hp.weight) * model_probs
        return mixture.clamp_min(torch.finfo(mixture.dtype).tiny).log()
