"""Dataset registry and loaders (docs/data.md).

Each registered loader is ``fn(data_dir: Path, split: str, download: bool, **params) -> ArrayDataset``
with ``split`` in ``"train" | "test" | "all"`` (all = train then test); a loader whose dataset also
has a validation split lists its splits in its ``splits`` attribute (e.g. ``("train", "val",
"test", "all")``). :func:`load_sources` joins several splits into one dataset that remembers where
each row came from (``ArrayDataset.source``). Torchvision datasets are
read from their ``.data`` / ``.targets`` arrays (no per-item transforms). Missing files raise
:class:`DatasetNotFoundError` with a one-line message naming the dataset, the directory and the fix;
damaged idx files a :class:`~pfl_core.data.idx.DatasetFileError` naming the file and the problem.
CIFAR-10/100 folders are checked first (:mod:`pfl_core.data.cifar_files`): missing, partial and
checksum-failing files each raise their own error; a known copy (the CIFAR-10 reconstruction) or one
accepted by ``PFL_ACCEPT_MD5_MISMATCH`` loads with its ``provenance`` set.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch

from pfl_core.data.augment.crop_flip import FEDL2P_CIFAR_MEAN, FEDL2P_CIFAR_STD
from pfl_core.fields import NonNegativeInt
from pfl_core.data import offline
from pfl_core.data.cifar_files import read_cifar, verify_cifar
from pfl_core.data.errors import DatasetNotFoundError, not_found  # noqa: F401 (imported from here by the loaders)
from pfl_core.data.federated import ArrayDataset
from pfl_core.data.idx import check_idx_folder
from pfl_core.data.integrity import check_labels
from pfl_core.data.splits import seeded_random_split
from pfl_core.registry import Registry

Loader = Callable[..., ArrayDataset]
DATASETS: Registry[Loader] = Registry("dataset")
SPLITS = ("train", "test", "all")
"""The splits every loader serves; a loader's own ``splits`` attribute may add ``val``."""


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """``data_dir`` if given, else env ``PFL_DATA_DIR``, else ``~/.cache/pfl-data``."""
    chosen = data_dir or os.environ.get("PFL_DATA_DIR") or Path.home() / ".cache" / "pfl-data"
    return Path(chosen).expanduser()


def _download_default() -> bool:
    """Env ``PFL_DOWNLOAD``: "0" (or false/no/off) disables downloads; default "1" allows them."""
    return os.environ.get("PFL_DOWNLOAD", "1").strip().lower() not in {"0", "false", "no", "off"}


@contextlib.contextmanager
def no_downloads():
    """``PFL_DOWNLOAD=0`` inside the block (a dry run's data step never downloads), restored after."""
    before = os.environ.get("PFL_DOWNLOAD")
    os.environ["PFL_DOWNLOAD"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PFL_DOWNLOAD", None)
        else:
            os.environ["PFL_DOWNLOAD"] = before


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    split: str = "train",
    download: bool | None = None,
    **params: Any,
) -> ArrayDataset:
    """Load dataset ``name`` through its registered loader."""
    loader = DATASETS.get(name)
    allowed = loader_splits(name)
    if split not in allowed:
        raise ValueError(f"dataset {name!r}: split must be one of {allowed}, got {split!r}")
    if download is None:
        download = _download_default()
    return loader(resolve_data_dir(data_dir), split, download, **params)


def loader_splits(name: str) -> tuple[str, ...]:
    """The splits dataset ``name`` serves (its loader's ``splits``, else :data:`SPLITS`)."""
    return tuple(getattr(DATASETS.get(name), "splits", SPLITS))


def load_sources(
    name: str,
    sources: list[str],
    data_dir: str | Path | None = None,
    download: bool | None = None,
    **params: Any,
) -> ArrayDataset:
    """Splits ``sources`` of dataset ``name`` (e.g. ``["train", "val", "test"]``) as one dataset:
    their rows in that order, ``source[i]`` = the position in ``sources`` of row i's split."""
    parts = [load_dataset(name, data_dir, split, download, **params) for split in sources]
    return concat_sources(parts, sources)


def concat_sources(parts: list[ArrayDataset], sources: list[str]) -> ArrayDataset:
    """One dataset of ``parts`` (the splits ``sources`` of one dataset), tagged with ``source``."""
    first = parts[0]
    tags = torch.cat([torch.full((len(p),), k, dtype=torch.int64) for k, p in enumerate(parts)])
    groups = None if first.groups is None else torch.cat([p.groups for p in parts])
    return ArrayDataset(
        name=first.name, x=torch.cat([p.x for p in parts]), y=torch.cat([p.y for p in parts]),
        num_classes=max(p.num_classes for p in parts), groups=groups, mean=first.mean, std=first.std,
        offline=first.offline, provenance=first.provenance, source=tags, sources=tuple(sources), group_names=first.group_names,
        evaluation_normalized=first.evaluation_normalized, inputs=first.inputs, extras=first.extras,
        unseen_groups=first.unseen_groups,
        description="; ".join(p.description for p in parts),
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
            raise not_found(title, data_dir, expected) from missing
    try:
        return make(train, True)
    except Exception as err:  # offline machine, unreachable mirror, corrupt archive
        raise not_found(title, data_dir, expected, f"download failed: {err}", download=True) from err


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
    trains = (True, False) if split == "all" else (split == "train",)
    for part, train in zip(parts, trains):
        labels_file = expected.parent / f"{stems[0 if train else 1]}-labels-idx1-ubyte"
        check_labels(part.targets, len(part.classes), len(part.data), labels_file)
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


MeanStd = Literal["none", "metavers", "fedl2p"]
"""A loader's ``mean_std``: ``none`` leaves inputs in [0, 1]; ``metavers`` is ToTensor then the
per-channel Normalize of the MetaVers code (docs/papers/metavers.md; its ``get_datasets``);
``fedl2p`` the FedL2P code's CIFAR-10 / CIFAR-10-C Normalize (docs/papers/fedl2p.md)."""

METAVERS_MEAN_STD = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "cinic10": ((0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835)),
}
FEDL2P_MEAN_STD = {name: (FEDL2P_CIFAR_MEAN, FEDL2P_CIFAR_STD) for name in ("cifar10", "cifar10c")}
MEAN_STD = {"metavers": METAVERS_MEAN_STD, "fedl2p": FEDL2P_MEAN_STD}


