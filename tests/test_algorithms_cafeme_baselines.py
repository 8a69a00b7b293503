"""IFCA, Ditto, FedRep and Per-FedAvg as the CAFeMe code runs them (CAFeMe spec, "Baselines as
implemented in the code"): hand-computed updates on tiny models, then end-to-end runs."""
import pytest
import torch
from torch import nn

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.perfedavg import hessian_vector_product
from pfl_core.config import FederationConfig, RunConfig
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.experiment import run_experiment
from pfl_core.federation import make_contexts
from pfl_core.models import build_model
from pfl_core.models.cnn import BaseCNN
from pfl_core.seeding import RunStreams
from pfl_core.training import average_params, batch_loss, gradients, model_params
from tests.helpers import tiny_federation
from tests.test_training import _mlr_grad


def _algorithm(method, model, **hp):
    cls = METHODS.get(method)
    return cls(model, cls.hyper_class.from_dict(hp))


def _contexts(fed, batch_size=100, ids=None):
    cfg = FederationConfig(batch_size=batch_size)
    ids = fed.train_clients if ids is None else ids
    return make_contexts(fed, ids, cfg, RunStreams(0), "batches", batch_size)


def _mlr(features=3, classes=3, seed=0):
    torch.manual_seed(seed)
    return build_model("mlr", (features,), classes)


def _train_xy(fed, cid):
    return fed.dataset.batch(fed.clients[cid].splits["train"])


def _mlr_params(W, b):
    return {"1.weight": W, "1.bias": b}


# ---------------------------------------------------------------- IFCA

def test_ifca_picks_the_argmin_loss_cluster_and_averages_each_cluster_over_its_choosers():
    fed = tiny_federation((6, 4, 5))
    for cid, label in ((0, 0), (1, 0), (2, 2)):  # clients 0 and 1 hold class 0, client 2 class 2
        fed.dataset.y[fed.clients[cid].splits["train"]] = label
    model = _mlr()
    alg = _algorithm("ifca", model, num_clusters=3, lr=0.5, local_epochs=1)
    W = torch.zeros(3, 3)
    clusters = [_mlr_params(W.clone(), torch.tensor(bias)) for bias in
                ([4.0, 0.0, 0.0], [0.0, 0.0, 4.0], [0.0, 4.0, 0.0])]  # favour class 0, 2, 1
    server = {"params": clusters[0], "clusters": clusters}
    ctx = _contexts(fed)
    updates = [alg.client_update(server, ctx[c], 0) for c in (0, 1, 2)]
    assert [u.cluster for u in updates] == [0, 0, 1]
    assert [ctx[c].state["cluster"] for c in (0, 1, 2)] == [0, 0, 1]

    def hand(cid, start):  # one full-batch SGD step (batch 100 > client size)
        x, y = _train_xy(fed, cid)
        gW, gb = _mlr_grad(start["1.weight"], start["1.bias"], x, y)
        return start["1.weight"] - 0.5 * gW, start["1.bias"] - 0.5 * gb

    new = alg.aggregate(server, updates)
    (W0, b0), (W1, b1), (W2, b2) = hand(0, clusters[0]), hand(1, clusters[0]), hand(2, clusters[1])
    assert torch.allclose(new["clusters"][0]["1.weight"], (W0 + W1) / 2, atol=1e-6)  # uniform mean
    assert torch.allclose(new["clusters"][0]["1.bias"], (b0 + b1) / 2, atol=1e-6)
    assert torch.allclose(new["clusters"][1]["1.weight"], W2, atol=1e-6)
    assert torch.allclose(new["clusters"][1]["1.bias"], b2, atol=1e-6)
    for name in clusters[2]:  # nobody chose cluster 2
        assert torch.equal(new["clusters"][2][name], clusters[2][name])
    assert new["params"] is new["clusters"][0]
    # evaluation chooses the same way (on the client's train split)
    assert alg.predictor(server, ctx[2]) is clusters[1]


def test_ifca_cluster_inits_are_independent_reproducible_and_leave_the_global_rng_alone():
    torch.manual_seed(3)
    model = build_model("dnn", (4,), 3, hidden=6)
    init = model_params(model)
    alg = _algorithm("ifca", model, num_clusters=4)
    rng_before = torch.random.get_rng_state()
    first = alg.init_server(init)["clusters"]
    assert torch.equal(rng_before, torch.random.get_rng_state())
    again = alg.init_server(init)["clusters"]
    assert len(first) == 4 and first[0] is init
    for a, b in zip(first, again):
        assert all(torch.equal(a[n], b[n]) for n in init)
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.allclose(first[i]["1.weight"], first[j]["1.weight"])
    # same default-init scale (not perturbations of cluster 0), and salted by init_seed_offset
    assert abs(float(first[1]["1.weight"].abs().max()) - float(init["1.weight"].abs().max())) < 0.3
    other = _algorithm("ifca", model, num_clusters=4, init_seed_offset=1).init_server(init)["clusters"]
    assert not torch.allclose(other[1]["1.weight"], first[1]["1.weight"])


