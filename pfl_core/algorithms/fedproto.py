"""FedProto (Tan et al., 2022): clients exchange class prototypes instead of parameters.

Each client trains its own model (kept in its state; the common initial model before) on

    L = CE(model(x), y) + ld * MSE(f(x), C_y),

f the embedding (:func:`pfl_core.training.embed`, ReLU(fc2) of ``lenet``) and C_y the global
prototype of y (FedProto Eq. 5-6; the code's ``nn.MSELoss``: the mean over the batch and the
feature dimension, a sample whose class has no global prototype contributing 0). While training,
it sums the features of its training batches per class (at the parameters before each step, as
the code collects them) and uploads the means, its local prototypes (Eq. 3). The server's global
prototype of a class is the plain mean of the uploaded prototypes of that class (Eq. 4,
``proto_aggregation``).

Prediction (``predict``): ``global_proto``, the nearest global prototype by squared distance
among the classes of the client's train split that have one (FedProto Sec. 4; the code's
``test_inference_new_het_lt`` "with protos" accuracy; ``own_classes_only``), or ``head``, the
client's own classifier. The code gives a class outside that set the distance 100 (in MSE
units); here such a class is never predicted. Local prototypes are the mean training features of
every local step (the code: of the last local epoch; the same with the default one epoch).

Hyperparameters from the FedProto code (MetaVers gives none): SGD lr 0.01, momentum 0.5, one
local epoch, ld 1. Switch ``keep_missing_protos``: the code replaces the global prototypes by
this round's aggregate, so with partial participation (MetaVers: 5 clients per round) a class
no sampled client holds has no prototype that round; True keeps its previous prototype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from torch.func import functional_call

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import FINETUNE_ORDER, HyperParams, SGD_LR, Tune
from pfl_core.algorithms.local_sgd import MomentumSGDHyper, local_sgd_plan, momentum_sgd
from pfl_core.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat
from pfl_core.prototypes import prototype_logits
from pfl_core.training import Params, embed, value_and_grad

#: keys of the global prototypes (and of the classes a client may predict) inside the parameters
#: :meth:`FedProto.predictor` returns
PROTOS, ALLOWED = "fedproto_protos", "fedproto_allowed"


@dataclass
class FedProtoHyper(MomentumSGDHyper, HyperParams):
    lr: Annotated[PositiveFloat, SGD_LR] = 0.01
    """Local SGD learning rate (FedProto code ``--lr`` 0.01)."""
    local_epochs: Annotated[NonNegativeInt, Tune(1, 5, order=1)] = 1
    """Local epochs per round (FedProto code ``--train_ep`` 1)."""
    local_steps: Annotated[NonNegativeInt, Tune(1, 50, log=True, order=1)] = 0
    """If > 0, this many batches instead of ``local_epochs`` passes."""
    momentum: NonNegativeFloat = 0.5
    """SGD momentum, a fresh optimiser every round (FedProto code: 0.5)."""
    weight_decay: NonNegativeFloat = 0.0
    """SGD weight decay (FedProto code: none)."""
    ld: Annotated[NonNegativeFloat, Tune(1e-2, 10.0, log=True, order=FINETUNE_ORDER + 1)] = 1.0
    """lambda, the weight of the prototype regulariser (FedProto code ``--ld`` 1)."""
    classifier: str = "fc3"
    """The module that maps the embedding to the logits (``fc3`` of ``lenet``)."""
    predict: Literal["global_proto", "head"] = "global_proto"
    """``global_proto``: nearest global prototype (FedProto paper); ``head``: the model's logits."""
    own_classes_only: bool = True
    """``global_proto`` prediction among the client's own classes (those of its train split), as the
    code's "with protos" accuracy; False: among every class with a global prototype."""
    keep_missing_protos: bool = False
    """False: a round's aggregate replaces the global prototypes (FedProto code); True: a class
    that no client of the round uploaded keeps its previous global prototype."""


