"""The suite's ``metric`` section as the report reads it, with defaults and validation.

Keys (all but ``key`` optional)::

    metric:
      key: acc_last3            # the run metric (final value, or a round/... history for best_val_round)
      label: "test accuracy (%)"
      scale: 100                # multiply stored values (fractions) into the paper's unit
      averaging: "..."          # free text: how the paper averaged over clients and seeds
      pm: std                   # the paper's +-: std | sem | none ...
      ddof: 0                   # ... with this ddof (applied to our seeds too)
      aggregate: final          # final | last3_of_seed_mean_curve | best_val_round | max_over_rounds
      also: [max_over_rounds]   # further aggregates, each shown as one more column beside "ours"
      curve_metric: curve/acc   # last3_of_seed_mean_curve: the per-step fine-tuning curve
      select_metric: round/val_acc_weighted  # best_val_round: the validation history selected on
      tolerance: 1.0            # absolute (metric units) where the paper gives no spread
      figure: table             # table | bars | curves | round_curves | line | tsne | dlg | ari |
                                # hyperparameters | cluster_map | cluster_map_all: the paper's figure
                                # form (round_curves: the per-round history of key and of
                                # loss_metric, e.g. CGPFL Figs. 1-2; tsne, dlg:
                                # drawn from the runs' evaluation.analyses arrays; the FedL2P forms
                                # from their personalization.npz, benchmarks.reporting.personalization)
      x_axis: samples           # line: the grid axis on the x axis (numeric labels)
      loss_metric: round/train_loss  # round_curves: the loss history drawn below the accuracy
      sample_sd: true           # also show the sample SD (ddof 1) of our seeds beside "ours" (FedL2P:
                                # the paper's ± is shown with ddof 0, an unstated convention)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.suite.spec import Suite
from benchmarks.suite.schema import SuiteError

AGGREGATES = ("final", "last3_of_seed_mean_curve", "best_val_round", "max_over_rounds")
FIGURES = ("table", "bars", "curves", "round_curves", "line", "tsne", "dlg", "ari", "hyperparameters", "cluster_map", "cluster_map_all")


@dataclass(frozen=True)
class MetricSpec:
    key: str
    label: str
    scale: float
    averaging: str
    pm: str
    ddof: int
    aggregate: str = "final"
    curve_metric: str = "curve/acc"
    select_metric: str = "round/val_acc"
    tolerance: float | None = None
    figure: str = "table"
    x_axis: str | None = None
    loss_metric: str = "round/train_loss"
    sample_sd: bool = False
    """Show the sample SD (ddof 1) of our seeds as a column beside "ours" (whose spread follows the
    paper's ``pm``/``ddof``): where the paper's ddof is unknown, both are shown."""
    also: tuple[str, ...] = ()
    higher_is_better: bool = True
    """The metric's direction: the best method of a column is the highest value, or the lowest
    (``higher_is_better: false``, e.g. MetaVers' nVAR, Table 4: "lower is better")."""
    """Further aggregates of the same runs, each shown as one more column (e.g. ``max_over_rounds``
    beside ``final``: pFedMe's convention next to the last round)."""

    @property
    def round_key(self) -> str:
        """The per-round history of ``key`` (``max_over_rounds``)."""
        return self.key if self.key.startswith("round/") else f"round/{self.key}"

    @property
    def history_keys(self) -> list[str]:
        """The metric histories a run must be read with (none for ``final``), for every aggregate."""
        keys = {"last3_of_seed_mean_curve": [self.curve_metric], "best_val_round": [self.key, self.select_metric],
                "max_over_rounds": [self.round_key], "final": []}
        return list(dict.fromkeys(k for agg in (self.aggregate, *self.also) for k in keys[agg]))

    @property
    def figure_histories(self) -> tuple[str, ...]:
        """The histories the paper figure draws (``curves``: the fine-tuning curve; ``round_curves``:
        the metric's and the loss's per-round histories)."""
        return {"curves": (self.curve_metric,), "round_curves": (self.round_key, self.loss_metric)}.get(self.figure, ())

    def describe(self) -> str:
        """One sentence on how a cell's number is computed (for the table legend)."""
        how = {
            "final": f"the run's final `{self.key}`, mean over seeds",
            "last3_of_seed_mean_curve": (
                f"mean of the last three points of the seed-averaged `{self.curve_metric}` curve; "
                f"± = mean of the last three per-step {self.pm}'s over seeds (docs/papers/cafeme.md)"),
            "best_val_round": (
                f"`{self.key}` at the round with the best `{self.select_metric}` per seed (rounds of a "
                "method's pretraining stage, LG-FedAvg's FedAvg rounds, left out), mean over "
                "seeds (MetaVers spec, \"Evaluation protocol\")"),
            "max_over_rounds": (
                f"the maximum over the logged rounds of `{self.round_key}` per seed, mean over seeds "
                "(the pFedMe code's convention)"),
        }[self.aggregate]
        also = "".join(f"; column \"ours ({a})\": the same runs aggregated by `{a}`" for a in self.also)
        return f"{how}; ours shown as mean ± {self.pm} (ddof={self.ddof}), the paper's convention{also}"


def metric_spec(suite: Suite, profile: str = "paper") -> MetricSpec:
    """Read and check ``suite.metric`` as ``profile`` reports it (its ``metric`` keys over the
    suite's: :meth:`Suite.metric_for`); a bad value raises SuiteError naming file and key."""
    raw = suite.metric_for(profile)
    where = f"{suite.path}: metric" + (f" (profile {profile})" if profile != "paper" else "")
    if raw.get("aggregate", "final") not in AGGREGATES:
        raise SuiteError(f"{where}.aggregate: {raw['aggregate']!r}; allowed: {list(AGGREGATES)}")
    if raw.get("figure", "table") not in FIGURES:
        raise SuiteError(f"{where}.figure: {raw['figure']!r}; allowed: {list(FIGURES)}")
    axes = [a.name for a in suite.axes]
    if raw.get("figure") == "line" and raw.get("x_axis") not in axes:
        raise SuiteError(f"{where}.x_axis: figure 'line' needs x_axis, one of the grid axes {axes}")
    tol = raw.get("tolerance")
    if tol is not None and (not isinstance(tol, (int, float)) or tol < 0 or math.isnan(tol)):
        raise SuiteError(f"{where}.tolerance: expected a non-negative number, got {tol!r}")
    also = raw.get("also") or []
    if not isinstance(also, list) or any(a not in AGGREGATES for a in also):
        raise SuiteError(f"{where}.also: {also!r}; expected a list of aggregates from {list(AGGREGATES)}")
    fields = {k: raw[k] for k in MetricSpec.__dataclass_fields__ if k in raw}
    fields["also"] = tuple(also)
    if not isinstance(raw.get("higher_is_better", True), bool):
        raise SuiteError(f"{where}.higher_is_better: expected true or false, got {raw['higher_is_better']!r}")
    if not isinstance(raw.get("sample_sd", False), bool):
        raise SuiteError(f"{where}.sample_sd: expected true or false, got {raw['sample_sd']!r}")
    fields.update(scale=float(raw["scale"]), ddof=int(raw["ddof"]),
                  tolerance=None if tol is None else float(tol))
    return MetricSpec(**fields)
