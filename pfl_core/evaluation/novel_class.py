"""The novel-class protocol of MetaVers' Table 6 (docs/papers/metavers.md; ``util_novel_class.py``
``evaluation`` of the authors' code): protocol ``novel_class``.

At every evaluation the global model embeds the images of classes it never trained on, held in
separate dataset splits (``evaluation.params.novel_val_split`` / ``novel_test_split``: e.g. the
CIFAR-100 class-index split or mini-ImageNet's validation/test classes), and for each of ``groups``
groups:

1. ``ways`` (5) classes are drawn at random from the split, without replacement;
2. each class's images are cut into ``users`` (10) folds by scikit-learn's ``KFold(shuffle=True)``;
   fold j of every class is test user j (about 60 images per class);
3. each user's images are cut into random halves by ``KFold(2, shuffle=True)`` (not stratified;
   the code keeps the last of the two splits: support = the first fold's ``ceil(n/2)`` images,
   query = the other ``floor(n/2)``); the query is classified by the nearest support prototype
   (squared Euclidean) among the group's classes;
4. accuracy = the mean over users, then over groups; ``ci95`` = 1.96 std (ddof 0) / sqrt(groups).

Validation uses ``groups_val`` (500) groups at every evaluation; the test split is evaluated
(``groups_test``: 1000) only when the validation accuracy beats every earlier one (strictly, from
0, as the code). Keys: ``val_acc``, ``val_acc_ci95`` always; ``acc``, ``acc_ci95`` on improving
evaluations; ``test_at_best_val`` (and its ``_ci95``), the test accuracy of the last improvement so
far: the number Table 6 reports. Early stopping as the code: ``federation.patience_rule: no_best``,
``early_stopping_after: 0``, ``early_stopping_key: val_acc``.

The embeddings are computed once per split and evaluation, in eval mode (BatchNorm with its running
statistics, docs/papers/metavers.md; a model with BN state embeds with
the server's ``buffers``, the statistics its method kept), so they do not depend on how
images are batched: the same numbers as the code's one batch per user. Groups are drawn from their
own stream (run seed, split, evaluation number), the same for every method.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pfl_core.engine.contract import ClientContext, ClientProgram, ServerState
from pfl_core.data.federated import ArrayDataset, FederatedData
from pfl_core.evaluation.config import EvalConfig
from pfl_core.evaluation.protocol import PROTOCOLS, Protocol
from pfl_core.evaluation.results import EvalResult
from pfl_core.evaluation.proto import eval_mode
from pfl_core.prototypes import class_prototypes, nearest_prototype
from pfl_core.training import Params, embed

#: the summary keys of the ``novel_class`` protocol beyond ``acc`` (``val_`` variants too)
NOVEL_KEYS = ("acc_ci95", "test_at_best_val", "test_at_best_val_ci95")


@dataclass
class Group:
    """One group: its ``classes`` and, per user, the dataset rows of its support and query."""

    classes: list[int]
    support: list[np.ndarray]
    query: list[np.ndarray]


def draw_group(class_rows: dict[int, np.ndarray], ways: int, users: int, rng: np.random.Generator) -> Group:
    """One group (module docstring, steps 1-3): ``class_rows`` maps each class of the split to its
    dataset rows."""
    from sklearn.model_selection import KFold  # here: scikit-learn costs every run's process 1 s to import

    classes = [int(c) for c in rng.choice(sorted(class_rows), ways, replace=False)]
    folds = KFold(n_splits=users, shuffle=True, random_state=int(rng.integers(2**31)))
    members: list[list[np.ndarray]] = [[] for _ in range(users)]
    for c in classes:
        rows = class_rows[c]
        for u, (_, fold) in enumerate(folds.split(rows)):
            members[u].append(rows[fold])
    support, query = [], []
    for parts in members:
        rows = np.concatenate(parts)
        halves = KFold(n_splits=2, shuffle=True, random_state=int(rng.integers(2**31)))
        *_, (support_pos, query_pos) = halves.split(rows)  # the code keeps the last split
        support.append(rows[support_pos])
        query.append(rows[query_pos])
    return Group(classes, support, query)


def group_accuracy(embeddings: torch.Tensor, labels: torch.Tensor, group: Group) -> float:
    """The mean over the group's users of the nearest-prototype accuracy on their query."""
    accs = []
    classes = torch.tensor(sorted(group.classes), device=labels.device)
    for support, query in zip(group.support, group.query):
        s = torch.as_tensor(support, device=labels.device)
        q = torch.as_tensor(query, device=labels.device)
        s_y = torch.searchsorted(classes, labels[s])
        q_y = torch.searchsorted(classes, labels[q])
        protos = class_prototypes(embeddings[s], s_y, len(group.classes))
        present = torch.bincount(s_y, minlength=len(group.classes)) > 0  # a class without support: none
        accs.append((nearest_prototype(embeddings[q], protos, present) == q_y).double().mean())
    return float(torch.stack(accs).mean())


