"""pFedGP's GP tree (``gp_head: tree_pg``): a binary tree over a client's classes whose internal
nodes are Polya-Gamma augmented binary GP classifiers (pFedGP code: ``pFedGP/tree.py``,
``class_splits.py``, ``pFedGP_full_data.py``). Host-side code: the tree's shape depends on the
data, so this head runs on the sequential path.

Tree (built from the current backbone's features of the client's whole train split, breadth
first): a node with two classes sends the smaller label left; a node with more classes splits them
into two groups by 2-means on the class mean features (the code: scikit-learn ``KMeans(2,
n_init=50, random_state=42)``; here the exact optimum, see :func:`two_means`). Each node with two or more classes holds a binary GP: "left" is its
class 0, with likelihood sigmoid(f) for class 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pfl_core.algorithms._lib import gp


@dataclass(frozen=True)
class TreeNode:
    """An internal node: the dataset labels of its left and right branches."""

    left: tuple[int, ...]
    right: tuple[int, ...]

    @property
    def classes(self) -> tuple[int, ...]:
        return self.left + self.right


EXHAUSTIVE_SPLIT_CLASSES = 12
"""Up to this many classes a node's 2-means split is found exhaustively (at most 2,047 partitions)."""


def two_means(points: torch.Tensor) -> list[int]:
    """Cluster (0/1) of each row of ``points`` minimising the 2-means objective (within-cluster sum
    of squared distances to the centroid), point 0 in cluster 0. Exhaustive up to
    ``EXHAUSTIVE_SPLIT_CLASSES`` points, the global optimum that the code's ``KMeans(n_init=50)``
    looks for by restarts; beyond, scikit-learn's ``KMeans(2, n_init=50, random_state=42)``."""
    n = points.shape[0]
    if n > EXHAUSTIVE_SPLIT_CLASSES:
        from sklearn.cluster import KMeans

        labels = KMeans(n_clusters=2, n_init=50, random_state=42).fit(points.cpu().numpy()).labels_.tolist()
        return [a ^ labels[0] for a in labels]
    codes = torch.arange(1, 2 ** (n - 1), device=points.device)
    right = ((codes.unsqueeze(1) >> torch.arange(n - 1, device=points.device)) & 1).bool()  # points 1..n-1
    right = torch.cat([torch.zeros(len(codes), 1, dtype=torch.bool, device=points.device), right], 1)
    cost = torch.zeros(len(codes), dtype=points.dtype, device=points.device)
    for members in (~right, right):
        weights = members.to(points.dtype)
        centroid = weights @ points / weights.sum(1, keepdim=True)
        cost += (weights * ((points.unsqueeze(0) - centroid.unsqueeze(1)) ** 2).sum(-1)).sum(1)
    return right[int(cost.argmin())].long().tolist()


def split_classes(classes: list[int], features: torch.Tensor, labels: torch.Tensor) -> TreeNode:
    """The two branches of a node over ``classes`` (sorted): by label for two, else 2-means on the
    class mean features (the smallest label's cluster goes left: a node GP is symmetric under
    swapping its branches, so this fixes only the naming)."""
    if len(classes) == 2:
        return TreeNode((classes[0],), (classes[1],))
    means = torch.stack([features[labels == c].mean(0) for c in classes]).detach().double()
    assignment = two_means(means)
    left = tuple(c for c, a in zip(classes, assignment) if a == 0)
    right = tuple(c for c, a in zip(classes, assignment) if a == 1)
    return TreeNode(left, right)


def build_tree(features: torch.Tensor, labels: torch.Tensor) -> list[TreeNode]:
    """The internal nodes, breadth first (none for a client with a single class)."""
    nodes, queue = [], [sorted(labels.unique().tolist())]
    while queue:
        classes = queue.pop(0)
        if len(classes) < 2:
            continue
        node = split_classes(classes, features, labels)
        nodes.append(node)
        queue += [list(node.left), list(node.right)]
    return nodes


@dataclass(frozen=True)
class GibbsSettings:
    draws: int
    steps: int
    pg_terms: int


