"""The mu interval of each K chosen by CGPFL-Heur (benchmarks/reporting/heur_k.py) against the solver
itself (pfl_core/algorithms/cgpfl_heur.py choose_num_clusters) on a fine mu grid."""
from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.reporting.heur_k import chosen_k, describe, k_intervals
from pfl_core.algorithms.cgpfl_heur import choose_num_clusters


def _in(intervals, mu):
    return [k for k, lo, hi in intervals if (lo < mu <= hi) or (lo == 0 and mu <= hi)]


@pytest.mark.parametrize("penalty", ["kd", "sqrt_kd"])
def test_the_intervals_are_where_the_solver_chooses_each_k(penalty):
    """Probed on both sides of every boundary and inside every interval (the solver refits its
    k-means on each call, so the probes are few: a fine grid would take minutes)."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 6)) * 3
    x = np.concatenate([c + rng.normal(size=(6, 6)) for c in centres])
    weights = rng.uniform(1, 3, size=len(x))
    candidates = list(range(1, 7))
    solve = lambda mu: choose_num_clusters(x, weights, candidates, mu, "relative", penalty, seed=0,  # noqa: E731
                                           n_init=3)[0].k
    _, fits = choose_num_clusters(x, weights, candidates, 1.0, "relative", penalty, seed=0, n_init=3)
    ks, costs = [f.k for f in fits], [f.cost for f in fits]
    intervals = k_intervals(ks, costs, penalty)
    assert intervals[0][:2] == (1, 0.0) and math.isinf(intervals[-1][2])
    assert all(a[2] == b[1] for a, b in zip(intervals, intervals[1:]))  # contiguous
    assert len(intervals) >= 3  # the example spans several K
    for k, lo, hi in intervals:
        probes = [lo * (1 + 1e-6) if lo else 1e-3, (lo + hi) / 2 if math.isfinite(hi) else lo * 2 + 1]
        probes += [hi * (1 - 1e-6)] if math.isfinite(hi) else []
        for mu in probes:
            assert solve(mu) == k == chosen_k(ks, costs, mu, penalty), (mu, intervals)


def test_every_mu_up_to_one_chooses_k1_under_kd():
    """The module docstring's claim (cgpfl_heur.py): with kd and relative mu, mu <= 1 gives K = 1."""
    ks, costs = [1, 2, 3], [10.0, 1.0, 0.0]  # lines 1 + mu, 2 + mu/10, 3
    (k1, lo, hi), *_ = k_intervals(ks, costs, "kd")
    assert (k1, lo) == (1, 0.0) and hi >= 1.0
    assert describe(k_intervals(ks, costs, "kd")) == "K=1: mu <= 1.11; K=2: 1.11 < mu <= 10; K=3: 10 < mu"  # 1 + mu = 2 + mu/10; 2 + mu/10 = 3