# ---------------------------------------------------------------- Ditto

@pytest.mark.parametrize("anchor", ["local_copy", "global"])
def test_ditto_personal_step_is_the_hand_computed_proximal_step(anchor):
    fed = tiny_federation((6, 4))
    model = _mlr()
    alg = _algorithm("ditto", model, lr=0.5, mu=0.7, global_lr=0.1, personal_steps=1, global_steps=2,
                     anchor=anchor)
    init = model_params(model)
    server = alg.init_server(init)
    ctx = _contexts(fed)
    x, y = _train_xy(fed, 0)
    # round 1: p = init, anchor = init in both modes
    server = alg.aggregate(server, [alg.client_update(server, ctx[c], 0) for c in (0, 1)])
    gW, gb = _mlr_grad(init["1.weight"], init["1.bias"], x, y)
    p1 = ctx[0].state["personal"]
    assert torch.allclose(p1["1.weight"], init["1.weight"] - 0.5 * gW, atol=1e-6)
    # round 2: the anchor is the client's own last local copy (code) or the current global model
    w = ctx[0].state["local"] if anchor == "local_copy" else server["params"]
    assert not torch.allclose(ctx[0].state["local"]["1.weight"], server["params"]["1.weight"])
    alg.client_update(server, ctx[0], 1)
    p2 = ctx[0].state["personal"]
    gW, gb = _mlr_grad(p1["1.weight"], p1["1.bias"], x, y)
    expected_W = p1["1.weight"] - 0.5 * (gW + 0.7 * (p1["1.weight"] - w["1.weight"]))
    expected_b = p1["1.bias"] - 0.5 * (gb + 0.7 * (p1["1.bias"] - w["1.bias"]))
    assert torch.allclose(p2["1.weight"], expected_W, atol=1e-6)
    assert torch.allclose(p2["1.bias"], expected_b, atol=1e-6)


@pytest.mark.parametrize("persist", [True, False])
def test_ditto_global_step_is_torch_adam_with_per_client_state(persist):
    fed = tiny_federation((6,))
    model = _mlr()
    alg = _algorithm("ditto", model, personal_steps=1, global_steps=2, global_lr=0.1,
                     persist_optimizer=persist)
    init = model_params(model)
    server = alg.init_server(init)
    ctx = _contexts(fed)[0]
    x, y = _train_xy(fed, 0)
    W, b = (nn.Parameter(init[k].clone()) for k in ("1.weight", "1.bias"))
    adam = torch.optim.Adam([W, b], lr=0.1)
    for _ in range(2):  # two rounds of one client: the server mean is its own upload
        update = alg.client_update(server, ctx, 0)
        server = alg.aggregate(server, [update])
        if not persist:
            adam = torch.optim.Adam([W, b], lr=0.1)
        for _ in range(2):
            W.grad, b.grad = _mlr_grad(W.detach(), b.detach(), x, y)
            adam.step()
        assert torch.allclose(update.params["1.weight"], W.detach(), atol=1e-6)
        assert torch.allclose(update.params["1.bias"], b.detach(), atol=1e-6)
    assert ("global_opt" in ctx.state) == persist
    assert alg.predictor(server, ctx) is server["params"]
    personal = _algorithm("ditto", model, evaluate_personal=True).predictor(server, ctx)
    assert personal is ctx.state["personal"]


# ---------------------------------------------------------------- FedRep

def _image_federation(sizes=(8, 8), classes=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) * 2
    x = torch.randint(0, 256, (total, 1, 28, 28), generator=gen, dtype=torch.uint8)
    y = torch.randint(0, classes, (total,), generator=gen)
    clients, start = [], 0
    for cid, n in enumerate(sizes):
        clients.append(Client(cid, {"train": torch.arange(start, start + n),
                                    "test": torch.arange(start + n, start + 2 * n)}))
        start += 2 * n
    return FederatedData(ArrayDataset("img", x, y, classes), clients, list(range(len(sizes))), [])


@pytest.mark.parametrize("head_steps,body_steps", [(2, 0), (0, 1)])
def test_fedrep_head_steps_change_only_the_head_and_body_steps_only_the_body(head_steps, body_steps):
    fed = _image_federation()
    torch.manual_seed(0)
    model = build_model("cafeme_cnn_a", (1, 28, 28), 10)
    alg = _algorithm("fedrep", model, lr=0.01, head_steps=head_steps, body_steps=body_steps)
    assert alg.head_names and all(n.startswith("fc.") for n in alg.head_names)
    assert alg.body_names and all(n.startswith("features.") for n in alg.body_names)
    init = model_params(model)
    server = alg.init_server(init)
    update = alg.client_update(server, _contexts(fed, batch_size=4)[0], 0)
    changed, fixed = (alg.head_names, alg.body_names) if head_steps else (alg.body_names, alg.head_names)
    assert all(torch.equal(update.params[n], init[n]) for n in fixed)
    assert all(not torch.equal(update.params[n], init[n]) for n in changed)
    assert set(update.params) == set(init)  # code: the full model is uploaded


