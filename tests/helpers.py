"""Tiny hand-made federated data for core tests."""
from __future__ import annotations

import pytest
import torch

from pfl_core.algorithms import METHODS
from pfl_core.data.federated import ArrayDataset, Client, FederatedData


@pytest.fixture
def one_thread():
    """Tiny problems: intra-op threads only add contention (and runs stay bit-reproducible).
    A module uses it with ``pytestmark = pytest.mark.usefixtures("one_thread")`` after importing it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_method(name: str, model, **hp):
    """The registered method ``name`` on ``model`` with hyperparameters ``hp`` (the rest defaults)."""
    cls = METHODS.get(name)
    return cls(model, cls.hyper_class.from_dict(hp))


def tiny_federation(sizes=(6, 4, 5), features=3, classes=3, unseen=(), seed=0, test=2) -> FederatedData:
    """Clients with ``sizes`` train samples each (contiguous rows) and ``test`` test samples."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) + test * len(sizes)
    x = torch.randn(total, features, generator=gen)
    y = torch.randint(0, classes, (total,), generator=gen)
    clients, start = [], 0
    for cid, n in enumerate(sizes):
        train = torch.arange(start, start + n)
        held = torch.arange(start + n, start + n + test)
        clients.append(Client(cid, {"train": train, "test": held}))
        start += n + test
    train_ids = [c for c in range(len(sizes)) if c not in unseen]
    return FederatedData(ArrayDataset("tiny", x, y, classes), clients, train_ids, list(unseen))


def tiny_modulated(context_labels: bool = False, modulation: str = "sigmoid", seed: int = 0):
    """A float64 1x6x6 CAFeMe-style modulated net (one conv block, one hidden dense block, 3
    classes), small enough for hand computations and finite differences."""
    from torch import nn

    from pfl_core.models.cafeme import ModulatedCNN
    from pfl_core.models.cnn import BaseCNN, conv_block, dense_block

    torch.manual_seed(seed)
    base = BaseCNN(nn.Sequential(conv_block(1, 2, 3, 1)), nn.Sequential(dense_block(18, 4), nn.Linear(4, 3)))
    return ModulatedCNN(base, nn.Sequential(conv_block(1, 2, 3, 1)), [18, 5, 6], 3,
                        modulation=modulation, context_labels=context_labels).double()


def image_federation(sizes=(12,), classes: int = 3, test: int = 4, seed: int = 0) -> FederatedData:
    """``tiny_federation`` with float64 1x6x6 images (for :func:`tiny_modulated`)."""
    gen = torch.Generator().manual_seed(seed)
    fed = tiny_federation(sizes=sizes, classes=classes, test=test, seed=seed)
    n = len(fed.dataset.y)
    fed.dataset = ArrayDataset("tiny6x6", torch.rand(n, 1, 6, 6, generator=gen, dtype=torch.float64),
                               fed.dataset.y, classes)
    return fed


class TinyLeNet(torch.nn.Module):
    """``lenet``'s structure on flat inputs (fc1 -> ReLU -> fc2 -> ReLU = the embedding -> fc3),
    small enough for hand computations: the model of the MetaVers baseline tests."""

    def __init__(self, features: int = 6, hidden: int = 5, embedding: int = 4, classes: int = 3):
        super().__init__()
        self.fc1 = torch.nn.Linear(features, hidden)
        self.fc2 = torch.nn.Linear(hidden, embedding)
        self.fc3 = torch.nn.Linear(embedding, classes)

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        features = torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1)))))
        return features if embed else self.fc3(features)


def split_clients(sizes, val: int, test: int) -> list[Client]:
    """Clients over consecutive rows: client k takes ``sizes[k]`` train, then ``val`` val and ``test`` test rows."""
    clients, start = [], 0
    for cid, n in enumerate(sizes):
        cut = [start, start + n, start + n + val, start + n + val + test]
        clients.append(Client(cid, {"train": torch.arange(cut[0], cut[1]), "val": torch.arange(cut[1], cut[2]),
                                    "test": torch.arange(cut[2], cut[3])}))
        start = cut[3]
    return clients


def fedl2p_round(fed: FederatedData, execution: str, hp: dict, **federation_kwargs):
    """One round of ``fedl2p`` on two clients of ``fed`` (a float64 tiny ResNet, fixed seeds) on the
    ``execution`` path; ``federation_kwargs`` go to :func:`pfl_core.federation.run_federation`."""
    from pfl_core.config import FederationConfig
    from pfl_core.engine import Executor
    from pfl_core.evaluation import EvalConfig
    from pfl_core.evaluation.clients import SeenClients
    from pfl_core.federation import run_federation
    from pfl_core.seeding import RunStreams
    from pfl_core.training import model_params

    torch.manual_seed(0)
    model = tiny_resnet().double()
    algorithm = make_method("fedl2p", model, **hp)
    algorithm.seed = 5
    return run_federation(algorithm, fed, model_params(model), FederationConfig(rounds=1, clients_per_round=2,
                                                                                 batch_size=4),
                          SeenClients(EvalConfig(steps=0, lr=0.1, reduction="sample")), RunStreams(0),
                          executor=Executor(execution, 0.0), **federation_kwargs)


def l2p_federation(sizes=(10, 10, 10), val=3, test=4, seed=0, classes=3) -> FederatedData:
    """float64 3x6x6 images; client k: ``sizes[k]`` train, ``val`` val and ``test`` test samples."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) + (val + test) * len(sizes)
    x = torch.rand(total, 3, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (total,), generator=gen)
    clients = split_clients(sizes, val, test)
    return FederatedData(ArrayDataset("img", x, y, classes), clients, list(range(len(sizes))))


def tiny_resnet(classes=3):
    """FedL2P's ResNet-18 (KLD-BN) at width 4 for 3x6x6 images."""
    from pfl_core.models import build_model

    return build_model("resnet18_cifar", (3, 6, 6), classes, width=4)
