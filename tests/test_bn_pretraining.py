"""Stage 1 of FedL2P (FedL2P spec, "Pretraining the global model"): fedavg, fedbabu and perfedavg
train a KLD-BN ResNet with standard BatchNorm (beta 1, running statistics updated at every local
step) and the round lr schedules. Tiny ResNets (width 4, 8x8 inputs), float64."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pfl_core.algorithms._lib.round_lr import RoundLR
from pfl_core.config import FederationConfig
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import make_contexts, run_federation
from pfl_core.models import build_model
from pfl_core.models.kld_bn import KLDBatchNorm2d, bn_names
from pfl_core.seeding import RunStreams
from pfl_core.training import average_buffers, initial_bn_state, model_params
from tests.helpers import make_method, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_resnet(classes=3, seed=0):
    torch.manual_seed(seed)
    return build_model("resnet18_cifar", (3, 8, 8), classes, width=4).double()


def rgb_federation(sizes=(8, 8, 8), classes=3, test=4, seed=0) -> FederatedData:
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) + test * len(sizes)
    x = torch.rand(total, 3, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (total,), generator=gen)
    clients, start = [], 0
    for cid, n in enumerate(sizes):
        clients.append(Client(cid, {"train": torch.arange(start, start + n),
                                    "test": torch.arange(start + n, start + n + test)}))
        start += n + test
    return FederatedData(ArrayDataset("rgb", x, y, classes), clients, list(range(len(sizes))))


def torch_reference(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose KLD-BN layers are plain ``torch.nn.BatchNorm2d`` (same weights)."""
    reference = copy.deepcopy(model)
    for name, layer in list(reference.named_modules()):
        if isinstance(layer, KLDBatchNorm2d):
            plain = nn.BatchNorm2d(layer.num_features, eps=layer.eps, momentum=layer.momentum).double()
            plain.load_state_dict({k: v for k, v in layer.state_dict().items()
                                   if k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")})
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent) if parent else reference, child, plain)
    return reference


def _train_batches(fed, cid, batch_size):
    ctx = make_contexts(fed, [cid], FederationConfig(batch_size=batch_size), RunStreams(0), "batches", batch_size)[cid]
    return ctx, [fed.dataset.batch(i) for i in ctx.epoch_index()]


# ------------------------------------------------------------------ BN state through a local round

def test_fedavg_local_steps_equal_torch_batchnorm_and_sgd():
    """Two local steps of fedavg on a KLD-BN ResNet (beta 1) give the parameters, running
    statistics and counters of torch's nn.BatchNorm2d network trained by torch.optim.SGD."""
    fed, model = rgb_federation(sizes=(8,)), tiny_resnet()
    algorithm = make_method("fedavg", model, lr=0.1, local_epochs=1)
    server = algorithm.init_server(model_params(model))
    ctx, batches = _train_batches(fed, 0, batch_size=4)
    assert len(batches) == 2
    update = algorithm.client_update(server, ctx, 0)

    reference = torch_reference(model).train()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches:
        sgd.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        sgd.step()
    expected = reference.state_dict()
    for name, value in update.params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-10, atol=1e-12)
    assert set(update.buffers) == {f"{n}.{k}" for n in bn_names(model)
                                   for k in ("running_mean", "running_var", "num_batches_tracked")}
    for name, value in update.buffers.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-10, atol=1e-12)
    assert int(update.buffers["bn1.num_batches_tracked"]) == 2
    assert not torch.equal(update.buffers["bn1.running_mean"], server["buffers"]["bn1.running_mean"])


