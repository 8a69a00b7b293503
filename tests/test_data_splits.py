"""Per-client splits, seen/unseen clients and the federated-data builder."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pfl_core.data import ArrayDataset, build_federated, split_indices, split_seen_unseen
from pfl_core.seeding import RunStreams


def test_split_indices_floor_and_disjoint_cover():
    indices = np.arange(100, 149)  # n = 49
    parts = split_indices(indices, {"eval": 0.2}, np.random.default_rng(0), remainder="pers")
    assert len(parts["eval"]) == 9 and len(parts["pers"]) == 40  # floor(0.2 * 49) = 9
    assert np.array_equal(np.sort(np.concatenate(list(parts.values()))), indices)
    three = split_indices(np.arange(50), {"val": 0.1, "test": 0.25}, np.random.default_rng(0))
    assert [len(three[k]) for k in ("val", "test", "train")] == [5, 12, 33]
    assert len(np.unique(np.concatenate(list(three.values())))) == 50
    assert all(v.dtype == np.int64 for v in three.values())


def test_split_indices_validation_and_determinism():
    idx = np.arange(30)
    with pytest.raises(ValueError, match="sum to < 1"):
        split_indices(idx, {"a": 0.5, "b": 0.5}, np.random.default_rng(0))
    with pytest.raises(ValueError, match="remainder"):
        split_indices(idx, {"train": 0.2}, np.random.default_rng(0))
    a = split_indices(idx, {"eval": 0.2}, np.random.default_rng(7))
    b = split_indices(idx, {"eval": 0.2}, np.random.default_rng(7))
    c = split_indices(idx, {"eval": 0.2}, np.random.default_rng(8))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["eval"], c["eval"])
    assert split_indices(idx, {}, np.random.default_rng(0))["train"].shape == (30,)


def test_seen_unseen_80_20():
    seen, unseen = split_seen_unseen(100, 0.2, np.random.default_rng(0))
    assert len(seen) == 80 and len(unseen) == 20
    assert seen == sorted(seen) and unseen == sorted(unseen)
    assert sorted(seen + unseen) == list(range(100))
    again = split_seen_unseen(100, 0.2, np.random.default_rng(0))
    assert again == (seen, unseen)
    assert split_seen_unseen(100, 0.2, np.random.default_rng(1))[1] != unseen
    assert split_seen_unseen(10, 0.0, np.random.default_rng(0)) == (list(range(10)), [])


def small_dataset(n: int = 2_000, num_groups: int = 20) -> ArrayDataset:
    rng = np.random.default_rng(0)
    return ArrayDataset(
        name="toy",
        x=torch.from_numpy(rng.normal(size=(n, 5)).astype(np.float32)),
        y=torch.from_numpy(rng.integers(0, 10, n)),
        num_classes=10,
        groups=torch.from_numpy(np.arange(n) % num_groups),
        offline=True,
    )


def build(dataset: ArrayDataset, seed: int = 0, **overrides):
    kwargs = dict(
        num_clients=20,
        partition="rotation_groups",
        partition_params={"num_groups": 5},
        client_splits={"eval": 0.2},
        unseen_fraction=0.2,
        streams=RunStreams(seed),
        remainder="pers",
    )
    kwargs.update(overrides)
    return build_federated(dataset, **kwargs)


def test_builder_end_to_end():
    ds = small_dataset()
    fed = build(ds)
    assert len(fed.clients) == 20
    assert len(fed.train_clients) == 16 and len(fed.unseen_clients) == 4
    all_idx = torch.cat([t for c in fed.clients for t in c.splits.values()])
    assert all_idx.dtype == torch.int64
    assert torch.equal(all_idx.sort().values, torch.arange(len(ds)))
    for client in fed.clients:
        assert set(client.splits) == {"pers", "eval"}
        assert client.meta["n"] == 100 and client.size("eval") == 20 and client.size("pers") == 80
        assert client.meta["group"] == client.cid // 4
    x, y = ds.batch(fed.clients[0].splits["pers"][:8])
    assert x.shape == (8, 5) and y.dtype == torch.int64


def test_builder_natural_groups_meta():
    ds = small_dataset()
    fed = build(ds, num_clients=10, partition="natural", partition_params={})
    groups = ds.groups.numpy()
    for client in fed.clients:
        members = np.concatenate([v.numpy() for v in client.splits.values()])
        assert set(groups[members]) == {client.meta["group"]}
    assert [c.meta["group"] for c in fed.clients] == sorted(c.meta["group"] for c in fed.clients)


def test_builder_deterministic_and_streams_independent():
    ds = small_dataset()
    a, b = build(ds, seed=3), build(ds, seed=3)
    assert a.train_clients == b.train_clients
    for ca, cb in zip(a.clients, b.clients):
        assert all(torch.equal(ca.splits[k], cb.splits[k]) for k in ca.splits)
    c = build(ds, seed=4)
    assert any(not torch.equal(x.splits["eval"], y.splits["eval"]) for x, y in zip(a.clients, c.clients))
    # a different unseen fraction leaves the partition and the splits untouched
    d = build(ds, seed=3, unseen_fraction=0.5)
    for ca, cd in zip(a.clients, d.clients):
        assert all(torch.equal(ca.splits[k], cd.splits[k]) for k in ca.splits)


def test_builder_rejects_too_small_split():
    ds = small_dataset(200)
    with pytest.raises(ValueError, match=r"client 0 .*split 'eval'.*min_split_size=25"):
        build(ds, partition="iid", partition_params={}, min_split_size=25)
