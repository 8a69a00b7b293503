"""Label/group partitioners: split one dataset's sample indices among clients.

Every partitioner has the signature ``fn(labels, num_clients, rng, *, <params>) -> list[np.ndarray]``
and returns one ``int64`` index array (into ``labels``) per client. Randomness comes only from
``rng`` (a ``numpy.random.Generator``), so the same seed gives the same partition. The ``natural``
partitioner also takes ``groups`` (one group id per sample).
"""
from __future__ import annotations

import inspect
import random
from typing import Callable, Union

import numpy as np

from pfl_core.fields import NonNegativeInt, PositiveFloat, PositiveInt, Probability
from pfl_core.data.lda import lda_apply, lda_plan
from pfl_core.registry import Registry

Partitioner = Callable[..., list[np.ndarray]]
ShuffleRng = Union[np.random.Generator, np.random.RandomState, random.Random]
"""A generator that can shuffle: numpy's (``permutation``) or Python's (``shuffle``, the MetaVers
code's ``random.shuffle`` after ``random.seed(seed)``)."""
PARTITIONERS: Registry[Partitioner] = Registry("partitioner")


def _int64_list(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(p, dtype=np.int64) for p in parts]


@PARTITIONERS.register("iid")
def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A random permutation cut into ``num_clients`` near-equal parts (sizes differ by at most 1)."""
    return _int64_list(np.array_split(rng.permutation(len(labels)), num_clients))


@PARTITIONERS.register("shards")
def shards(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    num_shards: PositiveInt = 200,
    shards_per_client: PositiveInt = 2,
) -> list[np.ndarray]:
    """FedLab shards (cafeme.md, "Partition schemes", Shards).

    Sort by label, cut into ``num_shards`` contiguous shards of ``N // num_shards`` samples, permute
    the shards; client i gets permutation positions ``[i*k, (i+1)*k)``. Deviation: the sort is a
    *stable* argsort (FedLab uses numpy's default quicksort), so ties keep index order. The last
    ``N mod num_shards`` samples in sorted order are left out when N is not divisible.
    """
    if num_shards != num_clients * shards_per_client:
        raise ValueError(
            f"shards: num_shards={num_shards} must equal num_clients*shards_per_client="
            f"{num_clients}*{shards_per_client}={num_clients * shards_per_client}"
        )
    shard_size = len(labels) // num_shards
    if shard_size == 0:
        raise ValueError(f"shards: {len(labels)} samples cannot fill {num_shards} shards")
    order = np.argsort(labels, kind="stable")[: shard_size * num_shards]
    shard_ids = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    blocks = order.reshape(num_shards, shard_size)
    return _int64_list([blocks[ids].reshape(-1) for ids in shard_ids])


@PARTITIONERS.register("dirichlet")
def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: PositiveFloat = 0.3,
    min_size: NonNegativeInt = 10,
    max_tries: PositiveInt = 1000,
) -> list[np.ndarray]:
    """FedLab ``hetero_dir_partition`` (cafeme.md, "Partition schemes", Dirichlet).

    Repeat until every client holds >= ``min_size`` samples: for each class, shuffle its indices,
    draw p ~ Dir(alpha * 1), zero p_j for clients already holding >= N/num_clients samples,
    renormalise, and cut the class at floor(cumsum(p) * n_k). Finally shuffle each client.

    Raises ``ValueError`` after ``max_tries`` failed draws (e.g. 500 clients with alpha=0.05 cannot
    reach min_size=10 in practice; pass a smaller ``min_size`` such as 0). If every still-eligible
    client draws p_j == 0 exactly (underflow at tiny alpha) the class is spread uniformly over the
    eligible clients instead of producing NaNs.
    """
    classes = np.unique(labels)
    class_indices = [np.flatnonzero(labels == c) for c in classes]
    cap = len(labels) / num_clients
    smallest = short = 0
    for _ in range(max_tries):
        sizes = np.zeros(num_clients, dtype=np.int64)
        pieces: list[list[np.ndarray]] = []
        for idx in class_indices:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            eligible = sizes < cap
            p = np.where(eligible, p, 0.0)
            p = p / p.sum() if p.sum() > 0 else eligible / eligible.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            split = np.split(idx, cuts)
            sizes += np.array([len(s) for s in split])
            pieces.append(split)
        smallest, short = int(sizes.min()), int(np.sum(sizes < min_size))
        if short == 0:
            return _int64_list([rng.permutation(np.concatenate(parts)) for parts in zip(*pieces)])
    raise ValueError(
        f"dirichlet: after max_tries={max_tries} draws, {short} of {num_clients} clients still had "
        f"fewer than min_size={min_size} samples (smallest {smallest}) with alpha={alpha} and "
        f"{len(labels)} samples; lower min_size (0 accepts empty clients) or raise alpha"
    )


@PARTITIONERS.register("lda")
def lda(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: PositiveFloat = 1.0,
    seed: NonNegativeInt | None = 1,
) -> list[np.ndarray]:
    """flwr ``create_lda_partitions`` at index-level parity (fedl2p.md, "Partitioning by LDA";
    :mod:`pfl_core.data.lda`): equal client sizes (sample j counts toward client j mod N), one
    Dirichlet row p_i ~ Dir(alpha * 1_K) per client, clients filled in order by drawing a class
    with ``multinomial(1, p_i)`` and popping that class's last remaining sample; an exhausted class
    gets probability 0 and eps = 1e-5 is added to the others before renormalising.

    ``seed``: the partition's own seed, independent of the run seed. The FedL2P code draws the
    Dirichlet matrix from ``default_rng(1)`` and shuffles and draws with ``np.random`` after
    ``np.random.seed(1)``, so its three runs share one partition; 1 (default) reproduces it.
    ``null``: everything from ``rng``, the run's partition stream (each run seed its own partition).
    """
    plan = lda_plan(labels, num_clients, rng, alpha=alpha, seed=seed)
    return lda_apply(labels, plan, rng)


lda.phases = (lda_plan, lda_apply)
"""Two-phase form: one Dirichlet matrix (and one running numpy stream) for train, val and test, as
the code reuses the training partition's matrix for the test partition (flwr's ``create_lda_partitions``,
step 5; docs/papers/fedl2p.md)."""


def assign_classes(
    num_classes: int,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
    low: float = 0.4,
    high: float = 0.6,
) -> list[list[tuple[int, float]]]:
    """Step A of the pFedHN/pFedGP client split, MetaVers version (metavers.md, "Client split").

    cnt = C*U/K clients per class (must be an integer). Per class in order: cnt proportions from
    U(low, high), normalised to sum 1. Per client in order: draw uniformly among the classes with
    the largest remaining count, redraw on duplicates, until it has C classes; its proportion for
    class c is popped from the end of c's list. Returns ``[(class, proportion), ...]`` per client.
    """
    total = classes_per_client * num_clients
    if classes_per_client > num_classes or total % num_classes:
        raise ValueError(
            f"classes_per_client: C*U/K = {classes_per_client}*{num_clients}/{num_classes} must be "
            f"an integer with C <= K"
        )
    cnt = total // num_classes
    proportions = []
    for _ in range(num_classes):
        p = rng.uniform(low, high, cnt)
        proportions.append(list(p / p.sum()))
    remaining = np.full(num_classes, cnt)
    assignment = []
    for _ in range(num_clients):
        chosen: list[int] = []
        while len(chosen) < classes_per_client:
            c = int(rng.choice(np.flatnonzero(remaining == remaining.max())))
            if c not in chosen:
                chosen.append(c)
                remaining[c] -= 1
        assignment.append([(c, float(proportions[c].pop())) for c in chosen])
    return assignment


def _shuffled(indices: np.ndarray, rng: ShuffleRng) -> np.ndarray:
    """``indices`` in a random order: ``rng.permutation``, or Python's ``random.shuffle`` (which
    makes the same swaps on a list as on the code's numpy array)."""
    if isinstance(rng, random.Random):
        order = indices.tolist()
        rng.shuffle(order)
        return np.asarray(order, dtype=np.int64)
    return rng.permutation(indices)