def novel_class_accuracy(embeddings: torch.Tensor, labels: torch.Tensor, groups: int, ways: int, users: int,
                         rng: np.random.Generator) -> tuple[float, float]:
    """(mean accuracy, 95% CI half-width) over ``groups`` groups drawn from ``rng``."""
    y = labels.cpu().numpy()
    class_rows = {int(c): np.flatnonzero(y == c) for c in np.unique(y)}
    if len(class_rows) < ways:
        raise ValueError(f"novel_class: the split has {len(class_rows)} classes, fewer than ways={ways}")
    accs = [group_accuracy(embeddings, labels, draw_group(class_rows, ways, users, rng)) for _ in range(groups)]
    return float(np.mean(accs)), 1.96 * float(np.std(accs)) / math.sqrt(groups)


@PROTOCOLS.register("novel_class")
class NovelClassEval(Protocol):
    """Table 6's protocol (module docstring). :func:`pfl_core.experiment.prepare_run` hands it the
    novel-class splits (:meth:`bind`); only the validation split when tuning."""

    bn_mode = "eval"

    seed = 0
    """Set per run (the evaluation stream of the run seed) by :func:`pfl_core.experiment.prepare_run`."""

    def __init__(self, cfg: EvalConfig, target: str = "test"):
        super().__init__(cfg, target)
        self.data: dict[str, ArrayDataset] = {}

    @property
    def dataset_splits(self) -> dict[str, str]:
        """role (val/test) -> dataset split name to load."""
        roles = {"val": self.cfg.novel_val_split}
        if self.target == "test":
            roles["test"] = self.cfg.novel_test_split
        return roles

    def bind(self, data: dict[str, ArrayDataset]) -> None:
        self.data = data

    def client_ids(self, fed: FederatedData) -> list[int]:
        """No client is evaluated (the global model meets new classes); a split loaded whole
        beside the clients (``data.pool_splits``, ``FederatedData.pools``) serves its role."""
        for role, split in self.dataset_splits.items():
            if role not in self.data and split in fed.pools:
                self.data[role] = fed.dataset.subset(fed.pools[split])
        return []

    @torch.no_grad()
    def _embed(self, algorithm: ClientProgram, params: Params, dataset: ArrayDataset) -> torch.Tensor:
        size = self.cfg.batch_size or 256
        rows = torch.arange(len(dataset), device=dataset.y.device)
        with eval_mode(algorithm.model) as model:
            return torch.cat([embed(model, params, dataset.batch(chunk)[0]) for chunk in rows.split(size)])

    def _split(self, role: str, algorithm: ClientProgram, params: Params, groups: int, evaluation: int):
        if role not in self.data:
            raise ValueError(f"protocol 'novel_class' has no {role!r} data: the run must load split "
                             f"{self.dataset_splits[role]!r} of its dataset (evaluation.params.novel_{role}_split)")
        dataset = self.data[role]
        rng = np.random.default_rng([self.seed, ("val", "test").index(role), evaluation])
        return novel_class_accuracy(self._embed(algorithm, params, dataset), dataset.y, groups,
                                    self.cfg.ways, self.cfg.users, rng)

    def evaluate(self, algorithm: ClientProgram, server: ServerState, contexts: dict[int, ClientContext],
                 executor=None, history: list[dict] | None = None) -> EvalResult:
        history = history or []
        params = {**algorithm.predictor(server, None), **(server.get("buffers") or {})}
        val, val_ci = self._split("val", algorithm, params, self.cfg.groups_val, len(history))
        if self.target == "validation":
            return EvalResult([], {"acc": val, "acc_ci95": val_ci})
        summary = {"val_acc": val, "val_acc_ci95": val_ci}
        best = max([0.0, *(row["val_acc"] for row in history if "val_acc" in row)])
        if val > best:
            test, test_ci = self._split("test", algorithm, params, self.cfg.groups_test, len(history))
            summary.update(acc=test, acc_ci95=test_ci)
        improved = [row for row in [*history, summary] if "acc" in row]
        if improved:
            summary["test_at_best_val"] = improved[-1]["acc"]
            summary["test_at_best_val_ci95"] = improved[-1]["acc_ci95"]
        return EvalResult([], summary)
