"""Figures (matplotlib): ours vs paper bars, a heat map of the differences, and each paper figure
in its own form (docs/papers/cafeme.md: bars with std for Fig. 3, curves with std bands
for Fig. 4, a line over the local data size for Fig. 5)."""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.reporting import personalization, qualitative  # noqa: E402
from benchmarks.reporting.grid import panel_grid  # noqa: E402
from benchmarks.reporting.stats import spread  # noqa: E402
from benchmarks.reporting.table import SuiteReport, column_label  # noqa: E402

OURS, PAPER, CODE = "#1f77b4", "#bbbbbb", "#ff7f0e"


def _columns(report: SuiteReport):
    cols = report.column_axes
    return list(report.table.groupby(cols, sort=False)) if cols else [((), report.table)]


def _err(values) -> np.ndarray:
    return np.array([0.0 if v is None or math.isnan(v) else v for v in values])


def _panels(n: int, width: float = 4.2, height: float = 3.2):
    return panel_grid(n, width, height, max_cols=3, title_room=0.6)


def grouped_bars(report: SuiteReport):
    """Per column a panel; per method ours (mean ± pm) beside the paper's (mean ± its ±) and, where
    the suite has a code reference, the authors' code's (mean ± pm over its seeds)."""
    method = report.method_axis
    groups = _columns(report)
    fig, axes = _panels(len(groups))
    for ax, (_, g) in zip(axes, groups):
        x = np.arange(len(g))
        bars = [("ours", "mean", "pm", {"color": OURS})]
        if g["published_mean"].notna().any():
            bars.append(("paper", "published_mean", "published_pm",
                         {"color": PAPER, "hatch": "//", "edgecolor": "#666666"}))
        else:
            ax.text(0.5, 0.97, "the paper prints no numbers here", transform=ax.transAxes, ha="center",
                    va="top", fontsize=7, color="#666666")
        if "code_mean" in g and g["code_mean"].notna().any():
            bars.append(("authors' code", "code_mean", "code_pm", {"color": CODE, "hatch": "..",
                                                                  "edgecolor": "#444444"}))
        width = 0.8 / len(bars)
        for k, (name, mean, pm, style) in enumerate(bars):
            offset = (k - (len(bars) - 1) / 2) * width
            ax.bar(x + offset, g[mean].fillna(0), width, yerr=_err(g[pm]), label=name, capsize=3, **style)
        labels = g[method] if method else g.apply(lambda r: column_label(r, report.axes), axis=1)
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(column_label(g.iloc[0], report.column_axes), fontsize=9)
        ax.set_ylabel(report.metric.label, fontsize=7)
    axes[0].legend(fontsize=7)
    code = " and the authors' code" if report.has_code_reference else ""
    fig.suptitle(f"{report.suite.key}: ours vs paper{code} (error bars: ±{report.metric.pm})", fontsize=10)
    fig.tight_layout()
    return fig


def diff_grid(report: SuiteReport):
    """(method labels, column labels, ours − paper per method x column, the verdict per cell)."""
    method = report.method_axis
    groups = _columns(report)
    methods = list(dict.fromkeys(report.table[method])) if method else ["value"]
    grid = np.full((len(methods), len(groups)), np.nan)
    verdicts = np.full(grid.shape, "", dtype=object)
    for j, (_, g) in enumerate(groups):
        for _, row in g.iterrows():
            i = methods.index(row[method]) if method else 0
            grid[i, j], verdicts[i, j] = row["diff"], row["verdict"]
    return methods, [column_label(g.iloc[0], report.column_axes) for _, g in groups], grid, verdicts


