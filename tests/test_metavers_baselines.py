"""MetaVers baselines (issue 13, item 2): FedPer, LG-FedAvg, FedBABU, kNN-Per, FedProto, and
Local's "100 local episodes without communication".

Each method's client round is checked against a hand computation on a tiny float64 LeNet-shaped
model (head ``fc3.``): the update rule, what is uploaded, what stays with the client; the
server's aggregation against a hand average. Batched == sequential is in
``tests/test_engine_equivalence.py`` (CASES).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pfl_core.algorithms.knn_per import knn_probabilities
from pfl_core.algorithms.local_sgd import MomentumSGDHyper, momentum_sgd
from pfl_core.config import FederationConfig
from pfl_core.data.federated import ArrayDataset, FederatedData
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import make_contexts, run_federation
from pfl_core.seeding import RunStreams
from pfl_core.training import embed, forward, gradients, model_params
from tests.helpers import TinyLeNet, make_method, one_thread, tiny_federation  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

HEAD = ["fc3.weight", "fc3.bias"]
BODY = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
PLAIN = {"momentum": 0.0, "weight_decay": 0.0, "local_steps": 1}  # one plain SGD step per round


def federation(sizes=(6, 6, 6), seed=0) -> FederatedData:
    """``tiny_federation`` in float64 (3 features, 3 classes)."""
    fed = tiny_federation(sizes=sizes, seed=seed)
    d = fed.dataset
    fed.dataset = ArrayDataset(d.name, d.x.double(), d.y, d.num_classes)
    return fed


def model(seed=0) -> TinyLeNet:
    torch.manual_seed(seed)
    return TinyLeNet(features=3).double()


def contexts(fed, batch_size=6, seed=0):
    cfg = FederationConfig(batch_size=batch_size)
    return make_contexts(fed, fed.train_clients, cfg, RunStreams(seed), "batches", batch_size)


def train_batch(ctx):
    """The client's whole train split (a batch of its size: the batch every step sees)."""
    return ctx.dataset.batch(ctx.client.splits["train"])


def sgd_by_hand(net, params, x, y, lr, names):
    """One SGD step on ``names`` through a module and ``.backward()`` (no functional code)."""
    net = type(net)(features=3).double()
    net.load_state_dict({k: v.clone() for k, v in params.items()})
    F.cross_entropy(net(x), y).backward()
    return {k: (p - lr * p.grad if k in names else p).detach() for k, p in net.named_parameters()}


def close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-10, atol=1e-12)


# -- the shared optimiser -------------------------------------------------------------------------
def test_momentum_sgd_is_torch_sgd_with_momentum_and_weight_decay():
    """The pFedHN client optimiser: a fresh ``torch.optim.SGD(lr, momentum, weight_decay)`` over
    the round's batches."""
    net, fed = model(), federation()
    x, y = train_batch(contexts(fed)[0])
    hp = MomentumSGDHyper(lr=0.1, momentum=0.9, weight_decay=0.01, local_steps=3)
    batches = {"train": (torch.stack([x, x.flip(0), x]), torch.stack([y, y.flip(0), y]))}
    ours, loss, _, _ = momentum_sgd(lambda p, x, y: gradients(net, p, x, y), model_params(net), batches, {}, hp)

    reference = model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    losses = []
    for xb, yb in zip(*batches["train"]):
        optimizer.zero_grad()
        step_loss = F.cross_entropy(reference(xb), yb)
        step_loss.backward()
        optimizer.step()
        losses.append(float(step_loss.detach()))
    close(ours, model_params(reference))
    assert float(loss) == pytest.approx(sum(losses) / 3, rel=1e-12)


