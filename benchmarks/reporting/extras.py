"""Per-cell figures beside the table value (issue 11): the CAFeMe paper's literal metric and the
clients whose train split is smaller than a batch.

* **Literal metric.** The CAFeMe paper reports "test accuracy after 50 personalization steps";
  the authors' results script tabulated the mean of the seed-mean curve over steps 48-50 (the
  table value, ``last3_of_seed_mean_curve``). For that aggregate every cell also gets the
  seed-mean accuracy at the curve's last step (after exactly N steps), with the same +- rule.
* **Short clients.** The CAFeMe code crashes on a client whose train split holds fewer than a
  batch (docs/papers/cafeme.md); the authors kept only seeds without one. Each run counts them
  (metric ``short_train_clients``, every client, unseen ones too; ``run_info.json`` lists them).
"""
from __future__ import annotations

import math

import pandas as pd

from benchmarks.reporting.stats import spread


def literal_statistics(metric, curves: list[list[float]]) -> dict:
    """``literal_mean``/``literal_pm``: the last point of each seed's curve (already scaled),
    mean and the paper's +- over seeds; NaN when the metric is not a fine-tuning curve."""
    if metric.aggregate != "last3_of_seed_mean_curve" or not curves:
        return {"literal_mean": math.nan, "literal_pm": math.nan, "literal_step": math.nan}
    steps = min(len(c) for c in curves)
    last = [c[steps - 1] for c in curves]
    return {"literal_mean": sum(last) / len(last), "literal_pm": spread(last, metric.pm, metric.ddof),
            "literal_step": steps - 1}


def short_clients_text(done: pd.DataFrame) -> str:
    """``seed 2: 1`` per finished run with clients smaller than a batch ('' when none)."""
    if "short_train_clients" not in done:
        return ""
    counts = [(int(s), int(n)) for s, n in zip(done["seed"], done["short_train_clients"])
              if isinstance(n, (int, float)) and not math.isnan(n) and n > 0]
    return ", ".join(f"seed {s}: {n}" for s, n in sorted(counts))


def markdown_lines(report) -> list[str]:
    """The report's sections for both figures (empty when a suite has neither)."""
    table, axes, lines = report.table, report.axes, []
    name = lambda r: "/".join(str(r[a]) for a in axes)
    if "literal_mean" in table and table["literal_mean"].notna().any():
        fmt = lambda m, pm: "—" if math.isnan(m) else (f"{m:.2f}" if math.isnan(pm) else f"{m:.2f} ± {pm:.2f}")
        lines += ["", "Literal metric (the paper's wording): accuracy after exactly the last personalization "
                      "step, mean ± the same spread over seeds, beside the table's mean of steps N-2..N:", ""]
        lines += [f"- {name(r)}: after {int(r['literal_step'])} steps {fmt(r['literal_mean'], r['literal_pm'])} "
                  f"(table value {fmt(r['mean'], r['pm'])})" for _, r in table.iterrows() if r["literal_mean"] == r["literal_mean"]]
    short = table[table.get("short_train_clients", pd.Series("", index=table.index)) != ""]
    if not short.empty:
        lines += ["", "Clients whose train split is smaller than a batch (the authors' code crashes on them; "
                      "here they train on one short batch; `data.redraw_short_clients` redraws such partitions):", ""]
        lines += [f"- {name(r)}: {r['short_train_clients']}" for _, r in short.iterrows()]
    return lines