def draw_diff(ax, report: SuiteReport, verdicts: bool = False, fontsize: float = 10):
    """The heat map of ours − paper on ``ax`` (None when no cell has both numbers), with each cell's
    value and, with ``verdicts``, its verdict under it. With verdicts the colour saturates at three
    times the median bound (beyond-the-bound cells stand out; the values stay printed)."""
    methods, columns, grid, verdict = diff_grid(report)
    if np.isnan(grid).all():
        return None
    lim = max(np.nanmax(np.abs(grid)), 1e-9)
    bounds = report.table["bound"].to_numpy(dtype=float)
    if verdicts and np.isfinite(bounds).any():
        lim = min(lim, max(3 * float(np.nanmedian(bounds)), 1e-9))
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        dark = not math.isnan(v) and abs(v) > 0.6 * lim
        colour = "white" if dark else "black"
        text = "—" if math.isnan(v) else f"{v:+.1f}" if not verdicts else f"{v:+.2f}"
        ax.text(j, i - (0.12 if verdicts else 0), text, ha="center", va="center", fontsize=fontsize,
                color=colour, weight="bold" if verdicts else "normal")
        if verdicts:
            ax.text(j, i + 0.22, verdict[i, j] or "", ha="center", va="center", fontsize=fontsize * 0.7,
                    color=colour)
    ax.set_xticks(range(len(columns)), columns, rotation=30 if not verdicts else 0,
                  ha="right" if not verdicts else "center", fontsize=9)
    ax.set_yticks(range(len(methods)), methods, fontsize=9)
    return image


def diff_heatmap(report: SuiteReport):
    """Methods x columns, colour = ours − paper; None when no cell has both numbers."""
    methods, columns, _, _ = diff_grid(report)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(columns), 1.2 + 0.45 * len(methods)))
    image = draw_diff(ax, report)
    if image is None:
        plt.close(fig)
        return None
    fig.colorbar(image, ax=ax, label="ours − paper")
    ax.set_title(f"{report.suite.key}: difference to the paper", fontsize=9)
    fig.tight_layout()
    return fig


def paper_bars(report: SuiteReport):
    """CAFeMe Fig. 3 form: x = columns, one bar per method (mean ± pm), the paper's values
    overlaid as black markers with their ±."""
    method = report.method_axis
    groups = _columns(report)
    methods = list(dict.fromkeys(report.table[method]))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(groups) * len(methods) * 0.4), 3.8))
    for k, m in enumerate(methods):
        rows = [g[g[method] == m].iloc[0] for _, g in groups]
        x = np.arange(len(groups)) + (k - (len(methods) - 1) / 2) * width
        ax.bar(x, [r["mean"] for r in rows], width, yerr=_err([r["pm"] for r in rows]), label=m, capsize=2)
        ax.errorbar(x, [r["published_mean"] for r in rows], yerr=_err([r["published_pm"] for r in rows]),
                    fmt="k_", markersize=8, capsize=2, linestyle="none",
                    label="paper" if k == 0 else None)
    ax.set_xticks(range(len(groups)), [column_label(g.iloc[0], report.column_axes) for _, g in groups], fontsize=8)
    ax.set_ylabel(report.metric.label, fontsize=8)
    ax.legend(fontsize=7, ncol=min(4, len(methods) + 1))
    ax.set_title(f"{report.suite.key}: reproduced figure (bars: ours ± {report.metric.pm}; black: paper)", fontsize=9)
    fig.tight_layout()
    return fig


def _curve_stats(report: SuiteReport, cell: str, key: str | None = None, scale: float | None = None):
    """The seed-mean history ``key`` (default: the fine-tuning curve) of a cell's finished runs, its
    ± band and steps (those every seed logged), or None."""
    key = key or report.metric.curve_metric
    scale = report.metric.scale if scale is None else scale
    done = report.runs[(report.runs["cell"] == cell) & (report.runs["status"] == "FINISHED")]
    histories = [h for h in (r.get(key) or {} for r in done["histories"]) if h]
    if not histories:
        return None
    steps = sorted(set.intersection(*(set(h) for h in histories)))
    if not steps:
        return None
    grid = np.array([[h[k] * scale for k in steps] for h in histories])
    band = np.array([spread(grid[:, k], report.metric.pm, report.metric.ddof) for k in range(len(steps))])
    return grid.mean(axis=0), np.nan_to_num(band), np.array(steps)


def curve_label(metric) -> str:
    """The y label of a curve over steps: the curve's key (the table metric's label names one point of
    it, e.g. the mean after steps 48-50), in % when the report scales by 100."""
    unit = " (%)" if metric.scale == 100 else ""
    return f"{metric.curve_metric}{unit}, seed mean"


