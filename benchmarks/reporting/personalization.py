"""FedL2P's meta-net figures and Table 6 in the report, drawn from the per-client arrays that the
``finetune_pretrained`` protocol logs with each run (``personalization.npz``: ``beta`` [clients, BN
layers], ``eta`` [clients, parameter tensors], ``xi`` [clients, BN layers], ``x`` [clients, 2 x
modules], ``group`` [clients]; :mod:`pfl_core.analysis.personalization` computes from them).

``metric.figure`` of a suite picks the form (docs/papers/fedl2p.md):

* ``ari`` (Table 6): per cell and clustered quantity, the Adjusted Rand Index between the clients'
  domains and the spectral clusters of that quantity, mean ± the suite's spread over seeds, beside
  the paper's value (the suite's ``published_quantities``); a bar figure of both;
* ``hyperparameters`` (Figures 2 and 4): per cell, box plots over clients of beta per BN layer and
  eta per parameter tensor, and the clients' sparsity (share of learning rates exactly 0);
* ``cluster_map`` (Figure 3: beta, eta) and ``cluster_map_all`` (Figure 5: xi, beta, x, eta): per cell
  the domains' log-normalised distance map of each quantity.

The figures show the run of the lowest finished seed of each cell; Table 6 uses every seed.
"""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from benchmarks.reporting.grid import panel_grid  # noqa: E402
from benchmarks.reporting.stats import spread  # noqa: E402
from benchmarks.store.tracking import Tracker, read_npz_artifact  # noqa: E402
from pfl_core.analysis.personalization import (cluster_distance_map, layer_distribution, lr_sparsity,  # noqa: E402
                                               spectral_ari)

ARTIFACT = "personalization"
"""The run artifact (``personalization.npz``) the ``finetune_pretrained`` protocol logs."""
QUANTITIES = {"xi": "BNNet input ξ", "beta": "BNNet output β", "x": "LRNet input x", "eta": "LRNet output η"}
KINDS = {
    "ari": ("ARI of spectral clusters vs domains", ("xi", "beta", "x", "eta")),
    "hyperparameters": ("learned β and η per layer, sparsity", ("beta", "eta")),
    "cluster_map": ("cluster distance maps of β and η", ("beta", "eta")),
    "cluster_map_all": ("cluster distance maps of ξ, β, x and η", ("xi", "beta", "x", "eta")),
}
CELLS_PER_FIGURE = 4
"""Cells (rows of panels) per figure: a PDF page holds one figure."""


def collect(tracker: Tracker, runs: pd.DataFrame) -> dict[str, dict[int, dict]]:
    """cell -> {seed: arrays} of every finished run that logged ``personalization.npz``."""
    out: dict[str, dict[int, dict]] = {}
    done = runs[runs["status"] == "FINISHED"].sort_values("seed")
    for _, run in done.iterrows():
        arrays = read_npz_artifact(tracker.client, run["run_id"], ARTIFACT)
        if arrays is not None:
            out.setdefault(run["cell"], {})[int(run["seed"])] = arrays
    return out


def ordered(report) -> list[tuple[str, str, dict[int, dict]]]:
    """(cell id, cell label, {seed: arrays}) in the suite grid's order, for cells with arrays."""
    from benchmarks.suite.spec import cell_id

    out = []
    for _, row in report.table.iterrows():
        cell = cell_id({a: row[a] for a in report.axes})
        if cell in report.panels:
            out.append((cell, " / ".join(str(row[a]) for a in report.axes), report.panels[cell]))
    return out


# ------------------------------------------------------------------------------------------ Table 6


def ari_rows(report) -> list[dict]:
    """Per cell and quantity: our ARI per seed, mean and spread (the suite's pm/ddof), the paper's."""
    from benchmarks.suite.spec import cell_id

    paper = {(cell_id(e["cell"]), e["quantity"]): e for e in report.suite.published_quantities}
    rows = []
    for cell, label, seeds in ordered(report):
        for q in KINDS["ari"][1]:
            values = {s: spectral_ari(a[q], a["group"]) for s, a in seeds.items()}
            x = list(values.values())
            pub = paper.get((cell, q), {})
            mean = float(np.mean(x))
            rows.append({"cell": cell, "label": label, "quantity": q, "seeds": values, "mean": mean,
                         "pm": spread(x, report.metric.pm, report.metric.ddof),
                         "paper": pub.get("mean", math.nan), "source": pub.get("source", ""),
                         "diff": mean - pub["mean"] if pub else math.nan})
    return rows


