"""The ``lda_per_group`` partitioner: LDA clients inside each natural group (domain, corruption).

FedL2P's Office-Caltech-10 and DomainNet loaders (fedl2p.md, "DomainNet"; ``domainnet_dataset.py``
L136, L190-198, ``office_dataset.py`` L128, L180-187) cut every domain into ``num_clients / G``
clients with flwr's LDA(alpha), re-seeding the generator with the code's fixed seed before each
domain: every domain gets the identical class-proportion matrix, so client k of every domain has
the same label proportions (this shapes Table 6's ARI). Clients are numbered group by group (domain
order), so clients ``m*g .. m*g+m-1`` hold domain g. With one client per group (Office: C = 4) each
client is its whole domain.

With several source splits (``data.source_splits: {train: train, val: val, test: test}``) the
builder runs the partitioner on each split with the same generator state, so train, val and test
of a domain are cut by the same proportions (exactly the same Dirichlet rows once ``lda`` draws its
matrix before anything that depends on the split's size).
"""
from __future__ import annotations

import numpy as np

from pfl_core.config import NonNegativeInt, PositiveFloat
from pfl_core.data.partitions import PARTITIONERS, partition


@PARTITIONERS.register("lda_per_group")
def lda_per_group(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    groups: np.ndarray,
    alpha: PositiveFloat = 1000.0,
    seed: NonNegativeInt | None = 1,
) -> list[np.ndarray]:
    """``num_clients / G`` ``lda`` clients per group (G distinct ``groups`` ids, sorted), the groups'
    clients in group order; indices are into ``labels``.

    ``seed``: each group's LDA draws from a fresh ``default_rng(seed)`` (the code's fixed seed 1,
    re-seeded per domain, independent of the run seed); None: from a copy of the run's partition
    generator ``rng`` as it stands, the same state for every group."""
    groups = np.asarray(groups)
    ids = np.unique(groups)
    if len(groups) != len(labels):
        raise ValueError(f"lda_per_group: {len(groups)} group ids for {len(labels)} samples")
    if num_clients % len(ids):
        raise ValueError(f"lda_per_group: num_clients={num_clients} is not divisible by the {len(ids)} groups "
                         f"(e.g. Office-Caltech-10: 4, DomainNet: 150 = 25 x 6)")
    per_group = num_clients // len(ids)
    state = rng.bit_generator.state
    parts: list[np.ndarray] = []
    for g in ids:
        rows = np.flatnonzero(groups == g)
        if seed is None:
            group_rng = np.random.Generator(type(rng.bit_generator)())
            group_rng.bit_generator.state = state
        else:
            group_rng = np.random.default_rng(seed)
        parts.extend(rows[p] for p in partition("lda", labels[rows], per_group, group_rng, alpha=alpha))
    return [np.asarray(p, dtype=np.int64) for p in parts]