def split_by_assignment(
    labels: np.ndarray, assignment: list[list[tuple[int, float]]], rng: ShuffleRng
) -> list[np.ndarray]:
    """Step B (metavers.md, "Client split"): per class (in class order) shuffle its indices; each
    client, in order, takes the next floor(n_c * p) indices of each of its classes."""
    num_classes = max([int(labels.max()) + 1] + [c + 1 for client in assignment for c, _ in client])
    pools = [_shuffled(np.flatnonzero(labels == c), rng) for c in range(num_classes)]
    cursor = np.zeros(num_classes, dtype=np.int64)
    parts = []
    for client in assignment:
        chunks = []
        for c, p in client:
            take = int(np.floor(len(pools[c]) * p))
            chunks.append(pools[c][cursor[c] : cursor[c] + take])
            cursor[c] += take
        parts.append(np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64))
    return _int64_list(parts)


@PARTITIONERS.register("classes_per_client")
def classes_per_client(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    classes_per_client: PositiveInt = 2,
    low: Probability = 0.4,
    high: Probability = 0.6,
) -> list[np.ndarray]:
    """pFedHN/pFedGP split as in MetaVers (metavers.md, "Client split"): Step A then Step B.

    K is ``labels.max() + 1``. Only the floor parts are assigned, so a few samples per class stay
    unused. Use :func:`assign_classes` and :func:`split_by_assignment` to apply one assignment to
    several splits (train/val/test).
    """
    assignment = _classes_per_client_assignment(labels, num_clients, rng, classes_per_client=classes_per_client,
                                                low=low, high=high)
    return split_by_assignment(labels, assignment, rng)