def _tiny_base_cnn():
    torch.manual_seed(0)
    return BaseCNN(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 3)))


def test_fedrep_personal_head_keeps_heads_per_client_and_averages_only_the_body():
    fed = tiny_federation((6, 4, 5))
    model = _tiny_base_cnn()
    alg = _algorithm("fedrep", model, lr=0.05, head_steps=2, body_steps=1, personal_head=True)
    init = model_params(model)
    server = alg.init_server(init)
    ctx = _contexts(fed, batch_size=2)
    updates = [alg.client_update(server, ctx[c], 0) for c in (0, 1, 2)]
    assert all(set(u.params) == set(alg.body_names) for u in updates)
    new = alg.aggregate(server, updates)
    body = average_params([u.params for u in updates], [1, 1, 1])
    for n in alg.body_names:
        assert torch.allclose(new["params"][n], body[n])
    for n in alg.head_names:
        assert torch.equal(new["params"][n], init[n])  # the server head is never uploaded
        assert not torch.allclose(ctx[0].state["head"][n], ctx[1].state["head"][n])
    mine = alg.predictor(new, ctx[1])
    assert all(mine[n] is ctx[1].state["head"][n] for n in alg.head_names)
    assert all(mine[n] is new["params"][n] for n in alg.body_names)
    # round 2 starts from the client's own head and the new global body
    head_before = ctx[1].state["head"]
    alg.client_update(new, ctx[1], 1)
    assert not torch.equal(ctx[1].state["head"]["fc.0.weight"], head_before["fc.0.weight"])
    assert {"head_adam", "body_adam"} <= set(ctx[1].state)


def test_fedrep_rejects_prefixes_that_do_not_split_the_model():
    with pytest.raises(ValueError, match="head_prefixes"):
        _algorithm("fedrep", _mlr())


# ---------------------------------------------------------------- Per-FedAvg

def _dnn64(seed=1):
    torch.manual_seed(seed)
    model = build_model("dnn", (4,), 3, hidden=6).double()
    params = {k: v.double() for k, v in model_params(model).items()}
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 3, (9,))
    v = {k: torch.randn_like(p) for k, p in params.items()}
    return model, params, x, y, v


def _flat(d):
    return torch.cat([t.reshape(-1) for t in d.values()])


def test_exact_hvp_matches_the_full_hessian_and_a_fine_finite_difference():
    model, params, x, y, v = _dnn64()
    exact = hessian_vector_product(model, params, x, y, v, "exact")
    shapes = {k: p.shape for k, p in params.items()}

    def loss_of(flat):
        out, i = {}, 0
        for k, s in shapes.items():
            n = s.numel()
            out[k] = flat[i:i + n].view(s)
            i += n
        return batch_loss(model, out, x, y)

    H = torch.autograd.functional.hessian(loss_of, _flat(params))
    assert torch.allclose(_flat(exact), H @ _flat(v), atol=1e-10, rtol=1e-8)
    fine = hessian_vector_product(model, params, x, y, v, "finite_difference", delta=1e-6)
    assert torch.allclose(_flat(fine), _flat(exact), atol=1e-7, rtol=1e-6)


def test_finite_difference_hvp_with_the_code_delta_is_close_to_exact():
    torch.manual_seed(2)
    model = build_model("dnn", (4,), 3, hidden=6)
    params = model_params(model)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    v, _ = gradients(model, params, x, y)  # as in Per-FedAvg: v is a gradient
    exact = _flat(hessian_vector_product(model, params, x, y, v, "exact"))
    fd = _flat(hessian_vector_product(model, params, x, y, v, "finite_difference", delta=1e-3))
    assert float((fd - exact).norm() / exact.norm()) < 1e-3


def _mlr_hvp(W, b, V, c, x, y):
    """Closed-form Hessian-vector product of mean softmax CE for logits = x W^T + b."""
    p = torch.softmax(x @ W.T + b, dim=1)
    u = x @ V.T + c
    s = p * u - p * (p * u).sum(1, keepdim=True)  # (diag(p) - p p^T) u, per sample
    return s.T @ x / len(y), s.mean(0)


