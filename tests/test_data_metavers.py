"""MetaVers data (MetaVers spec, "Data"): the train/val cut of CIFAR, CINIC-10, the novel-class
datasets, the pFedHN/pFedGP client split over several source splits, on files in the real formats."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torchvision import datasets as tv

from benchmarks.suite.spec import config_hash
from pfl_core.config import RunConfig
from pfl_core.fields import ConfigError
from pfl_core.data import DatasetNotFoundError, build_federated, load_dataset, load_sources
from pfl_core.data.builder import partition_rngs
from pfl_core.data.datasets import METAVERS_MEAN_STD, train_val_split
from pfl_core.data.federated import ArrayDataset
from pfl_core.data.partitions import assign_classes, partition, partition_sources
from pfl_core.experiment import load_run_dataset, run_experiment
from pfl_core.seeding import RunStreams

from fake_data import write_cifar_layout, write_cinic10, write_miniimagenet

# ----------------------------------------------------------------------------- CIFAR train / val


@pytest.mark.parametrize("seed", [0, 21, 42])
def test_train_val_split_is_the_codes_random_split(seed):
    """The code: torch.manual_seed(seed), then random_split(train set, [n - 10000, 10000])."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        train, val = torch.utils.data.random_split(range(50000), [40000, 10000])
    ours = train_val_split(50000, 10000, seed)
    assert ours[0].tolist() == train.indices and ours[1].tolist() == val.indices
    assert len(ours[0]) == 40000 and sorted(ours[0].tolist() + ours[1].tolist()) == list(range(50000))


def test_train_val_split_leaves_the_global_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    train_val_split(100, 10, 0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name,cls", [("cifar10", tv.CIFAR10), ("cifar100", tv.CIFAR100)])
def test_cifar_train_val_test_as_metavers(tmp_path, monkeypatch, name, cls):
    arrays = write_cifar_layout(tmp_path, cls, monkeypatch, n_per_file=12)
    images, labels = arrays["train"]
    n, val_size = len(labels), len(labels) // 5
    params = {"val_size": val_size, "val_seed": 21, "mean_std": "metavers"}
    train_rows, val_rows = train_val_split(n, val_size, 21)
    parts = {s: load_dataset(name, tmp_path, s, download=False, **params) for s in ("train", "val", "test")}
    assert len(parts["train"]) == n - val_size and len(parts["val"]) == val_size
    assert np.array_equal(parts["train"].x.numpy(), images[train_rows])  # the code's Subset order
    assert np.array_equal(parts["val"].x.numpy(), images[val_rows])
    assert parts["val"].y.tolist() == np.asarray(labels)[val_rows].tolist()
    assert np.array_equal(parts["test"].x.numpy(), arrays["test"][0])  # the official test set
    # ToTensor then Normalize with the MetaVers constants, by hand for one pixel
    mean, std = METAVERS_MEAN_STD[name]
    x, _ = parts["val"].batch(torch.tensor([0]))
    raw = images[val_rows[0], 2, 5, 7] / 255.0
    assert x[0, 2, 5, 7].item() == pytest.approx((raw - mean[2]) / std[2], abs=1e-6)
    joined = load_sources(name, ["train", "val", "test"], tmp_path, download=False, **params)
    assert joined.sources == ("train", "val", "test") and len(joined) == n + len(arrays["test"][1])
    assert np.array_equal(joined.x[joined.source_rows("val")].numpy(), parts["val"].x.numpy())


def test_cifar_defaults_unchanged_and_val_needs_val_size(tmp_path, monkeypatch):
    arrays = write_cifar_layout(tmp_path, tv.CIFAR10, monkeypatch, n_per_file=4)
    ds = load_dataset("cifar10", tmp_path, "train", download=False)
    assert np.array_equal(ds.x.numpy(), arrays["train"][0]) and ds.mean is None  # whole set, [0, 1]
    with pytest.raises(ValueError, match=r"'val' split only when data.params.val_size > 0"):
        load_dataset("cifar10", tmp_path, "val", download=False)
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'test', 'all'\)"):
        load_dataset("mnist", tmp_path, "val", download=False)


# ---------------------------------------------------------------------------------------- CINIC-10


