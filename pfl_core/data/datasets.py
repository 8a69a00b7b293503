"""Dataset registry and loaders (DESIGN.md, "Federated data").

Each registered loader is ``fn(data_dir: Path, split: str, download: bool, **params) -> ArrayDataset``
with ``split`` in ``"train" | "test" | "all"`` (all = train then test). Torchvision datasets are
read from their ``.data`` / ``.targets`` arrays (no per-item transforms). Missing files raise
:class:`DatasetNotFoundError` with a one-line message naming the dataset, the directory and the fix;
damaged idx files a :class:`~pfl_core.data.idx.DatasetFileError` naming the file and the problem.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from pfl_core.data import offline
from pfl_core.data.federated import ArrayDataset
from pfl_core.data.idx import check_idx_folder
from pfl_core.registry import Registry

Loader = Callable[..., ArrayDataset]
DATASETS: Registry[Loader] = Registry("dataset")
SPLITS = ("train", "test", "all")


class DatasetNotFoundError(FileNotFoundError):
    """The dataset files are not under the data directory (and were not downloaded)."""


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """``data_dir`` if given, else env ``PFL_DATA_DIR``, else ``~/.cache/pfl-data``."""
    chosen = data_dir or os.environ.get("PFL_DATA_DIR") or Path.home() / ".cache" / "pfl-data"
    return Path(chosen).expanduser()


def _download_default() -> bool:
    """Env ``PFL_DOWNLOAD``: "0" (or false/no/off) disables downloads; default "1" allows them."""
    return os.environ.get("PFL_DOWNLOAD", "1").strip().lower() not in {"0", "false", "no", "off"}


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    split: str = "train",
    download: bool | None = None,
    **params: Any,
) -> ArrayDataset:
    """Load dataset ``name`` through its registered loader."""
    loader = DATASETS.get(name)
    if split not in SPLITS:
        raise ValueError(f"dataset {name!r}: split must be one of {SPLITS}, got {split!r}")
    if download is None:
        download = _download_default()
    return loader(resolve_data_dir(data_dir), split, download, **params)


def _not_found(title: str, data_dir: Path, expected: Path, reason: str = "") -> DatasetNotFoundError:
    why = f" ({' '.join(reason.split())})" if reason else ""
    return DatasetNotFoundError(
        f"{title} not found under {data_dir} (expected {expected}){why}; download it on a machine "
        "with internet, copy the torchvision layout there, or set PFL_DATA_DIR / --data-dir"
    )


def _open(
    make: Callable[[bool, bool], Any],
    train: bool,
    download: bool,
    title: str,
    data_dir: Path,
    expected: Path,
) -> Any:
    """``make(train, False)``; only if the files are missing and ``download`` is True, then
    ``make(train, True)``. Either failure becomes a :class:`DatasetNotFoundError`."""
    try:
        return make(train, False)
    except RuntimeError as missing:  # torchvision: "Dataset not found [or corrupted]"
        if not download:
            raise _not_found(title, data_dir, expected) from missing
    try:
        return make(train, True)
    except Exception as err:  # offline machine, unreachable mirror, corrupt archive
        raise _not_found(title, data_dir, expected, f"download failed: {err}") from err


def _open_splits(
    make: Callable[[bool, bool], Any],
    title: str,
    data_dir: Path,
    split: str,
    download: bool,
    expected: Path,
) -> list[Any]:
    """Torchvision dataset objects for ``split`` ("all" = train then test)."""
    trains = (True, False) if split == "all" else (split == "train",)
    return [_open(make, train, download, title, data_dir, expected) for train in trains]


def _mnist_like(
    name: str,
    title: str,
    make: Callable[[bool, bool], Any],
    data_dir: Path,
    split: str,
    download: bool,
    expected: Path,
    stems: tuple[str, str] = ("train", "t10k"),
    transpose: bool = False,
) -> ArrayDataset:
    check_idx_folder(title, expected.parent, list(stems))  # a damaged file says what is wrong
    parts = _open_splits(make, title, data_dir, split, download, expected)
    x = torch.cat([p.data for p in parts]).unsqueeze(1)
    if transpose:
        x = x.transpose(2, 3)
    return ArrayDataset(
        name=name,
        x=x.contiguous(),
        y=torch.cat([torch.as_tensor(p.targets) for p in parts]).long(),
        num_classes=len(parts[0].classes),
        description=f"{title} {split} split (torchvision files under {data_dir})",
    )


def _torchvision_datasets():
    """``torchvision.datasets``, imported on first use: torchvision's import (it loads
    ``torch._dynamo`` through ``torchvision.ops``) costs seconds that a run on an offline dataset,
    e.g. every run of ``make demo``, never needs."""
    from torchvision import datasets

    return datasets


@DATASETS.register("mnist")
def mnist(data_dir: Path, split: str, download: bool) -> ArrayDataset:
    """MNIST, uint8 (N, 1, 28, 28), 10 classes."""
    return _mnist_like(
        "mnist", "MNIST",
        lambda train, dl: _torchvision_datasets().MNIST(data_dir, train=train, download=dl),
        data_dir, split, download, data_dir / "MNIST" / "raw" / "train-images-idx3-ubyte",
    )


@DATASETS.register("fmnist")
def fmnist(data_dir: Path, split: str, download: bool) -> ArrayDataset:
    """Fashion-MNIST, uint8 (N, 1, 28, 28), 10 classes."""
    return _mnist_like(
        "fmnist", "FashionMNIST",
        lambda train, dl: _torchvision_datasets().FashionMNIST(data_dir, train=train, download=dl),
        data_dir, split, download, data_dir / "FashionMNIST" / "raw" / "train-images-idx3-ubyte",
    )


@DATASETS.register("emnist")
def emnist(data_dir: Path, split: str, download: bool, emnist_split: str = "byclass") -> ArrayDataset:
    """EMNIST ``emnist_split`` (byclass: 62 classes), uint8 (N, 1, 28, 28).

    The EMNIST files store each image transposed; the loader transposes it back so characters are
    upright like MNIST and LEAF FEMNIST (torchvision itself leaves them transposed).
    """
    return _mnist_like(
        "emnist", f"EMNIST-{emnist_split}",
        lambda train, dl: _torchvision_datasets().EMNIST(data_dir, split=emnist_split, train=train, download=dl),
        data_dir, split, download,
        data_dir / "EMNIST" / "raw" / f"emnist-{emnist_split}-train-images-idx3-ubyte",
        stems=(f"emnist-{emnist_split}-train", f"emnist-{emnist_split}-test"), transpose=True,
    )


def _cifar(
    name: str, title: str, cls: type, folder: str, data_dir: Path, split: str, download: bool
) -> ArrayDataset:
    parts = _open_splits(
        lambda train, dl: cls(data_dir, train=train, download=dl),
        title, data_dir, split, download, data_dir / folder,
    )
    x = np.concatenate([p.data for p in parts])  # (N, 32, 32, 3) uint8
    return ArrayDataset(
        name=name,
        x=torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(),
        y=torch.tensor(np.concatenate([np.asarray(p.targets) for p in parts]), dtype=torch.int64),
        num_classes=len(parts[0].classes),
        description=f"{title} {split} split (torchvision files under {data_dir})",
    )


@DATASETS.register("cifar10")
def cifar10(data_dir: Path, split: str, download: bool) -> ArrayDataset:
    """CIFAR-10, uint8 (N, 3, 32, 32), 10 classes."""
    return _cifar("cifar10", "CIFAR-10", _torchvision_datasets().CIFAR10, "cifar-10-batches-py", data_dir, split, download)


@DATASETS.register("cifar100")
def cifar100(data_dir: Path, split: str, download: bool) -> ArrayDataset:
    """CIFAR-100 (fine labels), uint8 (N, 3, 32, 32), 100 classes."""
    return _cifar("cifar100", "CIFAR-100", _torchvision_datasets().CIFAR100, "cifar-100-python", data_dir, split, download)


def _whole_set_only(name: str, split: str) -> None:
    if split == "test":
        raise ValueError(
            f"offline dataset {name!r} has no test split; load split='train' or 'all' (the whole "
            "set) and use per-client splits"
        )


@DATASETS.register("synthetic")
def synthetic(data_dir: Path, split: str, download: bool, **params: Any) -> ArrayDataset:
    """Offline Synthetic(alpha, beta) (see :func:`offline.synthetic`); ``data_dir`` is unused."""
    _whole_set_only("synthetic", split)
    return offline.synthetic(**params)


synthetic.offline = True  # known before loading: reports flag offline cells up front
synthetic.params_from = offline.synthetic  # its data.params, checked when a suite is loaded


@DATASETS.register("digits28")
def digits28(data_dir: Path, split: str, download: bool, **params: Any) -> ArrayDataset:
    """Offline scikit-learn digits at 28x28 (see :func:`offline.digits28`); NOT MNIST."""
    _whole_set_only("digits28", split)
    return offline.digits28(**params)


digits28.offline = True
digits28.params_from = offline.digits28


def loader_params(name: str) -> Callable:
    """The function whose keyword parameters are dataset ``name``'s ``data.params`` (the loader, or
    the generator it forwards ``**params`` to), for checking a suite's values by their annotations."""
    loader = DATASETS.get(name)
    return getattr(loader, "params_from", loader)
