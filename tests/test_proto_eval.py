"""Protocol ``proto`` (MetaVers ``proto_eval``, the ``-Proto`` evaluation of Table 3) and nVAR
(Table 4): hand computations on a toy embedding, pooled vs unweighted accuracy, the batched path
against the sequential one (float64), and the protocol inside a federation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pfl_core.config import FederationConfig
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.engine import Executor
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation import PROTOCOLS
from pfl_core.federation import make_contexts, run_federation
from pfl_core.models import build_model
from pfl_core.evaluation.proto import nvar
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.helpers import make_method, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


class Identity2d(nn.Module):
    """A toy model whose embedding is its 2-d input (``x @ I``)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.eye(2, dtype=torch.float64))

    def forward(self, x, embed=False):
        return x @ self.w


# rows: (x, y, label); client 0 has classes 0 and 1, client 1 classes 1 and 2
ROWS = {
    0: {"train": [((0, 2), 0), ((0, 4), 0), ((4, 0), 1), ((6, 0), 1)],        # prototypes (0,3), (5,0)
        "val": [((0, 3), 0), ((5, 1), 0)],                                      # right, wrong: 1/2
        "test": [((0.1, 0.1), 0),  # nearest overall: client 1's class-2 prototype (0.1,0.1); own: 0, right
                 ((4, 1), 1),      # right
                 ((3, 3), 1),      # |.-(0,3)|^2 = 9 < |.-(5,0)|^2 = 13: predicted 0, wrong
                 ((1, 1), 2)]},    # a class the client has no prototype of: wrong
    1: {"train": [((0, 0), 2), ((0.2, 0.2), 2), ((10, 10), 1), ((10, 12), 1)],  # (0.1,0.1), (10,11)
        "val": [((0, 0), 2)],                                                   # right: 1/1
        "test": [((1, 0), 2), ((9, 9), 2), ((10, 10), 1)]},                     # right, wrong, right: 2/3
}


def toy_federation() -> FederatedData:
    xs, ys, clients = [], [], []
    for cid, splits in ROWS.items():
        index = {}
        for split, rows in splits.items():
            index[split] = torch.arange(len(xs), len(xs) + len(rows))
            xs += [r[0] for r in rows]
            ys += [r[1] for r in rows]
        clients.append(Client(cid, index))
    dataset = ArrayDataset("toy", torch.tensor(xs, dtype=torch.float64), torch.tensor(ys), 3)
    return FederatedData(dataset, clients, [0, 1], [])


def evaluate(fed, model, cfg: EvalConfig, execution="sequential", target="test", algorithm=None):
    algorithm = algorithm or make_method("fedavg", model)
    server = algorithm.init_server(model_params(model))
    protocol = PROTOCOLS.get("proto")(cfg, target)
    fcfg = FederationConfig(batch_size=2)
    contexts = make_contexts(fed, protocol.client_ids(fed), fcfg, RunStreams(0), "eval", 2)
    return protocol.evaluate(algorithm, server, contexts, Executor(execution))


def test_proto_eval_equals_a_hand_computation_with_own_class_prototypes_only():
    result = evaluate(toy_federation(), Identity2d(), EvalConfig(val_split="val", batch_size=3))
    assert [c.acc[0] for c in result.clients] == [pytest.approx(1 / 2), pytest.approx(2 / 3)]
    s = result.summary
    assert s["avg_acc"] == pytest.approx(4 / 7)  # pooled: (2 + 2) / (4 + 3), the reported number
    assert s["mean_acc"] == pytest.approx(7 / 12) == s["acc"]  # unweighted: (1/2 + 2/3) / 2
    assert s["acc_weighted"] == pytest.approx(s["avg_acc"])
    assert s["val_avg_acc"] == pytest.approx(2 / 3) and s["val_mean_acc"] == pytest.approx(3 / 4)
    # loss: cross-entropy over the client's own classes; the class-2 sample of client 0 has none
    logits = -torch.tensor([[0.01 + 8.41, 24.01 + 0.01], [16 + 4, 1 + 1], [9, 4 + 9]], dtype=torch.float64)
    expected = F.cross_entropy(logits, torch.tensor([0, 1, 1]), reduction="sum") / 4
    assert result.clients[0].loss[0] == pytest.approx(float(expected))


def test_pooled_and_unweighted_accuracy_differ_with_unequal_clients():
    s = evaluate(toy_federation(), Identity2d(), EvalConfig()).summary
    assert s["avg_acc"] != pytest.approx(s["mean_acc"])
    assert set(s) >= {"avg_acc", "mean_acc", "acc", "acc_weighted", "eval_loss"}
    assert not any(k.startswith("val_") for k in s)  # no val_split: test only


def test_tuning_evaluates_the_val_split_only():
    s = evaluate(toy_federation(), Identity2d(), EvalConfig(val_split="val"), target="validation").summary
    assert s["avg_acc"] == pytest.approx(2 / 3) and not any(k.startswith("val_") for k in s)


