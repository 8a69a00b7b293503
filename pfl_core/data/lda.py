"""flwr's ``create_lda_partitions`` at index-level parity (docs/papers/fedl2p.md).

The FedL2P code partitions with flwr 0.19's ``create_lda_partitions`` (its helpers from flwr 0.17's
``flwr/dataset/utils/common.py``). This module restates that algorithm on sample indices:

1. shuffle with the global numpy stream (``np.random.permutation``);
2. sort by label with numpy's classic, non-stable introsort (:func:`introsort_argsort`);
3. client sizes: sample j counts toward client j mod N;
4. one Dirichlet row per client, ``np.random.default_rng(seed).dirichlet`` (:func:`lda_plan`);
5. clients in id order: start from the client's row, zero exhausted classes, add eps = 1e-5 to the
   others and renormalise (:func:`exclude_and_normalize`); per sample draw a class with
   ``multinomial(1, p)`` from the global stream and ``pop()`` that class's last remaining sample;
   when a class runs out, zero it and renormalise again.

The global stream runs on from split to split (and from group to group): the code seeds numpy's
global generator once, then partitions train, (val,) test in turn with one Dirichlet matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LDA_EPS = 1e-5
"""flwr ``exclude_classes_and_normalize``'s default eps (docs/papers/fedl2p.md, step 4)."""
_SMALL_QUICKSORT = 15


def introsort_argsort(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys)`` (default kind) as numpy's classic ``aquicksort`` computes it: median-of-3
    quicksort, insertion sort below 16 elements, heapsort past a depth of 2*floor(log2 n).

    numpy 1.21.5 (the FedL2P stack) runs this for int64 labels; numpy >= 1.25 on AVX-512 CPUs (and
    numpy 2 on AVX2) sorts 32/64-bit keys with x86-simd-sort, which orders equal labels
    differently. The order of equal labels decides which sample each ``pop()`` takes, so the
    partition would depend on the numpy build and the CPU; this restatement does not.
    """
    v = np.asarray(keys).tolist()
    a = list(range(len(v)))
    stack: list[tuple[int, int, int]] = []
    pl, pr = 0, len(v) - 1
    depth = max(len(v).bit_length() - 1, 0) * 2
    while True:
        if depth < 0:
            _heapsort(v, a, pl, pr - pl + 1)
        else:
            while pr - pl > _SMALL_QUICKSORT:
                pl, pr, pushed = _partition(v, a, pl, pr)
                depth -= 1
                stack.append((*pushed, depth))
            _insertion_sort(v, a, pl, pr)
        if not stack:
            return np.asarray(a, dtype=np.int64)
        pl, pr, depth = stack.pop()


def _partition(v: list, a: list[int], pl: int, pr: int) -> tuple[int, int, tuple[int, int]]:
    """One quicksort partition of ``a[pl..pr]``: (the smaller side's bounds, the larger side's)."""
    pm = pl + ((pr - pl) >> 1)
    if v[a[pm]] < v[a[pl]]:
        a[pm], a[pl] = a[pl], a[pm]
    if v[a[pr]] < v[a[pm]]:
        a[pr], a[pm] = a[pm], a[pr]
    if v[a[pm]] < v[a[pl]]:
        a[pm], a[pl] = a[pl], a[pm]
    pivot = v[a[pm]]
    pi, pj = pl, pr - 1
    a[pm], a[pj] = a[pj], a[pm]
    while True:
        pi += 1
        while v[a[pi]] < pivot:
            pi += 1
        pj -= 1
        while pivot < v[a[pj]]:
            pj -= 1
        if pi >= pj:
            break
        a[pi], a[pj] = a[pj], a[pi]
    a[pi], a[pr - 1] = a[pr - 1], a[pi]
    if pi - pl < pr - pi:
        return pl, pi - 1, (pi + 1, pr)
    return pi + 1, pr, (pl, pi - 1)


def _insertion_sort(v: list, a: list[int], pl: int, pr: int) -> None:
    for i in range(pl + 1, pr + 1):
        item, key, j = a[i], v[a[i]], i
        while j > pl and key < v[a[j - 1]]:
            a[j] = a[j - 1]
            j -= 1
        a[j] = item


def _heapsort(v: list, a: list[int], lo: int, n: int) -> None:
    """numpy's ``aheapsort`` of ``a[lo:lo+n]`` (1-based heap positions)."""
    base = lo - 1

    def sift(item: int, i: int, size: int) -> None:
        j = 2 * i
        while j <= size:
            if j < size and v[a[base + j]] < v[a[base + j + 1]]:
                j += 1
            if not v[item] < v[a[base + j]]:
                break
            a[base + i] = a[base + j]
            i, j = j, 2 * j
        a[base + i] = item

    for top in range(n >> 1, 0, -1):
        sift(a[base + top], top, n)
    while n > 1:
        item = a[base + n]
        a[base + n] = a[base + 1]
        n -= 1
        sift(item, 1, n)


