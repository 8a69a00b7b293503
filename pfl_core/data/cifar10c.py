"""CIFAR-10-C as the FedL2P code splits it (docs/papers/fedl2p.md; its ``cifar10C_dataset.py``).

The release (Hendrycks & Dietterich, https://zenodo.org/record/2535967, ``CIFAR-10-C.tar``)
unpacks to ``CIFAR-10-C/<corruption>.npy`` (50,000 x 32 x 32 x 3 uint8: severities 1..5, 10,000
images each, built from the CIFAR-10 test split) and ``labels.npy``. Per corruption the code takes
the severity's 10,000 rows, cuts a stratified 20% test (``train_test_split``, ``random_state=1``),
then a stratified 20% of the rest as validation (same seed): 6,400 train / 1,600 val / 2,000 test.
The labels file is shared by all corruptions, so are the split positions. Each split holds the
corruptions one after the other (``all``: train, val, test, each so); ``groups`` is the corruption's position in
``corruptions`` (``group_names``), so ``data.partition_per_group`` gives every corruption its own
clients (25 per corruption, 250 in all, with one Dirichlet matrix).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pfl_core.fields import Fraction, PositiveInt
from pfl_core.data.datasets import DATASETS, DatasetNotFoundError, MeanStd, mean_std_of
from pfl_core.data.federated import ArrayDataset

FOLDER = "CIFAR-10-C"
SEVERITIES = 5
FEDL2P_CORRUPTIONS = ("brightness", "frost", "jpeg_compression", "contrast", "snow", "motion_blur", "pixelate",
                      "speckle_noise", "fog", "saturate")
"""The code's ``subset_types`` (the paper's 10 corruptions), in its order: client groups 0..9."""
ALL_CORRUPTIONS = ("brightness", "frost", "jpeg_compression", "shot_noise", "contrast", "gaussian_blur", "snow",
                   "defocus_blur", "gaussian_noise", "motion_blur", "spatter", "elastic_transform", "glass_blur",
                   "pixelate", "speckle_noise", "fog", "impulse_noise", "saturate", "zoom_blur")
"""The 19 corruption files of the release."""


def corruption_splits(labels: np.ndarray, test_fraction: float, val_fraction: float,
                      seed: int) -> dict[str, np.ndarray]:
    """Positions of one corruption's rows in train / val / test: the code's two stratified
    ``train_test_split`` calls (``shuffle=True, random_state=seed``), in their output order."""
    from sklearn.model_selection import train_test_split  # imported here: scikit-learn is slow to import

    rest, test = train_test_split(np.arange(len(labels)), test_size=test_fraction, stratify=labels,
                                  shuffle=True, random_state=seed)
    train, val = train_test_split(rest, test_size=val_fraction, stratify=labels[rest], shuffle=True,
                                  random_state=seed)
    return {"train": train, "val": val, "test": test}


def _open(path: Path, root: Path) -> np.ndarray:
    """One release file, memory-mapped; a clear error naming the folder when it is missing."""
    if not path.is_file():
        raise DatasetNotFoundError(
            f"CIFAR-10-C file {path.name} not found under {root} (expected {path}); download CIFAR-10-C.tar "
            "from https://zenodo.org/record/2535967 and unpack it into the data directory (it holds "
            "CIFAR-10-C/<corruption>.npy and labels.npy), or set PFL_DATA_DIR / --data-dir")
    return np.load(path, mmap_mode="r")


def severity_rows(num_rows: int, severity: int, path: Path) -> slice:
    """The rows of ``severity`` (1..5) in a file of 5 equal severity blocks (10,000 each in the release)."""
    if num_rows % SEVERITIES:
        raise DatasetNotFoundError(f"CIFAR-10-C file {path} holds {num_rows} rows, not {SEVERITIES} equal severity "
                                   f"blocks (the release: 50,000 = 5 x 10,000)")
    block = num_rows // SEVERITIES
    return slice((severity - 1) * block, severity * block)


@DATASETS.register("cifar10c")
def cifar10c(data_dir: Path, split: str, download: bool, corruptions: list = FEDL2P_CORRUPTIONS,
             severity: PositiveInt = 3, test_fraction: Fraction = 0.2, val_fraction: Fraction = 0.2,
             split_seed: int = 1, mean_std: MeanStd = "none") -> ArrayDataset:
    """CIFAR-10-C, uint8 (N, 3, 32, 32), 10 classes, ``groups`` = corruption, from
    ``<data dir>/CIFAR-10-C``. Never downloaded (2.9 GB).

    ``severity`` 1..5 as in the paper (3: rows [20000:30000], the code's 0-indexed 2);
    ``corruptions`` (default: the paper's 10, the code's order); ``test_fraction``,
    ``val_fraction``, ``split_seed``: the code's stratified splits (0.2, 0.2, its seed 1, the same for
    every run); ``mean_std``: ``fedl2p`` for the code's Normalize, ``none`` (default) for [0, 1]."""
    unknown = [c for c in corruptions if c not in ALL_CORRUPTIONS]
    if unknown or not corruptions:
        raise ValueError(f"data.params.corruptions: {unknown or 'empty'}; choose among {list(ALL_CORRUPTIONS)}")
    if not 1 <= severity <= 5:
        raise ValueError(f"data.params.severity must be 1..5 (the paper's severity; 3 in FedL2P), got {severity}")
    root = data_dir / FOLDER
    every_label = _open(root / "labels.npy", root)
    rows = severity_rows(len(every_label), severity, root / "labels.npy")
    labels = np.asarray(every_label[rows]).astype(np.int64)
    positions = corruption_splits(labels, test_fraction, val_fraction, split_seed)  # the same for every corruption
    wanted = ("train", "val", "test") if split == "all" else (split,)
    per_corruption = []
    for name in corruptions:
        images = _open(root / f"{name}.npy", root)
        if len(images) != len(every_label):
            raise DatasetNotFoundError(f"CIFAR-10-C file {root / (name + '.npy')} holds {len(images)} images "
                                       f"but labels.npy {len(every_label)} labels")
        images = np.asarray(images[rows])
        per_corruption.append({s: images[positions[s]] for s in wanted})
    order = [(s, group) for s in wanted for group in range(len(corruptions))]  # "all": train, val, test
    xs = [per_corruption[group][s] for s, group in order]
    ys = [labels[positions[s]] for s, _ in order]
    groups = [np.full(len(positions[s]), group, dtype=np.int64) for s, group in order]
    return ArrayDataset(
        name="cifar10c",
        x=torch.from_numpy(np.concatenate(xs)).permute(0, 3, 1, 2).contiguous(),
        y=torch.from_numpy(np.concatenate(ys)),
        num_classes=10,
        groups=torch.from_numpy(np.concatenate(groups)),
        group_names=tuple(corruptions),
        description=f"CIFAR-10-C severity {severity}, {len(corruptions)} corruptions, {split} split "
                    f"(stratified {test_fraction:g} test, then {val_fraction:g} val, seed {split_seed}; {root})",
        **mean_std_of("cifar10c", mean_std),
    )


cifar10c.splits = ("train", "val", "test", "all")
