"""Data faults say what is wrong (issue 15, item 8): damaged idx files fail in one line naming the
file and the problem, before torchvision reads them (it says "not found" or raises a bare assert)."""
from __future__ import annotations

import numpy as np
import pytest

from pfl_core.data import DatasetFileError, load_dataset

from fake_data import MNIST_STEMS, write_idx, write_mnist_layout


@pytest.fixture
def raw(tmp_path):
    write_mnist_layout(tmp_path, "MNIST", MNIST_STEMS, 10)  # 7 train and 3 test images
    return tmp_path / "MNIST" / "raw"


def _load_error(raw) -> str:
    with pytest.raises(DatasetFileError) as info:
        load_dataset("mnist", raw.parents[1], "train", download=False)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_truncated_images_file(raw):
    path = raw / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:16 + 3 * 784 + 10])
    message = _load_error(raw)
    assert message.startswith(f"{path}: truncated")
    assert f"{16 + 3 * 784 + 10} bytes" in message and f"{16 + 7 * 784}" in message  # found vs announced
    assert "not found" not in message


def test_truncated_header(raw):
    path = raw / "train-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes()[:6])
    assert _load_error(raw).startswith(f"{path}: truncated")


def test_missing_labels_file_is_named(raw):
    labels = raw / "train-labels-idx1-ubyte"
    labels.unlink()
    message = _load_error(raw)
    assert message.startswith(f"{labels}: missing")
    assert "train-images-idx3-ubyte" not in message.split(":")[0]


def test_wrong_magic_number(raw):
    path = raw / "t10k-images-idx3-ubyte"
    data = bytearray(path.read_bytes())
    data[:4] = (0x0777).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    message = _load_error(raw)
    assert message.startswith(f"{path}: wrong magic number 0x00000777")
    assert "0x00000803" in message  # the expected one


def test_gzip_file_under_the_idx_name(raw):
    import gzip

    path = raw / "train-images-idx3-ubyte"
    path.write_bytes(gzip.compress(path.read_bytes()))
    assert "gzip" in _load_error(raw)


def test_images_and_labels_disagree(raw):
    labels = raw / "train-labels-idx1-ubyte"
    write_idx(labels, np.arange(5) % 10)
    message = _load_error(raw)
    assert str(labels) in message and "7 images" in message and "5 labels" in message


def test_trailing_bytes(raw):
    path = raw / "train-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes() + b"\x00\x01")
    assert _load_error(raw).startswith(f"{path}: 2 bytes beyond")


def test_intact_files_still_load_and_empty_folder_is_not_found(raw, tmp_path):
    assert len(load_dataset("mnist", tmp_path, "train", download=False)) == 7
    from pfl_core.data import DatasetNotFoundError

    with pytest.raises(DatasetNotFoundError):
        load_dataset("mnist", tmp_path / "elsewhere", "train", download=False)


# -- issue 29, item 2: values a data file may not hold ----------------------------------------------
def test_idx_label_outside_the_classes_is_named(raw):
    labels = raw / "train-labels-idx1-ubyte"
    write_idx(labels, np.array([0, 1, 2, 160, 4, 5, 6]))
    message = _load_error(raw)
    assert message.startswith(f"{labels}: label 160 of item 3 is outside the 10 classes")


def test_cifar_pickle_labels_outside_the_classes(tmp_path, monkeypatch):
    import pickle

    from torchvision import datasets as tv

    from fake_data import patch_cifar_md5, write_cifar10

    md5s = write_cifar10(tmp_path, 4)
    batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    entry = pickle.loads(batch.read_bytes())
    entry["labels"] = [3, 12, 1, 0]
    batch.write_bytes(pickle.dumps(entry))
    md5s = {**md5s, "test_list": [["test_batch", __import__("hashlib").md5(batch.read_bytes()).hexdigest()]]}
    patch_cifar_md5(tv.CIFAR10, md5s, monkeypatch)
    with pytest.raises(DatasetFileError, match="test_batch: label 12 of item 1 is outside the 10 classes"):
        load_dataset("cifar10", tmp_path, "test", download=False)


def test_mini_imagenet_pickle_naming_missing_images(tmp_path):
    import pickle

    from fake_data import write_miniimagenet

    write_miniimagenet(tmp_path)
    path = next((tmp_path / "mini-imagenet").glob("*train.pkl"))
    data = pickle.loads(path.read_bytes())
    first = next(iter(data["class_dict"]))
    data["class_dict"][first] = [0, 1, 10_000]
    path.write_bytes(pickle.dumps(data))
    with pytest.raises(DatasetFileError, match="lists images outside"):
        load_dataset("miniimagenet", tmp_path, "train", download=False)