def test_cinic10_imagefolder_round_trip(tmp_path):
    arrays = write_cinic10(tmp_path, per_class=2)
    for split in ("train", "val", "test"):
        ds = load_dataset("cinic10", tmp_path, split, download=False)
        images, labels = arrays[split]
        assert ds.num_classes == 10 and ds.x.shape == (20, 3, 32, 32) and ds.x.dtype == torch.uint8
        assert np.array_equal(ds.x.permute(0, 2, 3, 1).numpy(), images)
        assert ds.y.tolist() == labels.tolist()
        assert ds.mean == METAVERS_MEAN_STD["cinic10"][0]  # normalised by default, as the code
    assert load_dataset("cinic10", tmp_path, "train", download=False, mean_std="none").mean is None
    assert len(load_dataset("cinic10", tmp_path, "all", download=False)) == 60


def test_cinic10_missing_says_where(tmp_path):
    write_cinic10(tmp_path, per_class=1)
    (tmp_path / "CINIC-10" / "valid").rename(tmp_path / "CINIC-10" / "validation")
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("cinic10", tmp_path, "val", download=False)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "CINIC-10" / "valid") in message
    assert "CINIC-10.tar.gz" in message and "PFL_DATA_DIR" in message


# ------------------------------------------------------------------------------------ novel classes


def test_miniimagenet_learn2learn_cache_files(tmp_path):
    arrays = write_miniimagenet(tmp_path, per_class=3)
    ds = load_dataset("miniimagenet", tmp_path, "all", download=False)
    offsets = {"train": 0, "val": 64, "test": 80}
    start = 0
    for split in ("train", "val", "test"):
        images, labels = arrays[split]
        rows = slice(start, start + len(labels))
        assert np.array_equal(ds.x[rows].permute(0, 2, 3, 1).numpy(), images)
        assert ds.y[rows].tolist() == (labels + offsets[split]).tolist()  # class_dict order, one label space
        start += len(labels)
    assert ds.num_classes == 100 and ds.x.shape[1:] == (3, 84, 84)
    x, _ = ds.batch(torch.arange(4))  # unnormalised floats in [0, 255], as learn2learn's .float()
    assert torch.allclose(x, ds.x[:4].float(), atol=1e-3) and x.max() > 1


def test_miniimagenet_missing_or_wrong_file(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"mini-imagenet-cache-validation\.pkl.*PFL_DATA_DIR"):
        load_dataset("miniimagenet", tmp_path, "val", download=False)
    write_miniimagenet(tmp_path, classes={"train": 65, "val": 1, "test": 1}, per_class=1, size=4)
    with pytest.raises(DatasetNotFoundError, match=r"65 classes, but the 'train' split of mini-ImageNet has 64"):
        load_dataset("miniimagenet", tmp_path, "train", download=False)


def test_cifar100_novel_class_split_and_axes_swap(tmp_path, monkeypatch):
    arrays = write_cifar_layout(tmp_path, tv.CIFAR100, monkeypatch, n_per_file=200)
    merged_x = np.concatenate([arrays["train"][0], arrays["test"][0]])  # CHW, train then test
    merged_y = np.asarray(arrays["train"][1] + arrays["test"][1])
    classes = {"train": range(0, 64), "val": range(84, 100), "test": range(64, 84)}
    for split, wanted in classes.items():
        ds = load_dataset("cifar100_novel", tmp_path, split, download=False)
        rows = np.flatnonzero(np.isin(merged_y, wanted))
        assert ds.y.tolist() == merged_y[rows].tolist() and set(ds.y.tolist()) == set(wanted)
        # the code: HWC uint8 -> transpose(1, 3) -> (C, W, H)
        assert np.array_equal(ds.x.numpy(), merged_x[rows].transpose(0, 1, 3, 2))
    upright = load_dataset("cifar100_novel", tmp_path, "test", download=False, swap_hw=False)
    assert np.array_equal(upright.x.numpy(), merged_x[np.isin(merged_y, classes["test"])])
    x, _ = upright.batch(torch.tensor([0]))
    assert torch.allclose(x, upright.x[:1].float(), atol=1e-3)  # raw 0-255, not normalised


# --------------------------------------------------------------------- client split (Step A / B)