@pytest.mark.parametrize("variant,hvp", [("hf", "exact"), ("hf", "finite_difference"), ("fo", "exact")])
def test_one_perfedavg_iteration_is_the_hand_formula(variant, hvp):
    fed = tiny_federation((6,))
    model = _mlr()
    alpha, beta = 0.3, 0.2
    alg = _algorithm("perfedavg", model, alpha=alpha, beta=beta, local_steps=1, variant=variant, hvp=hvp)
    init = model_params(model)
    update = alg.client_update(alg.init_server(init), _contexts(fed)[0], 0)  # full batch b1=b2=b3
    x, y = _train_xy(fed, 0)
    W, b = init["1.weight"], init["1.bias"]
    gW, gb = _mlr_grad(W, b, x, y)
    g1W, g1b = _mlr_grad(W - alpha * gW, b - alpha * gb, x, y)
    expected_W, expected_b = W - beta * g1W, b - beta * g1b
    if variant == "hf":
        hW, hb = _mlr_hvp(W, b, g1W, g1b, x, y)
        expected_W, expected_b = expected_W + beta * alpha * hW, expected_b + beta * alpha * hb
    tol = 1e-6 if hvp == "exact" else 1e-5
    assert torch.allclose(update.params["1.weight"], expected_W, atol=tol)
    assert torch.allclose(update.params["1.bias"], expected_b, atol=tol)
    if variant == "hf":  # the Hessian term matters at these step sizes
        assert not torch.allclose(update.params["1.weight"], W - beta * g1W, atol=1e-5)


@pytest.mark.parametrize("method,skip,consumed", [("perfedavg", True, 4), ("perfedavg", False, 3),
                                                  ("perfedavg_fo", True, 3), ("perfedavg_fo", False, 2)])
def test_perfedavg_batch_consumption(method, skip, consumed):
    fed = tiny_federation((20,))
    alg = _algorithm(method, _mlr(), local_steps=1, skip_logging_batch=skip)
    ctx = _contexts(fed, batch_size=2)[0]
    alg.client_update(alg.init_server(model_params(alg.model)), ctx, 0)
    assert torch.equal(ctx.streams["train"].next(), ctx.streams["train"].epoch()[consumed])


# ---------------------------------------------------------------- end to end

NEW_METHODS = {
    "ifca": {"num_clusters": 2, "local_epochs": 1},
    "ifca_ft": {"num_clusters": 2, "local_steps": 2},
    "ditto": {"personal_steps": 2, "global_steps": 2},
    "fedrep": {"head_steps": 2, "head_prefixes": ["3."]},
    "perfedavg": {"local_steps": 2},
    "perfedavg_fo": {"local_steps": 2},
}


@pytest.mark.parametrize("protocol", ["seen", "unseen"])
@pytest.mark.parametrize("method", sorted(NEW_METHODS))
def test_new_methods_run_end_to_end(method, protocol):
    cfg = RunConfig.from_dict({
        "data": {"dataset": "digits28", "num_clients": 10, "unseen_fraction": 0.2,
                 "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 20}},
        "model": {"name": "dnn", "params": {"hidden": 6}},
        "method": {"name": method, "params": NEW_METHODS[method]},
        "federation": {"rounds": 2, "clients_per_round": 3, "batch_size": 10},
        "evaluation": {"protocol": protocol, "params": {"steps": 2, "lr": 0.05}},
        "seed": 0,
    })
    result = run_experiment(cfg, device="cpu")
    assert 0.0 <= result.metrics["acc"] <= 1.0
    assert torch.isfinite(torch.tensor(result.metrics["train_loss"]))
    expected_points = 1 if method == "ifca" else 3  # IFCA evaluates its cluster without fine-tuning
    assert len(result.curve_mean) == expected_points


def test_ditto_global_sgd_switch_is_plain_sgd():
    from pfl_core.algorithms import METHODS
    from pfl_core.models import build_model
    from pfl_core.training import model_params, sgd_step
    from tests.helpers import tiny_federation
    from pfl_core.config import FederationConfig
    from pfl_core.evaluation import PROTOCOLS, EvalConfig
    from pfl_core.federation import run_federation
    from pfl_core.seeding import RunStreams

    fed = tiny_federation(sizes=(6,))
    model = build_model("mlr", (3,), 3)
    cls = METHODS.get("ditto")
    alg = cls(model, cls.hyper_class(global_optimizer="sgd", global_lr=0.3, global_steps=2, personal_steps=1))
    init = model_params(model)
    result = run_federation(alg, fed, init, FederationConfig(rounds=1, clients_per_round=0, batch_size=100),
                            PROTOCOLS.get("seen")(EvalConfig()), RunStreams(0))
    x, y = fed.dataset.batch(fed.clients[0].splits["train"])  # one full batch per step
    expected = init
    for _ in range(2):
        expected, _ = sgd_step(model, expected, x, y, 0.3)
    for name in init:
        assert torch.allclose(result.server["params"][name], expected[name], atol=1e-6)