class TreeGP:
    """The kernel and the Gibbs settings shared by the nodes of every client's tree."""

    def __init__(self, outputscale: float, lengthscale: float, jitter: float, train: GibbsSettings,
                 test: GibbsSettings, predict_ratio: float):
        self.outputscale, self.lengthscale, self.jitter = outputscale, lengthscale, jitter
        self.train, self.test, self.predict_ratio = train, test, predict_ratio

    def kernel(self, z: torch.Tensor) -> torch.Tensor:
        """The joint kernel of the rows of ``z`` plus the code's jitter on the diagonal."""
        eye = torch.eye(z.shape[0], dtype=z.dtype, device=z.device)
        return gp.rbf_kernel(z, z, self.outputscale, self.lengthscale) + self.jitter * eye

    def node_probs(self, fit_z, fit_left, test_z, settings: GibbsSettings, generator) -> torch.Tensor:
        """P(left) at ``test_z`` from a node GP conditioned on ``fit_z`` with ``fit_left`` (bool)."""
        kappa = fit_left.to(fit_z.dtype) - 0.5
        k_all = self.kernel(torch.cat([fit_z, test_z]))
        n = fit_z.shape[0]
        omega = gp.pg_gibbs(k_all[:n, :n].detach(), kappa, settings.draws, settings.steps, generator,
                            settings.pg_terms)
        return gp.pg_predictive_probs(k_all, n, kappa, omega)

    def loss(self, z: torch.Tensor, y: torch.Tensor, tree: list[TreeNode], generator) -> torch.Tensor:
        """Sum over nodes of the predictive-likelihood objective: per node, each branch's samples
        are split at random (``int(n * predict_ratio)`` held out), the GP is fitted to the rest and
        the cross-entropy of its predictions on the held-out part is averaged."""
        total = z.sum() * 0.0
        for node in tree:
            left = torch.isin(y, torch.tensor(node.left, device=y.device))
            fit, held = [], []
            for branch in (left, ~left & torch.isin(y, torch.tensor(node.right, device=y.device))):
                rows = branch.nonzero().squeeze(1)
                rows = rows[torch.randperm(rows.numel(), generator=generator).to(rows.device)]
                k = int(rows.numel() * self.predict_ratio)
                held.append(rows[:k])
                fit.append(rows[k:])
            fit, held = torch.cat(fit), torch.cat(held)
            if held.numel() == 0:
                continue
            p_left = self.node_probs(z[fit], left[fit], z[held], self.train, generator)
            p_true = torch.where(left[held], p_left, 1.0 - p_left)
            total = total - torch.log(p_true + 1e-12).mean()
        return total

    def fit_tree(self, train_z, train_y, tree: list[TreeNode], generator) -> list[tuple]:
        """Every node's GP conditioned on all its train samples (test Gibbs settings), kept for
        predicting any number of test batches (the code reuses the first batch's Gibbs state)."""
        return self.factor_tree(train_z, train_y, tree, self.gibbs_tree(train_z, train_y, tree, generator))

    def _node_data(self, train_z, train_y, node: TreeNode):
        """A node's train features, kappa (+1/2 left, -1/2 right) and kernel."""
        rows = torch.isin(train_y, torch.tensor(node.classes, device=train_y.device))
        fit_z = train_z[rows]
        kappa = torch.isin(train_y[rows], torch.tensor(node.left, device=train_y.device)).to(fit_z.dtype) - 0.5
        return fit_z, kappa, self.kernel(fit_z)

    def gibbs_tree(self, train_z, train_y, tree: list[TreeNode], generator) -> list[torch.Tensor]:
        """The final Polya-Gamma draws omega [draws, N_node] of every node (breadth first), the
        Gibbs chains in the order :meth:`fit_tree` runs them."""
        omegas = []
        for node in tree:
            _, kappa, k = self._node_data(train_z, train_y, node)
            omegas.append(gp.pg_gibbs(k, kappa, self.test.draws, self.test.steps, generator, self.test.pg_terms))
        return omegas

    def factor_tree(self, train_z, train_y, tree: list[TreeNode], omegas: list[torch.Tensor]) -> list[tuple]:
        """:meth:`fit_tree` from the nodes' Gibbs draws (the posterior factors only)."""
        fitted = []
        for node, omega in zip(tree, omegas, strict=True):
            fit_z, kappa, k = self._node_data(train_z, train_y, node)
            fitted.append((node, fit_z, *gp.pg_posterior_factor(k, kappa, omega)))
        return fitted

    def class_probs(self, fitted: list[tuple], present: torch.Tensor, test_z: torch.Tensor) -> torch.Tensor:
        """[M, classes] class probabilities: the product of the branch probabilities along every
        path (the code's ``eval_tree_full_path``); ``present`` (0/1 per class) zeroes the classes
        the client has no training sample of."""
        probs = present.to(test_z.dtype).expand(test_z.shape[0], present.numel()).clone()
        k_diag = torch.full((test_z.shape[0],), self.outputscale + self.jitter, dtype=test_z.dtype,
                            device=test_z.device)
        for node, fit_z, chol, alpha in fitted:
            k_cross = gp.rbf_kernel(fit_z, test_z, self.outputscale, self.lengthscale)
            p_left = gp.pg_predict(k_cross, k_diag, chol, alpha)
            probs[:, list(node.left)] *= p_left.unsqueeze(1)
            probs[:, list(node.right)] *= (1.0 - p_left).unsqueeze(1)
        return probs
