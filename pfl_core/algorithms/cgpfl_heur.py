"""CGPFL-Heur (Tang, Guo, Guo, IJCAI 2022, Section 4.4): CGPFL whose number of contexts K is chosen
once, at the first aggregation, by minimising expression (11) (docs/papers/cgpfl.md).

For every K in 1..K_max (K_max = ``max_clusters`` or N/2, "no more than N/2", Section 5.3) the
server clusters the uploads and picks argmin_K penalty(K) + mu * cost(K), with cost(K) = sum_i
(m_i/m) min_k ||omega_{i,R} - c_k||^2 (evaluated on the uploaded omega, not theta: the server never
sees theta; m_i = the client's training-sample count) and penalty(K) = K*d (``penalty="kd"``,
harness default) or sqrt(K*d) (``"sqrt_kd"``); d = number of model parameters. K is then fixed for
the rest of training (the paper runs the solver "only at the first global round"). Each run records
its choice in ``run_info.json`` (``cgpfl_heur_chosen_k``, with every candidate's cost and
objective) and as the run's metric ``cgpfl_heur_chosen_k`` (snapshots and reports carry it).

**Relative mu collapses to K = 1 for mu <= 1** (``mu_scale="relative"``, the harness default):
there mu_abs = mu * penalty(1) / cost(1), so with ``kd`` the objective is
d * (K + mu * cost(K)/cost(1)). K = 1 scores d * (1 + mu); any K >= 2 scores at least
d * (2 + mu * cost(K)/cost(1)) > d * (1 + mu) whenever mu <= 1 (cost(K) >= 0). Every mu <= 1 of the
Figure 3 grid (1e-3 .. 1) therefore picks K = 1, i.e. plain CGPFL(K = 1) = pFedMe with uniform
weights; only mu > 1 can choose K >= 2 (K wins over 1 iff mu (1 - cost(K)/cost(1)) > K - 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np

from pfl_core.algorithms import METHODS
from pfl_core.engine.contract import ServerState
from pfl_core.algorithms.cgpfl import CGPFL, CGPFLHyper, KMeansFit, kmeans_labels, weighted_cost
from pfl_core.fields import PositiveInt, Tune



@dataclass
class CGPFLHeurHyper(CGPFLHyper):
    """CGPFL-Heur: CGPFL whose K is chosen at the first round by minimising expression (11)."""

    num_clusters: PositiveInt = 4
    """Unused: K is chosen by expression (11); redeclared without CGPFL's tuning range."""
    mu: Annotated[float, Tune(0.1, 100.0, log=True, order=3)] | None = None
    """mu of expression (11), required ("an appropriate mu", paper Section 5.3; not published)."""
    mu_scale: Literal["absolute", "relative"] = "relative"
    """``absolute``: (11) uses mu as given. ``relative`` (harness default): mu_abs =
    mu * penalty(1) / cost(1), so mu is the ratio mu_abs*cost(1)/penalty(1) that the
    log-spaced grid (suites/cgpfl/fig3.yaml) 1e-3..1e3 spans, comparable across datasets and models."""
    penalty: Literal["kd", "sqrt_kd"] = "kd"
    """The K-dependent complexity term of (11), lost in the paper's text: ``kd`` = K*d (harness
    choice) or ``sqrt_kd`` = sqrt(K*d); d = number of model parameters."""
    max_clusters: int = 0
    """Largest candidate K; 0 = floor(N/2) ("no more than N/2", paper Section 5.3)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mu is None or not self.mu > 0:
            raise ValueError("cgpfl_heur needs method.params.mu > 0 (expression (11)'s mu; "
                             "the paper does not publish it)")


def penalty_term(kind: str, k: int, d: int) -> float:
    return float(k * d) if kind == "kd" else math.sqrt(k * d)


def choose_num_clusters(
    x: np.ndarray, weights: np.ndarray, candidates: list[int], mu: float, mu_scale: str,
    penalty: str, seed: int, n_init: int = 10, max_iter: int = 300,
) -> tuple[KMeansFit, list[KMeansFit]]:
    """The CGPFL-Heur solver: argmin_K penalty(K) + mu * cost(K) over ``candidates`` (expr. (11)).

    Returns the chosen fit and every candidate's fit (with its cost and objective). Ties go to the
    smallest K. With ``mu_scale="relative"`` mu is multiplied by penalty(1)/cost(1).
    """
    d = x.shape[1]
    fits = []
    for k in candidates:
        labels = kmeans_labels(x, k, seed, n_init, max_iter)
        fits.append(KMeansFit(k, labels, weighted_cost(x, labels, weights)))
    mu_abs = mu
    if mu_scale == "relative":
        base = weighted_cost(x, np.zeros(len(x), dtype=np.int64), weights)
        mu_abs = mu * penalty_term(penalty, 1, d) / base if base > 0 else mu
    for fit in fits:
        fit.objective = penalty_term(penalty, fit.k, d) + mu_abs * fit.cost
    best = min(fits, key=lambda f: (f.objective, f.k))
    return best, fits


@METHODS.register("cgpfl_heur")
class CGPFLHeur(CGPFL):
    """CGPFL-Heur: K chosen once, at the first aggregation, by expression (11) (paper Section 4.4).

    The server state gains ``heur``: the candidate K values with their cost and objective, and the
    chosen K (``num_clusters``)."""

    hyper_class = CGPFLHeurHyper

    def _initial_k(self) -> int | None:
        return None

    def _cluster(self, server: ServerState, x: np.ndarray, weights: np.ndarray) -> tuple[int, np.ndarray, dict]:
        if server["num_clusters"] is not None:
            return super()._cluster(server, x, weights)
        hp = self.hp
        k_max = hp.max_clusters or len(x) // 2
        candidates = list(range(1, max(1, min(k_max, len(x))) + 1))
        best, fits = choose_num_clusters(
            x, weights, candidates, hp.mu, hp.mu_scale, hp.penalty,
            self._round_seed(server["round"]), hp.kmeans_n_init, hp.kmeans_max_iter,
        )
        heur = {"chosen": best.k, "candidates": [f.k for f in fits], "cost": [f.cost for f in fits],
                "objective": [f.objective for f in fits]}
        return best.k, best.labels, {"heur": heur}

    def run_info(self, server: ServerState) -> dict:
        """The K chosen at the first round, with every candidate's cost and objective."""
        heur = server.get("heur") or {}
        return {**super().run_info(server), "cgpfl_heur_chosen_k": heur.get("chosen"),
                "cgpfl_heur_candidates": heur.get("candidates"), "cgpfl_heur_cost": heur.get("cost"),
                "cgpfl_heur_objective": heur.get("objective")}

    def run_metrics(self, server: ServerState) -> dict[str, float]:
        """``cgpfl_heur_chosen_k``: the K expression (11) chose at the first round, as a metric."""
        chosen = (server.get("heur") or {}).get("chosen")
        return {**super().run_metrics(server), **({} if chosen is None else {"cgpfl_heur_chosen_k": float(chosen)})}