# -- FedPer ---------------------------------------------------------------------------------------
def test_fedper_keeps_its_head_and_uploads_the_averaged_base():
    net, fed = model(), federation()
    algorithm = make_method("fedper", net, lr=0.5, **PLAIN)
    server = algorithm.init_server(model_params(net))
    ctx = contexts(fed)
    updates = [algorithm.client_update(server, ctx[c], 0) for c in (0, 1)]
    for c, update in zip((0, 1), updates):
        expected = sgd_by_hand(net, server["params"], *train_batch(ctx[c]), 0.5, HEAD + BODY)
        assert sorted(update.params) == sorted(BODY)  # only the base leaves the client
        close(update.params, {k: expected[k] for k in BODY})
        close(ctx[c].state["personal"], {k: expected[k] for k in HEAD})
    new = algorithm.aggregate(server, updates)
    for k in BODY:  # equal train sizes: the plain mean
        torch.testing.assert_close(new["params"][k], (updates[0].params[k] + updates[1].params[k]) / 2)
    for k in HEAD:  # the server's head is never changed
        assert torch.equal(new["params"][k], server["params"][k])
    # the next round starts from the new base and the client's own head; it predicts with them
    start = algorithm.carry_in(new, ctx[0], 1)["params"]
    close(start, {**new["params"], **ctx[0].state["personal"]})
    close(algorithm.predictor(new, ctx[0]), start)
    close(algorithm.predictor(new, ctx[2]), new["params"])  # never trained: the server's model


# -- LG-FedAvg ------------------------------------------------------------------------------------
def test_lg_fedavg_pretrains_fedavg_then_keeps_local_bodies_and_averages_the_head():
    net, fed = model(), federation()
    algorithm = make_method("lg_fedavg", net, lr=0.5, pretrain_rounds=1, **PLAIN)
    server = algorithm.init_server(model_params(net))
    ctx = contexts(fed)
    # round 0 (pretraining): FedAvg, every parameter uploaded, nothing kept
    updates = [algorithm.client_update(server, ctx[c], 0) for c in (0, 1)]
    assert all(sorted(u.params) == sorted(HEAD + BODY) for u in updates)
    assert all("personal" not in ctx[c].state for c in (0, 1))
    pretrained = algorithm.aggregate(server, updates)
    assert pretrained["round"] == 1
    for k in HEAD + BODY:
        torch.testing.assert_close(pretrained["params"][k], (updates[0].params[k] + updates[1].params[k]) / 2)
    # round 1: client 0 starts from the pretrained model, keeps its body, uploads the head
    update = algorithm.client_update(pretrained, ctx[0], 1)
    expected = sgd_by_hand(net, pretrained["params"], *train_batch(ctx[0]), 0.5, HEAD + BODY)
    assert sorted(update.params) == sorted(HEAD)
    close(update.params, {k: expected[k] for k in HEAD})
    close(ctx[0].state["personal"], {k: expected[k] for k in BODY})
    after = algorithm.aggregate(pretrained, [update])
    for k in BODY:  # the global body stays the pretrained one (clients that never trained use it)
        assert torch.equal(after["params"][k], pretrained["params"][k])
    close({k: after["params"][k] for k in HEAD}, {k: expected[k] for k in HEAD})
    close(algorithm.predictor(after, ctx[0]), {**after["params"], **ctx[0].state["personal"]})
    close(algorithm.predictor(after, ctx[2]), after["params"])
    assert algorithm.run_info(after) == {"lg_fedavg_pretrain_rounds": 1}


def test_lg_fedavg_averages_the_global_layers_uniformly_as_its_code():
    net, fed = model(), federation(sizes=(4, 8, 6))
    algorithm = make_method("lg_fedavg", net, lr=0.5, pretrain_rounds=0, head_prefixes=["fc1."], **PLAIN)
    server = algorithm.init_server(model_params(net))
    ctx = contexts(fed, batch_size=4)
    updates = [algorithm.client_update(server, ctx[c], 0) for c in (0, 1)]
    assert all(sorted(u.params) == ["fc1.bias", "fc1.weight"] for u in updates)  # the global layers
    new = algorithm.aggregate(server, updates)
    for k in ("fc1.weight", "fc1.bias"):  # 4 and 8 samples, yet the plain mean
        torch.testing.assert_close(new["params"][k], (updates[0].params[k] + updates[1].params[k]) / 2)


