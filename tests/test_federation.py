import numpy as np
import pytest
import torch

from pfl_core.algorithms import METHODS
from pfl_core.config import FederationConfig
from pfl_core.evaluation import EvalConfig, PROTOCOLS
from pfl_core.federation import ClientSampler, DivergenceError, run_federation
from pfl_core.models import build_model
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.helpers import tiny_federation
from tests.test_training import _mlr_grad


def _setup(method, sizes=(6, 4, 5), **hp):
    fed = tiny_federation(sizes)
    torch.manual_seed(0)
    model = build_model("mlr", (3,), 3)
    cls = METHODS.get(method)
    alg = cls(model, cls.hyper_class.from_dict(hp))
    return fed, model, alg


def _run(alg, fed, model, rounds=1, per_round=0, batch_size=100, protocol="seen"):
    cfg = FederationConfig(rounds=rounds, clients_per_round=per_round, batch_size=batch_size)
    init = model_params(model)
    result = run_federation(alg, fed, init, cfg, PROTOCOLS.get(protocol)(EvalConfig()), RunStreams(0))
    return init, result


def _hand_sgd(params, x, y, lr, steps):
    W, b = params["1.weight"].clone(), params["1.bias"].clone()
    for _ in range(steps):
        gW, gb = _mlr_grad(W, b, x, y)
        W, b = W - lr * gW, b - lr * gb
    return W, b


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_one_fedavg_round_is_the_weighted_mean_of_hand_computed_client_steps(weighting):
    fed, model, alg = _setup("fedavg", lr=0.5, local_steps=2, weighting=weighting)
    init, result = _run(alg, fed, model)
    expected_W, expected_b, total = 0, 0, 0
    for client in fed.clients:
        x, y = fed.dataset.batch(client.splits["train"])  # batch size > client size: full batch
        W, b = _hand_sgd(init, x, y, 0.5, 2)
        weight = client.size("train") if weighting == "samples" else 1
        expected_W, expected_b, total = expected_W + weight * W, expected_b + weight * b, total + weight
    server = result.server["params"]
    assert torch.allclose(server["1.weight"], expected_W / total, atol=1e-5)
    assert torch.allclose(server["1.bias"], expected_b / total, atol=1e-5)


def test_fedavg_local_epochs_walk_every_batch_once_per_epoch():
    fed, model, alg = _setup("fedavg", sizes=(6,), lr=0.1, local_epochs=2)
    init, result = _run(alg, fed, model, batch_size=3)
    ctx = result.contexts[0]
    W, b = init["1.weight"].clone(), init["1.bias"].clone()
    for _ in range(2):
        for index in ctx.streams["train"].epoch():
            x, y = fed.dataset.batch(index)
            gW, gb = _mlr_grad(W, b, x, y)
            W, b = W - 0.1 * gW, b - 0.1 * gb
    assert torch.allclose(result.server["params"]["1.weight"], W, atol=1e-6)


def test_local_never_changes_the_server_state_and_keeps_personal_models():
    fed, model, alg = _setup("local", lr=0.5, local_steps=3)
    init, result = _run(alg, fed, model, rounds=3)
    for name, value in init.items():
        assert torch.equal(result.server["params"][name], value)
    personal = [result.contexts[c].state["params"]["1.weight"] for c in fed.train_clients]
    assert not torch.allclose(personal[0], init["1.weight"])
    assert not torch.allclose(personal[0], personal[1])


def test_client_sampler_draws_without_replacement_from_its_own_stream():
    sampler = ClientSampler(list(range(80)), 5, RunStreams(3).numpy("sampling"))
    rounds = [sampler.sample() for _ in range(50)]
    assert all(len(set(r)) == 5 and set(r) <= set(range(80)) for r in rounds)
    again = ClientSampler(list(range(80)), 5, RunStreams(3).numpy("sampling"))
    assert rounds == [again.sample() for _ in range(50)]
    counts = np.bincount(np.concatenate(rounds), minlength=80)
    assert counts.sum() == 250 and (counts > 0).sum() > 60


def test_too_many_clients_per_round_is_an_error():
    with pytest.raises(ValueError, match="exceeds"):
        ClientSampler([0, 1], 3, RunStreams(0).numpy("sampling"))


def test_nan_loss_stops_the_run_with_a_divergence_error():
    fed, model, alg = _setup("fedavg", lr=0.1, local_steps=1)
    fed.dataset.x[fed.clients[1].splits["train"][0]] = float("nan")  # a corrupt sample
    with pytest.raises(DivergenceError, match="round 1"):
        _run(alg, fed, model, rounds=3)


def test_sampled_sequence_does_not_depend_on_the_method():
    seqs = []
    for method in ("fedavg", "local", "fedavg_ft"):
        fed, model, alg = _setup(method, sizes=(4,) * 10, lr=0.1, local_steps=1)
        _, result = _run(alg, fed, model, rounds=6, per_round=3)
        seqs.append(result.sampled)
    assert seqs[0] == seqs[1] == seqs[2]


def test_the_fused_finite_check_finds_one_bad_value_in_any_parameter_dict():
    """One host read per round (issue 26, item 2), still every tensor of every parameter dict:
    plain ``params``, a list of cluster models, integer BN counters."""
    from pfl_core.federation import _check_finite

    clusters = [{"w": torch.zeros(3), "b": torch.zeros(1)} for _ in range(3)]
    server = {"params": {"w": torch.ones(2, 2)}, "clusters": clusters,
              "buffers": {"bn.num_batches_tracked": torch.tensor(4)}, "step": 3}
    _check_finite(server, 0)
    clusters[2]["b"][0] = float("inf")
    with pytest.raises(DivergenceError, match="non-finite server parameters after round 5"):
        _check_finite(server, 4)
    _check_finite({"params": {}}, 0)  # nothing to check
    clusters[2]["b"][0] = float("nan")
    with pytest.raises(DivergenceError, match="after round 2"):
        _check_finite(server, 1)
    clusters[2]["b"][0] = 0.0
    server["params"]["w"] = torch.full((2, 2), 3e38)  # finite values whose float32 sum overflows
    assert torch.isinf(server["params"]["w"].sum())
    _check_finite(server, 0)
    server["params"]["w"] = torch.tensor([float("inf"), -float("inf")])  # a NaN sum from two infs
    with pytest.raises(DivergenceError):
        _check_finite(server, 0)


def test_the_finite_check_benchmark_times_both_checks_on_a_finite_state(capsys):
    """``benchmarks.timing.finite_check``: both checks pass pFedHN's CIFAR-10 server state."""
    from benchmarks.timing import finite_check

    server = finite_check.server_state(clients=8)
    assert finite_check.elementwise(server)
    finite_check.main(["--checks", "1"])
    finite_check.main(["--checks", "1", "--elementwise"])
    out = capsys.readouterr().out
    assert "(sum first)" in out and "(element-wise)" in out