def test_nvar_equals_a_hand_computation():
    emb = torch.tensor([[0, 0], [2, 0], [1, 4], [1, 6], [10, 0]], dtype=torch.float64)
    # c0 = (1,0), c1 = (1,5), c2 = (10,0); nearest others: c1 (25), c0 (25), c0 (81)
    # within: class 0: 1, 1; class 1: 1, 1; class 2: 0 -> (1/25 + 1/25 + 0) / 3
    expected = (1 / 25 + 1 / 25 + 0) / 3
    assert float(nvar(emb, torch.tensor([0, 0, 1, 1, 2]))) == pytest.approx(expected)
    assert float(nvar(emb, torch.tensor([3, 3, 7, 7, 9]))) == pytest.approx(expected)  # labels need not be 0..K-1
    with pytest.raises(ValueError, match="two classes"):
        nvar(emb[:2], torch.tensor([0, 0]))


def test_nvar_is_logged_from_the_pooled_test_embeddings():
    fed = toy_federation()
    s = evaluate(fed, Identity2d(), EvalConfig(nvar=True)).summary
    test = torch.cat([c.splits["test"] for c in fed.clients])
    assert s["nvar"] == pytest.approx(float(nvar(fed.dataset.x[test], fed.dataset.y[test])))


class PersonalFedAvg:
    """FedAvg whose predictor differs per client (a personal copy), to stack unshared parameters."""

    @staticmethod
    def make(model):
        algorithm = make_method("fedavg", model)

        def predictor(server, ctx):
            return {k: v + 0.01 * (ctx.cid + 1) for k, v in server["params"].items()}

        algorithm.predictor = predictor
        return algorithm


def image_federation(sizes, classes=4, seed=0) -> FederatedData:
    gen = torch.Generator().manual_seed(seed)
    total = sum(n for split in sizes for n in split)
    x = torch.randn(total, 3, 32, 32, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (total,), generator=gen)
    clients, start = [], 0
    for cid, split_sizes in enumerate(sizes):
        splits = {}
        for name, n in zip(("train", "val", "test"), split_sizes):
            splits[name] = torch.arange(start, start + n)
            start += n
        clients.append(Client(cid, splits))
    return FederatedData(ArrayDataset("img", x, y, classes), clients, list(range(len(sizes))), [])


@pytest.mark.parametrize("personal", [False, True])
def test_batched_proto_eval_equals_the_sequential_one(personal):
    fed = image_federation([(7, 3, 5), (5, 2, 5), (9, 4, 1)])  # chunks of 4: unequal sizes per position
    torch.manual_seed(0)
    model = build_model("lenet", (3, 32, 32), 4).double()
    cfg = EvalConfig(val_split="val", batch_size=4, nvar=True)
    seq, bat = [evaluate(fed, model, cfg, execution, algorithm=PersonalFedAvg.make(model) if personal else None)
                for execution in ("sequential", "batched")]
    assert seq.summary.keys() == bat.summary.keys()
    for key in seq.summary:
        assert bat.summary[key] == pytest.approx(seq.summary[key], rel=1e-9, abs=1e-12), key
    for a, b in zip(seq.clients, bat.clients):
        assert (a.cid, a.num_samples, a.acc) == (b.cid, b.num_samples, b.acc)
        assert b.loss[0] == pytest.approx(a.loss[0], rel=1e-9)


def test_proto_protocol_in_a_federation_logs_val_and_test_every_evaluation():
    fed = image_federation([(8, 4, 4), (6, 3, 3), (8, 2, 4)])
    torch.manual_seed(0)
    model = build_model("lenet", (3, 32, 32), 4).double()
    algorithm = make_method("fedavg", model, lr=0.05)
    cfg = FederationConfig(rounds=4, clients_per_round=2, batch_size=4, eval_every=2)
    protocol = PROTOCOLS.get("proto")(EvalConfig(val_split="val"))
    result = run_federation(algorithm, fed, model_params(model), cfg, protocol, RunStreams(0))
    evaluated = [row["round"] for row in result.history if "avg_acc" in row]
    assert evaluated == [2, 4]
    assert all("val_avg_acc" in row for row in result.history if "avg_acc" in row)
    assert result.final.summary["avg_acc"] == result.history[-1]["avg_acc"]


def test_proto_needs_a_model_with_an_embedding_and_the_splits():
    fed = image_federation([(4, 2, 2)])
    with pytest.raises(ValueError, match="no feature embedding"):
        evaluate(fed, build_model("mlr", (3, 32, 32), 4).double(), EvalConfig())
    protocol = PROTOCOLS.get("proto")(EvalConfig(val_split="dev"))
    with pytest.raises(ValueError, match="'dev' split"):
        protocol.client_ids(fed)


def test_proto_protocol_agrees_with_metavers_own_prototype_logits_under_seen():
    from tests.test_metavers import image_data

    fed = image_data()
    torch.manual_seed(0)
    model = build_model("le_embedding", (3, 32, 32), 4)
    algorithm = make_method("metavers", model, shot=2, query=3, warmup=1)
    cfg = FederationConfig(rounds=2, clients_per_round=2, batch_size=4)
    seen = PROTOCOLS.get("seen")(EvalConfig(reduction="sample"))
    result = run_federation(algorithm, fed, model_params(model), cfg, seen, RunStreams(0))
    proto = PROTOCOLS.get("proto")(EvalConfig())
    contexts = make_contexts(fed, proto.client_ids(fed), cfg, RunStreams(0), "eval", 4)
    for execution in ("sequential", "batched"):
        summary = proto.evaluate(algorithm, result.server, contexts, Executor(execution)).summary
        assert summary["avg_acc"] == pytest.approx(result.final.summary["acc_weighted"])
        assert summary["mean_acc"] == pytest.approx(result.final.summary["acc"])