def spec_client_split(labels_by_split: dict[str, np.ndarray], num_clients: int, per_client: int,
                      seed: int) -> dict[str, list[list[int]]]:
    """The spec's procedure, step by step, on the *global* generators re-seeded as the code does."""
    out = {}
    for split, labels in labels_by_split.items():
        random.seed(seed)
        np.random.seed(seed)
        classes, counts = np.unique(labels, return_counts=True)
        cnt = per_client * num_clients // len(classes)  # Step A
        props, left = {}, {}
        for k in range(len(classes)):
            u = np.random.uniform(0.4, 0.6, size=cnt)
            props[k], left[k] = (u / u.sum()).tolist(), cnt
        chosen = []
        for _ in range(num_clients):
            mine = []
            while len(mine) != per_client:
                top = max(left.values())
                pick = np.random.choice(np.where(np.array([left[k] for k in range(len(classes))]) == top)[0])
                if pick not in mine:
                    mine.append(pick)
                    left[pick] -= 1
            chosen.append([(c, props[c].pop()) for c in mine])
        random.seed(seed)
        np.random.seed(seed)
        pools = {k: np.where(labels == k)[0] for k in range(len(classes))}  # Step B
        for idx in pools.values():
            random.shuffle(idx)
        clients = []
        for mine in chosen:
            own = []
            for c, p in mine:
                take = int(counts[c] * p)
                own.extend(pools[c][:take].tolist())
                pools[c] = pools[c][take:]
            clients.append(own)
        out[split] = clients
    return out


def _labels(per_class: dict[str, int], num_classes: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s: rng.permutation(np.repeat(np.arange(num_classes), n)) for s, n in per_class.items()}


@pytest.mark.parametrize("num_classes,per_client,num_clients,seed", [(10, 2, 50, 0), (100, 10, 50, 21), (10, 4, 20, 42)])
def test_reseeded_split_is_the_codes_exact_partition(num_classes, per_client, num_clients, seed):
    labels = _labels({"train": 60, "val": 17, "test": 15}, num_classes, seed=seed)
    ours = partition_sources("classes_per_client", labels, num_clients, *partition_rngs("reseed", RunStreams(seed)),
                             classes_per_client=per_client)
    expected = spec_client_split(labels, num_clients, per_client, seed)
    assert {s: [p.tolist() for p in parts] for s, parts in ours.items()} == expected


def test_class_assignment_follows_the_spec():
    with pytest.raises(ValueError, match=r"C\*U/K = 3\*55/10 must be an integer"):
        assign_classes(10, 55, 3, np.random.RandomState(0))
    assignment = assign_classes(10, 50, 2, np.random.RandomState(0))
    for client in assignment:
        assert len({c for c, _ in client}) == 2  # the retry loop: never the same class twice
    per_class = {c: [p for client in assignment for cc, p in client if cc == c] for c in range(10)}
    for c, props in per_class.items():
        assert len(props) == 10 and sum(props) == pytest.approx(1.0)  # cnt = 2*50/10, normalised
        assert all(0.4 / 0.6 / 10 <= p <= 0.6 / 0.4 / 10 for p in props)
    # proportions are popped from the END of each class's list: the first client to take class c
    # gets the last of the cnt normalised draws of c
    rng = np.random.RandomState(0)
    first_draws = rng.uniform(0.4, 0.6, 10)
    first_client_of_0 = next(p for client in assignment for c, p in client if c == 0)
    assert first_client_of_0 == pytest.approx(first_draws[-1] / first_draws.sum())


# the spec's table of mean samples per client (train / val / test)
MEANS = {("cifar", 50): (800, 200, 200), ("cifar", 100): (400, 100, 100), ("cifar", 500): (80, 20, 20),
         ("cinic", 50): (1800, 1800, 1800), ("cinic", 100): (900, 900, 900), ("cinic", 500): (180, 180, 180)}
# real per-class counts: CIFAR-10 40,000/10,000/10,000, CIFAR-100 the same over 100 classes, CINIC-10 9,000 each
DATASETS = {"cifar10": ("cifar", 10, 2, (4000, 1000, 1000)), "cifar100": ("cifar", 100, 10, (400, 100, 100)),
            "cinic10": ("cinic", 10, 4, (9000, 9000, 9000))}


