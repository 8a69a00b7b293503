"""Faults of a SQLite store found before MLflow opens it (issue 29, item 3), each a one-line
:class:`~benchmarks.store.location.StoreError` naming the store, the fault and the fix: a folder on the
way that is a file, a database that is a directory or not a SQLite file (corrupt, truncated,
overwritten), and a read-only database or folder (SQLite writes a journal beside the file)."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import stat
from pathlib import Path

from benchmarks.store.location import StoreError

SQLITE_HEADER = b"SQLite format 3\x00"
"""The first 16 bytes of every SQLite 3 database file (sqlite.org/fileformat.html, 1.3)."""
_FIX = "use another --tracking-uri (e.g. sqlite:///results/mlflow.db)"


def _read_only(path: Path) -> bool:
    """No write permission for this user, or every write bit cleared (a store made read-only on
    purpose, which even root is not to write into)."""
    return not os.access(path, os.W_OK) or not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)


def check_sqlite_store(db: Path) -> None:
    """Raise :class:`StoreError` when SQLite database ``db`` cannot serve as a store."""
    where = f"store {db}"
    for parent in [*reversed(db.parents)]:
        if parent.exists() and not parent.is_dir():
            raise StoreError(f"{where}: {parent} is a file, not a folder; move it or {_FIX}")
    if db.is_dir():
        raise StoreError(f"{where}: is a directory, not a database file; {_FIX}")
    folder = next((p for p in [db.parent, *db.parents] if p.exists()), None)
    if folder is not None and _read_only(folder):
        raise StoreError(f"{where}: folder {folder} is read-only (SQLite writes its journal there); make it "
                         f"writable (chmod u+w) or {_FIX}")
    if not db.exists() or db.stat().st_size == 0:
        return
    if _read_only(db):
        raise StoreError(f"{where}: the database file is read-only; make it writable (chmod u+w) or {_FIX}")
    with db.open("rb") as handle:
        head = handle.read(len(SQLITE_HEADER))
    if head != SQLITE_HEADER:
        raise StoreError(f"{where}: not a SQLite database (corrupt or overwritten: its header is {head[:8]!r}); "
                         f"restore it from a backup, move it away to start a new store, or {_FIX}")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as err:
        raise StoreError(f"{where}: damaged SQLite database ({err}); restore it from a backup, move it away "
                         f"to start a new store, or {_FIX}") from None


def disk_full(err: BaseException) -> bool:
    """A write that failed for lack of space: ``OSError`` ENOSPC (artifacts, checkpoints, reports)
    or SQLite's "database or disk is full" (sqlite.org/rescode.html, SQLITE_FULL) as MLflow wraps it."""
    return (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "database or disk is full" in str(err)


def disk_full_message(err: BaseException) -> str:
    """The one-line answer to a full disk: what failed, what was marked, the fix."""
    where = getattr(err, "filename", None) or "the store"
    return (f"no space left on device writing {where}; the runs in progress were marked FAILED "
            f"(or are marked at the next start); free space, or use another --tracking-uri or --out, "
            f"then run the same command again")


class _QuietDiskFull(logging.Filter):
    """Drops a log record about a full disk: the caller answers it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return not (disk_full(err) if err is not None else "database or disk is full" in record.getMessage())


QUIET_LOGGERS = ("mlflow.store.db.utils",)
"""MLflow logs a SQLAlchemy error with its SQL and traceback before raising it (``... (Background
on this error at: https://sqlalche.me/...)``); a full disk is answered by ``pflbench``'s one line."""


def quiet_disk_full_logs() -> None:
    """Keep a full disk out of MLflow's error log (idempotent)."""
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietDiskFull) for f in logger.filters):
            logger.addFilter(_QuietDiskFull())
