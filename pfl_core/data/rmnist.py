"""Rotated MNIST (cafeme.md, "RMNIST") and the ``group_split`` partitioner that gives its clients.

Design (why the rotation lives in the dataset and the clients in a partitioner)
-------------------------------------------------------------------------------
The authors build RMNIST in one step: shuffle ``arange(60000)``, cut 10 chunks of 6,000, rotate
chunk k by 20·k degrees, and cut chunk k into clients 10k..10k+9. Shards/Dirichlet on RMNIST then
re-partition the *already rotated* 60,000 images by MNIST label, each image keeping the rotation of
the chunk it fell in. Pixels are therefore a property of the dataset, not of the partition, and a
partition must stay a pure function of (labels or groups, num_clients, params, partition RNG).

So the work is split in two:

* The **dataset** ``rmnist`` does the seeded shuffle and the rotation. Its RNG is the loader
  parameter ``rotation_seed`` (the loader gets no run seed): ``default_rng(rotation_seed)
  .permutation(N)`` is cut into ``num_groups`` near-equal chunks (``np.array_split``: 6,000 each
  for MNIST train), chunk k is rotated by ``angle_step * k`` degrees, and ``groups[i]`` is the chunk
  (rotation group) of image i. Images keep their MNIST order, so labels are MNIST's labels.
* The **partition** is chosen in the suite:

  - CAFeMe's "None" partition is ``group_split``: each group is shuffled with the partition RNG
    and cut into ``num_clients / num_groups`` equal clients, groups in sorted order, so clients
    ``m*g .. m*g+m-1`` all hold images of rotation group g (600 each for 100 clients);
  - Shards/Dirichlet are the ordinary ``shards``/``dirichlet`` partitioners on the MNIST labels of
    the rotated images: every image keeps its rotation.

Do **not** use ``rotation_groups`` on ``rmnist``: it re-shuffles with the partition RNG and ignores
``groups``, so its "groups" would not match the rotations.

Seeding deviation: in the authors' code the image-to-rotation assignment changes with the run seed;
here it is fixed by ``rotation_seed`` (default 0) for every run seed of a cell, while the client
split within each group (``group_split``) and Shards/Dirichlet follow the run's partition stream.
A suite that wants the authors' per-seed variation sets ``data.params.rotation_seed`` per run.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pfl_core.fields import NonNegativeInt, PositiveInt
from pfl_core.data.datasets import DATASETS, mnist
from pfl_core.data.federated import ArrayDataset
from pfl_core.data.partitions import PARTITIONERS


def rotation_chunks(n: int, num_groups: int, rotation_seed: int) -> list[np.ndarray]:
    """The rotation groups of ``n`` images: a seeded permutation cut into ``num_groups`` chunks."""
    return np.array_split(np.random.default_rng(rotation_seed).permutation(n), num_groups)


def rotate_images(x: torch.Tensor, angle: float) -> torch.Tensor:
    """``torchvision`` rotate of uint8 (N, C, H, W) images: nearest, no expand, zero fill,
    positive = counter-clockwise, about the image centre."""
    if angle == 0:
        return x.clone()
    from torchvision.transforms.functional import InterpolationMode, rotate  # lazy: see datasets.py

    return rotate(x, float(angle), interpolation=InterpolationMode.NEAREST, expand=False, fill=None)


@DATASETS.register("rmnist")
def rmnist(
    data_dir: Path,
    split: str,
    download: bool,
    num_groups: PositiveInt = 10,
    angle_step: float = 20.0,
    rotation_seed: NonNegativeInt = 0,
) -> ArrayDataset:
    """Rotated MNIST: MNIST ``split`` (the CAFeMe suites use ``train``), uint8 (N, 1, 28, 28), 10
    classes.

    Image i is rotated by ``angle_step * groups[i]`` degrees, where ``groups`` is the chunk of a
    ``rotation_seed``-seeded permutation it fell in (``num_groups`` chunks; see the module
    docstring). Pixels scale to [0, 1] with no normalisation.
    """
    if num_groups < 1:
        raise ValueError(f"rmnist: num_groups must be >= 1, got {num_groups}")
    base = mnist(data_dir, split, download)
    x = base.x.clone()
    groups = torch.empty(len(base), dtype=torch.int64)
    for k, chunk in enumerate(rotation_chunks(len(base), num_groups, rotation_seed)):
        idx = torch.as_tensor(chunk, dtype=torch.int64)
        x[idx] = rotate_images(base.x[idx], angle_step * k)
        groups[idx] = k
    angles = ", ".join(f"{angle_step * k:g}" for k in range(num_groups))
    return ArrayDataset(
        name="rmnist",
        x=x,
        y=base.y,
        num_classes=base.num_classes,
        groups=groups,
        description=(
            f"Rotated MNIST {split} split: {num_groups} groups from permutation seed "
            f"{rotation_seed}, rotated by {angles} degrees (nearest, no expand; MNIST files "
            f"under {data_dir})"
        ),
    )


@PARTITIONERS.register("group_split")
def group_split(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, groups: np.ndarray
) -> list[np.ndarray]:
    """Split every natural group into ``num_clients / num_groups`` equal clients (RMNIST "None").

    Groups are taken in sorted id order; each group's indices are shuffled with ``rng`` and cut
    into m = num_clients / num_groups near-equal parts (``np.array_split``), so clients
    ``g*m .. g*m+m-1`` hold only group g. On ``rmnist`` this is the CAFeMe suites' default
    partition.
    """
    groups = np.asarray(groups)
    if len(groups) != len(labels):
        raise ValueError(f"group_split: {len(groups)} group ids for {len(labels)} samples")
    ids = np.unique(groups)
    if num_clients % len(ids):
        raise ValueError(
            f"group_split: num_clients={num_clients} is not divisible by the {len(ids)} groups"
        )
    per_group = num_clients // len(ids)
    parts = []
    for g in ids:
        members = rng.permutation(np.flatnonzero(groups == g))
        parts.extend(np.array_split(members, per_group))
    return [np.asarray(p, dtype=np.int64) for p in parts]