@pytest.mark.parametrize("num_clients", [50, 100, 500])
@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_mean_samples_per_client_match_the_spec_table(dataset, num_clients):
    family, num_classes, per_client, counts = DATASETS[dataset]
    labels = _labels(dict(zip(("train", "val", "test"), counts)), num_classes)
    parts = partition_sources("classes_per_client", labels, num_clients, *partition_rngs("reseed", RunStreams(0)),
                              classes_per_client=per_client)
    for split, table_mean in zip(("train", "val", "test"), MEANS[family, num_clients]):
        sizes = np.array([len(p) for p in parts[split]])
        # flooring loses less than one sample per (client, class): "slightly lower"
        assert table_mean - per_client < sizes.mean() <= table_mean
        every = np.concatenate(parts[split])
        assert len(np.unique(every)) == len(every)  # disjoint clients


# ----------------------------------------------------------------------- source splits in a run


def _joined(seed: int = 0) -> ArrayDataset:
    labels = _labels({"train": 40, "val": 10, "test": 10}, 10, seed=seed)
    y = torch.as_tensor(np.concatenate(list(labels.values())))
    source = torch.as_tensor(np.repeat([0, 1, 2], [400, 100, 100]))
    return ArrayDataset("toy", torch.zeros(len(y), 1, 2, 2, dtype=torch.uint8), y, 10, source=source,
                        sources=("train", "val", "test"))


def test_clients_hold_the_same_classes_in_every_source_split():
    ds = _joined()
    fed = build_federated(ds, num_clients=20, partition="classes_per_client", partition_params={},
                          client_splits={}, unseen_fraction=0.0, streams=RunStreams(3),
                          source_splits={"train": "train", "val": "val", "test": "test"},
                          partition_seeding="reseed", pool_splits=["test"])
    source = ds.source.numpy()
    for client in fed.clients:
        classes = {s: set(ds.y[client.splits[s]].tolist()) for s in ("train", "val", "test")}
        assert classes["train"] == classes["val"] == classes["test"] and len(classes["train"]) == 2
        for k, s in enumerate(("train", "val", "test")):
            assert (source[client.splits[s].numpy()] == k).all()
        # the same proportions: 40 train images per class vs 10 val, so ~4x as many
        assert abs(len(client.splits["train"]) - 4 * len(client.splits["val"])) <= 8
    assert fed.pools["test"].tolist() == list(range(500, 600))
    again = build_federated(ds, num_clients=20, partition="classes_per_client", partition_params={},
                            client_splits={}, unseen_fraction=0.0, streams=RunStreams(3),
                            source_splits={"train": "train", "val": "val", "test": "test"},
                            partition_seeding="reseed")
    streams = build_federated(ds, num_clients=20, partition="classes_per_client", partition_params={},
                              client_splits={}, unseen_fraction=0.0, streams=RunStreams(3),
                              source_splits={"train": "train", "val": "val", "test": "test"})
    same = [torch.equal(a.splits["train"], b.splits["train"]) for a, b in zip(fed.clients, again.clients)]
    differ = [torch.equal(a.splits["train"], b.splits["train"]) for a, b in zip(fed.clients, streams.clients)]
    assert all(same) and not all(differ)


def test_source_split_config_errors():
    base = {"data": {"source_splits": {"train": "train", "test": "test"}, "client_splits": {}}}
    RunConfig.from_dict(base)
    with pytest.raises(ConfigError, match=r"data.client_splits must be \{\} with data.source_splits"):
        RunConfig.from_dict({"data": {"source_splits": {"train": "train"}}})  # default client_splits
    with pytest.raises(ConfigError, match=r"data.pool_splits needs data.source_splits"):
        RunConfig.from_dict({"data": {"pool_splits": ["val"]}})
    with pytest.raises(ConfigError, match=r"data.partition_seeding must be one of"):
        RunConfig.from_dict({"data": {"partition_seeding": "global"}})
    with pytest.raises(ValueError, match=r"partitioner 'iid' cannot apply one assignment.*classes_per_client"):
        build_federated(_joined(), num_clients=4, partition="iid", partition_params={}, client_splits={},
                        unseen_fraction=0.0, streams=RunStreams(0),
                        source_splits={"train": "train", "test": "test"})


def test_new_data_keys_leave_existing_config_hashes_alone():
    plain = RunConfig().to_dict()
    explicit = RunConfig.from_dict({"data": {"source_splits": {}, "pool_splits": [],
                                             "partition_seeding": "streams"}}).to_dict()
    assert config_hash(plain) == config_hash(explicit)


