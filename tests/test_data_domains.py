"""Office-Caltech-10 and DomainNet from FedBN's files, and their per-domain LDA clients (fedl2p.md)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.model_selection import train_test_split

from fake_data import write_fedbn_domains
from pfl_core.data import DatasetNotFoundError, build_federated, load_dataset, load_sources, partition
from pfl_core.data.domains import DOMAINNET, IMAGENET_MEAN_STD, OFFICE
from pfl_core.seeding import RunStreams

SOURCES = {"train": "train", "val": "val", "test": "test"}


@pytest.fixture(scope="module")
def office_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fedbn")
    written = write_fedbn_domains(root, "office_caltech10")
    return root, written


@pytest.fixture(scope="module")
def office_all_classes(tmp_path_factory):
    """Office files whose test lists hold every class (the LDA cut of each split needs them all)."""
    root = tmp_path_factory.mktemp("fedbn_all")
    return root, write_fedbn_domains(root, "office_caltech10", test=10)


def _rows(ds, domain_index):
    return (ds.groups == domain_index).nonzero().flatten()


def test_office_train_is_equalised_to_the_smallest_domain_then_cut_into_a_stratified_val(office_root):
    root, written = office_root
    train = load_dataset("office_caltech10", root, "train", download=False, image_size=8)
    val = load_dataset("office_caltech10", root, "val", download=False, image_size=8)
    smallest = min(len(w["train"][0]) for w in written.values())  # amazon: 50
    assert smallest == 50
    for g, domain in enumerate(OFFICE.domains):
        n = len(written[domain]["train"][0])
        keep = np.arange(n) if n == smallest else np.random.default_rng(1).choice(n, size=smallest, replace=False)
        labels = np.asarray([OFFICE.classes.index(t) for t in written[domain]["train"][1]])[keep]
        tr, va = train_test_split(np.arange(smallest), test_size=0.2, stratify=labels, shuffle=True, random_state=1)
        got_tr, got_va = _rows(train, g), _rows(val, g)
        assert len(got_tr) == 40 and len(got_va) == 10
        if g in (1, 2):  # RGB: the red channel of every fake image is its row k in FedBN's list
            assert train.x[got_tr, 0, 0, 0].tolist() == keep[tr].tolist()
            assert val.x[got_va, 0, 0, 0].tolist() == keep[va].tolist()
        assert train.y[got_tr].tolist() == labels[tr].tolist()
        assert val.y[got_va].tolist() == labels[va].tolist()
        assert sorted(np.bincount(val.y[got_va].numpy(), minlength=10)) == sorted(np.bincount(labels[va], minlength=10))


def test_office_images_are_resized_gray_and_rgba_become_three_equal_channels_test_is_fedbn_order(office_root):
    root, written = office_root
    test = load_dataset("office_caltech10", root, "test", download=False, image_size=8)
    assert test.x.dtype == torch.uint8 and tuple(test.x.shape[1:]) == (3, 8, 8)
    assert test.num_classes == 10 and test.groups.tolist() == [g for g in range(4) for _ in range(4)]
    gray, rgba, rgb = test.x[_rows(test, 0)], test.x[_rows(test, 3)], test.x[_rows(test, 1)]
    for images in (gray, rgba):  # fewer or more than 3 bands -> Grayscale(num_output_channels=3)
        assert torch.equal(images[:, 0], images[:, 1]) and torch.equal(images[:, 1], images[:, 2])
    assert rgb[:, 0, 0, 0].tolist() == [0, 1, 2, 3] and (rgb[:, 2] == 150).all()  # colour kept, in list order
    # RGBA (k, 20 c, 150) -> L = (299 R + 587 G + 114 B) / 1000, PIL's ITU-R 601-2 luma
    k = np.arange(4)
    luma = (299 * k + 587 * 20 * (k % 10) + 114 * 150 + 500) // 1000
    assert rgba[:, 0, 0, 0].tolist() == luma.tolist()
    assert test.y.tolist() == [OFFICE.classes.index(t) for d in OFFICE.domains for t in written[d]["test"][1]]


def test_office_normalisation_reaches_training_only_unless_normalize_everywhere(office_root):
    root, _ = office_root
    code = load_dataset("office_caltech10", root, "test", download=False, image_size=8)
    assert (code.mean, code.std) == IMAGENET_MEAN_STD and not code.evaluation_normalized
    x, _ = code.batch(torch.arange(2))
    x_eval, _ = code.for_evaluation().batch(torch.arange(2))
    assert torch.allclose(x_eval, code.x[:2].float() / 255)  # [0, 1]: the evaluation loaders' view
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in IMAGENET_MEAN_STD)
    assert torch.allclose(x, (x_eval - mean) / std)
    everywhere = load_dataset("office_caltech10", root, "test", download=False, image_size=8,
                              normalize_everywhere=True)
    assert torch.allclose(everywhere.for_evaluation().batch(torch.arange(2))[0], x)
    plain = load_dataset("office_caltech10", root, "test", download=False, image_size=8, normalize=False)
    assert plain.mean is None and torch.allclose(plain.batch(torch.arange(2))[0], x_eval)
    joined = load_sources("office_caltech10", ["train", "val", "test"], root, download=False, image_size=8)
    assert not joined.evaluation_normalized and joined.for_evaluation().mean is None


def test_office_gives_one_client_per_domain_with_its_own_train_val_test(office_all_classes):
    root, _ = office_all_classes
    ds = load_sources("office_caltech10", ["train", "val", "test"], root, download=False, image_size=8)
    fed = build_federated(ds, num_clients=4, partition="lda", partition_params={"alpha": 1000.0},
                          client_splits={}, unseen_fraction=0.0, streams=RunStreams(7), source_splits=SOURCES,
                          partition_per_group=True)
    for g, client in enumerate(fed.clients):
        assert client.meta["group"] == OFFICE.domains[g]
        for k, split in enumerate(("train", "val", "test")):
            whole = np.flatnonzero((ds.groups.numpy() == g) & (ds.source.numpy() == k))
            assert sorted(client.splits[split].tolist()) == whole.tolist()


def test_domainnet_is_normalised_everywhere_and_names_the_files_when_missing(tmp_path):
    write_fedbn_domains(tmp_path, "domainnet", train={d: 50 for d in DOMAINNET.domains}, test=3)
    ds = load_dataset("domainnet", tmp_path, "all", download=False, image_size=4)
    assert len(ds) == 6 * (50 + 3) and ds.num_classes == 10
    assert (ds.mean, ds.std) == IMAGENET_MEAN_STD and ds.evaluation_normalized and ds.for_evaluation() is ds
    with pytest.raises(DatasetNotFoundError, match=r"office_caltech_10/amazon_train\.pkl.*FedBN"):
        load_dataset("office_caltech10", tmp_path, "train", download=False)


def test_domainnet_without_normalize_is_unnormalised_on_every_path_as_the_codes_baselines(tmp_path):
    write_fedbn_domains(tmp_path, "domainnet", train={d: 50 for d in DOMAINNET.domains}, test=3)
    ds = load_dataset("domainnet", tmp_path, "all", download=False, image_size=4, normalize=False)
    assert ds.mean is None and ds.std is None and ds.for_evaluation() is ds
    x, _ = ds.batch(torch.arange(3))
    assert x.min() >= 0 and x.max() <= 1 and torch.equal(x, ds.raw_batch(torch.arange(3))[0])


def test_domainnet_clients_follow_one_matrix_in_train_val_and_test(tmp_path):
    write_fedbn_domains(tmp_path, "domainnet", train={d: 60 for d in DOMAINNET.domains}, test=20)
    ds = load_sources("domainnet", ["train", "val", "test"], tmp_path, download=False, image_size=4)
    fed = build_federated(ds, num_clients=12, partition="lda", partition_params={"alpha": 0.1},
                          client_splits={}, unseen_fraction=0.0, streams=RunStreams(0), source_splits=SOURCES,
                          partition_per_group=True)
    groups = ds.groups.numpy()
    for cid, client in enumerate(fed.clients):
        assert client.meta["group"] == DOMAINNET.domains[cid // 2]
        for split in ("train", "val", "test"):
            assert (groups[client.splits[split].numpy()] == cid // 2).all()
    # equal client sizes in every domain; one Dirichlet matrix for all domains (the draws of the
    # classes continue on the global stream, so label sequences differ: tests/test_data_lda.py)
    for split in ("train", "val", "test"):
        sizes = {len(fed.clients[c].splits[split]) for c in range(12)}
        assert sizes == {{"train": 24, "val": 6, "test": 10}[split]}


def test_an_office_run_trains_resnet18_imagenet_on_the_four_domain_clients(office_all_classes):
    from pfl_core.config import RunConfig
    from pfl_core.experiment import run_experiment

    root, _ = office_all_classes
    cfg = RunConfig.from_dict({
        "data": {"dataset": "office_caltech10", "num_clients": 4, "unseen_fraction": 0.0, "client_splits": {},
                 "params": {"image_size": 32}, "source_splits": SOURCES,
                 "partition": {"name": "lda", "alpha": 1000.0}, "partition_per_group": True},
        "model": {"name": "resnet18_imagenet", "params": {"width": 4}},
        "method": {"name": "fedavg", "params": {"lr": 0.01, "local_steps": 1}},
        "federation": {"rounds": 1, "clients_per_round": 4, "batch_size": 8},
        "evaluation": {"protocol": "seen"}})
    result = run_experiment(cfg, device="cpu", data_dir=str(root))
    assert 0 <= result.metrics["acc"] <= 1 and np.isfinite(result.metrics["train_loss"])
    assert [c["meta"]["group"] for c in result.clients] == list(OFFICE.domains)
