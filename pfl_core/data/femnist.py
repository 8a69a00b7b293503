"""FEMNIST from LEAF's JSON files (cafeme.md, "FEMNIST").

LEAF writes ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats]],
"y": [ints]}}}`` per file. Each ``x`` row is a 28x28 grayscale image flattened row-major and
divided by 255 (white background = 1.0, dark ink), so ``reshape(28, 28)`` is upright.

Storage: the images are stored **inverted** (ink bright), as uint8 ``255 - round(255 x)`` when
every value is a multiple of 1/255 (LEAF's output always is), else as float32 ``1 - x``; with
``mean = std = 0.5`` a batch is then ``((1 - x) - 0.5) / 0.5 = (0.5 - x) / 0.5``, the authors'
transform, without a negative ``std``.

``groups`` is the writer's index in the sorted list of writer ids, so the ``natural`` partitioner
with ``num_clients=100`` samples 100 writers uniformly (one client per writer).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pfl_core.data.datasets import DATASETS, DatasetNotFoundError
from pfl_core.data.federated import ArrayDataset

NUM_CLASSES = 62
SIDE = 28
#: folders searched under the data directory, in order (ours, then LEAF's own layout)
FOLDERS = (Path("femnist") / "train", Path("femnist") / "data" / "train")


def _not_found(data_dir: Path, reason: str) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"FEMNIST not found under {data_dir} (expected LEAF *.json files in "
        f"{data_dir / FOLDERS[0]}; {reason}); generate them with LEAF "
        "(github.com/TalwalkarLab/leaf, in data/femnist: "
        "./preprocess.sh -s niid --sf 1.0 -k 0 -t sample), copy data/femnist/data/train/*.json "
        "there, or set PFL_DATA_DIR / --data-dir"
    )


def _inverted(x: np.ndarray) -> np.ndarray:
    """LEAF floats in [0, 1] -> inverted uint8 ``255 - round(255 x)`` if exact, else float 1 - x."""
    levels = np.rint(x * 255.0)
    if x.size == 0 or (x.min() >= 0 and x.max() <= 1 and np.abs(levels / 255.0 - x).max() < 1e-6):
        return (255 - levels).astype(np.uint8)
    return (1.0 - x).astype(np.float32)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    """Concatenate inverted images; any float part turns the uint8 parts into floats in [0, 1]."""
    if all(part.dtype == np.uint8 for part in parts):
        return np.concatenate(parts)
    return np.concatenate(
        [p.astype(np.float32) / 255.0 if p.dtype == np.uint8 else p for p in parts]
    )


def _read_users(files: list[Path]) -> dict[str, tuple[list, list]]:
    """Writer id -> (image arrays, label arrays), converted file by file to keep memory low."""
    users: dict[str, tuple[list, list]] = {}
    for path in files:
        with open(path) as f:
            blob = json.load(f)
        for user, data in blob.pop("user_data").items():
            x = np.asarray(data["x"], dtype=np.float64).reshape(-1, 1, SIDE, SIDE)
            xs, ys = users.setdefault(str(user), ([], []))
            xs.append(_inverted(x))
            ys.append(np.asarray(data["y"], dtype=np.int64).reshape(-1))
        del blob
    return users


@DATASETS.register("femnist")
def femnist(data_dir: Path, split: str, download: bool) -> ArrayDataset:
    """LEAF FEMNIST (train JSON part), inverted images (N, 1, 28, 28), 62 classes, writer groups.

    Reads every ``*.json`` in ``<data_dir>/femnist/train/`` (or LEAF's ``femnist/data/train/``).
    Only the LEAF ``train`` part exists here: ``split`` must be ``train`` or ``all`` (both read it).
    """
    if split == "test":
        raise ValueError(
            "femnist: only LEAF's train JSON part is read (as the authors' code does); load "
            "split='train' and use per-client splits"
        )
    folder = next((data_dir / f for f in FOLDERS if (data_dir / f).is_dir()), None)
    if folder is None:
        raise _not_found(data_dir, "folder missing")
    files = sorted(folder.glob("*.json"))
    if not files:
        raise _not_found(data_dir, f"no *.json in {folder}")
    users = _read_users(files)
    writers = sorted(users)
    xs, ys, gs = [], [], []
    for gid, writer in enumerate(writers):
        x_parts, y_parts = users.pop(writer)
        x, y = _concat(x_parts), np.concatenate(y_parts)
        if len(x) != len(y):
            raise ValueError(f"femnist: writer {writer!r} has {len(x)} images but {len(y)} labels")
        xs.append(x)
        ys.append(y)
        gs.append(np.full(len(y), gid, dtype=np.int64))
    y = np.concatenate(ys)
    if y.size and (y.min() < 0 or y.max() >= NUM_CLASSES):
        raise ValueError(
            f"femnist: labels must lie in [0, {NUM_CLASSES}), got {y.min()}..{y.max()}"
        )
    images = torch.from_numpy(_concat(xs))
    storage = "uint8" if images.dtype == torch.uint8 else "float32"
    return ArrayDataset(
        name="femnist",
        x=images,
        y=torch.from_numpy(y),
        num_classes=NUM_CLASSES,
        groups=torch.from_numpy(np.concatenate(gs)),
        mean=(0.5,),
        std=(0.5,),
        description=(
            f"LEAF FEMNIST train JSON ({len(files)} files in {folder}): {len(writers)} writers, "
            f"{len(y)} images stored inverted as {storage}; batches are (0.5 - x)/0.5"
        ),
    )