# -- FedBABU --------------------------------------------------------------------------------------
def test_fedbabu_trains_the_body_only_with_the_head_at_its_random_init():
    net, fed = model(), federation()
    algorithm = make_method("fedbabu", net, lr=0.5, **PLAIN)
    server = algorithm.init_server(model_params(net))
    ctx = contexts(fed)
    update = algorithm.client_update(server, ctx[0], 0)
    expected = sgd_by_hand(net, server["params"], *train_batch(ctx[0]), 0.5, BODY)
    assert sorted(update.params) == sorted(BODY)
    close(update.params, {k: expected[k] for k in BODY})
    assert ctx[0].state == {}  # nothing personal


def test_fedbabu_head_never_changes_in_training_and_is_fine_tuned_at_evaluation():
    net, fed = model(), federation(sizes=(8, 8, 8, 8))
    init = model_params(net)
    algorithm = make_method("fedbabu", net, lr=0.3, local_steps=3)
    cfg = FederationConfig(rounds=4, clients_per_round=2, batch_size=4)
    protocol = SeenClients(EvalConfig(steps=10, lr=0.1, reduction="sample"))
    result = run_federation(algorithm, fed, init, cfg, protocol, RunStreams(0))
    for k in HEAD:
        assert torch.equal(result.server["params"][k], init[k])
    assert any(not torch.equal(result.server["params"][k], init[k]) for k in BODY)
    assert algorithm.finetune_at_eval  # MetaVers: 10 fine-tuning steps at test
    assert all(len(c.acc) == 11 for c in result.final.clients)


# -- kNN-Per --------------------------------------------------------------------------------------
def test_knn_probabilities_by_hand():
    """Keys 0, 1, 3 (labels 0, 1, 1), query 0.9, k = 2, D = 1, scale 1: neighbours at squared
    distances 0.01 (label 1) and 0.81 (label 0), weights exp(-0.01), exp(-0.81)."""
    keys = torch.tensor([[0.0], [1.0], [3.0]], dtype=torch.float64)
    p = knn_probabilities(torch.tensor([[0.9]], dtype=torch.float64), keys, torch.tensor([0, 1, 1]), 3, 2, 1.0)
    w1, w0 = math.exp(-0.01), math.exp(-0.81)
    torch.testing.assert_close(p, torch.tensor([[w0 / (w0 + w1), w1 / (w0 + w1), 0.0]], dtype=torch.float64))
    # scale and dimension divide the distances; k above the datastore size uses all of it
    p = knn_probabilities(torch.tensor([[0.9]], dtype=torch.float64), keys, torch.tensor([0, 1, 1]), 3, 10, 2.0)
    w = [math.exp(-0.81 / 2), math.exp(-0.01 / 2), math.exp(-4.41 / 2)]
    torch.testing.assert_close(p, torch.tensor([[w[0], w[1] + w[2], 0.0]], dtype=torch.float64) / sum(w))


def test_knn_probabilities_survive_far_queries():
    """Every kernel value underflows for a far query; the shifted distances still give the
    nearest neighbours' vote, not 0/0."""
    keys = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    p = knn_probabilities(torch.tensor([[1e6]], dtype=torch.float64), keys, torch.tensor([0, 1]), 2, 1, 1.0)
    torch.testing.assert_close(p, torch.tensor([[0.0, 1.0]], dtype=torch.float64))


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_knn_per_interpolates_the_global_model_with_a_knn_on_the_clients_train_features(weight):
    net, fed = model(), federation()
    algorithm = make_method("knn_per", net, k=3, weight=weight)
    server = algorithm.init_server(model_params(net))
    ctx = contexts(fed)[1]
    params = algorithm.predictor(server, ctx)
    x_train, y_train = train_batch(ctx)
    x = fed.dataset.batch(ctx.client.splits["test"])[0]
    features = embed(net, server["params"], x)
    store = embed(net, server["params"], x_train)
    expected = torch.zeros(len(x), 3, dtype=torch.float64)
    for i, f in enumerate(features):  # brute force: sort the datastore by distance
        d = ((store - f) ** 2).sum(1)
        order = d.argsort()[:3]
        w = torch.exp(-(d[order] - d[order[0]]) / store.shape[1])
        for j, wj in zip(order, w):
            expected[i, y_train[j]] += wj / w.sum()
    mixture = weight * expected + (1 - weight) * forward(net, server["params"], x).softmax(1)
    torch.testing.assert_close(algorithm.logits(params, x, ctx).exp(), mixture)


