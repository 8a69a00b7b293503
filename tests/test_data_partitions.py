"""Partitioners (pfl_core.data.partitions): coverage, scheme-specific invariants, determinism."""
from __future__ import annotations

import numpy as np
import pytest

from pfl_core.data.partitions import (
    PARTITIONERS,
    assign_classes,
    partition,
    partitioner_params,
    rotation_group_of,
    split_by_assignment,
)


def mnist_like_labels(n: int = 60_000, num_classes: int = 10, seed: int = 123) -> np.ndarray:
    """Balanced labels in random order, like MNIST's training labels."""
    return np.random.default_rng(seed).permutation(np.arange(n) % num_classes)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    all_idx = np.concatenate(parts)
    assert all(p.dtype == np.int64 for p in parts)
    assert len(all_idx) == n
    assert np.array_equal(np.sort(all_idx), np.arange(n))


def assert_disjoint(parts: list[np.ndarray]) -> None:
    all_idx = np.concatenate(parts)
    assert len(np.unique(all_idx)) == len(all_idx)


CASES = {
    "iid": (100, {}),
    "shards": (100, {}),
    "dirichlet": (100, {"alpha": 0.3}),
    "lda": (100, {"alpha": 0.5, "seed": None}),  # seed None: the run's stream (test_data_lda.py: fixed seed)
    "classes_per_client": (50, {"classes_per_client": 2}),
    "rotation_groups": (100, {"num_groups": 10}),
}


