"""CINIC-10 as the MetaVers code reads it (docs/papers/metavers.md).

The official archive (``CINIC-10.tar.gz``) unpacks to ``train/``, ``valid/`` and ``test/``, each
with one folder per class (``airplane`` ... ``truck``) of 32x32 PNGs, 9,000 per class and split.
The code reads each split with torchvision's ``ImageFolder`` (classes sorted by folder name, files
sorted within a class) and normalises with CINIC-10's constants; so does this loader, keeping the
images as uint8 (N, 3, 32, 32) until a batch is drawn. Splits: ``train``, ``val`` (the ``valid``
folder), ``test``, ``all`` (the three in that order).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pfl_core.data.datasets import DATASETS, DatasetNotFoundError, MeanStd, _torchvision_datasets, mean_std_of
from pfl_core.data.federated import ArrayDataset

FOLDER = "CINIC-10"
FOLDERS = {"train": "train", "val": "valid", "test": "test"}


def _read_split(root: Path, split: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(images (N, 32, 32, 3) uint8, labels, class names) of one split folder, in ImageFolder order."""
    folder = root / FOLDERS[split]
    try:
        found = _torchvision_datasets().ImageFolder(str(folder))
    except (FileNotFoundError, RuntimeError) as err:  # no folder / no class folder / no image
        raise DatasetNotFoundError(
            f"CINIC-10 {split!r} split not found under {root} (expected {folder}/<class>/*.png: "
            f"{' '.join(str(err).split())}); unpack CINIC-10.tar.gz into {root} (it holds train/, "
            "valid/, test/), or set PFL_DATA_DIR / --data-dir") from err
    images = np.stack([np.asarray(Image.open(path).convert("RGB"), dtype=np.uint8) for path, _ in found.samples])
    return images, np.asarray(found.targets, dtype=np.int64), found.classes


@DATASETS.register("cinic10")
def cinic10(data_dir: Path, split: str, download: bool, mean_std: MeanStd = "metavers") -> ArrayDataset:
    """CINIC-10, uint8 (N, 3, 32, 32), 10 classes, from ``<data dir>/CINIC-10/{train,valid,test}``.

    ``mean_std``: ``metavers`` (default: the MetaVers code's CINIC-10 Normalize) or ``none``
    (inputs in [0, 1], like pFedGP's x/255 without normalisation). Never downloaded: the archive
    is 700 MB (https://datashare.ed.ac.uk/handle/10283/3192)."""
    root = data_dir / FOLDER
    parts = [_read_split(root, s) for s in (("train", "val", "test") if split == "all" else (split,))]
    classes = parts[0][2]
    if any(p[2] != classes for p in parts):
        raise DatasetNotFoundError(f"CINIC-10 under {root}: the split folders hold different class folders")
    return ArrayDataset(
        name="cinic10",
        x=torch.from_numpy(np.concatenate([p[0] for p in parts])).permute(0, 3, 1, 2).contiguous(),
        y=torch.from_numpy(np.concatenate([p[1] for p in parts])),
        num_classes=len(classes),
        description=f"CINIC-10 {split} split (ImageFolder under {root})",
        **mean_std_of("cinic10", mean_std),
    )


cinic10.splits = ("train", "val", "test", "all")
