"""Build :class:`FederatedData` from a dataset: partition, per-client splits, seen/unseen clients.

Each step has its own random stream (``partition``, ``split``, ``unseen``; see
``pfl_core.seeding``), so changing one setting never moves the others.
"""
from __future__ import annotations

import numpy as np
import torch

from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.data.partitions import partition as run_partition
from pfl_core.data.partitions import partitioner_params, rotation_group_of
from pfl_core.data.splits import split_indices, split_seen_unseen
from pfl_core.seeding import RunStreams


def _client_groups(
    name: str, params: dict, parts: list[np.ndarray], groups: np.ndarray | None
) -> list[int | None]:
    """The group of each client: its rotation group, or the dataset group (writer, rotation chunk,
    domain) that all of its samples share; None for clients that mix groups."""
    if name == "rotation_groups":
        num_groups = params.get("num_groups", partitioner_params(name)["num_groups"])
        return [rotation_group_of(c, len(parts), num_groups) for c in range(len(parts))]
    if groups is not None:
        return [int(groups[idx[0]]) if len(idx) and (groups[idx] == groups[idx[0]]).all() else None
                for idx in parts]
    return [None] * len(parts)


def build_federated(
    dataset: ArrayDataset,
    *,
    num_clients: int,
    partition: str,
    partition_params: dict,
    client_splits: dict[str, float],
    unseen_fraction: float,
    streams: RunStreams,
    min_split_size: int = 1,
    remainder: str = "train",
    validation_fraction: float = 0.0,
    min_train_size: int = 0,
    max_draws: int = 100,
) -> FederatedData:
    """Partition ``dataset`` among ``num_clients`` clients and split each client's indices.

    ``client_splits`` maps split names to fractions (e.g. ``{"eval": 0.2}``); the rest of each
    client goes to ``remainder``. Raises ``ValueError`` naming the client and split when a split
    has fewer than ``min_split_size`` samples. ``Client.meta`` holds ``n`` (client size) and,
    where the partition defines it, ``group``.

    ``validation_fraction`` of the seen clients (own stream ``validation``) are held out of
    training as validation clients for tuning; the unseen (test) clients are drawn first and do
    not depend on it.

    ``min_train_size`` > 0 redraws the whole partition (and the splits), continuing their
    streams, while any client's ``train`` split holds fewer samples (at most ``max_draws``
    draws). With the batch size it reproduces the CAFeMe authors' de-facto rule (their code crashes
    on such a client, and their published Dirichlet/FEMNIST numbers come from the seeds without
    one); a seed whose first draw has no such client keeps exactly its partition.
    ``FederatedData.partition_draws`` records the draws.
    """
    labels = dataset.labels_numpy()
    groups = dataset.groups.cpu().numpy() if dataset.groups is not None else None
    partition_rng, split_rng = streams.numpy("partition"), streams.numpy("split")
    for draw in range(1, max_draws + 1):
        parts = run_partition(partition, labels, num_clients, partition_rng, groups=groups, **partition_params)
        clients = _split_clients(parts, _client_groups(partition, partition_params, parts, groups), client_splits,
                                 split_rng, remainder, min_split_size, partition)
        short = short_train_clients(clients, min_train_size)
        if not short:
            break
    else:
        raise ValueError(
            f"data.redraw_short_clients: after {max_draws} partitions, client {short[0]} still has fewer than "
            f"{min_train_size} train samples (partition {partition!r} may be fixed, e.g. natural): run other "
            f"seeds, or turn the switch off to keep one short batch")
    seen, unseen = split_seen_unseen(len(clients), unseen_fraction, streams.numpy("unseen"))
    train, validation = seen, []
    if validation_fraction:
        kept, held = split_seen_unseen(len(seen), validation_fraction, streams.numpy("validation"))
        train, validation = [seen[i] for i in kept], [seen[i] for i in held]
    return FederatedData(dataset, clients, train_clients=train, unseen_clients=unseen,
                         validation_clients=validation, partition_draws=draw)


def short_train_clients(clients: list[Client], batch_size: int) -> list[int]:
    """The clients whose train split holds fewer than ``batch_size`` samples (the CAFeMe code
    crashes on them; here such a client trains or fine-tunes on one short batch)."""
    return [c.cid for c in clients if "train" in c.splits and len(c.splits["train"]) < batch_size]


def _split_clients(parts: list[np.ndarray], client_group: list[int | None], client_splits: dict[str, float],
                   split_rng: np.random.Generator, remainder: str, min_split_size: int,
                   partition: str) -> list[Client]:
    """One :class:`Client` per partition part, its indices split by ``client_splits``."""
    clients = []
    for cid, (indices, group) in enumerate(zip(parts, client_group)):
        splits = split_indices(indices, client_splits, split_rng, remainder=remainder)
        for split_name, idx in splits.items():
            if len(idx) < min_split_size:
                raise ValueError(
                    f"client {cid} ({len(indices)} samples, partition {partition!r}) has "
                    f"{len(idx)} samples in split {split_name!r} (< min_split_size={min_split_size})"
                )
        meta: dict = {"n": int(len(indices))}
        if group is not None:
            meta["group"] = group
        clients.append(
            Client(cid, {k: torch.as_tensor(v, dtype=torch.int64) for k, v in splits.items()}, meta)
        )
    return clients