def paper_curves(report: SuiteReport):
    """CAFeMe Fig. 4 form: per column, the seed-mean fine-tuning curve per method with ± bands."""
    from benchmarks.suite.spec import cell_id

    method = report.method_axis
    groups = _columns(report)
    fig, axes = _panels(len(groups), 4.6, 3.3)
    for ax, (_, g) in zip(axes, groups):
        for _, row in g.iterrows():
            stats = _curve_stats(report, cell_id({a: row[a] for a in report.axes}))
            if stats is None:
                continue
            mean, band, _ = stats
            steps = np.arange(len(mean))
            line, = ax.plot(steps, mean, label=row[method] if method else None, marker="." if len(mean) == 1 else None)
            ax.fill_between(steps, mean - band, mean + band, color=line.get_color(), alpha=0.2)
        ax.set_title(column_label(g.iloc[0], report.column_axes), fontsize=9)
        ax.set_xlabel("personalization steps", fontsize=8)
        ax.set_ylabel(curve_label(report.metric), fontsize=7)
        if ax.lines:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
    fig.suptitle(f"{report.suite.key}: accuracy vs personalization steps (band: ±{report.metric.pm})", fontsize=10)
    fig.tight_layout()
    return fig


def paper_round_curves(report: SuiteReport):
    """CGPFL Figs. 1-2 form: per column, the seed-mean per-round test accuracy (top) and training
    loss (bottom, ``metric.loss_metric``) of every method, with ± bands over seeds."""
    from benchmarks.suite.spec import cell_id

    method, groups, metric = report.method_axis, _columns(report), report.metric
    fig, axes = plt.subplots(2, len(groups), figsize=(4.6 * len(groups), 6.4), squeeze=False)
    for col, (_, g) in enumerate(groups):
        for row_ax, key, scale, label in ((axes[0][col], metric.round_key, metric.scale, metric.label),
                                          (axes[1][col], metric.loss_metric, 1.0, metric.loss_metric)):
            for _, row in g.iterrows():
                stats = _curve_stats(report, cell_id({a: row[a] for a in report.axes}), key, scale)
                if stats is None:
                    continue
                mean, band, steps = stats
                line, = row_ax.plot(steps, mean, label=row[method] if method else None, lw=1.0)
                row_ax.fill_between(steps, mean - band, mean + band, color=line.get_color(), alpha=0.2)
            row_ax.set_xlabel("round", fontsize=8)
            row_ax.set_ylabel(label, fontsize=7)
            if row_ax.lines:
                row_ax.legend(fontsize=6)
            else:
                row_ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=row_ax.transAxes, color="grey")
        axes[0][col].set_title(column_label(g.iloc[0], report.column_axes), fontsize=9)
    fig.suptitle(f"{report.suite.key}: test accuracy and training loss over rounds (band: ±{metric.pm} over seeds)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def paper_line(report: SuiteReport):
    """CAFeMe Fig. 5 form: the metric against ``metric.x_axis`` (numeric labels), one line per
    method with ± error bars; the paper's values dashed where it gives them."""
    x_axis, method = report.metric.x_axis, report.method_axis
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for m, g in report.table.groupby(method, sort=False) if method else [("ours", report.table)]:
        g = g.assign(_x=g[x_axis].astype(float)).sort_values("_x")
        line = ax.errorbar(g["_x"], g["mean"], yerr=_err(g["pm"]), marker="o", capsize=3, label=m)
        if g["published_mean"].notna().any():
            ax.errorbar(g["_x"], g["published_mean"], yerr=_err(g["published_pm"]), linestyle="--",
                        marker="x", color=line[0].get_color(), alpha=0.6, label=f"{m} (paper)")
    ax.set_xlabel(x_axis)
    ax.set_ylabel(report.metric.label, fontsize=8)
    ax.legend(fontsize=7)
    ax.set_title(f"{report.suite.key}: {report.metric.key} vs {x_axis}", fontsize=9)
    fig.tight_layout()
    return fig


def suite_figures(report: SuiteReport) -> dict[str, object]:
    """name -> Figure for every figure of the suite (missing ones are left out)."""
    figures = {"bars": grouped_bars(report), "diff": diff_heatmap(report)}
    kind = report.metric.figure
    if kind == "bars" and report.method_axis:
        figures["figure"] = paper_bars(report)
    elif kind == "curves":
        figures["figure"] = paper_curves(report)
    elif kind == "round_curves":
        figures["figure"] = paper_round_curves(report)
    elif kind == "line":
        figures["figure"] = paper_line(report)
    elif kind in qualitative.KINDS:
        figures["figure"] = qualitative.qualitative_figure(report)
    elif kind in personalization.KINDS:
        figures.update(personalization.figures(report))
    return {k: v for k, v in figures.items() if v is not None}
