"""Per-client index splits and the seen/unseen client split (cafeme.md, "Per-client split")."""
from __future__ import annotations

import numpy as np


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
