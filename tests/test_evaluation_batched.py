"""The batched evaluation path gives the sequential path's per-client curves (issue 10).

Both protocols, with personalization steps, both reductions, clients of unequal test sizes (last
batches of one sample, a client whose test split is one sample) and unequal train batch sizes (a
short train split), on an MLP, a BatchNorm CNN, CAFeMe's modulated CNN and methods whose predictor
differs per client (IFCA-FT's chosen cluster, Local's and Ditto's personal models), in float64.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import pfl_core.evaluation.batched as evaluation_module
from pfl_core.algorithms import METHODS
from pfl_core.config import FederationConfig
from pfl_core.data.federated import FederatedData
from pfl_core.engine import Executor
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients, UnseenClients
from pfl_core.evaluation.batched import batched_evaluation_fallback
from pfl_core.federation import make_contexts, run_federation
from pfl_core.models.cafeme import ModulatedCNN
from pfl_core.models.cnn import conv_block
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.test_engine_equivalence import CASES, tiny_cnn

TRAIN = (8, 8, 7, 9, 2, 8, 6)  # batch 3: client 4 has a short split (one batch of 2)
TEST = (7, 4, 3, 6, 5, 8, 1)   # batch 3: [3,3,1] [3,1] [3] [3,3] [3,2] [3,3,2] [1]
TEST_BN = (8, 5, 3, 6, 5, 8, 2)  # no batch of one: BatchNorm cannot normalise it (either path)
UNSEEN = [2, 4, 6]
BATCH = 3
TOL = dict(rel=1e-9, abs=1e-12)

EVAL_CASES = {
    "fedavg_ft-mlp": CASES["fedavg_ft"],
    "fedrep-batchnorm": CASES["fedrep"],
    "cafeme-modulated": CASES["cafeme-fo"],
    "ifca_ft-clusters": ("ifca_ft", *CASES["ifca"][1:]),
    "local-personal": CASES["local"],
    "ditto-personal": CASES["ditto"],
}


def federation(data_fn, test=TEST) -> FederatedData:
    """The test helpers' federation with unequal test splits and held-out clients."""
    fed = data_fn(TRAIN, test=max(test))
    for client, n in zip(fed.clients, test):
        client.splits["test"] = client.splits["test"][:n]
    train = [c for c in range(len(TRAIN)) if c not in UNSEEN]
    return FederatedData(fed.dataset, fed.clients, train, UNSEEN)


def trained(case, model_fn=None, rounds=2, test=TEST):
    """(algorithm, server, federation, config, streams) after a few sequential rounds."""
    method, hp, default_model, data_fn = case
    fed = federation(data_fn, test)
    torch.manual_seed(0)
    model = (model_fn or default_model)().double()
    cls = METHODS.get(method)
    algorithm = cls(model, cls.hyper_class.from_dict(hp))
    algorithm.seed = 11
    cfg = FederationConfig(rounds=rounds, clients_per_round=0, batch_size=BATCH)
    streams = RunStreams(0)
    result = run_federation(algorithm, fed, model_params(model), cfg, SeenClients(EvalConfig()), streams,
                            evaluate_clients=False)
    return algorithm, result, fed, cfg, streams


def evaluate(setup, protocol, execution):
    algorithm, result, fed, cfg, streams = setup
    states = {cid: ctx.state for cid, ctx in result.contexts.items()}
    contexts = make_contexts(fed, protocol.client_ids(fed), cfg, streams, "eval", BATCH, states)
    with warnings.catch_warnings():  # a missing vmap batching rule would silently loop per client
        warnings.filterwarnings("error", message=".*performance drop.*")
        return protocol.evaluate(algorithm, result.server, contexts, Executor(execution))


def assert_same_curves(sequential, batched):
    assert [r.cid for r in batched.clients] == [r.cid for r in sequential.clients]
    for a, b in zip(sequential.clients, batched.clients):
        assert b.num_samples == a.num_samples
        assert b.acc == pytest.approx(a.acc, **TOL), a.cid
        assert b.loss == pytest.approx(a.loss, **TOL), a.cid
    assert batched.curve_mean == pytest.approx(sequential.curve_mean, **TOL)
    assert batched.curve_weighted == pytest.approx(sequential.curve_weighted, **TOL)
    assert batched.summary == pytest.approx(sequential.summary, **TOL)


def protocols(steps=5, reduction="batch_mean"):
    cfg = EvalConfig(steps=steps, lr=0.1, gamma=0.5, decay_every=2, reduction=reduction)
    return {"unseen": UnseenClients(cfg), "seen": SeenClients(cfg)}


