"""Integrity checks of MNIST-like idx files, before torchvision reads them (issue 15, item 8).

torchvision reports a truncated or missing file as "Dataset not found" and a wrong magic number as
a bare ``AssertionError``; :func:`check_idx_folder` reads each file's header instead and raises a
:class:`DatasetFileError` whose one line names the file, the problem and the fix.
"""
from __future__ import annotations

from pathlib import Path

#: idx magic numbers of unsigned-byte files: 0x0801 labels (1 dimension), 0x0803 images (3)
IDX_MAGIC = {"labels": 0x00000801, "images": 0x00000803}
IDX_DIMS = {"labels": 1, "images": 3}
_FIX = "replace it with the uncompressed file of the original archive, or delete it to download again"


class DatasetFileError(ValueError):
    """A dataset file exists but is damaged (truncated, wrong format, inconsistent with its pair)."""


def _error(path: Path, problem: str) -> DatasetFileError:
    return DatasetFileError(f"{path}: {problem}; {_FIX}")


def idx_count(path: Path, kind: str) -> int:
    """The number of items of idx file ``path`` (``kind`` images or labels), after checking its
    magic number and that its size matches the dimensions in its header."""
    data_size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(4)
        if len(head) < 4:
            raise _error(path, f"truncated: {data_size} bytes, shorter than an idx header")
        magic = int.from_bytes(head, "big")
        if head[:2] == b"\x1f\x8b":
            raise _error(path, "a gzip archive under the name of the uncompressed idx file (gunzip it)")
        if magic != IDX_MAGIC[kind]:
            raise _error(path, f"wrong magic number 0x{magic:08x} (expected 0x{IDX_MAGIC[kind]:08x} "
                               f"for an idx {kind} file)")
        ndim = IDX_DIMS[kind]
        dims_bytes = handle.read(4 * ndim)
    header = 4 + 4 * ndim
    if len(dims_bytes) < 4 * ndim:
        raise _error(path, f"truncated: {data_size} bytes, shorter than its {header}-byte header")
    dims = [int.from_bytes(dims_bytes[4 * i:4 * i + 4], "big") for i in range(ndim)]
    body = 1
    for d in dims:
        body *= d
    expected = header + body
    shape = "x".join(map(str, dims))
    if data_size < expected:
        raise _error(path, f"truncated: {data_size} bytes, its header announces {shape} "
                           f"({expected} bytes)")
    if data_size > expected:
        raise _error(path, f"{data_size - expected} bytes beyond the {shape} its header announces")
    return dims[0]


def check_idx_folder(title: str, raw: Path, stems: list[str]) -> None:
    """Check the image and label idx files ``raw/<stem>-{images-idx3,labels-idx1}-ubyte`` of every
    stem. Nothing there at all passes (the caller reports the dataset as not found, or downloads
    it); a missing member of the set, a damaged file or disagreeing counts raise
    :class:`DatasetFileError`."""
    pairs = [(raw / f"{stem}-images-idx3-ubyte", raw / f"{stem}-labels-idx1-ubyte") for stem in stems]
    files = [path for pair in pairs for path in pair]
    present = [path for path in files if path.exists()]
    if not present:
        return
    for path in files:
        if not path.exists():
            raise DatasetFileError(f"{path}: missing ({title} needs {', '.join(p.name for p in files)} "
                                   f"in {raw}); copy it from the original archive (uncompressed), or "
                                   f"delete the folder to download everything again")
    for images, labels in pairs:
        n_images, n_labels = idx_count(images, "images"), idx_count(labels, "labels")
        if n_images != n_labels:
            raise _error(labels, f"{n_labels} labels for the {n_images} images of {images.name}")
