"""Meta-Dataset clients for CAFeMe (cafeme.md, "Meta-Dataset (8 sources, concept shift)").

Files under ``<data_dir>/metadataset/``; each source is read from the first of these that exists:

* ``records/<source>/<class_id>.tfrecords``: Meta-Dataset's converter output (one file per class,
  every record a ``tf.train.Example`` with features ``image`` (encoded bytes, JPEG as written by
  ``dataset_to_records.py``) and ``label`` (int64)). All class files are used; Meta-Dataset's
  train/valid/test class splits are ignored, as in the authors' code.
* ``folders/<source>/[train/]<class>/*.{jpg,jpeg,png,...}``: an ImageFolder (the authors read
  mini-ImageNet's 64 train classes and CIFAR-FS's 64 train classes this way, from a ``train``
  sub-folder, which is used when present).

Sources: omniglot, aircraft, cu_birds, dtd, traffic_sign, vgg_flower (normally records) and
mini_imagenet, cifar_fs (normally folders; the authors call them ``miniimagenet`` and ``cifar``).

Images become ``image_size`` x ``image_size`` RGB uint8 (PIL bilinear resize, as torchvision's
``Resize`` on a PIL image). Omniglot: grayscale replicated to 3 channels, then inverted (1 - v).
Decoding choice (logged in ``description``): records are decoded with PIL to **RGB**; the authors'
OpenCV ``imdecode`` gave BGR that was then treated as RGB (a channel permutation only).

Clients. The authors build clients by sampling (clients may share classes and even images), so the
loader builds them itself from ``client_seed`` and stores them one after another, with
``groups`` = client index: the ``natural`` partitioner with ``num_clients`` equal to the loader's
``num_clients`` recovers the clients exactly (one client per group, in order). Per client, from a
``numpy`` generator ``default_rng(client_seed)``: pick a source uniformly; pick
``classes_per_client`` of its classes without replacement; map them to labels 0..C-1 by a random
permutation; take ``min(n_c, images_per_class)`` images of each class without replacement (so an
Omniglot client, 20 images per character, has 200 images). The draws follow the authors' order but
use numpy instead of Python's ``random``, so the clients are not the authors' exact clients.
"""
from __future__ import annotations

import io
import struct
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from pfl_core.fields import PositiveInt
from pfl_core.data.datasets import DATASETS, DatasetNotFoundError
from pfl_core.data.federated import ArrayDataset

SOURCES = (
    "omniglot", "aircraft", "cu_birds", "dtd", "traffic_sign", "vgg_flower", "mini_imagenet",
    "cifar_fs",
)
FOLDER_SOURCES = ("mini_imagenet", "cifar_fs")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
RECORD_FEATURES = {"image": "byte", "label": "int"}


def _class_sort_key(name: str) -> tuple:
    return (0, int(name), name) if name.isdigit() else (1, 0, name)


def count_records(path: Path) -> int:
    """Number of records in a TFRecord file, from its framing only (length, crc, data, crc)."""
    count = 0
    with open(path, "rb") as f:
        while True:
            head = f.read(8)
            if not head:
                return count
            if len(head) < 8:
                raise ValueError(f"{path}: truncated TFRecord file")
            (length,) = struct.unpack("<Q", head)
            f.seek(4 + length + 4, io.SEEK_CUR)
            count += 1


def _convert(img: Image.Image, size: int, omniglot: bool) -> np.ndarray:
    """A decoded image as (3, size, size) uint8; Omniglot: gray, 3 channels, inverted."""
    if omniglot:
        gray = np.asarray(img.convert("L").resize((size, size), Image.BILINEAR))
        return np.repeat((255 - gray)[None], 3, axis=0)
    rgb = np.asarray(img.convert("RGB").resize((size, size), Image.BILINEAR))
    return rgb.transpose(2, 0, 1)


class _Source:
    """The classes of one source and lazy access to their images."""

    def __init__(self, name: str, root: Path, data_dir: Path):
        self.name = name
        records = root / "records" / name
        folder = root / "folders" / name
        self.kind = ""
        if records.is_dir() and any(records.glob("*.tfrecords")):
            self.kind = "records"
            files = {p.stem: p for p in records.glob("*.tfrecords")}
            self.classes = sorted(files, key=_class_sort_key)
            self.files = [files[c] for c in self.classes]
            self.location = records
        elif folder.is_dir():
            self.kind = "folder"
            base = folder / "train" if (folder / "train").is_dir() else folder
            dirs = sorted(d for d in base.iterdir() if d.is_dir())
            self.classes = [d.name for d in dirs]
            self.images = [
                sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS) for d in dirs
            ]
            self.location = base
        if not self.kind or not self.classes:
            raise DatasetNotFoundError(
                f"Meta-Dataset source {name!r} not found under {data_dir} (expected "
                f"{records}/<class>.tfrecords or {folder}/<class>/*.jpg|png); convert it with "
                "google-research/meta-dataset (dataset_conversion) or copy the class folders "
                "there, narrow data.params.sources, or set PFL_DATA_DIR / --data-dir"
            )
        self._counts: dict[int, int] = {}

    def count(self, c: int) -> int:
        if c not in self._counts:
            self._counts[c] = (
                count_records(self.files[c]) if self.kind == "records" else len(self.images[c])
            )
        return self._counts[c]

    def load(self, c: int, wanted: set[int], size: int) -> dict[int, np.ndarray]:
        """Images ``wanted`` (record/file positions) of class ``c``, converted."""
        omniglot = self.name == "omniglot"
        out: dict[int, np.ndarray] = {}
        if self.kind == "folder":
            for i in sorted(wanted):
                with Image.open(self.images[c][i]) as img:
                    out[i] = _convert(img, size, omniglot)
            return out
        from tfrecord.reader import example_loader  # only needed for record sources

        for i, example in enumerate(example_loader(str(self.files[c]), None, RECORD_FEATURES)):
            if i in wanted:
                with Image.open(io.BytesIO(example["image"])) as img:
                    out[i] = _convert(img, size, omniglot)
        return out


