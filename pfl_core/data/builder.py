"""Build :class:`FederatedData` from a dataset: partition, per-client splits, seen/unseen clients.

Each step has its own random stream (``partition``, ``split``, ``unseen``; see
``pfl_core.seeding``), so changing one setting never moves the others.
"""
from __future__ import annotations

import copy

import random
from typing import Callable

import numpy as np
import torch

from pfl_core.config import DataConfig
from pfl_core.fields import ConfigError
from pfl_core.data.datasets import loader_splits
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.data.partitions import PARTITIONERS, two_phase
from pfl_core.data.partitions import partition as run_partition
from pfl_core.data.partitions import partition_sources, partitioner_params, rotation_group_of, takes_groups
from pfl_core.data.splits import client_val_split, split_indices, split_seen_unseen
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


def check_sources(data: DataConfig) -> None:
    """Load-time check of ``data.source_splits`` / ``pool_splits`` / ``partition_seeding`` against
    the dataset's splits and the partitioner (raises :class:`ConfigError` naming the key)."""
    splits = [s for s in loader_splits(data.dataset) if s != "all"]
    for key, name in [*((f"data.source_splits.{k}", v) for k, v in data.source_splits.items()),
                      *((f"data.pool_splits[{i}]", v) for i, v in enumerate(data.pool_splits))]:
        if name not in splits:
            raise ConfigError(f"{key}: dataset {data.dataset!r} has the splits {splits}, not {name!r}", key)
    partition = data.partition.get("name") if isinstance(data.partition, dict) else None
    several = len(set(data.source_splits.values())) > 1
    needs_two = several or data.partition_seeding == "reseed" or data.partition_per_group
    if needs_two and partition in PARTITIONERS and not two_phase(partition) \
            and not (several and takes_groups(partition)):
        two = sorted(n for n in PARTITIONERS.names() if two_phase(n))
        key = ("data.source_splits" if several else
               "data.partition_per_group" if data.partition_per_group else "data.partition_seeding")
        raise ConfigError(f"{key} needs a partitioner that applies one class assignment to several splits "
                          f"({two}), not {partition!r}", key)


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
    source_splits: dict[str, str] | None = None,
    pool_splits: list[str] = (),
    partition_seeding: str = "streams",
    partition_per_group: bool = False,
    client_val_fraction: float = 0.0,
    client_val_seed: int = 1,
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

    ``source_splits`` (client split -> source split of ``dataset``, a dataset joined by
    :func:`~pfl_core.data.datasets.load_sources`) gives each client its splits whole from several
    source splits under one class assignment (:func:`source_split_clients`); ``client_splits`` is
    then unused. ``pool_splits`` are source splits kept whole in ``FederatedData.pools``.
    ``partition_seeding`` is ``streams`` (the ``partition`` stream) or ``reseed`` (the MetaVers
    code's re-seeding with the run seed, :func:`partition_rngs`). ``partition_per_group`` partitions
    each of the dataset's groups (corruption, domain) on its own under one assignment
    (:func:`~pfl_core.data.partitions.partition_sources`); ``Client.meta["group"]`` names the group.

    ``client_val_fraction`` > 0 then cuts each client's ``train`` split into ``train`` and ``val``
    (:func:`~pfl_core.data.splits.client_val_split`, generator seeded ``client_val_seed``).
    """
    labels = dataset.labels_numpy()
    groups = dataset.groups.cpu().numpy() if dataset.groups is not None else None
    pools = {name: torch.as_tensor(dataset.source_rows(name)) for name in pool_splits}
    if source_splits:
        clients = source_split_clients(dataset, num_clients, partition, partition_params, source_splits,
                                       *partition_rngs(partition_seeding, streams), per_group=partition_per_group)
        clients = cut_client_val(clients, client_val_fraction, client_val_seed)
        return _federated(dataset, clients, unseen_fraction, validation_fraction, streams, 1, pools)
    partition_rng, split_rng = streams.numpy("partition"), streams.numpy("split")
    reseed = partition_rngs(partition_seeding, streams) if partition_seeding == "reseed" else None
    for draw in range(1, max_draws + 1):
        if reseed:  # the code's draw, always the same for a seed: nothing to redraw
            parts = partition_sources(partition, {"split": labels}, num_clients, *reseed, **partition_params)["split"]
        else:
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
    clients = cut_client_val(clients, client_val_fraction, client_val_seed)
    return _federated(dataset, clients, unseen_fraction, validation_fraction, streams, draw, pools)


def _federated(dataset: ArrayDataset, clients: list[Client], unseen_fraction: float, validation_fraction: float,
               streams: RunStreams, draws: int, pools: dict[str, torch.Tensor]) -> FederatedData:
    """The clients with their roles: unseen (test) clients first (the dataset's own
    ``unseen_groups``, else a random ``unseen_fraction``), then validation clients."""
    if dataset.unseen_groups:
        if unseen_fraction:
            raise ValueError(f"dataset {dataset.name!r} holds its own unseen clients (groups "
                             f"{list(dataset.unseen_groups)[:3]}...): set data.unseen_fraction to 0")
        held = set(dataset.unseen_groups)
        unseen = [c.cid for c in clients if c.meta.get("group") in held]
        seen = [c.cid for c in clients if c.meta.get("group") not in held]
    else:
        seen, unseen = split_seen_unseen(len(clients), unseen_fraction, streams.numpy("unseen"))
    train, validation = seen, []
    if validation_fraction:
        kept, held = split_seen_unseen(len(seen), validation_fraction, streams.numpy("validation"))
        train, validation = [seen[i] for i in kept], [seen[i] for i in held]
    return FederatedData(dataset, clients, train_clients=train, unseen_clients=unseen,
                         validation_clients=validation, partition_draws=draws, pools=pools)


def partition_rngs(seeding: str, streams: RunStreams) -> tuple:
    """(assignment generator, per-split shuffle generator factory) of ``data.partition_seeding``.

    ``streams``: both from the run's ``partition`` stream (one generator, continued in split
    order). ``reseed``: as the MetaVers code re-seeds every RNG with the run seed before Step A and
    before each Step B (docs/papers/metavers.md): ``np.random.RandomState(seed)`` (numpy's
    global generator after ``np.random.seed(seed)``) for the assignment, a fresh
    ``random.Random(seed)`` (``random.shuffle`` after ``random.seed(seed)``) for each split."""
    if seeding == "reseed":
        seed = streams.seed
        return np.random.RandomState(seed), lambda split: random.Random(seed)
    if seeding != "streams":
        raise ValueError(f"data.partition_seeding must be 'streams' or 'reseed', got {seeding!r}")
    rng = streams.numpy("partition")
    return rng, lambda split: rng


def source_split_clients(dataset: ArrayDataset, num_clients: int, partition: str, partition_params: dict,
                         source_splits: dict[str, str], assign_rng, split_rng: Callable,
                         per_group: bool = False) -> list[Client]:
    """Clients whose splits come from different source splits of ``dataset`` with ONE class
    assignment (docs/papers/metavers.md: Step A once, Step B per source split): client split
    ``name`` of client i is client i's part of source split ``source_splits[name]``, whole. With a
    single source split any partitioner serves (e.g. ``shards`` on the novel-class ``train`` split).
    ``per_group``: each of the dataset's groups on its own, clients g*m .. g*m+m-1 in group g."""
    labels = dataset.labels_numpy()
    sources = list(dict.fromkeys(source_splits.values()))
    rows = {s: dataset.source_rows(s) for s in sources}
    groups = None
    if per_group:
        if dataset.groups is None:
            raise ValueError(f"data.partition_per_group: dataset {dataset.name!r} has no groups")
        every = dataset.groups.cpu().numpy()
        groups = {s: every[rows[s]] for s in sources}
    natural = None
    if takes_groups(partition):  # natural (speakers): every split cut alike, from one generator state
        if dataset.groups is None:
            raise ValueError(f"partitioner {partition!r}: dataset {dataset.name!r} has no groups")
        natural = dataset.groups.cpu().numpy()
        state = copy.deepcopy(assign_rng)
        parts = {s: run_partition(partition, labels[rows[s]], num_clients, copy.deepcopy(state),
                                  groups=natural[rows[s]], **partition_params) for s in sources}
    elif len(sources) == 1 and not two_phase(partition) and groups is None:  # one source split: any partitioner
        parts = {sources[0]: run_partition(partition, labels[rows[sources[0]]], num_clients, assign_rng,
                                           **partition_params)}
    else:
        parts = partition_sources(partition, {s: labels[rows[s]] for s in sources}, num_clients, assign_rng,
                                  split_rng, groups=groups, **partition_params)
    ids = np.unique(np.concatenate(list(groups.values()))) if groups is not None else None
    clients = []
    for cid in range(num_clients):
        own = {s: rows[s][parts[s][cid]] for s in sources}
        splits = {name: torch.as_tensor(own[s], dtype=torch.int64) for name, s in source_splits.items()}
        meta = {"n": int(sum(len(v) for v in own.values())), **{f"n_{s}": int(len(v)) for s, v in own.items()}}
        if ids is not None:  # clients g*m .. g*m+m-1 form group g (partition_sources)
            meta["group"] = group_label(dataset, int(ids[cid // (num_clients // len(ids))]))
        elif natural is not None:
            (group,) = _client_groups(partition, partition_params, [np.concatenate(list(own.values()))], natural)
            if group is not None:
                meta["group"] = group
        clients.append(Client(cid, splits, meta))
    return clients


def group_label(dataset: ArrayDataset, group: int) -> str | int:
    """The name of group id ``group`` (``ArrayDataset.group_names``: a corruption, a domain), else the id."""
    return dataset.group_names[group] if dataset.group_names else group


def cut_client_val(clients: list[Client], fraction: float, seed: int) -> list[Client]:
    """Each client's ``train`` split cut into ``train`` and ``val`` (:func:`client_val_split`);
    ``fraction`` 0 leaves the clients as they are."""
    if not fraction:
        return clients
    out = []
    for client in clients:
        if "train" not in client.splits or "val" in client.splits:
            raise ValueError(f"data.client_val_fraction: client {client.cid} needs a 'train' split and no 'val' "
                             f"split, it has {sorted(client.splits)}")
        train, val = client_val_split(client.splits["train"].numpy(), fraction, seed)
        splits = {**client.splits, "train": torch.as_tensor(train), "val": torch.as_tensor(val)}
        out.append(Client(client.cid, splits, dict(client.meta)))
    return out


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
