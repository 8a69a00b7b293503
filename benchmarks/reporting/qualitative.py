"""Qualitative figures drawn from the runs' post-run analyses (``evaluation.analyses``,
:mod:`pfl_core.analysis`): MetaVers Figure 2 (``metric.figure: tsne``) and Figure 3
(``metric.figure: dlg``). The paper's figures carry no numbers, so these are compared by eye; the
report says so.

* **t-SNE** (:func:`tsne_panels`): scikit-learn's ``TSNE`` of each cell's logged test embeddings
  (``embeddings.npz``), one panel per cell (the paper: Local, Only Triplet, Only CE, MetaVers on
  CINIC-10), dots coloured by class, the class centroids of the 2-D map as large points (the
  paper's Figure 2 legend).
* **DLG** (:func:`dlg_panels`): per cell the attacked image and its reconstruction
  (``dlg.npz``), with PSNR (dB) and SSIM against the original.

Each cell shows its run of the lowest finished seed; the Markdown lists every seed's numbers.
"""
from __future__ import annotations

import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from sklearn.manifold import TSNE  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from benchmarks.reporting.grid import panel_grid  # noqa: E402
from benchmarks.store.tracking import Tracker, read_npz_artifact  # noqa: E402

#: figure kind -> (the analysis artifact it reads, its run metrics, its title in the report)
KINDS = {
    "tsne": ("embeddings", ("embeddings_logged",), "t-SNE of test embeddings"),
    "dlg": ("dlg", ("dlg_psnr", "dlg_ssim"), "DLG reconstructions"),
}
QUALITATIVE_NOTE = ("Qualitative: the paper's figure prints no numbers, so there is no published value to "
                    "compare with; judge the panels by eye against the paper's figure.")


def stored_metric(value: float) -> float:
    """A metric as logged: MLflow stores +-inf (a perfect reconstruction's PSNR) as +-float max."""
    return math.copysign(math.inf, value) if abs(value) >= sys.float_info.max else value


def collect_panels(tracker: Tracker, runs: pd.DataFrame, kind: str) -> dict[str, dict]:
    """cell -> {seed, arrays (of the lowest finished seed), metrics: {seed: {name: value}}};
    cells whose runs logged no such artifact are left out."""
    artifact, names, _ = KINDS[kind]
    out = {}
    done = runs[runs["status"] == "FINISHED"].sort_values("seed")
    for cell, group in done.groupby("cell", sort=False):
        metrics, shown = {}, None
        for _, run in group.iterrows():
            logged = tracker.client.get_run(run["run_id"]).data.metrics
            metrics[int(run["seed"])] = {n: stored_metric(logged.get(n, math.nan)) for n in names}
            if shown is None:
                arrays = read_npz_artifact(tracker.client, run["run_id"], artifact)
                shown = None if arrays is None else (int(run["seed"]), arrays)
        if shown is not None:
            out[cell] = {"seed": shown[0], "arrays": shown[1], "metrics": metrics}
    return out


def tsne_map(embeddings: np.ndarray, seed: int = 0, perplexity: float = 30.0) -> np.ndarray:
    """scikit-learn's 2-D t-SNE (PCA initialisation); the perplexity is capped below the sample
    count, as TSNE requires. OpenMP runs one thread: with torch loaded, two OpenMP runtimes
    (torch's and scikit-learn's) contend and the Barnes-Hut gradient slows ~80x (measured on this
    project's 2-core machine: 58 s instead of 0.7 s for 45 points)."""
    n = len(embeddings)
    if n < 3:
        raise ValueError(f"t-SNE needs at least 3 embeddings, got {n}")
    with threadpool_limits(limits=1, user_api="openmp"):
        return TSNE(n_components=2, perplexity=min(perplexity, (n - 1) / 3), init="pca",
                    random_state=seed).fit_transform(np.asarray(embeddings, dtype=np.float64))


