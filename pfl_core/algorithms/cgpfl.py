"""CGPFL and CGPFL-Heur (Tang, Guo, Guo, IJCAI 2022): personalized FL with contextualized
generalization.

The server keeps K context models Omega_K = [omega_1..omega_K] and an assignment of clients to
contexts (P^t of the paper, kept as ``server["assign"]``: client id -> context). Per round
(CGPFL paper, Algorithm 1; docs/papers/cgpfl.md):

1. every client i receives omega_{k(i)} (line 2, line 4: Omega_{I,0} = Omega_K J^t);
2. R local rounds (lines 6-11), each: one mini-batch, S steps theta <- theta - eta grad F_i(theta)
   with F_i(theta) = f_i(theta) + lam/2 ||theta - omega_{i,r}||^2, then the omega update (line 10).
   This is :func:`pfl_core.algorithms.pfedme.prox_local_rounds`, the pFedMe mechanism itself;
3. clients upload omega_{i,R}; the server runs k-means++ on them (line 13) -> P^{t+1};
4. Omega^{t+1} = (1 - alpha) Omega^t + alpha * Omega_{I,R} P^{t+1} (line 14): each context moves
   toward the plain mean of its members' uploads (p_{k,j} = 1/|C_k|, Eq. 2).

The scored model is ``predictor`` (shared with pFedMe): by default the client's local model
omega_{i,R} = w_i, as the pFedMe code scores "PM"; ``predictor="theta"`` scores theta_i, the
Algorithm 1 output Theta^T_I. theta_i starts each round at the received context model
(``theta_start="received"``, pFedMe code), or carries over (``"persist"``). The CGPFL paper says
neither; following the pFedMe code keeps CGPFL(K=1) = pFedMe (Eq. 2 remark).

Reconstruction choices (named switches, CGPFL spec):

* ``omega_update``: ``pfedme_equivalent`` (default) omega <- omega - lr*lam*(omega - theta): with
  K = 1 exactly pFedMe's local update. ``paper_literal``: omega <- omega - lr*(2/N)(omega - theta),
  the reconstructed grad_omega G = (2/N)(omega - theta) of Algorithm 1 line 10 with beta = lr and
  N = ``literal_n``. In both modes the theta step is ``personal_lr``.
* Clustering: scikit-learn ``KMeans`` (k-means++, ``kmeans_n_init`` = 10 restarts, at most
  ``kmeans_max_iter`` = 300 Lloyd iterations) on flattened float64 parameter vectors, written in
  an orthonormal basis of their span first (:func:`span_coordinates`: same distances, same labels,
  milliseconds instead of a third of a DNN round). Its labels
  define P^{t+1}; the new centres are then recomputed in torch as the member means, i.e. exactly
  Omega_{I,R} P^{t+1} (equal to KMeans' centroids at convergence). With K = 1 no KMeans is run
  (every client is in the one context), so CGPFL(K=1) reduces to pFedMe with uniform weights and
  beta = alpha, bit for bit.
* Seeding: the algorithm does not see the run seed, so round t's k-means uses
  ``random_state = SeedSequence([run seed stream, kmeans_seed, t])``: it follows the run seed.
* An empty context (possible when uploads coincide) keeps its previous centre (a harness choice).
* ``cluster_alignment``: ``hungarian`` (default) matches the new clusters to the previous centres
  by minimum total squared distance before the alpha-step; with alpha = 1 (the paper's value) this
  only renames contexts and changes no model. ``none`` uses KMeans' label order (for alpha < 1 the
  paper does not specify the alignment).
* Initialization: Omega^0 = K copies of the initial model omega^0, theta_i^0 = omega^0 (the model
  received), P^0 = every client in context 0 (all centres are equal, so it does not matter).

CGPFL-Heur (paper Section 4.4), which chooses K once, is :mod:`pfl_core.algorithms.cgpfl_heur`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
import torch

from pfl_core.algorithms import METHODS
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.algorithms.pfedme import ProxHyper, ProxProgram, mix, personal_predictor
from pfl_core.fields import PositiveInt, Tune
from pfl_core.training import Params, average_params, clone_params



@dataclass
class CGPFLHyper(ProxHyper):
    """CGPFL hyperparameters; defaults are CGPFL Table 1 (MNIST/FMNIST MLR) and harness
    choices. The shared proximal fields (lr, personal_lr, lam, inner_steps = S,
    local_rounds = R, hidden_l2, predictor, theta_start) are documented on :class:`ProxHyper`."""

    num_clusters: Annotated[PositiveInt, Tune(2, 8, order=3)] = 4
    """K, the number of context models (CGPFL Table 1: CGPFL (K = 4))."""
    alpha: float = 1.0
    """alpha, the server step of Algorithm 1 line 14 (Table 1 caption: 1; alpha = 1 -> centroids)."""
    omega_update: Literal["pfedme_equivalent", "paper_literal"] = "pfedme_equivalent"
    """``pfedme_equivalent`` (a harness choice: omega <- omega - lr*lam*(omega - theta)) or
    ``paper_literal`` (omega <- omega - lr*(2/N)*(omega - theta), Algorithm 1 line 10 as printed)."""
    literal_n: int = 40
    """N in the paper-literal factor 2/N (CGPFL Table 1: N = 40). Unused in pfedme_equivalent mode."""
    kmeans_seed: int = 0
    """Base seed of the per-round k-means (harness default; the paper gives none)."""
    kmeans_n_init: int = 10
    """k-means++ restarts (a harness choice, scikit-learn KMeans semantics)."""
    kmeans_max_iter: int = 300
    """Maximum Lloyd iterations per restart (a harness choice)."""
    cluster_alignment: Literal["hungarian", "none"] = "hungarian"
    """``hungarian``: match new clusters to the old centres before the alpha-step; ``none``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_clusters < 1:
            raise ValueError(f"num_clusters must be >= 1, got {self.num_clusters}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    @property
    def pull_rate(self) -> float:
        """The rate of the omega update ``omega <- omega - rate*(omega - theta)`` (line 10)."""
        if self.omega_update == "pfedme_equivalent":
            return self.lr * self.lam
        return self.lr * 2.0 / self.literal_n


@dataclass
class ContextUpdate(ClientUpdate):
    """A client upload that names its client (the server re-clusters clients every round)."""

    cid: int = -1


@dataclass
class KMeansFit:
    k: int
    labels: np.ndarray
    cost: float = 0.0
    """Weighted cost sum_i (m_i/m) ||x_i - c_{label_i}||^2 against the member means."""
    objective: float = field(default=float("nan"))


def flatten(params: Params) -> np.ndarray:
    """One float64 vector of all parameters (sorted by name for a stable layout)."""
    return torch.cat([params[k].detach().reshape(-1).double().cpu() for k in sorted(params)]).numpy()


def kmeans_labels(x: np.ndarray, k: int, seed: int, n_init: int = 10, max_iter: int = 300) -> np.ndarray:
    """k-means++ labels (scikit-learn KMeans, Euclidean, ``n_init`` restarts); k = 1: all zeros."""
    if k > len(x):
        raise ValueError(f"cannot cluster {len(x)} client models into K={k} contexts (K > clients)")
    if k == 1:
        return np.zeros(len(x), dtype=np.int64)
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    z = span_coordinates(x)
    # scikit-learn's tolerance is tol * (mean per-feature variance); the total variance is kept by
    # the change of coordinates, so scaling by (features before / after) keeps its default 1e-4
    tol = 1e-4 * x.shape[1] / z.shape[1]
    # N = 40 points: one BLAS/OpenMP thread is fastest (threads next to torch's pool contend badly)
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore")  # fewer distinct points than K: sklearn warns, we keep centres
        km = KMeans(n_clusters=k, init="k-means++", n_init=n_init, max_iter=max_iter, tol=tol, random_state=seed)
        return km.fit_predict(z).astype(np.int64)


def span_coordinates(x: np.ndarray) -> np.ndarray:
    """The n points ``x`` (n x d) centred and written in an orthonormal basis of their span (at most
    n coordinates; R^T of the QR factorisation of the centred x^T). Every distance between points
    and means of points is unchanged up to float rounding, so k-means labels are the same while a
    round's clustering of 40 DNN uploads (about 10^5 parameters each) costs milliseconds instead of a third of the
    round (``benchmarks.timing.speed`` workload ``cgpfl-mnist``). scikit-learn centres the data itself too.
    d <= n: only centred."""
    points = torch.from_numpy(x)
    centred = points - points.mean(0)
    if x.shape[1] <= x.shape[0]:
        return centred.numpy()
    return torch.linalg.qr(centred.T, mode="r").R.T.contiguous().numpy()


def weighted_cost(x: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> float:
    """sum_i (m_i/m) ||x_i - mean of x_i's cluster||^2 (the cost of Theorem 4.2 / expression (11))."""
    cost = 0.0
    for k in np.unique(labels):
        members = labels == k
        centre = x[members].mean(axis=0)
        cost += float((weights[members] * ((x[members] - centre) ** 2).sum(axis=1)).sum())
    return cost / float(weights.sum())


def _align(old: list[Params], means: list[Params | None]) -> list[int]:
    """Permutation p with new cluster j -> context p[j], minimising sum ||mean_j - old_{p[j]}||^2."""
    from scipy.optimize import linear_sum_assignment

    old_x = np.stack([flatten(c) for c in old])
    cost = np.zeros((len(means), len(old)))
    for j, m in enumerate(means):
        if m is not None:
            cost[j] = ((old_x - flatten(m)) ** 2).sum(axis=1)
    rows, cols = linear_sum_assignment(cost)
    perm = [0] * len(means)
    for r, c in zip(rows, cols):
        perm[r] = int(c)
    return perm


@METHODS.register("cgpfl")
class CGPFL(ProxProgram):
    """CGPFL, Algorithm 1. Server state: ``centers`` (Omega_K), ``assign`` (P^t as client ->
    context), ``round``, ``num_clusters``, and ``params`` (the size-weighted mean of the context
    models; a diagnostic "global" model, also what a never-trained client predicts with)."""

    hyper_class = CGPFLHyper

    def init_server(self, params: Params) -> ServerState:
        k = self._initial_k()
        centers = [clone_params(params) for _ in range(k or 1)]
        return {"params": params, "centers": centers, "assign": {}, "round": 0, "num_clusters": k,
                "sizes": [0] * len(centers)}

    def _initial_k(self) -> int | None:
        return self.hp.num_clusters

    # -- the client program: R local rounds from the client's context model (prox_local_rounds) ---
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        """omega_{k(i)} (Algorithm 1 line 4) and theta_i per ``theta_start``."""
        return self.start_carry(client, server["centers"][server["assign"].get(client.cid, 0)])

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        client.state.update(theta=carry["theta"], local=carry["w"])
        return ContextUpdate(carry["w"], client.num_samples("train"), loss, cid=client.cid)

    def _round_seed(self, round_idx: int) -> int:
        state = np.random.SeedSequence([self.seed, self.hp.kmeans_seed, round_idx]).generate_state(1)[0]
        return int(state)

    def _cluster(self, server: ServerState, x: np.ndarray, weights: np.ndarray) -> tuple[int, np.ndarray, dict]:
        k = server["num_clusters"]
        labels = kmeans_labels(x, k, self._round_seed(server["round"]), self.hp.kmeans_n_init,
                               self.hp.kmeans_max_iter)
        return k, labels, {}

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        uploads = [u for u in updates if u.params is not None]
        if not uploads:
            return server
        x = np.stack([flatten(u.params) for u in uploads])
        weights = np.array([float(u.num_samples) for u in uploads])
        k, labels, extra = self._cluster(server, x, weights)
        old = list(server["centers"])
        if len(old) != k:  # CGPFL-Heur's first round: K fixed now; all old centres are omega^0
            old = [clone_params(old[0]) for _ in range(k)]
        means: list[Params | None] = []
        for j in range(k):
            members = [u.params for u, lab in zip(uploads, labels) if lab == j]
            means.append(average_params(members, [1.0] * len(members)) if members else None)
        perm = _align(old, means) if self.hp.cluster_alignment == "hungarian" and k > 1 else list(range(k))
        centers, sizes = list(old), [0] * k
        for j, m in enumerate(means):
            target = perm[j]
            if m is not None:  # empty cluster: keep the previous centre
                centers[target] = mix(old[target], m, self.hp.alpha)
                sizes[target] = int((labels == j).sum())
        assign = dict(server["assign"])
        for u, lab in zip(uploads, labels):
            assign[u.cid] = perm[int(lab)]
        used = [(c, s) for c, s in zip(centers, sizes) if s > 0]
        summary = average_params([c for c, _ in used], [s for _, s in used])
        return {**server, **extra, "params": summary, "centers": centers, "assign": assign,
                "round": server["round"] + 1, "num_clusters": k, "sizes": sizes}

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        fallback = server["centers"][server["assign"].get(client.cid, 0)]
        return personal_predictor(self.hp, fallback, client)

    def run_info(self, server: ServerState) -> dict:
        """``cgpfl_contexts``: K, and the final context sizes (clients per context)."""
        return {"cgpfl_contexts": server["num_clusters"], "cgpfl_context_sizes": list(server["sizes"])}

    def run_metrics(self, server: ServerState) -> dict[str, float]:
        """``cgpfl_contexts``: K, as a metric (snapshots and reports read it per run)."""
        return {"cgpfl_contexts": float(server["num_clusters"])}
