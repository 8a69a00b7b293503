"""Dataset loaders on tiny files in the exact torchvision layouts, offline datasets, real MNIST."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision import datasets as tv

from pfl_core.data import DATASETS, DatasetNotFoundError, load_dataset, resolve_data_dir
from pfl_core.data.offline import synthetic_draws

from fake_data import MNIST_STEMS, write_cifar_layout, write_mnist_layout

SHARED_DATA = Path(os.environ.get("PFL_SHARED_MNIST", Path(__file__).parents[2] / "shared" / "data"))


@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fmnist", "FashionMNIST")])
def test_mnist_like_round_trip(tmp_path, name, folder):
    arrays = write_mnist_layout(tmp_path, folder, MNIST_STEMS, 10)
    for split in ("train", "test"):
        ds = load_dataset(name, tmp_path, split, download=False)
        images, labels = arrays[split]
        assert ds.name == name and not ds.offline and ds.num_classes == 10
        assert ds.x.shape == (len(labels), 1, 28, 28) and ds.x.dtype == torch.uint8
        assert ds.y.dtype == torch.int64
        assert np.array_equal(ds.x[:, 0].numpy(), images)
        assert np.array_equal(ds.y.numpy(), labels)
        assert split in ds.description
    both = load_dataset(name, tmp_path, "all", download=False)
    assert len(both) == 10
    assert np.array_equal(both.x[7:, 0].numpy(), arrays["test"][0])


def test_emnist_is_transposed_upright(tmp_path):
    stems = {"train": "emnist-byclass-train", "test": "emnist-byclass-test"}
    arrays = write_mnist_layout(tmp_path, "EMNIST", stems, 62)
    ds = load_dataset("emnist", tmp_path, "train", download=False, emnist_split="byclass")
    assert ds.num_classes == 62 and ds.x.shape == (7, 1, 28, 28) and ds.x.dtype == torch.uint8
    assert np.array_equal(ds.x[:, 0].numpy(), arrays["train"][0].transpose(0, 2, 1))


@pytest.mark.parametrize(
    "name,cls,num_classes", [("cifar10", tv.CIFAR10, 10), ("cifar100", tv.CIFAR100, 100)]
)
def test_cifar_round_trip(tmp_path, monkeypatch, name, cls, num_classes):
    arrays = write_cifar_layout(tmp_path, cls, monkeypatch)
    for split in ("train", "test"):
        ds = load_dataset(name, tmp_path, split, download=False)
        images, labels = arrays[split]
        assert ds.num_classes == num_classes and not ds.offline
        assert ds.x.shape == (len(labels), 3, 32, 32) and ds.x.dtype == torch.uint8
        assert ds.y.dtype == torch.int64
        assert np.array_equal(ds.x.numpy(), images)  # CHW pixels survive the HWC round trip
        assert ds.y.tolist() == labels
    assert len(load_dataset(name, tmp_path, "all", download=False)) == len(arrays["train"][1]) + len(
        arrays["test"][1]
    )


@pytest.mark.parametrize("name", ["mnist", "fmnist", "emnist", "cifar10", "cifar100"])
def test_missing_dataset_error_is_one_line(tmp_path, name):
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset(name, tmp_path / "empty", "train", download=False)
    message = str(info.value)
    assert "\n" not in message
    assert str(tmp_path / "empty") in message and "PFL_DATA_DIR" in message
    assert isinstance(info.value, FileNotFoundError)


def test_missing_error_names_dataset(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"^MNIST not found under .*MNIST/raw/train-images"):
        load_dataset("mnist", tmp_path, download=False)


def test_failed_download_becomes_not_found(tmp_path, monkeypatch):
    """download=True is tried only after download=False fails; its failure is reported in one line.
    The network call itself is replaced so the test never touches the network."""

    def no_network(self):
        raise OSError("<urlopen error [Errno -3] Temporary failure\nin name resolution>")

    monkeypatch.setattr(tv.MNIST, "download", no_network)
    with pytest.raises(DatasetNotFoundError, match="download failed: <urlopen error") as info:
        load_dataset("mnist", tmp_path, download=True)
    assert "\n" not in str(info.value)


def test_gzip_only_is_not_enough_offline(tmp_path):
    """torchvision 0.29 reads only the extracted idx files; .gz archives alone count as missing."""
    write_mnist_layout(tmp_path, "MNIST", MNIST_STEMS, 10)
    for path in (tmp_path / "MNIST" / "raw").iterdir():
        path.rename(path.with_name(path.name + ".gz"))
    with pytest.raises(DatasetNotFoundError):
        load_dataset("mnist", tmp_path, download=False)


def test_data_dir_and_download_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("PFL_DATA_DIR", str(tmp_path))
    assert resolve_data_dir(None) == tmp_path
    assert resolve_data_dir("/x/y") == Path("/x/y")
    monkeypatch.delenv("PFL_DATA_DIR")
    assert resolve_data_dir(None) == Path.home() / ".cache" / "pfl-data"
    monkeypatch.setenv("PFL_DOWNLOAD", "0")  # download=None must read the env: no network attempt
    with pytest.raises(DatasetNotFoundError):
        load_dataset("mnist", tmp_path / "none")
    with pytest.raises(ValueError, match="split"):
        load_dataset("mnist", tmp_path, "val", download=False)


def test_registry_names():
    expected = {"mnist", "fmnist", "emnist", "cifar10", "cifar100", "synthetic", "digits28"}
    assert expected <= set(DATASETS.names())


def test_digits28_offline():
    ds = load_dataset("digits28")
    assert ds.offline and "NOT MNIST" in ds.description
    assert ds.x.shape == (1797, 1, 28, 28) and ds.x.dtype == torch.uint8
    assert int(ds.x.min()) == 0 and int(ds.x.max()) == 255
    assert ds.y.dtype == torch.int64 and sorted(ds.y.unique().tolist()) == list(range(10))
    with pytest.raises(ValueError, match="no test split"):
        load_dataset("digits28", split="test")


def test_synthetic_check_values():
    """cgpfl.md, "pFedMe Synthetic(α=0.5, β=0.5)", CHECK VALUES."""
    ds = load_dataset("synthetic")
    assert ds.offline and ds.x.dtype == torch.float32 and ds.x.shape == (205_795, 60)
    sizes = np.bincount(ds.groups.numpy())
    assert sizes[:10].tolist() == [9545, 855, 2180, 24380, 11685, 285, 2075, 450, 470, 870]
    assert (sizes.min(), sizes.max(), sizes.sum(), len(sizes)) == (250, 25810, 205_795, 100)
    labels = ds.y.numpy()
    hist = [20440, 15477, 13612, 7703, 17542, 21572, 9409, 48331, 32221, 19488]
    assert np.bincount(labels, minlength=10).tolist() == hist
    users = np.split(labels, np.cumsum(sizes)[:-1])
    assert sum(len(np.unique(u)) == 1 for u in users) == 18
    majority = sum(np.bincount(u).max() for u in users) / len(labels)
    assert majority == pytest.approx(0.8246, abs=5e-5)


def test_synthetic_prior_draws():
    """u, B, W_0[0,0], b_0[0] check values (same legacy RandomState(0) stream, spec's draw order)."""
    draws = synthetic_draws()
    np.testing.assert_allclose(draws.u[:3], [0.94158, -0.67388, -0.63524], atol=1e-5)
    np.testing.assert_allclose(draws.b_mean[:3], [-0.18459, -0.11969, 0.54983], atol=1e-5)
    np.testing.assert_allclose(draws.w[0, 0, 0], 1.19668, atol=1e-5)
    np.testing.assert_allclose(draws.b[0, 0], 0.31868, atol=1e-5)


def test_synthetic_parameters_change_data():
    small = load_dataset("synthetic", alpha=1.0, beta=1.0, num_users=5, seed=1)
    assert small.x.shape[1] == 60 and len(np.unique(small.groups.numpy())) == 5
    assert "alpha=1.0" in small.description


@pytest.mark.skipif(not (SHARED_DATA / "MNIST" / "raw").is_dir(), reason="real MNIST not present")
def test_real_mnist():
    train = load_dataset("mnist", SHARED_DATA, "train", download=False)
    test = load_dataset("mnist", SHARED_DATA, "test", download=False)
    assert train.x.shape == (60_000, 1, 28, 28) and test.x.shape == (10_000, 1, 28, 28)
    assert train.x.dtype == torch.uint8 and train.y.dtype == torch.int64
    assert train.y[:5].tolist() == [5, 0, 4, 1, 9]
    assert np.bincount(train.y.numpy()).tolist()[:2] == [5923, 6742]