def mean_std_of(name: str, mean_std: str) -> dict:
    """``{mean, std}`` for :class:`ArrayDataset` under the loader setting ``mean_std``."""
    if mean_std == "none":
        return {}
    if name not in MEAN_STD.get(mean_std, {}):
        allowed = ["none", *(k for k, table in MEAN_STD.items() if name in table)]
        raise ValueError(f"dataset {name!r}: data.params.mean_std must be one of {allowed}, got {mean_std!r}")
    mean, std = MEAN_STD[mean_std][name]
    return {"mean": mean, "std": std}


def train_val_split(n: int, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The MetaVers code's train/val cut of a training set of ``n`` (docs/papers/metavers.md):
    ``torch.utils.data.random_split(dataset, [n - val_size, val_size])`` right after
    ``torch.manual_seed(seed)``, i.e. one ``randperm(n)`` of the seeded CPU generator; returns the
    (train, val) positions in that permutation's order (the order of the code's ``Subset``)."""
    if not 0 < val_size < n:
        raise ValueError(f"data.params.val_size must be in (0, {n}) for a training set of {n}, got {val_size}")
    train, val = seeded_random_split(n, [n - val_size, val_size], seed)
    return train, val


def _cifar(
    name: str, title: str, cls: type, folder: str, data_dir: Path, split: str, download: bool,
    val_size: int, val_seed: int, mean_std: str,
) -> ArrayDataset:
    if split == "val" and not val_size:
        raise ValueError(f"dataset {name!r} has a 'val' split only when data.params.val_size > 0 "
                         "(MetaVers: val_size: 10000, val_seed: \"${seed}\")")
    wanted = ("train", "val", "test") if split == "all" else (split,)
    expected = data_dir / folder
    provenance = verify_cifar(name, title, cls, data_dir, download)
    xs, ys = [], []
    if "train" in wanted or "val" in wanted:
        part = read_cifar(cls, data_dir, train=True)
        x, y = part.data, np.asarray(part.targets)
        check_labels(y, len(part.classes), len(x), expected / "data_batch_1..5")
        rows = dict(zip(("train", "val"), train_val_split(len(y), val_size, val_seed))) if val_size \
            else {"train": np.arange(len(y))}
        for s in ("train", "val"):
            if s in wanted and s in rows:
                xs.append(x[rows[s]])
                ys.append(y[rows[s]])
    if "test" in wanted:
        part = read_cifar(cls, data_dir, train=False)
        check_labels(part.targets, len(part.classes), len(part.data), expected / "test_batch")
        xs.append(part.data)
        ys.append(np.asarray(part.targets))
    cut = f"; train/val = random_split({val_size} val) after torch.manual_seed({val_seed})" if val_size else ""
    return ArrayDataset(
        name=name,
        x=torch.from_numpy(np.concatenate(xs)).permute(0, 3, 1, 2).contiguous(),  # (N, 32, 32, 3) uint8
        y=torch.tensor(np.concatenate(ys), dtype=torch.int64),
        num_classes=len(part.classes),
        description=f"{title} {split} split (torchvision files under {data_dir}){cut}",
        provenance=provenance,
        **mean_std_of(name, mean_std),
    )


@DATASETS.register("cifar10")
def cifar10(data_dir: Path, split: str, download: bool, val_size: NonNegativeInt = 0,
            val_seed: NonNegativeInt = 0, mean_std: MeanStd = "none") -> ArrayDataset:
    """CIFAR-10, uint8 (N, 3, 32, 32), 10 classes.

    ``val_size`` > 0 cuts the training set into train / val (``val_size``) as the MetaVers code
    does (:func:`train_val_split` with ``val_seed``; MetaVers: 10000 and ``"${seed}"``), and the
    split ``val`` exists; 0 (default) keeps the whole training set as ``train``. ``mean_std``:
    see :data:`MeanStd` (MetaVers: ``metavers``)."""
    return _cifar("cifar10", "CIFAR-10", _torchvision_datasets().CIFAR10, "cifar-10-batches-py", data_dir, split, download,
                  val_size, val_seed, mean_std)


@DATASETS.register("cifar100")
def cifar100(data_dir: Path, split: str, download: bool, val_size: NonNegativeInt = 0,
             val_seed: NonNegativeInt = 0, mean_std: MeanStd = "none") -> ArrayDataset:
    """CIFAR-100 (fine labels), uint8 (N, 3, 32, 32), 100 classes; ``val_size``, ``val_seed``,
    ``mean_std`` as for :func:`cifar10`."""
    return _cifar("cifar100", "CIFAR-100", _torchvision_datasets().CIFAR100, "cifar-100-python", data_dir, split, download,
                  val_size, val_seed, mean_std)


cifar10.splits = cifar100.splits = ("train", "val", "test", "all")


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
