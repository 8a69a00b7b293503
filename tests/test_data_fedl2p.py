"""FedL2P data (FedL2P spec, "Data"): CIFAR-10 clients (LDA train + test with one Dirichlet matrix,
40/10 train/val random_split seeded 1) and CIFAR-10-C (real .npy layout, severity rows, stratified
splits, 25 clients per corruption with one matrix)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.suite.spec import config_hash
from pfl_core.config import RunConfig
from pfl_core.fields import ConfigError
from pfl_core.data import DatasetNotFoundError, build_federated, load_dataset, load_sources
from pfl_core.data.cifar10c import FEDL2P_CORRUPTIONS
from pfl_core.data.datasets import concat_sources
from pfl_core.data.federated import ArrayDataset
from pfl_core.data.partitions import partition_sources
from pfl_core.experiment import load_run_dataset, prepare_run
from pfl_core.seeding import RunStreams

from fake_data import write_cifar10c

CORRUPTIONS = ("fog", "snow")


def cifar_sized(num_train: int = 50_000, num_test: int = 10_000) -> ArrayDataset:
    """CIFAR-10-shaped labels (balanced, shuffled) joined as train then test; inputs are 1-d."""
    def split(n: int, seed: int) -> ArrayDataset:
        y = torch.as_tensor(np.random.default_rng(seed).permutation(np.arange(n) % 10))
        return ArrayDataset("cifar10", torch.zeros(n, 1), y, 10)
    return concat_sources([split(num_train, 0), split(num_test, 1)], ["train", "test"])


def fedl2p_cifar10(dataset: ArrayDataset, seed: int):
    return build_federated(dataset, num_clients=1000, partition="lda", partition_params={"alpha": 0.1, "seed": 1},
                           client_splits={}, unseen_fraction=0.0, streams=RunStreams(seed),
                           source_splits={"train": "train", "test": "test"}, client_val_fraction=0.2,
                           client_val_seed=1)


def test_cifar10_clients_are_40_10_10_with_the_codes_random_split():
    data = cifar_sized()
    fed = fedl2p_cifar10(data, seed=0)
    assert {(c.size("train"), c.size("val"), c.size("test")) for c in fed.clients} == {(40, 10, 10)}
    train_rows, test_rows = data.source_rows("train"), data.source_rows("test")
    y = data.labels_numpy()
    parts = partition_sources("lda", {"train": y[train_rows], "test": y[test_rows]}, 1000, None, lambda s: None,
                              alpha=0.1, seed=1)
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(1)).numpy()  # random_split(40, 10)
    for client, own_train, own_test in zip(fed.clients, parts["train"], parts["test"]):
        drawn = train_rows[own_train]  # the client's train.pt, in draw order
        assert client.splits["train"].tolist() == drawn[perm[:40]].tolist()
        assert client.splits["val"].tolist() == drawn[perm[40:]].tolist()
        assert client.splits["test"].tolist() == test_rows[own_test].tolist()
    # the whole test set is used once; the partition and the cut do not follow the run seed
    every_test = np.sort(np.concatenate([c.splits["test"].numpy() for c in fed.clients]))
    assert np.array_equal(every_test, test_rows)
    other = fedl2p_cifar10(data, seed=7)
    assert all(torch.equal(a.splits[s], b.splits[s]) for a, b in zip(fed.clients, other.clients)
               for s in ("train", "val", "test"))


def test_client_val_fraction_keeps_small_clients_whole_when_floor_is_zero():
    data = cifar_sized(400, 100)
    fed = build_federated(data, num_clients=100, partition="lda", partition_params={"alpha": 1.0},
                          client_splits={}, unseen_fraction=0.0, streams=RunStreams(0),
                          source_splits={"train": "train", "test": "test"}, client_val_fraction=0.2)
    assert {(c.size("train"), c.size("val")) for c in fed.clients} == {(4, 0)}  # int(0.2 * 4) = 0, as the code


def test_fedl2p_data_keys_config_checks_and_hash():
    plain = RunConfig().to_dict()
    explicit = RunConfig.from_dict({"data": {"partition_per_group": False, "client_val_fraction": 0.0,
                                             "client_val_seed": 1}}).to_dict()
    assert config_hash(plain) == config_hash(explicit)
    with pytest.raises(ConfigError, match="data.partition_per_group needs data.source_splits"):
        RunConfig.from_dict({"data": {"partition_per_group": True}})
    with pytest.raises(ConfigError, match="data.client_val_fraction"):
        RunConfig.from_dict({"data": {"client_val_fraction": 1.5}})


def test_cifar10c_loader_severity_rows_and_stratified_splits(tmp_path):
    write_cifar10c(tmp_path, CORRUPTIONS, per_severity=250)
    parts = {s: load_dataset("cifar10c", tmp_path, s, corruptions=list(CORRUPTIONS)) for s in ("train", "val", "test")}
    assert {s: len(d) for s, d in parts.items()} == {"train": 2 * 160, "val": 2 * 40, "test": 2 * 50}
    seen = {k: [] for k in range(2)}
    for s, d in parts.items():
        assert d.x.shape[1:] == (3, 32, 32) and d.group_names == CORRUPTIONS
        rows = d.x[:, 0, 0, 0].long() + 256 * d.x[:, 1, 0, 0].long()
        corruption = d.x[:, 2, 0, 0].long()
        assert torch.equal(corruption, d.groups)
        assert ((rows >= 500) & (rows < 750)).all()  # severity 3 = the third block of 250
        half = len(d) // 2
        assert (d.groups[:half] == 0).all() and (d.groups[half:] == 1).all()  # corruption after corruption
        assert torch.equal(rows[:half], rows[half:])  # the same split for every corruption
        counts = torch.bincount(d.y[:half], minlength=10)
        assert (counts == half // 10).all()  # stratified: balanced labels stay balanced
        for k in range(2):
            seen[k] += rows[d.groups == k].tolist()
    assert all(sorted(v) == list(range(500, 750)) for v in seen.values())  # train + val + test, no overlap


def test_cifar10c_clients_per_corruption(tmp_path):
    write_cifar10c(tmp_path, CORRUPTIONS, per_severity=250)
    cfg = RunConfig.from_dict({"data": {
        "dataset": "cifar10c", "params": {"corruptions": list(CORRUPTIONS), "mean_std": "fedl2p"},
        "num_clients": 10, "partition": {"name": "lda", "alpha": 0.5}, "partition_per_group": True,
        "source_splits": {"train": "train", "val": "val", "test": "test"}, "client_splits": {}},
        "model": {"name": "mlr"}, "federation": {"clients_per_round": 2}})
    setup = prepare_run(cfg, torch.device("cpu"), data_dir=str(tmp_path))
    data, clients = setup.fed.dataset, setup.fed.clients
    assert data.mean is not None
    assert [c.meta["group"] for c in clients] == ["fog"] * 5 + ["snow"] * 5
    assert {(c.size("train"), c.size("val"), c.size("test")) for c in clients} == {(32, 8, 10)}
    for c in clients:
        for split, idx in c.splits.items():
            assert (data.groups[idx] == CORRUPTIONS.index(c.meta["group"])).all()
            assert (data.source[idx] == ("train", "val", "test").index(split)).all()
    # the product's clients are partition_sources' per-group partition of the loaded splits
    joined = load_sources("cifar10c", ["train", "val", "test"], tmp_path, corruptions=list(CORRUPTIONS))
    rows = {s: joined.source_rows(s) for s in ("train", "val", "test")}
    y, g = joined.labels_numpy(), joined.groups.numpy()
    parts = partition_sources("lda", {s: y[r] for s, r in rows.items()}, 10, None, lambda s: None,
                              groups={s: g[r] for s, r in rows.items()}, alpha=0.5, seed=1)
    for cid, c in enumerate(clients):
        assert all(c.splits[s].tolist() == rows[s][parts[s][cid]].tolist() for s in rows)


def test_cifar10c_missing_files_name_the_folder(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"labels.npy not found under .*CIFAR-10-C.*zenodo"):
        load_dataset("cifar10c", tmp_path, "train")
    write_cifar10c(tmp_path, ("fog",), per_severity=100)
    with pytest.raises(DatasetNotFoundError, match=r"brightness.npy not found under .*CIFAR-10-C"):
        load_dataset("cifar10c", tmp_path, "train")  # the default: the paper's 10 corruptions
    with pytest.raises(ValueError, match="corruptions"):
        load_dataset("cifar10c", tmp_path, "train", corruptions=["rain"])
    assert FEDL2P_CORRUPTIONS[0] == "brightness" and len(FEDL2P_CORRUPTIONS) == 10


def test_lda_seed_is_checked_at_config_time():
    from pfl_core.fields import check_call_values
    from pfl_core.data.partitions import PARTITIONERS

    lda = PARTITIONERS.get("lda")
    assert check_call_values(lda, {"alpha": 1, "seed": None}, "data.partition.", "lda") == {"alpha": 1.0, "seed": None}
    with pytest.raises(ConfigError, match=r"data.partition.seed must be an integer >= 0"):
        check_call_values(lda, {"seed": "1"}, "data.partition.", "lda")
    with pytest.raises(ConfigError, match=r"data.partition.seed must be >= 0, got -1"):
        check_call_values(lda, {"seed": -1}, "data.partition.", "lda")


def test_cifar10_fedl2p_data_config_end_to_end(tmp_path, monkeypatch):
    """The README's CIFAR-10 data block on tiny real-format pickles: LDA train/test, 80/20 client cut."""
    from torchvision import datasets as tv

    from fake_data import write_cifar_layout

    write_cifar_layout(tmp_path, tv.CIFAR10, monkeypatch, n_per_file=20)  # 100 train, 20 test
    cfg = RunConfig.from_dict({"data": {
        "dataset": "cifar10", "params": {"mean_std": "fedl2p"}, "num_clients": 10,
        "partition": {"name": "lda", "alpha": 0.5}, "source_splits": {"train": "train", "test": "test"},
        "client_splits": {}, "client_val_fraction": 0.2}, "model": {"name": "mlr"},
        "federation": {"clients_per_round": 2}, "seed": 3})
    fed = prepare_run(cfg, torch.device("cpu"), data_dir=str(tmp_path)).fed
    assert {(c.size("train"), c.size("val"), c.size("test")) for c in fed.clients} == {(8, 2, 2)}
    assert fed.dataset.mean == (0.4914, 0.4822, 0.4465)
    joined = load_run_dataset(cfg, str(tmp_path))
    every = np.sort(np.concatenate([torch.cat([c.splits["train"], c.splits["val"]]).numpy() for c in fed.clients]))
    assert np.array_equal(every, joined.source_rows("train"))