def test_one_local_step_running_statistics_equal_batchnorm2d_on_the_batch():
    """After one step the statistics are torch's (momentum 0.1, unbiased variance) on that batch."""
    fed, model = rgb_federation(sizes=(4,)), tiny_resnet()
    algorithm = make_method("fedavg", model, lr=0.1, local_steps=1)
    server = algorithm.init_server(model_params(model))
    ctx, batches = _train_batches(fed, 0, batch_size=4)
    update = algorithm.client_update(server, ctx, 0)
    x, _ = batches[0]
    stem = nn.BatchNorm2d(4).double().train()
    stem(nn.functional.conv2d(x, server["params"]["conv1.weight"], padding=1))
    torch.testing.assert_close(update.buffers["bn1.running_mean"], stem.running_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(update.buffers["bn1.running_var"], stem.running_var, rtol=1e-10, atol=1e-12)
    conv = nn.functional.conv2d(x, server["params"]["conv1.weight"], padding=1)
    by_hand = 0.9 * 1.0 + 0.1 * conv.var(dim=(0, 2, 3), unbiased=True)
    torch.testing.assert_close(update.buffers["bn1.running_var"], by_hand, rtol=1e-10, atol=1e-12)


def test_server_averages_running_statistics_with_the_parameters_weights():
    """The FedL2P code's flwr FedAvg averages the whole state_dict weighted by n_k: statistics as
    floats, the int64 counter truncated (here (2*2 + 3*3) / 5 = 2.6 -> 2)."""
    a = {"bn.running_mean": torch.tensor([1.0, 0.0]), "bn.num_batches_tracked": torch.tensor(2)}
    b = {"bn.running_mean": torch.tensor([2.0, 5.0]), "bn.num_batches_tracked": torch.tensor(3)}
    avg = average_buffers([a, b], [2, 3])
    torch.testing.assert_close(avg["bn.running_mean"], torch.tensor([1.6, 3.0]))
    assert avg["bn.num_batches_tracked"].dtype == torch.int64 and int(avg["bn.num_batches_tracked"]) == 2
    assert int(average_buffers([a, b], [1, 1])["bn.num_batches_tracked"]) == 2  # 2.5 -> 2
    assert int(average_buffers([b, b], [1, 2])["bn.num_batches_tracked"]) == 3  # exact, no float slip


def test_a_fedavg_round_averages_clients_statistics_into_the_server():
    fed, model = rgb_federation(sizes=(8, 4, 8)), tiny_resnet()
    algorithm = make_method("fedavg", model, lr=0.1, local_epochs=1)
    server = algorithm.init_server(model_params(model))
    contexts = make_contexts(fed, [0, 1, 2], FederationConfig(batch_size=4), RunStreams(0), "batches", 4)
    updates = [algorithm.client_update(server, contexts[c], 0) for c in (0, 1, 2)]
    new = algorithm.aggregate(server, updates)
    for name in new["buffers"]:
        if name.endswith("num_batches_tracked"):
            assert int(new["buffers"][name]) == (8 * 2 + 4 * 1 + 8 * 2) // 20  # 36 / 20 -> 1
        else:
            expected = sum(n * u.buffers[name] for n, u in zip((8, 4, 8), updates)) / 20
            torch.testing.assert_close(new["buffers"][name], expected, rtol=1e-12, atol=1e-14)


def test_models_without_bn_state_keep_the_old_carry_and_server():
    """No BN state, no schedule: no ``buffers`` anywhere, no ``lr`` in the carry (the old path)."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 3)).double()
    assert initial_bn_state(model) is None
    fed = rgb_federation(sizes=(4,))
    for method, hp in (("fedavg", {"lr": 0.1, "local_steps": 1}), ("perfedavg", {"local_steps": 1})):
        algorithm = make_method(method, model, **hp)
        server = algorithm.init_server(model_params(model))
        assert set(server) == {"params"}
        ctx = make_contexts(fed, [0], FederationConfig(batch_size=2), RunStreams(0), "batches", 2)[0]
        assert set(algorithm.carry_in(server, ctx, 3)) == {"params"}
        assert algorithm.client_update(server, ctx, 0).buffers is None


# ------------------------------------------------------------------ FedBABU and Per-FedAvg(HF)

def test_fedbabu_freezes_the_resnet_fc_and_trains_the_rest():
    """FedBABU pretraining: ``fc.`` frozen (lr 0, FedL2P code ``exclude_layers`` net.fc.*), the body
    and the BN affine parameters trained, the running statistics averaged."""
    fed, model = rgb_federation(), tiny_resnet()
    algorithm = make_method("fedbabu", model, lr=0.1, local_epochs=1, local_steps=0, momentum=0.0,
                            weight_decay=0.0, head_prefixes=["fc."])
    assert algorithm.head_names == ["fc.weight", "fc.bias"]
    init = model_params(model)
    result = run_federation(algorithm, fed, init, FederationConfig(rounds=2, clients_per_round=3, batch_size=4),
                            SeenClients(EvalConfig(steps=0)), RunStreams(0), evaluate_clients=False)
    params = result.server["params"]
    for name in ("fc.weight", "fc.bias"):
        assert torch.equal(params[name], init[name])
    for name in init:
        if not name.startswith("fc."):
            assert not torch.equal(params[name], init[name]), name
    assert int(result.server["buffers"]["layer4.1.bn2.num_batches_tracked"]) == 2 * 2  # 2 rounds x 2 steps


@pytest.mark.parametrize("variant, hvp, forwards", [("hf", "finite_difference", 4), ("hf", "exact", 3),
                                                    ("fo", "finite_difference", 2)])
def test_perfedavg_updates_running_statistics_at_every_forward(variant, hvp, forwards):
    """Per-FedAvg's passes update the statistics as a BatchNorm module in train mode: b1 at theta, b2
    at theta~, and the Hessian-vector product's b3 forwards (central difference: two; exact: one)."""
    fed, model = rgb_federation(sizes=(16,)), tiny_resnet()
    algorithm = make_method("perfedavg", model, local_steps=2, alpha=0.01, beta=0.01, variant=variant, hvp=hvp,
                            skip_logging_batch=False)
    server = algorithm.init_server(model_params(model))
    ctx, _ = _train_batches(fed, 0, batch_size=2)
    update = algorithm.client_update(server, ctx, 0)
    assert int(update.buffers["bn1.num_batches_tracked"]) == 2 * forwards


def test_perfedavg_statistics_follow_b1_at_theta_then_b2_at_theta_tilde():
    """One FO iteration's statistics equal torch's BatchNorm network after a train-mode forward of
    b1 at theta and one of b2 at theta~ = theta - alpha grad l(theta; b1)."""
    fed, model = rgb_federation(sizes=(8,)), tiny_resnet()
    algorithm = make_method("perfedavg", model, local_steps=1, alpha=0.05, variant="fo")
    server = algorithm.init_server(model_params(model))
    _, batches = _train_batches(fed, 0, batch_size=4)
    buffers = algorithm.meta_step(server["params"], batches[0], batches[1], None, server["buffers"])[2]
    reference = torch_reference(model).train()
    params = [p for _, p in reference.named_parameters()]
    grads = torch.autograd.grad(nn.functional.cross_entropy(reference(batches[0][0]), batches[0][1]), params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= 0.05 * g
        reference(batches[1][0])
    expected = reference.state_dict()
    for name, value in buffers.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ round lr schedules

def test_step_schedule_is_the_fedl2p_cifar10_one():
    hp = RoundLR(lr_milestones=[250, 375])
    hp.lr = 0.1
    lrs = {r: hp.round_lr(r - 1) for r in (1, 250, 251, 375, 376, 500)}
    assert lrs == pytest.approx({1: 0.1, 250: 0.1, 251: 0.01, 375: 0.01, 376: 0.001, 500: 0.001}, rel=1e-12)


def test_exponential_schedule_is_the_speech_commands_one():
    hp = RoundLR(lr_decay=0.1 ** (1 / 500))
    hp.lr = 0.1
    for r in (1, 2, 100, 250, 499, 500):
        assert hp.round_lr(r - 1) == pytest.approx(0.1 * 0.1 ** (r / 500), rel=1e-12)
    assert hp.round_lr(499) == pytest.approx(0.01, rel=1e-12)


def test_schedules_are_validated():
    with pytest.raises(ValueError, match="either lr_milestones"):
        RoundLR(lr_milestones=[2], lr_decay=0.9)
    with pytest.raises(ValueError, match="strictly increasing"):
        RoundLR(lr_milestones=[3, 2])
    with pytest.raises(ValueError, match="positive round"):
        RoundLR(lr_milestones=[0])
    with pytest.raises(Exception, match="lr_decay"):
        make_method("fedbabu", tiny_resnet(), lr_decay=-1.0, head_prefixes=["fc."])


@pytest.mark.parametrize("method, hp", [
    ("fedavg", {"lr_milestones": [1, 2]}),
    ("fedbabu", {"lr_milestones": [1, 2], "momentum": 0.0, "weight_decay": 0.0, "head_prefixes": ["3."]}),
    ("fedavg", {"lr_decay": 0.5}),
])
def test_each_round_trains_at_its_scheduled_lr(method, hp):
    """One client, one full-batch step per round: theta_r = theta_{r-1} - lr_r * grad, with the
    gradient recomputed here, for rounds 1..3 (step schedule 0.2, 0.02, 0.002; exponential 0.1,
    0.05, 0.025)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    fed = rgb_federation(sizes=(6,))
    algorithm = make_method(method, model, lr=0.2, local_steps=1, local_epochs=0, **hp)
    init = model_params(model)
    x, y = fed.dataset.batch(fed.clients[0].splits["train"])
    theta, trained = dict(init), [n for n in init if not n.startswith(tuple(hp.get("head_prefixes", ["-"])))]
    for rounds in (1, 2, 3):
        result = run_federation(algorithm, fed, init, FederationConfig(rounds=rounds, clients_per_round=1,
                                                                       batch_size=6),
                                SeenClients(EvalConfig()), RunStreams(0), evaluate_clients=False)
        leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
        loss = nn.functional.cross_entropy(torch.func.functional_call(model, leaves, (x,)), y)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        lr = algorithm.hp.round_lr(rounds - 1)
        assert lr == pytest.approx({1: 0.2, 2: 0.02, 3: 0.002}[rounds] if "lr_milestones" in hp
                                   else 0.2 * 0.5 ** rounds)
        theta = {k: v - lr * grads[k] if k in trained else v for k, v in theta.items()}
        for name in theta:
            torch.testing.assert_close(result.server["params"][name], theta[name], rtol=1e-10, atol=1e-12)
