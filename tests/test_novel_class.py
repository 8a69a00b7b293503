"""The novel-class protocol of MetaVers' Table 6: group construction (fold sizes, disjointness,
determinism), the accuracy and CI on a toy embedding, test evaluated only on a validation
improvement, and the protocol inside a run."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from pfl_core.data.federated import ArrayDataset
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation import PROTOCOLS
from pfl_core.evaluation.novel_class import draw_group, group_accuracy, novel_class_accuracy
from tests.helpers import make_method

SIZES = [60 + c for c in range(8)]  # 60..67 images per class, contiguous rows
CLASS_ROWS = {c: np.arange(sum(SIZES[:c]), sum(SIZES[:c + 1])) for c in range(8)}


def test_a_group_has_ways_classes_cut_into_disjoint_folds_of_near_equal_size():
    group = draw_group(CLASS_ROWS, ways=5, users=10, rng=np.random.default_rng(0))
    assert len(set(group.classes)) == 5 and set(group.classes) <= set(CLASS_ROWS)
    all_rows = np.concatenate([*group.support, *group.query])
    assert len(all_rows) == len(set(all_rows.tolist()))  # users and halves are disjoint
    assert sorted(all_rows.tolist()) == sorted(np.concatenate([CLASS_ROWS[c] for c in group.classes]).tolist())
    for support, query in zip(group.support, group.query):
        user = np.concatenate([support, query])
        for c in group.classes:
            n = len(CLASS_ROWS[c])
            assert np.isin(user, CLASS_ROWS[c]).sum() in (n // 10, n // 10 + 1)  # one KFold fold per class
        assert (len(support), len(query)) == (math.ceil(len(user) / 2), len(user) // 2)  # KFold(2): halves


def test_groups_are_a_function_of_the_rng_only():
    a = draw_group(CLASS_ROWS, 5, 10, np.random.default_rng(3))
    b = draw_group(CLASS_ROWS, 5, 10, np.random.default_rng(3))
    c = draw_group(CLASS_ROWS, 5, 10, np.random.default_rng(4))
    assert a.classes == b.classes
    assert all(np.array_equal(x, y) for x, y in zip(a.support + a.query, b.support + b.query))
    assert a.classes != c.classes or not all(np.array_equal(x, y) for x, y in zip(a.support, c.support))


def toy_embedding(separable: bool):
    """Class c's images embedded at (c, 0) (+ noise when not separable), labels 0..7."""
    rows = sum(SIZES)
    labels = torch.repeat_interleave(torch.arange(8), torch.tensor(SIZES))
    gen = torch.Generator().manual_seed(0)
    emb = torch.stack([labels.double(), torch.zeros(rows, dtype=torch.float64)], 1)
    if not separable:
        emb = emb + 3 * torch.randn(rows, 2, generator=gen, dtype=torch.float64)
    return emb, labels


def test_accuracy_is_the_mean_over_users_then_groups_with_the_95_percent_ci():
    emb, labels = toy_embedding(separable=True)
    acc, ci = novel_class_accuracy(emb, labels, 4, 5, 2, np.random.default_rng(0))  # 2 users: 30 per class
    assert (acc, ci) == (1.0, 0.0)
    emb, labels = toy_embedding(separable=False)
    groups = [draw_group(CLASS_ROWS, 5, 2, np.random.default_rng(7))]
    rng = np.random.default_rng(1)
    per_group = [group_accuracy(emb, labels, draw_group(CLASS_ROWS, 5, 10, rng)) for _ in range(6)]
    acc, ci = novel_class_accuracy(emb, labels, 6, 5, 10, np.random.default_rng(1))
    assert acc == pytest.approx(np.mean(per_group)) and 0.2 < acc < 0.9
    assert ci == pytest.approx(1.96 * np.std(per_group) / math.sqrt(6))
    # one group by hand: per user, nearest support prototype on the query
    group = groups[0]
    accs = []
    for support, query in zip(group.support, group.query):
        protos = {c: emb[support][labels[support] == c].mean(0) for c in group.classes}
        hits = [min(protos, key=lambda c: float((emb[q] - protos[c]).pow(2).sum())) == int(labels[q]) for q in query]
        accs.append(np.mean(hits))
    assert group_accuracy(emb, labels, group) == pytest.approx(np.mean(accs))


class Coordinates(nn.Module):
    """Embeds a 1x1x2 image as its two pixels, scaled by ``scale`` (a parameter)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x, embed=False):
        return x.flatten(1) * self.scale


def novel_split(seed):
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(6).repeat_interleave(20)
    x = torch.stack([y.float(), torch.zeros(120)], 1) + 2.0 * torch.randn(120, 2, generator=gen)
    return ArrayDataset("novel", x.view(120, 1, 1, 2), y, 6)


def test_the_protocol_evaluates_test_only_when_validation_improves():
    model = Coordinates()
    algorithm = make_method("fedavg", model)
    server = algorithm.init_server({"scale": torch.ones(())})
    protocol = PROTOCOLS.get("novel_class")(EvalConfig(groups_val=3, groups_test=4, users=4))
    protocol.bind({"val": novel_split(0), "test": novel_split(1)})
    history = []
    for k in range(3):
        history.append({"round": k + 1, **protocol.evaluate(algorithm, server, {}, None, history).summary})
    first = history[0]
    assert set(first) == {"round", "val_acc", "val_acc_ci95", "acc", "acc_ci95", "test_at_best_val",
                          "test_at_best_val_ci95"}
    best = first["val_acc"]
    for row in history[1:]:  # each evaluation draws new groups (evaluation number in the stream)
        improved = row["val_acc"] > best
        assert ("acc" in row) == improved
        best = max(best, row["val_acc"])
        last = [r for r in history[:history.index(row) + 1] if "acc" in r][-1]
        assert row["test_at_best_val"] == last["acc"]
    assert len({row["val_acc"] for row in history}) > 1
    again = PROTOCOLS.get("novel_class")(EvalConfig(groups_val=3, groups_test=4, users=4))
    again.bind({"val": novel_split(0), "test": novel_split(1)})
    assert again.evaluate(algorithm, server, {}, None, []).summary == {k: v for k, v in first.items() if k != "round"}


def test_tuning_never_reads_the_test_classes():
    protocol = PROTOCOLS.get("novel_class")(EvalConfig(groups_val=2, users=4), target="validation")
    assert protocol.dataset_splits == {"val": "val"}
    model = Coordinates()
    algorithm = make_method("fedavg", model)
    protocol.bind({"val": novel_split(0)})
    summary = protocol.evaluate(algorithm, algorithm.init_server({"scale": torch.ones(())}), {}, None, []).summary
    assert set(summary) == {"acc", "acc_ci95"}