def test_knn_per_trains_as_fedavg():
    net, fed = model(), federation()
    algorithm = make_method("knn_per", net, lr=0.5, **PLAIN)
    server = algorithm.init_server(model_params(net))
    ctx = contexts(fed)
    update = algorithm.client_update(server, ctx[0], 0)
    close(update.params, sgd_by_hand(net, server["params"], *train_batch(ctx[0]), 0.5, HEAD + BODY))


# -- FedProto -------------------------------------------------------------------------------------
def test_fedproto_local_loss_regularises_features_towards_global_prototypes():
    net, fed = model(), federation()
    algorithm = make_method("fedproto", net, ld=0.7)
    x, y = train_batch(contexts(fed)[0])
    params = model_params(net)
    protos = torch.randn(3, 4, dtype=torch.float64)
    has = torch.tensor([True, False, True])
    features = torch.relu(net.fc2(torch.relu(net.fc1(x))))
    reg = sum(((features[i] - protos[y[i]]) ** 2).sum() for i in range(len(y)) if has[y[i]]) / (len(y) * 4)
    expected = F.cross_entropy(net(x), y) + 0.7 * reg
    torch.testing.assert_close(algorithm.loss(params, x, y, protos, has), expected)


def test_fedproto_client_round_uploads_its_class_prototypes_and_keeps_its_model():
    net, fed = model(), federation()
    algorithm = make_method("fedproto", net, lr=0.5, momentum=0.0, local_epochs=1)
    server = algorithm.init_server(model_params(net))
    server = {**server, "protos": torch.randn(3, 4, dtype=torch.float64), "has_proto": torch.tensor([True, True, False])}
    ctx = contexts(fed)[0]
    update = algorithm.client_update(server, ctx, 0)
    x, y = train_batch(ctx)
    # one step (one epoch, one batch): the features before the step give the local prototypes
    features = embed(net, server["params"], x)
    for c in range(3):
        assert bool(update.params["has_proto"][c]) == bool((y == c).any())
        if (y == c).any():
            torch.testing.assert_close(update.params["protos"][c], features[y == c].mean(0))
    # the step itself: gradient of CE + ld * MSE
    grads, _ = gradients(net, server["params"], x, y)  # CE part
    leaves = {k: v.clone().requires_grad_(True) for k, v in server["params"].items()}
    algorithm.loss(leaves, x, y, server["protos"], server["has_proto"]).backward()
    close(ctx.state["params"], {k: (v - 0.5 * leaves[k].grad).detach() for k, v in server["params"].items()})
    assert any(not torch.allclose(leaves[k].grad, grads[k]) for k in grads)  # the regulariser acts


def test_fedproto_server_averages_prototypes_per_class_over_the_clients_that_have_it():
    net = model()
    algorithm = make_method("fedproto", net)
    server = algorithm.init_server(model_params(net))
    a, b, old = (torch.randn(3, 4, dtype=torch.float64) for _ in range(3))
    server = {**server, "protos": old, "has_proto": torch.tensor([True, True, True])}
    from pfl_core.engine.contract import ClientUpdate

    ups = [ClientUpdate({"protos": a, "has_proto": torch.tensor([True, True, False])}, 10, torch.tensor(0.0)),
           ClientUpdate({"protos": b, "has_proto": torch.tensor([True, False, False])}, 50, torch.tensor(0.0))]
    new = algorithm.aggregate(server, ups)
    torch.testing.assert_close(new["protos"][0], (a[0] + b[0]) / 2)  # plain mean, not by samples
    torch.testing.assert_close(new["protos"][1], a[1])
    assert new["has_proto"].tolist() == [True, True, False]  # replaced by this round's aggregate
    kept = make_method("fedproto", net, keep_missing_protos=True).aggregate(server, ups)
    torch.testing.assert_close(kept["protos"][2], old[2])
    assert kept["has_proto"].tolist() == [True, True, True]


