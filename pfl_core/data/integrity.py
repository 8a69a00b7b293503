"""Values a dataset file may not hold (issue 29, item 2): labels outside the class range, and
image and label counts that disagree. Checked right after a loader reads its files, so a damaged
file fails in one line naming it, not deep in training (``IndexError: Target 160 is out of
bounds``)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pfl_core.data.idx import DatasetFileError

_FIX = "replace it with the file of the original archive, or delete it to download again"


def check_labels(labels, num_classes: int, n_images: int, source: Path | str) -> None:
    """Raise :class:`DatasetFileError` naming ``source`` when ``labels`` has a value outside
    ``[0, num_classes)`` or a length other than ``n_images``."""
    y = np.asarray(labels).reshape(-1)
    if len(y) != n_images:
        raise DatasetFileError(f"{source}: {len(y)} labels for {n_images} images; {_FIX}")
    bad = (y < 0) | (y >= num_classes)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise DatasetFileError(f"{source}: label {int(y[first])} of item {first} is outside the {num_classes} "
                               f"classes (0..{num_classes - 1}; {int(bad.sum())} such labels); {_FIX}")