def _classes_per_client_assignment(labels: np.ndarray, num_clients: int, rng, *, classes_per_client: int = 2,
                                   low: float = 0.4, high: float = 0.6) -> list[list[tuple[int, float]]]:
    return assign_classes(int(labels.max()) + 1, num_clients, classes_per_client, rng, low, high)


classes_per_client.phases = (_classes_per_client_assignment, split_by_assignment)
"""Two-phase form (``assign(labels, num_clients, rng, **params)``, ``apply(labels, assignment,
rng)``): one assignment applied to several source splits (:func:`partition_sources`)."""


def rotation_group_of(client_id: int, num_clients: int, num_groups: int) -> int:
    """Group of ``client_id`` under :func:`rotation_groups`: clients g*m .. g*m+m-1 form group g."""
    return client_id // (num_clients // num_groups)


@PARTITIONERS.register("rotation_groups")
def rotation_groups(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, num_groups: PositiveInt = 10
) -> list[np.ndarray]:
    """RMNIST default partition (cafeme.md, "RMNIST"): shuffle arange(N), cut into ``num_groups``
    equal chunks, cut chunk g into m = num_clients/num_groups clients g*m .. g*m+m-1."""
    if num_clients % num_groups:
        raise ValueError(
            f"rotation_groups: num_clients={num_clients} is not divisible by num_groups={num_groups}"
        )
    chunks = np.array_split(rng.permutation(len(labels)), num_groups)
    per_group = num_clients // num_groups
    return _int64_list([part for chunk in chunks for part in np.array_split(chunk, per_group)])


@PARTITIONERS.register("natural")
def natural(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, groups: np.ndarray
) -> list[np.ndarray]:
    """One client per natural group (writer, user, domain), in sorted group-id order.

    With fewer clients than groups, ``num_clients`` group ids are chosen uniformly without
    replacement (cafeme.md, FEMNIST: "samples 100 writers uniformly") and kept in sorted order.
    """
    groups = np.asarray(groups)
    if len(groups) != len(labels):
        raise ValueError(f"natural: {len(groups)} group ids for {len(labels)} samples")
    ids = np.unique(groups)
    if num_clients > len(ids):
        raise ValueError(f"natural: num_clients={num_clients} but only {len(ids)} groups exist")
    if num_clients < len(ids):
        ids = np.sort(rng.choice(ids, size=num_clients, replace=False))
    return _int64_list([np.flatnonzero(groups == g) for g in ids])


def _keyword_params(fn: Partitioner) -> dict[str, inspect.Parameter]:
    return {
        name: p
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "groups"
    }


def partitioner_params(name: str) -> dict[str, object]:
    """The tunable keyword parameters of partitioner ``name`` and their defaults."""
    return {k: p.default for k, p in _keyword_params(PARTITIONERS.get(name)).items()}