def test_fedproto_predicts_the_nearest_global_prototype_among_classes_that_have_one():
    net, fed = model(), federation()
    algorithm = make_method("fedproto", net, own_classes_only=False)
    server = algorithm.init_server(model_params(net))
    ctx = contexts(fed)[0]
    x = fed.dataset.batch(ctx.client.splits["test"])[0]
    features = embed(net, server["params"], x)
    protos = torch.stack([features[0], features[1], features[0]])  # class 2 sits on sample 0 too
    server = {**server, "protos": protos, "has_proto": torch.tensor([False, True, True])}
    logits = algorithm.logits(algorithm.predictor(server, ctx), x, ctx)
    assert logits.argmax(1).tolist() == [2, 1]  # class 0 has no prototype: never predicted
    torch.testing.assert_close(logits[:, 1:], -((features.unsqueeze(1) - protos[1:]) ** 2).sum(-1))
    head = make_method("fedproto", net, predict="head")
    torch.testing.assert_close(head.logits(head.predictor(server, ctx), x, ctx), net(x))


def test_fedproto_predicts_among_the_clients_own_classes_by_default():
    """The code's "with protos" accuracy compares a sample with the global prototypes of the
    client's own classes only."""
    net, fed = model(), federation(sizes=(2, 6, 6), seed=3)
    algorithm = make_method("fedproto", net)
    server = algorithm.init_server(model_params(net))
    ctx = contexts(fed, batch_size=2)[0]
    own = sorted(set(train_batch(ctx)[1].tolist()))
    assert len(own) < 3  # a client without every class
    x = fed.dataset.batch(ctx.client.splits["test"])[0]
    protos = torch.randn(3, 4, dtype=torch.float64)
    server = {**server, "protos": protos, "has_proto": torch.tensor([True, True, True])}
    predicted = algorithm.logits(algorithm.predictor(server, ctx), x, ctx).argmax(1)
    d = ((embed(net, server["params"], x).unsqueeze(1) - protos) ** 2).sum(-1)
    assert predicted.tolist() == [own[int(i)] for i in d[:, own].argmin(1)]


# -- Local: "100 local episodes without communication" ---------------------------------------------
def test_local_trains_each_client_100_steps_without_communication():
    """MetaVers' Local row: ``rounds: 1``, ``clients_per_round: 0`` (every client once),
    ``method.params.local_steps: 100``: each client takes exactly 100 SGD steps of its own."""
    net, fed = model(), federation(sizes=(6, 5, 7))
    init = model_params(net)
    algorithm = make_method("local", net, lr=0.05, local_steps=100)
    cfg = FederationConfig(rounds=1, clients_per_round=0, batch_size=2)
    result = run_federation(algorithm, fed, init, cfg, SeenClients(EvalConfig(reduction="sample")), RunStreams(0))
    assert result.sampled == [[0, 1, 2]]
    close(result.server["params"], init)  # nothing communicated
    replay = contexts(fed, batch_size=2)  # the same batch streams
    for cid, ctx in replay.items():
        params = init
        for _ in range(100):
            x, y = ctx.next_batch()
            grads, _ = gradients(net, params, x, y)
            params = {k: v - 0.05 * grads[k] for k, v in params.items()}
        close(result.contexts[cid].state["params"], params)


# -- end to end: a run configuration on generated CIFAR-10 pickles, lenet, both execution paths ----
E2E = {
    "fedper": {}, "fedbabu": {}, "knn_per": {"k": 3},
    "lg_fedavg": {"pretrain_rounds": 2}, "fedproto": {"local_steps": 2},
}


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    from torchvision import datasets as tv

    from tests.fake_data import write_cifar10

    root = tmp_path_factory.mktemp("cifar")
    md5s = write_cifar10(root, 16)  # 80 train images, 8 per class
    patch = pytest.MonkeyPatch()
    for attr, value in md5s.items():
        patch.setattr(tv.CIFAR10, attr, value)
    yield str(root)
    patch.undo()


