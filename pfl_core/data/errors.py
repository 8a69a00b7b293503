"""The data errors a loader raises, one class per fix (issue 37, item 2).

* :class:`DatasetNotFoundError`: no file of the dataset under the data directory (and none
  downloaded): point ``PFL_DATA_DIR`` / ``--data-dir`` at the files or allow downloads.
* :class:`DatasetPartialError` (a :class:`DatasetNotFoundError`): some of the dataset's files are
  there, others are not: copy the missing ones (named) or delete the folder to download it again.
* :class:`DatasetChecksumError` (a :class:`~pfl_core.data.idx.DatasetFileError`): every file is
  there but one fails its md5 check (named): replace it, or accept the copy knowingly with the
  switch the message names (:data:`pfl_core.data.cifar_files.ACCEPT_ENV`).

Each message is one line naming the path and the fix.
"""
from __future__ import annotations

from pfl_core.data.idx import DatasetFileError


class DatasetNotFoundError(FileNotFoundError):
    """The dataset files are not under the data directory (and were not downloaded)."""


class DatasetPartialError(DatasetNotFoundError):
    """Some of the dataset's files are under the data directory, others are missing."""


class DatasetChecksumError(DatasetFileError):
    """Every file of the dataset is there, but at least one fails its md5 check."""


def not_found(title: str, data_dir, expected, reason: str = "", download: bool = False) -> DatasetNotFoundError:
    """The one-line "not found" error: the dataset, the directory searched, the path expected and
    the fix (``reason``: why a download did not help, e.g. ``download failed: ...``)."""
    why = f" ({' '.join(reason.split())})" if reason else ""
    fix = ("or download it on a machine with internet and copy the torchvision layout there" if download
           else "or allow downloads (PFL_DOWNLOAD=1) on a machine with internet")
    return DatasetNotFoundError(
        f"{title} not found under {data_dir} (expected {expected}){why}; set PFL_DATA_DIR / --data-dir to "
        f"the folder that holds it, {fix}"
    )


__all__ = ["DatasetChecksumError", "DatasetFileError", "DatasetNotFoundError", "DatasetPartialError", "not_found"]
