"""Datasets of MetaVers' novel-class protocol (Table 6; docs/papers/metavers.md).

Both have three splits with *disjoint classes*: ``train`` (the 64 classes the clients hold),
``val`` (16) and ``test`` (20), and ``all`` (the three in that order). Like the code
(``trainer_novel_class.py``) the pixels are *not normalised*: a batch holds floats in [0, 255]
(the images stay uint8 in memory; ``mean`` 0 and ``std`` 1/255 undo the loader's scaling to [0, 1]).

* ``miniimagenet``: learn2learn's ``MiniImagenet`` files, ``mini-imagenet-cache-{train,validation,
  test}.pkl`` (each a pickle of ``{"image_data": uint8 (N, 84, 84, 3), "class_dict": {wnid:
  [row, ...]}}``), read without learn2learn. learn2learn numbers each file's classes 0.. in the
  order of ``class_dict``; here the splits share one label space, so validation classes are
  64..79 and test classes 80..99 (a relabelling: the protocol samples classes within one split).
* ``cifar100_novel``: CIFAR-100's train and test sets merged (60,000, train first) and cut by class
  index as the code's ``Cifar100_partion``: classes 0-63 ``train``, 84-99 ``val``, 64-83 ``test``,
  labels kept. The code feeds the HWC uint8 arrays through ``transpose(1, 3)``, which gives
  (C, W, H): the images are mirrored across the diagonal (``swap_hw``, default True as in the code).

The 64 training clients are the ``shards`` partitioner with ``num_shards: 128`` and
``shards_per_client: 2`` on the ``train`` split (the code's ``mini_shard_noniid``: sort by label, 128
shards of 300, 2 random shards each); see that partitioner for its deviations (stable sort).
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from pfl_core.data.cifar_files import read_cifar, verify_cifar
from pfl_core.data.datasets import DATASETS, DatasetNotFoundError, _torchvision_datasets
from pfl_core.data.federated import ArrayDataset
from pfl_core.data.idx import DatasetFileError

NOVEL_SPLITS = ("train", "val", "test", "all")
RAW_PIXELS = {"mean": (0.0, 0.0, 0.0), "std": (1 / 255, 1 / 255, 1 / 255)}
"""Normalisation constants that turn the loader's [0, 1] scaling back into raw [0, 255] floats."""

MINI_FOLDER = "mini-imagenet"
MINI_FILES = {"train": "train", "val": "validation", "test": "test"}
MINI_LABEL_OFFSET = {"train": 0, "val": 64, "test": 80}
MINI_CLASSES = {"train": 64, "val": 16, "test": 20}

CIFAR100_CLASSES = {"train": range(0, 64), "test": range(64, 84), "val": range(84, 100)}


def _wanted(split: str) -> tuple[str, ...]:
    return ("train", "val", "test") if split == "all" else (split,)


def _read_mini(root: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    path = root / f"mini-imagenet-cache-{MINI_FILES[split]}.pkl"
    if not path.is_file():
        raise DatasetNotFoundError(
            f"mini-ImageNet {split!r} split not found under {root} (expected {path}, learn2learn's "
            "MiniImagenet cache file); copy learn2learn's mini-imagenet-cache-{train,validation,test}.pkl "
            "there, or set PFL_DATA_DIR / --data-dir")
    with open(path, "rb") as f:
        data = pickle.load(f)
    if not isinstance(data, dict) or not {"image_data", "class_dict"} <= set(data):
        raise DatasetNotFoundError(f"{path}: not a learn2learn mini-ImageNet cache (a pickled dict with "
                                   "'image_data' and 'class_dict' expected)")
    images = np.asarray(data["image_data"], dtype=np.uint8)
    names = list(data["class_dict"])
    if len(names) > MINI_CLASSES[split]:
        raise DatasetNotFoundError(f"{path}: {len(names)} classes, but the {split!r} split of mini-ImageNet "
                                   f"has {MINI_CLASSES[split]}")
    labels = np.full(len(images), -1, dtype=np.int64)
    for k, name in enumerate(names):
        rows = np.asarray(data["class_dict"][name], dtype=np.int64)
        if ((rows < 0) | (rows >= len(images))).any():  # the pickle's labels and images disagree
            raise DatasetFileError(f"{path}: class_dict[{name!r}] lists images outside the {len(images)} of "
                                   f"'image_data'; replace the file with learn2learn's cache file")
        labels[rows] = MINI_LABEL_OFFSET[split] + k
    if (labels < 0).any():
        raise DatasetNotFoundError(f"{path}: {int((labels < 0).sum())} images belong to no class of 'class_dict'")
    return images, labels


@DATASETS.register("miniimagenet")
def miniimagenet(data_dir: Path, split: str, download: bool) -> ArrayDataset:
    """mini-ImageNet (64/16/20 classes, 600 images each), uint8 (N, 3, 84, 84), batches in [0, 255];
    files under ``<data dir>/mini-imagenet/`` (never downloaded)."""
    root = data_dir / MINI_FOLDER
    parts = [_read_mini(root, s) for s in _wanted(split)]
    return ArrayDataset(
        name="miniimagenet",
        x=torch.from_numpy(np.concatenate([p[0] for p in parts])).permute(0, 3, 1, 2).contiguous(),
        y=torch.from_numpy(np.concatenate([p[1] for p in parts])),
        num_classes=sum(MINI_CLASSES.values()),
        description=f"mini-ImageNet {split} split (learn2learn cache files under {root}; raw 0-255 pixels)",
        **RAW_PIXELS,
    )


@DATASETS.register("cifar100_novel")
def cifar100_novel(data_dir: Path, split: str, download: bool, swap_hw: bool = True) -> ArrayDataset:
    """CIFAR-100 split by class for the novel-class protocol: train 0-63, val 84-99, test 64-83;
    uint8 (N, 3, 32, 32), batches in [0, 255]. ``swap_hw`` (default True, the code's
    ``transpose(1, 3)`` of HWC images, docs/papers/metavers.md): images stored as (C, W, H); False
    stores them upright (C, H, W)."""
    cls = _torchvision_datasets().CIFAR100
    provenance = verify_cifar("cifar100", "CIFAR-100", cls, data_dir, download)
    parts = [read_cifar(cls, data_dir, train) for train in (True, False)]
    x = np.concatenate([p.data for p in parts])  # (60000, H, W, C), train then test
    y = np.concatenate([np.asarray(p.targets) for p in parts]).astype(np.int64)
    rows = np.concatenate([np.flatnonzero(np.isin(y, CIFAR100_CLASSES[s])) for s in _wanted(split)])
    images = torch.from_numpy(x[rows])
    images = images.permute(0, 3, 2, 1) if swap_hw else images.permute(0, 3, 1, 2)
    return ArrayDataset(
        name="cifar100_novel",
        x=images.contiguous(),
        y=torch.from_numpy(y[rows]),
        num_classes=100,
        description=(f"CIFAR-100 novel-class {split} split (train+test merged, classes 0-63 train, 84-99 "
                     f"val, 64-83 test; {'H/W swapped as the code' if swap_hw else 'upright'}; raw 0-255 "
                     f"pixels; torchvision files under {data_dir})"),
        provenance=provenance,
        **RAW_PIXELS,
    )


miniimagenet.splits = cifar100_novel.splits = NOVEL_SPLITS
