"""Atomic files (issue 29, item 4): every file the harness writes for a user (reports, figures,
PDFs, checkpoints, tuned values) is written under a temporary name in its own directory, flushed
to disk, then renamed over the target with ``os.replace`` (atomic on POSIX within one file
system). A kill at any point leaves either the old file or the new one, never a truncated one;
an error removes the temporary file. A write also removes the temporary files of earlier writes of
the same target whose process is gone (killed mid-write, issue 38): :func:`remove_stale`."""
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
    remove_stale(path)
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


def _alive(pid: int) -> bool:
    """Does process ``pid`` exist on this machine?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):  # not a process id at all
        return False
    return True


def remove_stale(path: str | Path) -> list[Path]:
    """Delete the temporary files of :func:`atomic_path` for ``path`` (``.<stem>.<pid>.tmp<suffix>``
    beside it) whose process no longer exists on this machine; return them. Another live writer's
    file is kept (a writer on another machine sharing the folder is not seen from here)."""
    path = Path(path)
    prefix, suffix = f".{path.stem}.", f".tmp{path.suffix}"
    removed = []
    try:
        names = os.listdir(path.parent)
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for name in names:
        pid = name[len(prefix):-len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else ""
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            (path.parent / name).unlink()
            removed.append(path.parent / name)
    return removed


def write_text(path: str | Path, text: str) -> Path:
    """``Path(path).write_text(text)``, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)