def tsne_panels(panels: dict[str, tuple[np.ndarray, np.ndarray]], title: str = "", seed: int = 0,
                perplexity: float = 30.0):
    """The t-SNE figure: one panel per entry ``name -> (embeddings [n, d], labels [n])``, dots
    coloured by class, class centroids of the map as large outlined points."""
    fig, axes = panel_grid(len(panels), 3.6, 3.4, max_cols=4, title_room=0.7)
    classes = sorted({int(c) for _, labels in panels.values() for c in np.asarray(labels)})
    colours = plt.get_cmap("tab10" if len(classes) <= 10 else "tab20")
    for k, (ax, (name, (emb, labels))) in enumerate(zip(axes, panels.items())):
        xy, labels = tsne_map(emb, seed, perplexity), np.asarray(labels)
        for j, c in enumerate(classes):
            mine = xy[labels == c]
            if len(mine):
                colour = colours(j % colours.N)
                ax.scatter(mine[:, 0], mine[:, 1], s=4, color=colour, alpha=0.6, label=str(c))
                ax.scatter(*mine.mean(0), s=140, color=colour, edgecolor="black", linewidth=1.2)
        ax.set_title(f"({chr(97 + k)}) {name}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[-1].legend(title="class", fontsize=6, title_fontsize=7, markerscale=2, loc="center left",
                    bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(title or "t-SNE of test embeddings (large points: class centroids)", fontsize=10)
    fig.tight_layout()
    return fig


def _image(chw: np.ndarray) -> np.ndarray:
    """[C, H, W] pixels -> an [H, W, C] (or [H, W]) array in [0, 1] for imshow."""
    image = np.clip(np.moveaxis(np.asarray(chw, dtype=np.float64), 0, -1), 0.0, 1.0)
    return image[..., 0] if image.shape[-1] == 1 else image


def dlg_panels(panels: dict[str, dict], title: str = ""):
    """The DLG figure: per entry ``name -> {original, reconstruction, psnr, ssim}`` a column with
    the attacked image above its reconstruction, PSNR and SSIM under it."""
    fig, axes = plt.subplots(2, len(panels), figsize=(2.6 * len(panels), 5.4), squeeze=False)
    for j, (name, panel) in enumerate(panels.items()):
        top, bottom = axes[0][j], axes[1][j]
        top.imshow(_image(panel["original"]), cmap="gray")
        top.set_title(f"{name}\noriginal", fontsize=8)
        bottom.imshow(_image(panel["reconstruction"]), cmap="gray")
        bottom.set_title(f"reconstruction\nPSNR {panel['psnr']:.2f} dB, SSIM {panel['ssim']:.3f}", fontsize=8)
        for ax in (top, bottom):
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(title or "DLG single-image reconstruction", fontsize=10)
    fig.tight_layout()
    return fig


def ordered_panels(report) -> list[tuple[str, dict]]:
    """(cell label, panel) in the suite grid's order, for the cells that have one."""
    from benchmarks.suite.spec import cell_id

    out = []
    for _, row in report.table.iterrows():
        cell = cell_id({a: row[a] for a in report.axes})
        if cell in report.panels:
            out.append(("/".join(str(row[a]) for a in report.axes), report.panels[cell]))
    return out


def qualitative_figure(report):
    """The suite's Figure 2/3 form (None when no run logged the arrays it needs)."""
    kind, panels = report.metric.figure, ordered_panels(report)
    if kind not in KINDS or not panels:
        return None
    title = f"{report.suite.key}: {KINDS[kind][2]} (qualitative; profile {report.profile})"
    if kind == "tsne":
        return tsne_panels({name: (p["arrays"]["embeddings"], p["arrays"]["labels"]) for name, p in panels}, title)
    return dlg_panels({name: {**p["arrays"], "psnr": p["metrics"][p["seed"]]["dlg_psnr"],
                              "ssim": p["metrics"][p["seed"]]["dlg_ssim"]} for name, p in panels}, title)


def markdown_lines(report) -> list[str]:
    """The figure section: the qualitative notice, the figure, and per cell what it shows."""
    kind = report.metric.figure
    if kind not in KINDS:
        return []
    lines = ["", f"## Figure: {KINDS[kind][2]}", "", f"**{QUALITATIVE_NOTE}**", ""]
    if not report.panels:
        return lines + ["No finished run logged the arrays this figure needs (evaluation.analyses)."]
    lines += [f"![{KINDS[kind][2]}]({report.suite.name}_figure.png)", ""]
    for name, panel in ordered_panels(report):
        if kind == "dlg":
            per_seed = ", ".join(f"seed {s}: PSNR {m['dlg_psnr']:.2f} dB, SSIM {m['dlg_ssim']:.3f}"
                                 for s, m in panel["metrics"].items())
            lines.append(f"- {name} (image of seed {panel['seed']} shown): {per_seed}")
        else:
            n = len(panel["arrays"]["labels"])
            classes = len(set(panel["arrays"]["labels"].tolist()))
            lines.append(f"- {name}: {n} test embeddings of {classes} classes (seed {panel['seed']})")
    return lines
