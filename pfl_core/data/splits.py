"""Per-client index splits and the seen/unseen client split (cafeme.md, "Per-client split")."""
from __future__ import annotations

import numpy as np
import torch


def split_indices(
    indices: np.ndarray,
    fractions: dict[str, float],
    rng: np.random.Generator,
    remainder: str = "train",
) -> dict[str, np.ndarray]:
    """Shuffle ``indices`` once; each named split (in dict order) takes the next floor(f * n)
    indices (CAFeMe: eval = floor(0.2 n)) and ``remainder`` takes the rest.

    ``fractions`` must not name ``remainder``, each fraction must be >= 0 and their sum < 1.
    """
    if remainder in fractions:
        raise ValueError(f"split {remainder!r} is the remainder split; do not give it a fraction")
    if any(f < 0 for f in fractions.values()) or sum(fractions.values()) >= 1:
        raise ValueError(f"split fractions must be >= 0 and sum to < 1, got {fractions}")
    shuffled = rng.permutation(np.asarray(indices, dtype=np.int64))
    n = len(shuffled)
    out: dict[str, np.ndarray] = {}
    start = 0
    for name, fraction in fractions.items():
        take = int(np.floor(fraction * n))
        out[name] = shuffled[start : start + take]
        start += take
    out[remainder] = shuffled[start:]
    return out


def split_seen_unseen(
    num_clients: int, unseen_fraction: float, rng: np.random.Generator
) -> tuple[list[int], list[int]]:
    """Hold out round(num_clients * unseen_fraction) clients chosen uniformly (cafeme.md: 20 of 100
    clients never train). Returns (seen, unseen), both sorted."""
    if not 0 <= unseen_fraction < 1:
        raise ValueError(f"unseen_fraction must be in [0, 1), got {unseen_fraction}")
    num_unseen = int(round(num_clients * unseen_fraction))
    unseen = set(rng.choice(num_clients, size=num_unseen, replace=False).tolist())
    seen = [c for c in range(num_clients) if c not in unseen]
    return seen, sorted(unseen)


def seeded_random_split(n: int, sizes: list[int], seed: int) -> list[np.ndarray]:
    """``torch.utils.data.random_split(range(n), sizes, generator=torch.Generator().manual_seed(seed))``:
    one ``randperm(n)`` of a fresh seeded CPU generator cut into consecutive parts; each part's
    positions in that permutation's order (the order of the code's ``Subset``)."""
    generator = torch.Generator().manual_seed(seed)
    parts = torch.utils.data.random_split(range(n), sizes, generator=generator)
    return [np.asarray(part.indices, dtype=np.int64) for part in parts]


def client_val_split(indices: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) of one client's training indices as the FedL2P CIFAR-10 loader cuts them
    (docs/papers/fedl2p.md: val = int(fraction * n), ``random_split`` with a generator seeded
    ``seed`` = 1, the same cut in every round and every run; 50 samples give 40 / 10)."""
    indices = np.asarray(indices, dtype=np.int64)
    val = int(fraction * len(indices))
    train, held = seeded_random_split(len(indices), [len(indices) - val, val], seed)
    return indices[train], indices[held]
