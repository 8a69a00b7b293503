"""The ``lda`` partitioner at flwr parity (FedL2P spec, "Partitioning by LDA"; pfl_core.data.lda).

The reference below restates flwr 0.19's ``create_lda_partitions`` (with flwr 0.17's helpers) the
way flwr computes it - on the data arrays themselves, with numpy's global generator - so that the
product's index-level restatement is checked against an independent statement of the algorithm.
"""
from __future__ import annotations

import numpy as np
import pytest

from pfl_core.data import lda as lda_module
from pfl_core.data.lda import LDA_EPS, exclude_and_normalize, introsort_argsort
from pfl_core.data.partitions import partition, partition_sources


def labels_of(n: int, num_classes: int = 10, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % num_classes)


def flwr_reference(y: np.ndarray, num_clients: int, alpha: float, seed: int, matrix=None):
    """flwr's create_lda_partitions on x = sample ids, drawing from the *global* np.random (the
    caller seeds it). numpy's int16 argsort is the classic introsort (no SIMD for 16-bit keys),
    i.e. what numpy 1.21's default argsort does for the code's int64 labels."""
    x = np.arange(len(y))
    idx = np.random.permutation(len(x))
    x, y = x[idx], y[idx]
    idx = np.argsort(y.astype(np.int16))
    x, y = x[idx], y[idx]
    sizes = [0] * num_clients
    for j in range(len(x)):
        sizes[j % num_clients] += 1
    classes, starts = np.unique(y, return_index=True)
    bounds = list(starts) + [len(x)]
    samples = [list(x[bounds[k]:bounds[k + 1]]) for k in range(len(classes))]
    if matrix is None:
        matrix = np.random.default_rng(seed).dirichlet(np.repeat(alpha, len(classes)), size=num_clients)
    empty = [False] * len(classes)

    def exclude(dist):
        dist[[not e for e in empty]] += 1e-5
        dist[empty] = 0.0
        return dist / (np.sum(dist) + np.finfo(float).eps)

    parts = []
    for i in range(num_clients):
        dist = exclude(matrix[i].copy())
        taken = []
        for _ in range(sizes[i]):
            c = np.where(np.random.multinomial(1, dist) == 1)[0][0]
            taken.append(samples[c].pop())
            if len(samples[c]) == 0:
                empty[c] = True
                dist = exclude(dist)
        parts.append(np.array(taken))
    return parts, matrix


@pytest.fixture
def global_numpy_seed_1():
    """np.random.seed(1), as the FedL2P code's FederatedDataset does; the state is restored after."""
    state = np.random.get_state()
    np.random.seed(1)
    yield
    np.random.set_state(state)


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("n,k", [(1, 2), (16, 3), (17, 3), (1000, 10), (5003, 10), (20000, 100)])
def test_introsort_argsort_is_numpys_classic_argsort(n, k):
    y = np.random.default_rng(n).integers(0, k, n)
    assert np.array_equal(introsort_argsort(y), np.argsort(y.astype(np.int16)))


def test_introsort_heapsort_fallback_matches_numpy(monkeypatch):
    """Musser's median-of-3 killer drives the quicksort past its depth limit: the heapsort
    fallback then runs, and the result is still numpy's."""
    calls = []
    heapsort = lda_module._heapsort
    monkeypatch.setattr(lda_module, "_heapsort", lambda *a: (calls.append(a[3]), heapsort(*a)))
    n, half = 1024, 512
    y = np.zeros(n, dtype=np.int64)
    for i in range(1, half + 1):
        if i % 2:
            y[i - 1], y[i] = i, half + i
        y[half + i - 1] = 2 * i
    assert np.array_equal(introsort_argsort(y), np.argsort(y.astype(np.int16)))
    assert calls


def test_exclude_and_normalize_hand_computed():
    p = np.array([0.5, 0.5, 0.0])
    out = exclude_and_normalize(p, np.array([False, False, False]))
    total = 1.0 + 3 * LDA_EPS + np.finfo(float).eps
    assert np.allclose(out, [(0.5 + 1e-5) / total, (0.5 + 1e-5) / total, 1e-5 / total], rtol=0, atol=1e-15)
    assert p[2] == 0.0  # the input is not modified
    out = exclude_and_normalize(np.array([0.2, 0.3, 0.5]), np.array([False, True, False]))
    total = 0.7 + 2 * LDA_EPS + np.finfo(float).eps
    assert out[1] == 0.0 and out[0] == pytest.approx((0.2 + 1e-5) / total, abs=1e-15)
    with pytest.raises(ValueError, match="sum to 1"):
        exclude_and_normalize(np.array([0.2, 0.2]), np.array([False, False]))


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_lda_matches_flwr_reference(alpha, global_numpy_seed_1):
    y = labels_of(2_000)
    expected, _ = flwr_reference(y, 40, alpha, seed=1)
    ours = partition("lda", y, 40, np.random.default_rng(99), alpha=alpha, seed=1)
    assert same(ours, expected)


