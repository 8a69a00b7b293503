"""CIFAR-10/100 python pickles: checked, then read (issue 37, items 1 and 2).

Before reading, :func:`verify_cifar` looks at the folder (``cifar-10-batches-py`` or
``cifar-100-python``) and tells apart the three ways it can fail, each with its own one-line error
naming the path and the fix (:mod:`pfl_core.data.errors`): no file (not found), some files (partial:
which are missing), every file but one failing its md5 (checksum failed: which file).

A copy whose md5s are not torchvision's loads in two cases only, both recorded as the dataset's
``provenance`` (run info ``data_provenance``, the run's tag and every report built from it):

* its md5s equal those of a known copy in :data:`KNOWN_COPIES` (the CIFAR-10 reconstruction);
* the switch :data:`ACCEPT_ENV` names the dataset (any copy, accepted knowingly, unverified).

The official archive loads as before (its provenance is empty). The pickles are then read as
torchvision's ``CIFAR10``/``CIFAR100`` read them (``pickle.load(encoding="latin1")``, rows of 3072
CHW bytes, HWC out); torchvision is used only to download, and for its md5 lists.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pfl_core.data.errors import DatasetChecksumError, DatasetFileError, DatasetPartialError, not_found

ACCEPT_ENV = "PFL_ACCEPT_MD5_MISMATCH"
"""Env switch: comma-separated dataset names (``cifar10``, ``cifar100``) whose files load although
they fail torchvision's md5 check; each run that uses them records it. Unset: such files fail."""


@dataclass(frozen=True)
class KnownCopy:
    """A copy of a dataset that is not the official archive but is known file by file."""

    name: str
    """Short id, recorded in every run that used the copy."""
    md5: dict
    """File name -> md5 of every file of the copy's folder."""
    note: str
    """One line: how the copy differs from the official archive."""


CIFAR10_RECONSTRUCTION = KnownCopy(
    name="cifar10-reconstruction-121-filled",
    md5={
        "data_batch_1": "ecbc6677546142b588821a7ca64c3f58",
        "data_batch_2": "061f3bd52ad13e030ecc0be36eecaf23",
        "data_batch_3": "31ed6d445a89ff7c9e7bd645f0138d5e",
        "data_batch_4": "ec0bb25d458c75bb894bf380d5da99cb",
        "data_batch_5": "dc326a0f9fddc6caaf23a85ffb001109",
        "test_batch": "acc8af15a5071d62ddb80673f8da4ff2",
        "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
    },
    note=("not the official archive: 121 of 60,000 images (96 train, 25 test) are copies of other "
          "same-class images, the rest pixel-exact, labels official"),
)
"""A reconstruction of CIFAR-10 in torchvision's ``cifar-10-batches-py`` layout (batches without the
``filenames`` key). Source of the md5s: the reconstruction's own manifest (``RECONSTRUCTION.json``,
``checks.md5_written``, shipped beside its files), equal to ``md5sum`` of the files; ``batches.meta``
is the official file (torchvision's md5). Source of the note: the same manifest (``images_exact``
59,879 of ``images_total`` 60,000; its ``missing`` list: 96 train and 25 test slots, each
``filled_with`` an image of the same class and split)."""

KNOWN_COPIES: dict[str, tuple[KnownCopy, ...]] = {"cifar10": (CIFAR10_RECONSTRUCTION,)}
"""Dataset name -> the known copies that load without :data:`ACCEPT_ENV`."""

_MD5_CACHE: dict[tuple[str, int, int], str] = {}


