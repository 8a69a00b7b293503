"""Tiny hand-made federated data for core tests."""
from __future__ import annotations

import torch

from pfl_core.data.federated import ArrayDataset, Client, FederatedData


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