@pytest.mark.parametrize("method", sorted(E2E))
def test_each_baseline_runs_a_metavers_style_configuration_on_both_paths(method, cifar_dir):
    """classes_per_client split (2 classes per client), lenet, seen clients evaluated every 2
    rounds; the batched path gives the sequential path's numbers (float32: to rounding)."""
    from pfl_core.config import RunConfig
    from pfl_core.experiment import run_experiment

    cfg = RunConfig.from_dict({
        "data": {"dataset": "cifar10", "num_clients": 5, "client_splits": {"test": 0.25},
                 "partition": {"name": "classes_per_client", "classes_per_client": 2}},
        "model": {"name": "lenet"},
        "method": {"name": method, "params": {"lr": 0.01, "local_steps": 2, **E2E[method]}},
        "federation": {"rounds": 4, "clients_per_round": 2, "batch_size": 4, "eval_every": 2},
        "evaluation": {"protocol": "seen", "params": {"steps": 2, "lr": 0.01, "reduction": "sample"}},
        "seed": 0,
    })
    runs = [run_experiment(cfg, device="cpu", data_dir=cifar_dir, execution=e) for e in ("sequential", "batched")]
    assert runs[1].info["execution"] == "batched"
    for a, b in zip(runs[0].history, runs[1].history):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
    assert 0.0 <= runs[0].metrics["acc_weighted"] <= 1.0
    assert [h["round"] for h in runs[0].history if "acc" in h] == [2, 4]


def test_tuning_spaces_tune_the_step_count_the_baselines_default_to():
    """The pFedHN optimiser counts 50 steps per round by default: the search space tunes steps."""
    import optuna

    from benchmarks.suite.search_spaces import suggest

    study = optuna.create_study()
    for method in ("fedper", "lg_fedavg", "fedbabu", "knn_per"):
        config = {"method": {"name": method, "params": {}}, "evaluation": {"params": {}}, "data": {}}
        assert "method.params.local_steps" in suggest(study.ask(), config)
    config = {"method": {"name": "fedproto", "params": {}}, "evaluation": {"params": {}}, "data": {}}
    assert {"method.params.local_epochs", "method.params.ld"} <= set(suggest(study.ask(), config))


def test_lg_fedavg_resumes_from_a_checkpoint_after_its_fedavg_stage(tmp_path, cifar_dir):
    """The server's round counter and every client's local body are saved: stopped after round 5
    and resumed from round 4 (LG stage from round 3), the run equals an uninterrupted one."""
    from pfl_core.checkpoint import Checkpointing
    from pfl_core.config import RunConfig
    from pfl_core.experiment import run_experiments
    from tests.test_checkpoint import Stop, _same, _stop_after

    cfg = RunConfig.from_dict({
        "data": {"dataset": "cifar10", "num_clients": 5, "client_splits": {"test": 0.25},
                 "partition": {"name": "classes_per_client", "classes_per_client": 2}},
        "model": {"name": "lenet"},
        "method": {"name": "lg_fedavg", "params": {"lr": 0.01, "local_steps": 2, "pretrain_rounds": 3}},
        "federation": {"rounds": 6, "clients_per_round": 2, "batch_size": 4, "eval_every": 2},
        "evaluation": {"protocol": "seen", "params": {"reduction": "sample"}},
    })
    reference = run_experiments([cfg], device="cpu", data_dir=cifar_dir)[0]
    saving = Checkpointing([tmp_path / "run.pt"], every=2)
    with pytest.raises(Stop):
        run_experiments([cfg], device="cpu", data_dir=cifar_dir, on_round=_stop_after(5), checkpointing=saving)
    state = torch.load(saving.paths[0], weights_only=False)
    assert state["next_round"] == 4 and state["federation"]["server"]["round"] == 4
    resumed = run_experiments([cfg], device="cpu", data_dir=cifar_dir, checkpointing=saving)[0]
    _same(reference, resumed)
    assert resumed.info["lg_fedavg_pretrain_rounds"] == 3
