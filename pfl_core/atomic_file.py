"""Atomic files (issue 29, item 4): every file the harness writes for a user (reports, figures,
PDFs, checkpoints, tuned values) is written under a temporary name in its own directory, flushed
to disk, then renamed over the target with ``os.replace`` (atomic on POSIX within one file
system). A kill at any point leaves either the old file or the new one, never a truncated one;
an error removes the temporary file."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffix, so writers that infer the format from it
    still do); on a clean exit it is synced and renamed to ``path``, on an error deleted."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_text(path: str | Path, text: str) -> Path:
    """``Path(path).write_text(text)``, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)