def _checked_params(name: str, num_clients: int, params: dict) -> Partitioner:
    fn = PARTITIONERS.get(name)
    allowed = _keyword_params(fn)
    for key in params:
        if key not in allowed:
            raise ValueError(
                f"partitioner {name!r} has no parameter {key!r}; allowed: "
                f"{', '.join(sorted(allowed)) or '(none)'}"
            )
    if num_clients < 1:
        raise ValueError(f"partitioner {name!r}: num_clients must be >= 1, got {num_clients}")
    return fn


def partition(
    name: str,
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: np.ndarray | None = None,
    **params: object,
) -> list[np.ndarray]:
    """Run partitioner ``name`` after checking ``params``; ``groups`` goes only to ``natural``-style
    partitioners (those with a ``groups`` keyword)."""
    fn = _checked_params(name, num_clients, params)
    labels = np.asarray(labels)
    if takes_groups(name):
        if groups is None:
            raise ValueError(f"partitioner {name!r} needs per-sample groups; the dataset has none")
        params["groups"] = np.asarray(groups)
    return fn(labels, num_clients, rng, **params)


def takes_groups(name: str) -> bool:
    """Whether partitioner ``name`` reads per-sample ``groups`` (``natural``)."""
    return "groups" in inspect.signature(PARTITIONERS.get(name)).parameters


def two_phase(name: str) -> bool:
    """Whether partitioner ``name`` can apply one assignment to several splits."""
    return hasattr(PARTITIONERS.get(name), "phases")


def partition_sources(
    name: str,
    labels: dict[str, np.ndarray],
    num_clients: int,
    assign_rng: np.random.Generator | np.random.RandomState,
    split_rng: Callable[[str], ShuffleRng],
    groups: dict[str, np.ndarray] | None = None,
    **params: object,
) -> dict[str, list[np.ndarray]]:
    """Partition several source splits (name -> its labels) with ONE assignment of classes to
    clients: the partitioner's first phase once, on the first split's labels, with ``assign_rng``;
    its second phase on each split, in order, with ``split_rng(split)``. Returns each split's
    per-client indices (into that split's labels). docs/papers/metavers.md: Step A once,
    Step B per split.

    ``groups`` (split -> one group id per sample: corruption, domain) partitions every group on its
    own among ``num_clients / G`` clients, group by group in id order and split by split inside a
    group (clients g*m .. g*m+m-1 form group g), all under the one assignment: the FedL2P code's
    CIFAR-10-C and DomainNet re-draw the Dirichlet matrix per group from ``default_rng(1)``, i.e.
    the same matrix for every group (docs/papers/fedl2p.md), while numpy's global stream runs on."""
    fn = _checked_params(name, num_clients, params)
    if not hasattr(fn, "phases"):
        two = sorted(n for n in PARTITIONERS.names() if two_phase(n))
        raise ValueError(f"partitioner {name!r} cannot apply one assignment to several splits "
                         f"(data.source_splits, data.partition_seeding: reseed, data.partition_per_group); "
                         f"use one of {two}")
    assign, apply = fn.phases
    labels = {split: np.asarray(y) for split, y in labels.items()}
    first = next(iter(labels.values()))
    if groups is None:
        assignment = assign(first, num_clients, assign_rng, **params)
        return {split: apply(y, assignment, split_rng(split)) for split, y in labels.items()}
    ids = np.unique(np.concatenate([np.asarray(g) for g in groups.values()]))
    if num_clients % len(ids):
        raise ValueError(f"partitioner {name!r} per group: num_clients={num_clients} is not a multiple of "
                         f"the {len(ids)} groups")
    first_groups = np.asarray(next(iter(groups.values())))
    assignment = assign(first[first_groups == ids[0]], num_clients // len(ids), assign_rng, **params)
    out: dict[str, list[np.ndarray]] = {split: [] for split in labels}
    for group in ids:
        for split, y in labels.items():
            rows = np.flatnonzero(np.asarray(groups[split]) == group)
            out[split] += [rows[part] for part in apply(y[rows], assignment, split_rng(split))]
    return out
