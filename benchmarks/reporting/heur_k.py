"""Which K CGPFL-Heur chooses for which mu: the mu interval of every K, from the candidates' costs.

CGPFL-Heur (``pfl_core/algorithms/cgpfl_heur.py``, paper Section 4.4, expression (11)) picks
argmin_K penalty(K) + mu_abs * cost(K) once, at the first aggregation. With ``mu_scale: relative``
(the suites' setting) mu_abs = mu * penalty(1) / cost(1), so the objective divided by penalty(1) is
a line in mu for every K,

    a_K + mu * b_K,   a_K = penalty(K) / penalty(1),   b_K = cost(K) / cost(1),

and the K chosen for a mu is the lowest line there (ties to the smallest K, as the solver breaks
them). :func:`k_intervals` returns the lower envelope as (K, mu_low, mu_high) intervals, so the mu
that the paper's unpublished "appropriate mu" must have been for each K is read off the costs a
run records (``run_info.json``: ``cgpfl_heur_candidates``, ``cgpfl_heur_cost``) without training
further. The costs depend only on the first round, so a one-round run gives them (:func:`main`).

    python -m benchmarks.reporting.heur_k cgpfl/table1 --seeds 0 1 2 3 4
"""
from __future__ import annotations

import argparse
import math

PENALTIES = ("kd", "sqrt_kd")


def _line(k: int, cost: float, base: float, penalty: str) -> tuple[float, float]:
    a = float(k) if penalty == "kd" else math.sqrt(k)  # penalty(K)/penalty(1); d cancels
    return a, cost / base


def chosen_k(ks: list[int], costs: list[float], mu: float, penalty: str = "kd") -> int:
    """The K the solver picks at relative ``mu`` (the objective of ``choose_num_clusters``)."""
    base = costs[ks.index(1)]
    lines = [_line(k, c, base, penalty) for k, c in zip(ks, costs)]
    return min(zip(ks, lines), key=lambda kl: (kl[1][0] + mu * kl[1][1], kl[0]))[0]


def k_intervals(ks: list[int], costs: list[float], penalty: str = "kd") -> list[tuple[int, float, float]]:
    """(K, mu_low, mu_high) for every K chosen by some relative mu >= 0, in increasing mu; the last
    interval ends at infinity. ``ks`` must hold K = 1 (the relative scale's reference)."""
    if penalty not in PENALTIES:
        raise ValueError(f"penalty must be one of {PENALTIES}, got {penalty!r}")
    if 1 not in ks or costs[ks.index(1)] <= 0:
        raise ValueError("the costs must include K = 1 with a positive cost")
    base = costs[ks.index(1)]
    lines = {k: _line(k, c, base, penalty) for k, c in zip(ks, costs)}
    cuts = {0.0}
    for i in ks:
        for j in ks:
            (ai, bi), (aj, bj) = lines[i], lines[j]
            if bi != bj and (aj - ai) / (bi - bj) > 0:
                cuts.add((aj - ai) / (bi - bj))
    cuts = sorted(cuts)
    probes = [(lo + hi) / 2 for lo, hi in zip(cuts, cuts[1:])] + [cuts[-1] * 2 + 1]
    out: list[list] = []
    for lo, probe in zip(cuts, probes):
        k = chosen_k(ks, costs, probe, penalty)
        if out and out[-1][0] == k:
            continue
        if out:
            out[-1][2] = lo
        out.append([k, lo, math.inf])
    return [tuple(x) for x in out]


def describe(intervals: list[tuple[int, float, float]]) -> str:
    """``K=1: mu <= 3.1; K=2: 3.1 < mu <= 7.4; ...`` (a boundary mu goes to the smaller K)."""
    parts = []
    for k, lo, hi in intervals:
        if lo == 0:
            parts.append(f"K={k}: mu <= {hi:.3g}" if math.isfinite(hi) else f"K={k}: every mu")
        else:
            parts.append(f"K={k}: {lo:.3g} < mu" + (f" <= {hi:.3g}" if math.isfinite(hi) else ""))
    return "; ".join(parts)


def first_round_costs(spec, device: str = "cpu", data_dir: str | None = None) -> tuple[list[int], list[float], int]:
    """(candidates, costs, chosen K) of a CGPFL-Heur run's first aggregation: the run cut to one
    round, with no evaluation (neither changes what the first round computes)."""
    import copy

    from pfl_core.config import RunConfig
    from pfl_core.experiment import run_experiment

    raw = copy.deepcopy(spec.config)
    raw["federation"].update(rounds=1, eval_every=0)
    result = run_experiment(RunConfig.from_dict(raw), device=device, data_dir=data_dir, execution="auto")
    info = result.info
    return info["cgpfl_heur_candidates"], info["cgpfl_heur_cost"], info["cgpfl_heur_chosen_k"]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.suite.spec import load_suite

    parser = argparse.ArgumentParser(prog="python -m benchmarks.reporting.heur_k", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", help="a suite with CGPFL-Heur cells, e.g. cgpfl/table1")
    parser.add_argument("--profile", default="paper")
    parser.add_argument("--method", default="CGPFL-Heur", help="the method-axis label of the CGPFL-Heur cells")
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--settings", nargs="*", default=None, help="setting labels (default: all)")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    suite = load_suite(args.suite)
    specs = [s for s in suite.expand(args.profile, seeds=args.seeds)
             if s.cell.get("method") == args.method and (not args.settings or s.cell.get("setting") in args.settings)]
    print("| setting | seed | mu (suite) | chosen K | mu interval of each K (relative scale) |")
    print("| --- | --- | --- | --- | --- |")
    for spec in specs:
        hp = spec.config["method"]["params"]
        ks, costs, chosen = first_round_costs(spec, data_dir=args.data_dir)
        intervals = k_intervals(ks, costs, hp.get("penalty", "kd"))
        assert chosen == chosen_k(ks, costs, hp["mu"], hp.get("penalty", "kd"))  # the solver's own choice
        print(f"| {spec.cell.get('setting')} | {spec.seed} | {hp['mu']:g} | {chosen} | {describe(intervals)} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