@pytest.mark.parametrize("name", ["iid", "shards", "dirichlet", "lda", "rotation_groups"])
def test_exact_cover(name):
    labels = mnist_like_labels(12_000)
    num_clients, params = CASES[name]
    parts = partition(name, labels, num_clients, rng(), **params)
    assert len(parts) == num_clients
    assert_exact_cover(parts, len(labels))


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_seed_same_output_different_seed_different(name):
    labels = mnist_like_labels(6_000)
    num_clients, params = CASES[name]
    a = partition(name, labels, num_clients, rng(1), **params)
    b = partition(name, labels, num_clients, rng(1), **params)
    c = partition(name, labels, num_clients, rng(2), **params)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_natural_determinism_and_subsample():
    labels = mnist_like_labels(1_000)
    groups = np.arange(1_000) % 37 + 100
    all_groups = partition("natural", labels, 37, rng(0), groups=groups)
    assert_exact_cover(all_groups, 1_000)
    assert [int(groups[p[0]]) for p in all_groups] == list(range(100, 137))
    a = partition("natural", labels, 10, rng(5), groups=groups)
    b = partition("natural", labels, 10, rng(5), groups=groups)
    c = partition("natural", labels, 10, rng(6), groups=groups)
    ids_a = [int(groups[p[0]]) for p in a]
    assert ids_a == sorted(ids_a) and len(set(ids_a)) == 10
    assert all(len(np.unique(groups[p])) == 1 for p in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert ids_a != [int(groups[p[0]]) for p in c]
    with pytest.raises(ValueError, match="only 37 groups"):
        partition("natural", labels, 38, rng(), groups=groups)
    with pytest.raises(ValueError, match="groups"):
        partition("natural", labels, 10, rng())


def test_shards_sizes_and_classes():
    labels = mnist_like_labels()
    parts = partition("shards", labels, 100, rng(), num_shards=200, shards_per_client=2)
    assert {len(p) for p in parts} == {600}
    assert max(len(np.unique(labels[p])) for p in parts) <= 2
    with pytest.raises(ValueError, match="num_shards"):
        partition("shards", labels, 100, rng(), num_shards=150)


def test_dirichlet_min_size_holds():
    labels = mnist_like_labels()
    parts = partition("dirichlet", labels, 100, rng(), alpha=0.3, min_size=10)
    assert min(len(p) for p in parts) >= 10
    assert_exact_cover(parts, len(labels))


def test_dirichlet_500_clients_alpha_005_terminates():
    """Infeasible in practice with min_size=10: it stops after max_tries with a clear error;
    with min_size=0 it succeeds at once (empty clients allowed)."""
    labels = mnist_like_labels()
    with pytest.raises(ValueError, match="max_tries=50.*min_size=10"):
        partition("dirichlet", labels, 500, rng(), alpha=0.05, max_tries=50)
    parts = partition("dirichlet", labels, 500, rng(), alpha=0.05, min_size=0)
    assert len(parts) == 500
    assert_exact_cover(parts, len(labels))


def test_lda_equal_sizes_and_skew():
    labels = mnist_like_labels(50_000)
    parts = partition("lda", labels, 1_000, rng(), alpha=0.1)
    assert {len(p) for p in parts} == {50}
    assert_exact_cover(parts, len(labels))
    # small alpha: most clients are dominated by few classes
    top_share = np.mean([np.bincount(labels[p]).max() / len(p) for p in parts])
    assert top_share > 0.5
    uneven = partition("lda", labels[:1_003], 10, rng(), alpha=1.0)
    assert sorted(len(p) for p in uneven) == [100] * 7 + [101] * 3


def test_classes_per_client_assignment_and_counts():
    labels = mnist_like_labels(10_000)
    num_clients, c = 50, 2
    r = rng(3)
    assignment = assign_classes(10, num_clients, c, r, 0.4, 0.6)
    parts = split_by_assignment(labels, assignment, r)
    # same as the registered partitioner with the same generator state
    again = partition("classes_per_client", labels, num_clients, rng(3), classes_per_client=c)
    assert all(np.array_equal(x, y) for x, y in zip(parts, again))
    assert_disjoint(parts)
    n_c = np.bincount(labels, minlength=10)
    per_class = np.zeros(10)
    for client, idx in zip(assignment, parts):
        classes = [k for k, _ in client]
        assert len(set(classes)) == c
        assert sorted(np.unique(labels[idx]).tolist()) == sorted(classes)
        for k, p in client:
            assert np.sum(labels[idx] == k) == int(np.floor(n_c[k] * p))
            assert 0.4 / (0.6 * 9 + 0.4) <= p <= 0.6 / (0.4 * 9 + 0.6)
            per_class[k] += p
    # cnt = C*U/K = 10 clients per class and each class's proportions sum to 1
    assert np.allclose(per_class, 1.0)
    assert all(sum(k == j for cl in assignment for k, _ in cl) == 10 for j in range(10))
    with pytest.raises(ValueError, match="integer"):
        partition("classes_per_client", labels, 51, rng(), classes_per_client=2)


def test_rotation_groups_layout():
    labels = mnist_like_labels()
    parts = partition("rotation_groups", labels, 100, rng(), num_groups=10)
    assert {len(p) for p in parts} == {600}
    assert [rotation_group_of(c, 100, 10) for c in (0, 9, 10, 99)] == [0, 0, 1, 9]
    with pytest.raises(ValueError, match="divisible"):
        partition("rotation_groups", labels, 95, rng(), num_groups=10)


def test_unknown_param_rejected_with_key_and_allowed():
    with pytest.raises(ValueError, match=r"'dirichlet'.*'alhpa'.*alpha, max_tries, min_size"):
        partition("dirichlet", mnist_like_labels(100), 5, rng(), alhpa=0.1)
    with pytest.raises(KeyError, match="unknown partitioner"):
        partition("nope", mnist_like_labels(100), 5, rng())


def test_partitioner_params_defaults():
    assert partitioner_params("dirichlet") == {"alpha": 0.3, "min_size": 10, "max_tries": 1000}
    assert partitioner_params("shards") == {"num_shards": 200, "shards_per_client": 2}
    assert partitioner_params("natural") == {}
    assert partitioner_params("iid") == {}
    assert {
        "iid", "shards", "dirichlet", "lda", "classes_per_client", "rotation_groups", "natural"
    } <= set(PARTITIONERS.names())