@pytest.mark.parametrize("reduction", ["batch_mean", "sample"])
@pytest.mark.parametrize("protocol", ["unseen", "seen"])
@pytest.mark.parametrize("name", sorted(EVAL_CASES))
def test_batched_evaluation_gives_the_sequential_curves(name, protocol, reduction):
    batchnorm = name in ("fedrep-batchnorm", "cafeme-modulated")
    setup = trained(EVAL_CASES[name], test=TEST_BN if batchnorm and reduction == "sample" else TEST)
    proto = protocols(reduction=reduction)[protocol]
    sequential = evaluate(setup, proto, "sequential")
    batched = evaluate(setup, proto, "batched")
    assert all(len(r.acc) == 6 for r in sequential.clients)
    assert_same_curves(sequential, batched)


def test_per_client_predictors_really_differ():
    """Local's seen clients start from their own models (so stacking per-client params matters)."""
    algorithm, result, fed, *_ = setup = trained(EVAL_CASES["local-personal"])
    first = [algorithm.predictor(result.server, result.contexts[c])["1.weight"] for c in fed.train_clients]
    assert not torch.equal(first[0], first[1])
    evaluation = evaluate(setup, protocols(steps=0)["seen"], "batched")
    assert len({tuple(r.loss) for r in evaluation.clients}) == len(fed.train_clients)


def test_the_batched_evaluation_stacks_clients(monkeypatch):
    """Seen clients (test batches [3,3,1] [3,1] [3,3] [3,3,2], train batches all of 3): per
    evaluation one vmap over the four first batches and one over the three full second batches
    (lone batches run without vmap), per fine-tuning step one vmap over the four clients."""
    calls = []
    real = evaluation_module.vmap

    def counting(fn, **kw):
        mapped = real(fn, **kw)
        return lambda params, *tensors: calls.append(tensors[0].shape[0]) or mapped(params, *tensors)

    monkeypatch.setattr(evaluation_module, "vmap", counting)
    setup = trained(EVAL_CASES["fedavg_ft-mlp"])
    evaluate(setup, protocols(steps=2, reduction="sample")["seen"], "batched")
    assert calls == [4, 3, 4, 4, 3, 4, 4, 3]
    calls.clear()
    evaluate(setup, protocols(steps=2, reduction="sample")["seen"], "sequential")
    assert calls == []


def labelled_modulated(classes=3):
    trunk = nn.Sequential(conv_block(1, 4, 3, 1))
    return ModulatedCNN(tiny_cnn(classes), trunk, [36, 6], classes, context_labels=True)


def test_label_conditioned_cafeme_falls_back_to_the_sequential_path(monkeypatch):
    """Its logits read a labelled context batch from the client (host side): sequential, said why."""
    calls = []
    monkeypatch.setattr(evaluation_module, "vmap", lambda fn, **kw: calls.append(kw))
    setup = trained(CASES["cafeme-fo"], model_fn=labelled_modulated)
    assert "context_labels" in batched_evaluation_fallback(setup[0])
    assert batched_evaluation_fallback(trained(CASES["cafeme-fo"])[0]) is None
    proto = protocols(steps=2)["unseen"]
    assert_same_curves(evaluate(setup, proto, "sequential"), evaluate(setup, proto, "batched"))
    assert calls == []


@pytest.mark.parametrize("protocol", ["unseen", "seen"])
def test_run_federation_evaluates_on_the_executors_path(protocol):
    """The federation loop passes its executor to the protocol: whole runs (with evaluation every
    round) agree, history included."""
    method, hp, model_fn, data_fn = EVAL_CASES["cafeme-modulated"]

    def run(execution):
        fed = federation(data_fn)  # batch_mean: the batches of one are skipped
        torch.manual_seed(0)
        model = model_fn().double()
        cls = METHODS.get(method)
        cfg = FederationConfig(rounds=2, clients_per_round=3, batch_size=BATCH, eval_every=1)
        return run_federation(cls(model, cls.hyper_class.from_dict(hp)), fed, model_params(model), cfg,
                              protocols(steps=3)[protocol], RunStreams(1), executor=Executor(execution))

    sequential, batched = run("sequential"), run("batched")
    assert_same_curves(sequential.final, batched.final)
    for a, b in zip(sequential.history, batched.history):
        assert b == pytest.approx(a, rel=1e-6, abs=1e-8)