def test_a_run_on_metavers_cifar10_splits(tmp_path, monkeypatch):
    """End to end: CIFAR-10 pickles -> 40/10-style train/val cut -> classes_per_client over the
    train/val/test source splits -> a FedAvg run evaluated on each client's test split."""
    write_cifar_layout(tmp_path, tv.CIFAR10, monkeypatch, n_per_file=20)
    cfg = RunConfig.from_dict({
        "data": {"dataset": "cifar10", "params": {"val_size": 20, "val_seed": 0, "mean_std": "metavers"},
                 "num_clients": 5, "partition": {"name": "classes_per_client", "classes_per_client": 2},
                 "source_splits": {"train": "train", "val": "val", "test": "test"}, "client_splits": {},
                 "partition_seeding": "reseed"},
        "model": {"name": "lenet"}, "method": {"name": "fedavg", "params": {"local_steps": 1}},
        "federation": {"rounds": 1, "clients_per_round": 2, "batch_size": 4},
        "seed": 0,
    })
    result = run_experiment(cfg, device="cpu", data_dir=str(tmp_path))
    assert 0 <= result.metrics["acc"] <= 1 and len(result.clients) == 5
    assert sum(c["num_samples"] for c in result.clients) == sum(c["meta"]["n_test"] for c in result.clients)


def test_suite_validation_checks_split_names_and_partitioner():
    from benchmarks.suite.schema import SuiteError, validate_config

    def config(**data):
        return {"data": {"dataset": "cifar10", "client_splits": {}, "partition": {"name": "classes_per_client"},
                         **data}, "model": {"name": "lenet"}}

    validate_config(config(source_splits={"train": "train", "val": "val"}, pool_splits=["test"]), "s.yaml: cell")
    with pytest.raises(SuiteError, match=r"data.source_splits.val: dataset 'cifar10' has the splits "
                                         r"\['train', 'val', 'test'\], not 'valid'"):
        validate_config(config(source_splits={"train": "train", "val": "valid"}), "s.yaml: cell")
    with pytest.raises(SuiteError, match=r"data.pool_splits\[0\]: dataset 'cifar10'"):
        validate_config(config(source_splits={"train": "train"}, pool_splits=["all"]), "s.yaml: cell")
    with pytest.raises(SuiteError, match=r"data.partition_seeding needs a partitioner .* not 'dirichlet'"):
        validate_config({"data": {"dataset": "cifar10", "partition": {"name": "dirichlet"},
                                  "partition_seeding": "reseed"}}, "s.yaml: cell")


def test_novel_class_training_clients_are_two_shards_of_one_class_each():
    """Table 6: 64 classes x 600 training images, sorted by label, 128 shards of 300, 2 per client."""
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(64), 600))
    parts = partition("shards", labels, 64, np.random.default_rng(1), num_shards=128, shards_per_client=2)
    assert [len(p) for p in parts] == [600] * 64
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(labels)))
    ways = [len(np.unique(labels[p])) for p in parts]
    assert set(ways) <= {1, 2} and 2 in ways
    for p in parts:  # each 300-image shard holds one class
        assert all(len(np.unique(labels[half])) == 1 for half in (p[:300], p[300:]))


def test_novel_class_run_data_keeps_val_and_test_whole(tmp_path):
    write_miniimagenet(tmp_path, classes={"train": 4, "val": 2, "test": 2}, per_class=3, size=84)
    cfg = RunConfig.from_dict({"data": {
        "dataset": "miniimagenet", "num_clients": 2, "client_splits": {},
        "partition": {"name": "shards", "num_shards": 4, "shards_per_client": 2},
        "source_splits": {"train": "train"}, "pool_splits": ["val", "test"]},
        "federation": {"clients_per_round": 0}})
    ds = load_run_dataset(cfg, str(tmp_path))
    fed = build_federated(ds, num_clients=2, partition="shards", partition_params={"num_shards": 4,
                          "shards_per_client": 2}, client_splits={}, unseen_fraction=0.0, streams=RunStreams(0),
                          source_splits=cfg.data.source_splits, pool_splits=cfg.data.pool_splits)
    assert sorted(torch.cat([c.splits["train"] for c in fed.clients]).tolist()) == list(range(12))
    assert set(ds.y[fed.pools["val"]].tolist()) == {64, 65} and set(ds.y[fed.pools["test"]].tolist()) == {80, 81}
    assert all(set(c.splits) == {"train"} for c in fed.clients)