def exclude_and_normalize(p: np.ndarray, empty: np.ndarray, eps: float = LDA_EPS) -> np.ndarray:
    """flwr ``exclude_classes_and_normalize``: +eps on the classes not ``empty``, 0 on the empty
    ones, divided by (sum + machine eps). A copy; eps accumulates when applied again."""
    if np.any(p < 0) or not np.isclose(np.sum(p), 1.0):
        raise ValueError(f"lda: a class distribution must be non-negative and sum to 1, got {p}")
    p = p.copy()
    p[~empty] += eps
    p[empty] = 0.0
    return p / (np.sum(p) + np.finfo(float).eps)


@dataclass
class LdaPlan:
    """What one LDA partition shares across its splits (and groups): the Dirichlet matrix and the
    global numpy stream that shuffles and draws, running on from split to split."""

    matrix: np.ndarray
    """(clients, classes): row i is client i's class distribution p_i ~ Dir(alpha)."""
    stream: np.random.RandomState | np.random.Generator | None = None
    """The code's ``np.random`` after ``np.random.seed(seed)``; None: the caller's generator."""


def lda_plan(labels: np.ndarray, num_clients: int, rng, *, alpha: float = 1.0, seed: int | None = 1) -> LdaPlan:
    """The Dirichlet matrix over the classes present in ``labels``: from ``default_rng(seed)`` with a
    fixed ``seed`` (the code: 1, every run alike), else from ``rng`` (the run's partition stream)."""
    num_classes = len(np.unique(labels))
    source = np.random.default_rng(seed) if seed is not None else rng
    matrix = source.dirichlet(np.full(num_classes, float(alpha)), size=num_clients)
    return LdaPlan(matrix, np.random.RandomState(seed) if seed is not None else None)


def lda_apply(labels: np.ndarray, plan: LdaPlan, rng) -> list[np.ndarray]:
    """Partition ``labels`` with ``plan`` (steps 1-3 and 5 of the module docstring); returns each
    client's indices into ``labels`` in draw order. Shuffle and draws use ``plan.stream`` when it
    is set, else ``rng`` (anything with numpy's ``permutation`` and ``multinomial``)."""
    stream = plan.stream if plan.stream is not None else rng
    if not hasattr(stream, "multinomial"):
        raise ValueError("lda with seed: null draws from the run's numpy partition stream; "
                         "data.partition_seeding: reseed gives Python's random - use streams, or an integer seed")
    labels = np.asarray(labels)
    num_clients, num_classes = plan.matrix.shape
    shuffled = stream.permutation(len(labels))
    order = shuffled[introsort_argsort(labels[shuffled])]
    classes, starts = np.unique(labels[order], return_index=True)
    if len(classes) != num_classes:
        raise ValueError(f"lda: this split holds {len(classes)} classes, the Dirichlet matrix "
                         f"{num_classes}; every split must hold every class")
    pools = [part.tolist() for part in np.split(order, starts[1:])]
    empty = np.zeros(num_classes, dtype=bool)
    parts = []
    for client in range(num_clients):
        size = len(labels) // num_clients + (client < len(labels) % num_clients)
        p = exclude_and_normalize(plan.matrix[client], empty)
        taken = []
        for _ in range(size):
            c = int(stream.multinomial(1, p).argmax())  # the one class drawn (flwr: np.where(... == 1))
            taken.append(pools[c].pop())
            if not pools[c]:
                empty[c] = True
                p = exclude_and_normalize(p, empty)
        parts.append(np.asarray(taken, dtype=np.int64))
    return parts
