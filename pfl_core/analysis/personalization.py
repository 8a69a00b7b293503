"""What FedL2P's meta-nets say about the clients (docs/papers/fedl2p.md): pure functions of the
per-client arrays the ``finetune_pretrained`` protocol logs (``personalization.npz``: ``beta``
[clients, 20], ``eta`` [clients, 62], ``xi`` [clients, 20], ``x`` [clients, 82], ``group``).

* Table 6: :func:`spectral_ari`, the Adjusted Rand Index between the clients' domains and a
  spectral clustering of one of those vectors;
* Figures 3 and 5: :func:`cluster_distance_map`, block (j, k) = log(d(j,k) / sqrt(d(j,j) d(k,k)));
* Figures 2 and 4: :func:`layer_distribution` (box-plot statistics of beta or eta per layer across
  clients) and :func:`lr_sparsity` (per client, the share of the per-tensor learning rates that are 0).

The post-run analysis ``personalization`` (``evaluation.analyses: [{name: personalization}]``, with
the :class:`ClusteringSettings` as parameters) applies them to a ``finetune_pretrained`` run: metrics
``ari_xi``, ``ari_beta``, ``ari_x``, ``ari_eta`` (clients' ``group`` as the domain) and
``lr_sparsity`` (mean over clients), and the artifact ``personalization_figures.npz``: ``domains``,
``dmap_<q>`` [D, D] per quantity, ``sparsity`` [clients], ``beta_box`` / ``eta_box`` [5, layers]
(min, q1, median, q3, max).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from pfl_core.fields import HyperParams
from pfl_core.analysis.base import ANALYSES, Analysis, AnalysisOutput
from pfl_core.fields import NonNegativeInt


@dataclass
class ClusteringSettings(HyperParams):
    """Table 6's spectral clustering. The paper says only "the default parameters for spectral
    clustering from scikit-learn" with the discretization label assignment of Yu & Shi (paper
    footnote 7, docs/papers/fedl2p.md); the affinity and the number of clusters are unknowns
    (docs/papers/fedl2p.md) and these defaults are a harness choice."""

    affinity: Literal["rbf", "nearest_neighbors"] = "rbf"
    """``rbf``: exp(-gamma ||a - b||^2) of the Euclidean distance between two clients' vectors
    (scikit-learn's default affinity; a harness choice)."""
    gamma: float = 1.0
    """RBF width; 1.0 is scikit-learn's default (a harness choice)."""
    assign_labels: Literal["discretize", "kmeans", "cluster_qr"] = "discretize"
    """Label assignment on the Laplacian embedding: the paper's "discretization approach" [58]."""
    n_clusters: NonNegativeInt = 0
    """Number of clusters; 0 = the number of distinct domains (a harness choice)."""
    random_state: int = 0
    """Seed of the eigen-solver's and the discretization's random initialisation."""


def spectral_clusters(features: np.ndarray, n_clusters: int,
                      settings: ClusteringSettings = ClusteringSettings()) -> np.ndarray:
    """Cluster labels of the rows of ``features`` [clients, dim] by spectral clustering."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2:
        raise ValueError(f"spectral clustering needs one vector per client ([clients, dim]), got shape "
                         f"{features.shape}")
    if not np.isfinite(features).all():
        raise ValueError("spectral clustering: the client vectors hold NaN or inf")
    if n_clusters >= len(features):  # every client its own cluster (Office-Caltech-10: 4 clients, 4 domains)
        return np.arange(len(features))
    from sklearn.cluster import SpectralClustering  # here: scikit-learn costs every run's process 0.5 s to import

    model = SpectralClustering(n_clusters=n_clusters, affinity=settings.affinity, gamma=settings.gamma,
                               assign_labels=settings.assign_labels, random_state=settings.random_state)
    return model.fit_predict(features)


def spectral_ari(features: np.ndarray, domains: Sequence, settings: ClusteringSettings = ClusteringSettings()) -> float:
    """Table 6: ARI between ``domains`` (one label per client) and the spectral clusters of
    ``features`` (one of xi, beta, x, eta per client)."""
    domains = np.asarray(domains)
    if len(domains) != len(features):
        raise ValueError(f"spectral_ari: {len(features)} client vectors but {len(domains)} domain labels")
    n_clusters = settings.n_clusters or len(np.unique(domains))
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score(domains, spectral_clusters(features, n_clusters, settings)))


def pairwise_distances(features: np.ndarray) -> np.ndarray:
    """Euclidean distances between the rows of ``features`` [clients, dim] -> [clients, clients]."""
    f = np.asarray(features, dtype=np.float64)
    diff = f[:, None, :] - f[None, :, :]
    return np.sqrt((diff ** 2).sum(-1))


def cluster_distance_map(features: np.ndarray, domains: Sequence) -> tuple[np.ndarray, list]:
    """Figures 3 and 5: (map [D, D], the domains in sorted order). d(j, k) is the mean Euclidean
    distance over all pairs of clients of domains j and k; within a domain (j = k) over pairs of two
    distinct clients (a client's zero distance to itself is not a pair). Block (j, k) =
    log(d(j,k) / (sqrt d(j,j) sqrt d(k,k))), so the diagonal is 0 and an off-diagonal block > 0 means
    the domains are further apart than their clients within. A domain with a single client has no
    within-domain distance: its row and column are NaN (Office-Caltech-10 has one client per domain)."""
    domains = np.asarray(domains)
    if len(domains) != len(features):
        raise ValueError(f"cluster_distance_map: {len(features)} client vectors but {len(domains)} domain labels")
    dist = pairwise_distances(features)
    names = sorted(np.unique(domains).tolist())
    members = [np.flatnonzero(domains == name) for name in names]
    d = np.full((len(names), len(names)), np.nan)
    for j, a in enumerate(members):
        for k, b in enumerate(members):
            block = dist[np.ix_(a, b)]
            if j == k:
                d[j, k] = block[~np.eye(len(a), dtype=bool)].mean() if len(a) > 1 else np.nan
            else:
                d[j, k] = block.mean()
    within = np.sqrt(np.diag(d))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(d / np.outer(within, within)), names


def lr_sparsity(etas: np.ndarray) -> np.ndarray:
    """Figures 2 and 4: per client, the share of its learning rates (one per parameter tensor, 62
    for ResNet-18) that are exactly 0. Per tensor, not per parameter, as the authors' code
    computes it (docs/papers/fedl2p.md; the paper's footnote 6 says "parameters")."""
    etas = np.asarray(etas)
    if etas.ndim != 2:
        raise ValueError(f"lr_sparsity needs [clients, tensors] learning rates, got shape {etas.shape}")
    return (etas == 0).mean(axis=1)


def layer_distribution(values: np.ndarray) -> dict[str, np.ndarray]:
    """Figures 2 and 4: box-plot statistics per layer (column) of ``values`` [clients, layers]
    (beta per BN layer, or eta per parameter tensor) across clients: ``min``, ``q1``,
    ``median``, ``q3``, ``max``, ``mean`` (each [layers])."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 2:
        raise ValueError(f"layer_distribution needs [clients, layers] values, got shape {v.shape}")
    q = np.quantile(v, [0.0, 0.25, 0.5, 0.75, 1.0], axis=0)
    return {"min": q[0], "q1": q[1], "median": q[2], "q3": q[3], "max": q[4], "mean": v.mean(0)}


#: the quantities of Table 6, as named in the ``personalization`` arrays of ``finetune_pretrained``
QUANTITIES = ("xi", "beta", "x", "eta")
#: the metrics of the ``personalization`` analysis
PERSONALIZATION_METRICS = (*(f"ari_{q}" for q in QUANTITIES), "lr_sparsity")


@ANALYSES.register("personalization")
class Personalization(Analysis):
    """Table 6 and Figures 2-5 from the per-client arrays of a ``finetune_pretrained`` run."""

    params_class = ClusteringSettings

    def run(self, setup, result) -> AnalysisOutput:
        arrays = result.final.arrays.get("personalization") if result.final is not None else None
        if arrays is None:
            raise ValueError("analysis 'personalization' reads the per-client arrays of protocol "
                             "finetune_pretrained: set evaluation.protocol: finetune_pretrained")
        domains = arrays["group"]
        if len(np.unique(domains)) < 2:
            raise ValueError("analysis 'personalization' clusters clients by their meta group (domain), but the "
                             f"evaluated clients have {len(np.unique(domains))} group(s); use a dataset with "
                             "domains (office_caltech10, domainnet, cifar10c)")
        metrics = {f"ari_{q}": spectral_ari(arrays[q], domains, self.params) for q in QUANTITIES}
        sparsity = lr_sparsity(arrays["eta"])
        metrics["lr_sparsity"] = float(sparsity.mean())
        figures: dict[str, np.ndarray] = {"sparsity": sparsity}
        for q in QUANTITIES:
            figures[f"dmap_{q}"], names = cluster_distance_map(arrays[q], domains)
        figures["domains"] = np.array(names)
        for q in ("beta", "eta"):
            stats = layer_distribution(arrays[q])
            figures[f"{q}_box"] = np.stack([stats[k] for k in ("min", "q1", "median", "q3", "max")])
        return AnalysisOutput(metrics, {"personalization_figures": figures})