def ari_figure(report):
    """Per cell a panel: ours (mean ± spread over seeds) beside the paper's ARI for each quantity."""
    rows = ari_rows(report)
    cells = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = panel_grid(len(cells), 3.6, 2.8, max_cols=3, title_room=0.6)
    for ax, label in zip(axes, cells):
        mine = [r for r in rows if r["label"] == label]
        x = np.arange(len(mine))
        ax.bar(x - 0.2, [r["mean"] for r in mine], 0.4, yerr=[0 if math.isnan(r["pm"]) else r["pm"] for r in mine],
               capsize=3, label="ours", color="#1f77b4")
        ax.bar(x + 0.2, [0 if math.isnan(r["paper"]) else r["paper"] for r in mine], 0.4, label="paper",
               color="#bbbbbb", hatch="//", edgecolor="#666666")
        ax.set_xticks(x, [QUANTITIES[r["quantity"]] for r in mine], rotation=25, ha="right", fontsize=7)
        ax.set_ylim(min(-0.1, min(r["mean"] for r in mine) - 0.1), 1.05)
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("ARI", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{report.suite.key}: ARI of spectral clusters vs domains, ours vs paper (profile {report.profile})",
                 fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------ Figures 2 and 4


def _lowest_seed(seeds: dict[int, dict]) -> tuple[int, dict]:
    seed = min(seeds)
    return seed, seeds[seed]


def _boxes(ax, values: np.ndarray, what: str) -> None:
    stats = layer_distribution(values)
    boxes = [{"med": stats["median"][j], "q1": stats["q1"][j], "q3": stats["q3"][j], "whislo": stats["min"][j],
              "whishi": stats["max"][j], "mean": stats["mean"][j], "fliers": []} for j in range(values.shape[1])]
    ax.bxp(boxes, showmeans=True, meanprops={"markersize": 2}, medianprops={"linewidth": 0.8},
           boxprops={"linewidth": 0.6}, whiskerprops={"linewidth": 0.6}, capprops={"linewidth": 0.6})
    step = max(1, values.shape[1] // 10)
    ticks = list(range(1, values.shape[1] + 1, step))
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=6)
    ax.set_xlabel(what, fontsize=7)
    ax.tick_params(axis="y", labelsize=6)


def hyperparameter_figure(report, chunk: list[tuple[str, str, dict]]):
    """Rows = cells; columns: beta per BN layer, eta per parameter tensor (box plots over clients),
    the clients' sparsity."""
    fig, axes = panel_grid(3 * len(chunk), 3.6, 2.2, max_cols=3, title_room=0.6)
    for k, (_, label, seeds) in enumerate(chunk):
        seed, arrays = _lowest_seed(seeds)
        beta, eta = np.asarray(arrays["beta"], dtype=float), np.asarray(arrays["eta"], dtype=float)
        ax_b, ax_e, ax_s = axes[3 * k: 3 * k + 3]
        _boxes(ax_b, beta, "BN layer")
        ax_b.set_title(f"{label}: β (seed {seed})", fontsize=8)
        _boxes(ax_e, eta, "parameter tensor")
        ax_e.set_title(f"{label}: η", fontsize=8)
        sparsity = lr_sparsity(eta)
        ax_s.hist(sparsity, bins=np.linspace(0, 1, 11), color="#1f77b4")
        ax_s.set_xlim(0, 1)
        ax_s.set_xlabel("sparsity (share of the tensors' η = 0)", fontsize=7)
        ax_s.set_title(f"{label}: sparsity, mean {sparsity.mean():.2f}", fontsize=8)
        ax_s.tick_params(labelsize=6)
    fig.suptitle(f"{report.suite.key}: learned β and η across clients, sparsity (profile {report.profile})", fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------ Figures 3 and 5


def cluster_map_figure(report, chunk: list[tuple[str, str, dict]], quantities: tuple[str, ...]):
    """Rows = cells, columns = quantities: the domains' map log(d(j,k) / sqrt(d(j,j) d(k,k))),
    annotated; a domain with one client has no within-domain distance (blank)."""
    fig, axes = panel_grid(len(quantities) * len(chunk), 2.9, 2.6, max_cols=len(quantities), title_room=0.6)
    for k, (_, label, seeds) in enumerate(chunk):
        seed, arrays = _lowest_seed(seeds)
        for j, q in enumerate(quantities):
            ax = axes[k * len(quantities) + j]
            grid, names = cluster_distance_map(arrays[q], arrays["group"])
            finite = grid[np.isfinite(grid)]
            lim = max(float(np.abs(finite).max()) if finite.size else 0.0, 1e-6)
            ax.imshow(np.ma.masked_invalid(grid), cmap="RdBu_r", vmin=-lim, vmax=lim)
            for (r, c), v in np.ndenumerate(grid):
                text = "—" if not np.isfinite(v) else f"{v if abs(v) >= 0.005 else 0.0:.2f}"
                dark = np.isfinite(v) and abs(v) > 0.6 * lim
                ax.text(c, r, text, ha="center", va="center", fontsize=6, color="white" if dark else "black")
            names = [str(n) for n in names]
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=6)
            ax.set_yticks(range(len(names)), names, fontsize=6)
            ax.set_title(f"{label}: {QUANTITIES[q]} (seed {seed})", fontsize=7)
    fig.suptitle(f"{report.suite.key}: cluster distance maps (profile {report.profile}; > 0: domains apart)",
                 fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------- entries


def figures(report) -> dict[str, object]:
    """name -> figure for the suite's ``metric.figure`` (``figure``, ``figure_2``, ...: a few cells each)."""
    kind, cells = report.metric.figure, ordered(report)
    if kind not in KINDS or not cells:
        return {}
    if kind == "ari":
        return {"figure": ari_figure(report)}
    chunks = [cells[i:i + CELLS_PER_FIGURE] for i in range(0, len(cells), CELLS_PER_FIGURE)]
    out = {}
    for i, chunk in enumerate(chunks):
        name = "figure" if i == 0 else f"figure_{i + 1}"
        out[name] = (hyperparameter_figure(report, chunk) if kind == "hyperparameters"
                     else cluster_map_figure(report, chunk, KINDS[kind][1]))
    return out


def _value(mean: float, pm: float) -> str:
    return f"{mean:.2f}" + ("" if math.isnan(pm) else f" ± {pm:.2f}")


def markdown_lines(report) -> list[str]:
    """The section of the suite's figure (or Table 6): what is drawn, and its numbers per cell."""
    kind = report.metric.figure
    if kind not in KINDS:
        return []
    lines = ["", f"## {KINDS[kind][0]}", ""]
    if not report.panels:
        return lines + [f"No finished run logged `{ARTIFACT}.npz` (the finetune_pretrained protocol's per-client "
                        "arrays), so there is nothing to draw."]
    if kind == "ari":
        lines += [f"ARI per seed; ours = mean ± {report.metric.pm} (ddof {report.metric.ddof}) over seeds; "
                  "spectral clustering with a harness choice (RBF affinity, scikit-learn's gamma, "
                  "one cluster per domain, discretize).", "",
                  "| cell | quantity | ours | per seed | paper | ours − paper |", "|---|---|---|---|---|---|"]
        for r in ari_rows(report):
            seeds = ", ".join(f"{s}: {v:.2f}" for s, v in r["seeds"].items())
            paper = "—" if math.isnan(r["paper"]) else f"{r['paper']:.2f}"
            diff = "—" if math.isnan(r["diff"]) else f"{r['diff']:+.2f}"
            lines.append(f"| {r['label']} | {QUANTITIES[r['quantity']]} | {_value(r['mean'], r['pm'])} | {seeds} | "
                         f"{paper} | {diff} |")
        return lines + ["", f"![ARI]({report.suite.name}_figure.png)"]
    lines += ["Qualitative: the paper's figure prints no numbers; compare the panels by eye. Each cell shows its "
              "run of the lowest finished seed.", ""]
    for _, label, seeds in ordered(report):
        seed, arrays = _lowest_seed(seeds)
        eta = np.asarray(arrays["eta"], dtype=float)
        groups = sorted({str(g) for g in np.asarray(arrays["group"]).tolist()})
        lines.append(f"- {label} (seed {seed}): {len(eta)} clients of {len(groups)} group(s); mean β "
                     f"{float(np.mean(arrays['beta'])):.3f}; mean sparsity {float(lr_sparsity(eta).mean()):.3f}")
    pictures = math.ceil(len(ordered(report)) / CELLS_PER_FIGURE)
    return lines + [""] + [f"![{KINDS[kind][0]}]({report.suite.name}_{'figure' if i == 0 else f'figure_{i + 1}'}.png)"
                           for i in range(pictures)]