@METHODS.register("fedproto")
class FedProto(Algorithm):
    """Server state: ``params`` (the initial model), ``protos`` [C, D] and ``has_proto`` [C];
    client state: ``params`` (its own model, once trained)."""

    hyper_class = FedProtoHyper
    maskable_streams = ("train",)

    def __init__(self, model, hp):
        super().__init__(model, hp)
        try:
            self.head = model.get_submodule(hp.classifier)
        except AttributeError:
            raise ValueError(f"fedproto: the model has no module {hp.classifier!r} mapping its embedding "
                             "to logits; set method.params.classifier (lenet: fc3)") from None
        self.num_classes, self.embedding_dim = self.head.weight.shape

    def init_server(self, params: Params) -> ServerState:
        like = params[f"{self.hp.classifier}.weight"]
        return {"params": params, "protos": torch.zeros_like(like),
                "has_proto": torch.zeros(self.num_classes, dtype=torch.bool, device=like.device)}

    def features_and_logits(self, params: Params, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = embed(self.model, params, x)
        prefix = f"{self.hp.classifier}."
        head = {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
        return features, functional_call(self.head, head, (features,))

    def loss(self, params: Params, x, y, protos: torch.Tensor, has_proto: torch.Tensor) -> torch.Tensor:
        features, logits = self.features_and_logits(params, x)
        target = torch.where(has_proto[y].unsqueeze(1), protos[y], features.detach())
        return F.cross_entropy(logits, y) + self.hp.ld * F.mse_loss(features, target)

    # -- the client program ---------------------------------------------------------------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        return {"params": client.state.get("params", server["params"]),
                "protos": server["protos"], "has_proto": server["has_proto"]}

    def draw(self, client: ClientContext, round_idx: int):
        return local_sgd_plan(client, self.hp)

    def local_update(self, carry, batches, masks):
        protos, has_proto = carry["protos"], carry["has_proto"]

        def loss_and_grads(params, x, y):
            return value_and_grad(lambda p, x, y: self.loss(p, x, y, protos, has_proto), params, x, y)

        def class_sums(params, x, y):
            with torch.no_grad():
                onehot = F.one_hot(y, self.num_classes).to(protos.dtype)
                return {"sums": onehot.T @ embed(self.model, params, x), "counts": onehot.sum(0)}

        params, loss, seen, _ = momentum_sgd(loss_and_grads, carry["params"], batches, masks, self.hp, class_sums)
        local = seen["sums"] / seen["counts"].clamp_min(1).unsqueeze(1)
        return {"params": params, "protos": local, "has_proto": seen["counts"] > 0}, loss

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        client.state["params"] = carry["params"]
        upload = {"protos": carry["protos"], "has_proto": carry["has_proto"]}
        return ClientUpdate(upload, client.num_samples("train"), loss)

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        """Per class, the plain mean of the uploaded local prototypes of that class."""
        present = torch.stack([u.params["has_proto"] for u in updates]).to(server["protos"].dtype)  # [K, C]
        protos = torch.stack([u.params["protos"] for u in updates])  # [K, C, D]
        counts = present.sum(0)
        mean = (present.unsqueeze(2) * protos).sum(0) / counts.clamp_min(1).unsqueeze(1)
        has_proto = counts > 0
        if self.hp.keep_missing_protos:
            mean = torch.where(has_proto.unsqueeze(1), mean, server["protos"])
            has_proto = has_proto | server["has_proto"]
        return {**server, "protos": mean, "has_proto": has_proto}

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        """The client's model, plus the global prototypes and the classes it may predict (read by
        :meth:`logits`)."""
        allowed = server["has_proto"]
        if self.hp.own_classes_only:
            labels = client.dataset.y[client.client.splits["train"]]
            own = torch.zeros_like(allowed).index_fill(0, labels.to(allowed.device), True)
            allowed = allowed & own
        return {**client.state.get("params", server["params"]), PROTOS: server["protos"], ALLOWED: allowed}

    def logits(self, params: Params, x: torch.Tensor, client: ClientContext) -> torch.Tensor:
        model_params = {k: v for k, v in params.items() if k not in (PROTOS, ALLOWED)}
        features, logits = self.features_and_logits(model_params, x)
        if self.hp.predict == "head":
            return logits
        scores = prototype_logits(features, params[PROTOS])
        floor = scores.min(1, keepdim=True).values - 1.0  # classes not allowed: below every other
        return torch.where(params[ALLOWED], scores, floor)
