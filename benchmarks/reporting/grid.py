"""A grid of equal figure panels, shared by the report's figures (bars, t-SNE)."""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def panel_grid(n: int, width: float, height: float, max_cols: int, title_room: float):
    """(figure, the first ``n`` axes) of a grid of at most ``max_cols`` columns of ``width`` x
    ``height`` inch panels, ``title_room`` inches above for the title; unused cells hidden."""
    ncols = min(n, max_cols)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows + title_room), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])