def test_lda_train_then_test_share_matrix_and_stream(global_numpy_seed_1):
    """CIFAR-10 in the code: train partitioned, then test with the train matrix, numpy's global
    stream running on between them."""
    train, test = labels_of(1_000, seed=1), labels_of(200, seed=2)
    exp_train, matrix = flwr_reference(train, 20, 0.5, seed=1)
    exp_test, _ = flwr_reference(test, 20, 0.5, seed=1, matrix=matrix)
    ours = partition_sources("lda", {"train": train, "test": test}, 20, None, lambda s: None, alpha=0.5, seed=1)
    assert same(ours["train"], exp_train) and same(ours["test"], exp_test)


def test_lda_per_group_matches_code_order(global_numpy_seed_1):
    """CIFAR-10-C in the code: per corruption (group) train, val, test in turn, the Dirichlet matrix
    re-drawn from default_rng(1) (the same for every group), the global stream running on."""
    splits = {"train": labels_of(600, seed=3), "val": labels_of(150, seed=4), "test": labels_of(200, seed=6)}
    groups = {s: np.arange(len(y)) % 2 for s, y in splits.items()}  # two "corruptions"
    expected = {s: [] for s in splits}
    for g in (0, 1):
        matrix = None
        for s, y in splits.items():
            rows = np.flatnonzero(groups[s] == g)
            parts, matrix = flwr_reference(y[rows], 5, 0.1, seed=1, matrix=matrix)
            expected[s] += [rows[p] for p in parts]
    ours = partition_sources("lda", splits, 10, None, lambda s: None, groups=groups, alpha=0.1, seed=1)
    for s in splits:
        assert same(ours[s], expected[s])
        assert all(set(groups[s][p]) == {c // 5} for c, p in enumerate(ours[s]))


def test_lda_sizes_cover_and_no_overlap():
    y = labels_of(1_003)
    parts = partition("lda", y, 10, None, alpha=0.1, seed=1)
    assert sorted(len(p) for p in parts) == [100] * 7 + [101] * 3
    assert [len(p) for p in parts[:3]] == [101] * 3  # sample j counts toward client j mod N
    everything = np.concatenate(parts)
    assert np.array_equal(np.sort(everything), np.arange(1_003))


def test_lda_seed_fixes_partition_independently_of_run_stream():
    y = labels_of(1_000)
    a = partition("lda", y, 10, np.random.default_rng(1), alpha=0.5, seed=1)
    b = partition("lda", y, 10, np.random.default_rng(2), alpha=0.5, seed=1)
    c = partition("lda", y, 10, np.random.default_rng(2), alpha=0.5, seed=2)
    d = partition("lda", y, 10, np.random.default_rng(1), alpha=0.5, seed=None)
    e = partition("lda", y, 10, np.random.default_rng(2), alpha=0.5, seed=None)
    assert same(a, b) and not same(a, c) and not same(d, e)
    assert same(d, partition("lda", y, 10, np.random.default_rng(1), alpha=0.5, seed=None))


def test_lda_test_labels_follow_training_proportions():
    train, test = labels_of(20_000, seed=7), labels_of(4_000, seed=8)
    out = partition_sources("lda", {"train": train, "test": test}, 20, None, lambda s: None, alpha=0.5, seed=1)
    hist = {s: np.array([np.bincount(y[p], minlength=10) / len(p) for p in out[s]])
            for s, y in (("train", train), ("test", test))}
    tv = 0.5 * np.abs(hist["train"][:, None, :] - hist["test"][None, :, :]).sum(-1)  # [train i, test j]
    own, other = np.diag(tv), tv[~np.eye(20, dtype=bool)]
    assert own.mean() < 0.15 and own.mean() < 0.3 * other.mean()
    assert (tv.argmin(axis=1) == np.arange(20)).mean() >= 0.9


def test_lda_split_missing_a_class_is_a_clear_error():
    with pytest.raises(ValueError, match="every split must hold every class"):
        partition_sources("lda", {"train": labels_of(100), "test": np.zeros(20, dtype=np.int64)}, 5, None,
                          lambda s: None, alpha=1.0, seed=1)


def test_lda_seed_null_needs_a_numpy_stream():
    import random

    with pytest.raises(ValueError, match="partition_seeding: reseed"):
        partition_sources("lda", {"train": labels_of(100)}, 5, np.random.RandomState(0),
                          lambda s: random.Random(0), alpha=1.0, seed=None)
