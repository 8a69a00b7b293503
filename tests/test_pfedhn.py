"""pFedHN: generated target shapes, the hypergradient against finite differences, one round
against a reference written with torch's own modules and optimisers, its one-client sampling."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pfl_core.config import FederationConfig
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import run_federation
from pfl_core.models import build_model
from pfl_core.seeding import RunStreams
from pfl_core.training import batch_loss, forward, model_params
from tests.helpers import make_method, one_thread, tiny_federation  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def dnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3)).double()


def federation(sizes):
    """float64 features (the tiny models are float64)."""
    fed = tiny_federation(sizes=sizes)
    fed.dataset.x = fed.dataset.x.double()
    return fed


def prepared(model, fed, **hp):
    algorithm = make_method("pfedhn", model, **{"hidden_dim": 6, "n_hidden": 1, **hp})
    algorithm.seed = 3
    algorithm.prepare(fed)
    return algorithm, algorithm.init_server(model_params(model))


def test_generated_weights_have_the_lenet_target_shapes():
    model = build_model("lenet", (3, 32, 32), 10)
    fed = tiny_federation(sizes=(4,) * 12)
    algorithm, server = prepared(model, fed, hidden_dim=100, n_hidden=3)
    theta = algorithm.generate(server["hnet"], 5)
    assert {k: v.shape for k, v in theta.items()} == {k: p.shape for k, p in model.named_parameters()}
    assert list(theta) == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias",
                           "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    # the code's sizes: embedding int(1 + 12 / 4) = 4, hidden 100, a head per target tensor
    assert server["hnet"]["embeddings.weight"].shape == (12, 4)
    assert server["hnet"]["heads.fc1_weight.weight"].shape == (120 * 800, 100)
    assert forward(model, theta, torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_hypergradient_is_the_gradient_of_the_target_loss():
    """With one plain SGD inner step, theta - theta_tilde = a grad_theta L, so Algorithm 1's VJP is
    a * d L(h(v; phi)) / d phi: checked against central finite differences in phi."""
    fed = federation((6, 5, 4))
    model = dnn()
    a = 0.1
    algorithm, server = prepared(model, fed, inner_steps=1, inner_lr=a, inner_momentum=0.0,
                                 inner_weight_decay=0.0, grad_clip=0.0)
    x, y = fed.dataset.batch(fed.clients[1].splits["train"])
    theta = algorithm.generate(server["hnet"], 1)
    carry = {"params": theta, "momentum": {k: torch.zeros_like(v) for k, v in theta.items()}}
    trained, _ = algorithm.local_update(carry, {"train": (x[None], y[None])}, {})
    vjp = algorithm.hypergradient(server["hnet"], 1, trained["params"])

    def target_loss(hnet):
        return float(batch_loss(model, algorithm.generate(hnet, 1), x, y))

    gen, eps = torch.Generator().manual_seed(0), 1e-6
    for name in ("embeddings.weight", "mlp.0.weight", "heads.0_weight.bias", "heads.2_bias.weight"):
        direction = torch.randn(server["hnet"][name].shape, generator=gen, dtype=torch.float64)
        plus = {**server["hnet"], name: server["hnet"][name] + eps * direction}
        minus = {**server["hnet"], name: server["hnet"][name] - eps * direction}
        numeric = a * (target_loss(plus) - target_loss(minus)) / (2 * eps)
        assert float((vjp[name] * direction).sum()) == pytest.approx(numeric, rel=1e-6, abs=1e-10), name
    # only the sampled client's embedding row receives gradient
    rows = vjp["embeddings.weight"].abs().sum(1)
    assert rows[1] > 0 and rows[0] == 0 and rows[2] == 0


def test_one_round_equals_algorithm_1_written_with_torch_modules_and_optimizers():
    """The code's step: load h(v_i) into the target, SGD(momentum, wd) with clipping for k steps,
    torch.autograd.grad(weights, hnet, delta), clip, SGD(momentum, wd) on the hypernetwork."""
    fed = federation((6, 5, 4))
    model = dnn()
    hp = dict(inner_steps=3, inner_lr=0.2, grad_clip=0.5, batch_draw="stream", lr=0.1)
    algorithm, server = prepared(model, fed, **hp)
    cfg = FederationConfig(rounds=1, clients_per_round=3, batch_size=4)
    ref_hnet = copy.deepcopy(algorithm.hnet).double()
    result = run_federation(algorithm, fed, model_params(model), cfg,
                            SeenClients(EvalConfig(steps=0, reduction="sample")), RunStreams(0))
    (cid,) = result.sampled[0]  # one client per round, whatever clients_per_round says

    # the reference, on the same batches (a fresh stream with the run's seed)
    from pfl_core.federation import make_contexts
    ctx = make_contexts(fed, [cid], cfg, RunStreams(0), "batches", 4)[cid]
    outer = torch.optim.SGD(ref_hnet.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    weights = ref_hnet(torch.tensor(cid))
    net = copy.deepcopy(model)
    net.load_state_dict(weights)
    inner = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9, weight_decay=5e-5)
    for _ in range(3):
        inner.zero_grad()
        x, y = ctx.next_batch()
        nn.functional.cross_entropy(net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        inner.step()
    final = net.state_dict()
    delta = [weights[k].detach() - final[k] for k in weights]
    grads = torch.autograd.grad(list(weights.values()), list(ref_hnet.parameters()), grad_outputs=delta)
    for p, g in zip(ref_hnet.parameters(), grads):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(ref_hnet.parameters(), 0.5)
    outer.step()
    for name, p in ref_hnet.named_parameters():
        torch.testing.assert_close(result.server["hnet"][name], p.detach(), rtol=1e-10, atol=1e-12)


def test_clients_per_round_and_personalised_predictors():
    fed = federation((6, 5, 4, 6))
    cfg = FederationConfig(rounds=3, clients_per_round=3, batch_size=4)
    protocol = SeenClients(EvalConfig(steps=0, reduction="sample"))
    for per_round, expected in ((1, 1), (2, 2), (0, 3)):  # 0: federation.clients_per_round
        algorithm = make_method("pfedhn", dnn(), hidden_dim=6, n_hidden=1, inner_steps=2,
                                clients_per_round=per_round)
        result = run_federation(algorithm, fed, model_params(dnn()), cfg, protocol, RunStreams(0))
        assert [len(s) for s in result.sampled] == [expected] * 3
    # each client predicts with its own generated weights
    ctx = result.contexts
    theta = [algorithm.predictor(result.server, ctx[c]) for c in (0, 1)]
    assert not torch.allclose(theta[0]["0.weight"], theta[1]["0.weight"])
    torch.testing.assert_close(theta[1], algorithm.generate(result.server["hnet"], 1))


def test_a_configured_run_end_to_end_on_both_paths():
    from pfl_core.config import RunConfig
    from pfl_core.experiment import run_experiment

    cfg = RunConfig.from_dict({
        "data": {"dataset": "digits28", "num_clients": 6, "client_splits": {"test": 0.25},
                 "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 20}},
        "model": {"name": "mlr"},
        "method": {"name": "pfedhn", "params": {"inner_steps": 2, "hidden_dim": 8, "n_hidden": 1}},
        "federation": {"rounds": 3, "clients_per_round": 5, "batch_size": 10},
        "evaluation": {"protocol": "seen"},
    })
    runs = [run_experiment(cfg, device="cpu", execution=e) for e in ("sequential", "batched")]
    assert runs[0].metrics["acc"] == pytest.approx(runs[1].metrics["acc"], abs=1e-6)
    assert 0.0 <= runs[0].metrics["acc"] <= 1.0