def file_md5(path: Path) -> str:
    """md5 of ``path``, cached per (path, size, mtime) for this process (train and test loads of one
    run check the same files)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _MD5_CACHE:
        digest = hashlib.md5()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _MD5_CACHE[key] = digest.hexdigest()
    return _MD5_CACHE[key]


def official_md5(cls: type) -> dict[str, str]:
    """File name -> md5 of the official archive, as torchvision's class ``cls`` lists them
    (``train_list``, ``test_list``, ``meta``): read at call time, so a test may patch them."""
    return {**{f: m for f, m in [*cls.train_list, *cls.test_list]}, cls.meta["filename"]: cls.meta["md5"]}


def accepted() -> set[str]:
    """The dataset names :data:`ACCEPT_ENV` lists."""
    return {n.strip().lower() for n in os.environ.get(ACCEPT_ENV, "").split(",") if n.strip()}


def verify_cifar(name: str, title: str, cls: type, data_dir: Path, download: bool) -> str:
    """Check the folder of ``cls`` under ``data_dir`` (downloading it when no file is there and
    ``download``); return its provenance: "" for the official archive, else one line saying which
    copy it is. Raises the not-found, partial or checksum error (:mod:`pfl_core.data.errors`)."""
    folder = data_dir / cls.base_folder
    official = official_md5(cls)
    present = [f for f in official if (folder / f).is_file()]
    if not present:
        if not download:
            raise not_found(title, data_dir, folder)
        try:
            cls(data_dir, train=True, download=True)
        except Exception as err:  # offline machine, unreachable mirror, corrupt archive
            raise not_found(title, data_dir, folder, f"download failed: {err}", download=True) from err
        present = [f for f in official if (folder / f).is_file()]
    missing = [f for f in official if f not in present]
    if missing:
        raise DatasetPartialError(
            f"{title} partial under {folder}: {len(present)} of {len(official)} files there, missing "
            f"{', '.join(missing)}; copy the missing files of the same copy there, or delete the folder "
            f"and allow downloads (PFL_DOWNLOAD=1) to get the official archive")
    actual = {f: file_md5(folder / f) for f in official}
    if actual == official:
        return ""
    for copy in KNOWN_COPIES.get(name, ()):
        if actual == copy.md5:
            return f"{title} is {copy.name} (md5 manifest matched), {copy.note}"
    failing = [f for f in official if actual[f] != official[f]]
    if name in accepted():
        return (f"{title} failed torchvision's md5 check ({', '.join(failing)}) and was accepted by "
                f"{ACCEPT_ENV}={name}: an unverified copy, not the official archive")
    first = failing[0]
    raise DatasetChecksumError(
        f"{title} checksum failed for {folder / first} (md5 {actual[first]}, the official archive's is "
        f"{official[first]}; {len(failing)} of {len(official)} files differ: {', '.join(failing)}); replace "
        f"the files with the official archive's, or use this copy knowingly: {ACCEPT_ENV}={name}")


@dataclass
class CifarPart:
    """One split read from the pickles, shaped as torchvision's dataset object."""

    data: np.ndarray
    """(N, 32, 32, 3) uint8, HWC."""
    targets: list
    classes: list


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
    except Exception as err:
        raise DatasetFileError(f"{path}: not a CIFAR python pickle ({type(err).__name__}: {err}); replace it "
                               f"with the file of the official archive") from None
    if not isinstance(entry, dict):
        raise DatasetFileError(f"{path}: a pickled {type(entry).__name__}, not the dict of a CIFAR batch")
    return entry


def read_cifar(cls: type, data_dir: Path, train: bool) -> CifarPart:
    """The train or test split of the (verified) folder of ``cls``, read as torchvision reads it."""
    folder = data_dir / cls.base_folder
    data, targets = [], []
    for filename, _ in cls.train_list if train else cls.test_list:
        entry = _unpickle(folder / filename)
        key = "labels" if "labels" in entry else "fine_labels"
        if "data" not in entry or key not in entry:
            raise DatasetFileError(f"{folder / filename}: no 'data' / '{key}' key (keys: {sorted(entry)}); replace "
                                   f"it with the file of the official archive")
        data.append(np.asarray(entry["data"], dtype=np.uint8))
        targets.extend(entry[key])
    images = np.vstack(data)
    if images.size % 3072:
        raise DatasetFileError(f"{folder}: {images.size} bytes of pixels are not whole 3x32x32 images")
    meta = _unpickle(folder / cls.meta["filename"])
    if cls.meta["key"] not in meta:
        raise DatasetFileError(f"{folder / cls.meta['filename']}: no {cls.meta['key']!r} key")
    return CifarPart(images.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), targets, list(meta[cls.meta["key"]]))