@DATASETS.register("metadataset")
def metadataset(
    data_dir: Path,
    split: str,
    download: bool,
    num_clients: PositiveInt = 100,
    images_per_class: PositiveInt = 60,
    classes_per_client: PositiveInt = 10,
    sources: Sequence[str] = SOURCES,
    client_seed: int = 0,
    image_size: int = 32,
) -> ArrayDataset:
    """CAFeMe's Meta-Dataset clients, stored one after another; ``groups`` = client index.

    uint8 (N, 3, image_size, image_size), labels 0..classes_per_client-1 per client (see the module
    docstring). Use ``data.partition: {name: natural}`` with the same ``num_clients``. ``sources``
    is a list of source names or one comma-separated string.
    """
    if split == "test":
        raise ValueError("metadataset: the clients are built from all classes; load split='train'")
    if isinstance(sources, str):  # "omniglot,aircraft": hashable, for cached loader params
        sources = [part.strip() for part in sources.split(",") if part.strip()]
    sources = list(sources)
    unknown = [s for s in sources if s not in SOURCES]
    if unknown or not sources:
        raise ValueError(f"metadataset: unknown sources {unknown}; allowed: {', '.join(SOURCES)}")
    if num_clients < 1 or images_per_class < 1 or classes_per_client < 1:
        raise ValueError(
            "metadataset: num_clients, images_per_class and classes_per_client must be >= 1"
        )
    root = data_dir / "metadataset"
    readers = [_Source(name, root, data_dir) for name in sources]
    for reader in readers:
        if len(reader.classes) < classes_per_client:
            raise ValueError(
                f"metadataset: source {reader.name!r} has {len(reader.classes)} classes in "
                f"{reader.location}, fewer than classes_per_client={classes_per_client}"
            )

    # Plan every client first (source, class, label, image positions), then decode each class once.
    rng = np.random.default_rng(client_seed)
    plan: list[tuple[int, list[tuple[int, int, np.ndarray]]]] = []
    for _ in range(num_clients):
        s = int(rng.integers(len(readers)))
        reader = readers[s]
        chosen = rng.choice(len(reader.classes), size=classes_per_client, replace=False)
        labels = rng.permutation(classes_per_client)
        blocks = []
        for c, label in zip(chosen.tolist(), labels.tolist()):
            n_c = reader.count(c)
            picks = rng.choice(n_c, size=min(n_c, images_per_class), replace=False)
            blocks.append((c, label, picks))
        plan.append((s, blocks))

    wanted: dict[tuple[int, int], set[int]] = {}
    for s, blocks in plan:
        for c, _, picks in blocks:
            wanted.setdefault((s, c), set()).update(picks.tolist())
    decoded = {
        key: readers[key[0]].load(key[1], positions, image_size)
        for key, positions in sorted(wanted.items())
    }

    xs, ys, gs = [], [], []
    for cid, (s, blocks) in enumerate(plan):
        for c, label, picks in blocks:
            images = decoded[(s, c)]
            xs.extend(images[i] for i in picks.tolist())
            ys.extend([label] * len(picks))
            gs.extend([cid] * len(picks))
    per_source = Counter(readers[s].name for s, _ in plan)
    kinds = ", ".join(f"{r.name}:{r.kind}" for r in readers)
    return ArrayDataset(
        name="metadataset",
        x=torch.from_numpy(np.stack(xs)),
        y=torch.tensor(ys, dtype=torch.int64),
        num_classes=classes_per_client,
        groups=torch.tensor(gs, dtype=torch.int64),
        description=(
            f"Meta-Dataset clients under {root} ({kinds}): {num_clients} clients x "
            f"{classes_per_client} classes x <= {images_per_class} images, client_seed "
            f"{client_seed}, {image_size}x{image_size} RGB (records decoded to RGB with PIL, not "
            f"OpenCV's BGR); clients per source {dict(sorted(per_source.items()))}"
        ),
    )
