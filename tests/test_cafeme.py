import pytest
import torch

from pfl_core.algorithms import METHODS
from pfl_core.config import RunConfig
from pfl_core.experiment import run_experiment
from pfl_core.models import build_model, count_parameters
from pfl_core.training import forward, model_params
from tests.helpers import tiny_modulated


@pytest.mark.parametrize("name, shape, classes, total, fm", [
    ("cafeme_a", (1, 28, 28), 10, 1_126_462, 543_220),
    ("cafeme_a", (1, 28, 28), 62, 1_153_138, 543_220),
    ("cafeme_b", (3, 32, 32), 10, 1_731_858, 725_000),
])
def test_parameter_counts_match_the_spec(name, shape, classes, total, fm):
    model = build_model(name, shape, classes)
    assert count_parameters(model) == total
    assert count_parameters(model.fm) == fm
    assert model(torch.rand(3, *shape)).shape == (3, classes)


def test_context_is_invariant_to_the_order_of_the_batch():
    model = build_model("cafeme_a", (1, 28, 28), 10)
    x = torch.rand(16, 1, 28, 28)
    perm = torch.randperm(16)
    assert torch.allclose(model.fm(x), model.fm(x[perm]), atol=1e-5)
    assert torch.allclose(model(x)[perm], model(x[perm]), atol=1e-5)


def _set_gates(model, bias):
    with torch.no_grad():
        model.fm.head[-1].weight.zero_()
        model.fm.head[-1].bias.fill_(bias)


def test_open_gates_give_the_base_network_and_closed_gates_silence_it():
    model = build_model("cafeme_b", (3, 32, 32), 10)
    x = torch.rand(6, 3, 32, 32)
    _set_gates(model, 60.0)  # sigmoid = 1: every modulation point passes through
    assert torch.allclose(model(x), model.base(x), atol=1e-5)
    _set_gates(model, -60.0)  # sigmoid ~ 0: the last hidden layer is zeroed, only the bias remains
    assert torch.allclose(model(x), model.base.fc[-1].bias.expand(6, -1), atol=1e-5)


def test_gates_lie_in_unit_interval_and_sit_after_each_block():
    model = build_model("cafeme_a", (1, 28, 28), 10)
    seen = []
    model._modulate = (lambda original: lambda h, z: seen.append((h.shape[1], torch.sigmoid(z))) or original(h, z))(model._modulate)
    model(torch.rand(5, 1, 28, 28))
    assert [width for width, _ in seen] == [32, 64, 1024, 512]
    assert all(((g >= 0) & (g <= 1)).all() for _, g in seen)


def test_film_switch_doubles_the_modulator_output_and_labels_widen_its_input():
    film = build_model("cafeme_a", (1, 28, 28), 10, modulation="film")
    assert film.fm.head[-1].out_features == 2 * 1632
    labelled = build_model("cafeme_a", (1, 28, 28), 10, context_labels=True)
    assert labelled.fm.per_sample[0].in_features == 1024 + 10
    x, y = torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))
    assert labelled(x, context_y=y).shape == (4, 10)
    with pytest.raises(ValueError, match="labels"):
        labelled(x)


def _tiny_modulated():
    """A 1x6x6 modulated net small enough for float64 finite differences."""
    return tiny_modulated()


def _algorithm(model, **hp):
    cls = METHODS.get("cafeme")
    return cls(model, cls.hyper_class(**hp))


def _batches(seed=1):
    gen = torch.Generator().manual_seed(seed)
    make = lambda n: (torch.rand(n, 1, 6, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen))
    return [make(4), make(4)], make(8)


def _steps(support):
    """Support batches as the (xs, ys) step sequences ``meta_gradient`` takes."""
    return [x for x, _ in support], [y for _, y in support]


def test_second_order_meta_gradient_matches_finite_differences():
    model = _tiny_modulated()
    alg = _algorithm(model, first_order=False, inner_lr=0.3)
    params = model_params(model)
    support, query = _batches()
    grads, _ = alg.meta_gradient(params, _steps(support), query)

    def meta_loss(p):
        phi = p
        for x, y in support:
            leaves = {k: v.detach().requires_grad_(True) for k, v in phi.items()}
            g = torch.autograd.grad(alg.loss(leaves, x, y), list(leaves.values()))
            phi = {k: v - 0.3 * gk for (k, v), gk in zip(phi.items(), g)}
        return float(alg.loss(phi, *query))

    eps = 1e-6
    for name in ("fm.head.2.weight", "base.features.0.0.weight", "base.fc.1.bias"):
        for i in (0, params[name].numel() // 2):
            plus = {k: v.clone() for k, v in params.items()}
            minus = {k: v.clone() for k, v in params.items()}
            plus[name].view(-1)[i] += eps
            minus[name].view(-1)[i] -= eps
            numeric = (meta_loss(plus) - meta_loss(minus)) / (2 * eps)
            assert grads[name].view(-1)[i].item() == pytest.approx(numeric, rel=1e-4, abs=1e-7)


def test_first_order_gradient_is_the_query_gradient_at_the_adapted_point():
    model = _tiny_modulated()
    alg = _algorithm(model, first_order=True, inner_lr=0.3)
    params = model_params(model)
    support, query = _batches()
    grads, _ = alg.meta_gradient(params, _steps(support), query)
    phi = params
    for x, y in support:
        leaves = {k: v.detach().requires_grad_(True) for k, v in phi.items()}
        g = torch.autograd.grad(alg.loss(leaves, x, y), list(leaves.values()))
        phi = {k: (v - 0.3 * gk).detach() for (k, v), gk in zip(leaves.items(), g)}
    leaves = {k: v.requires_grad_(True) for k, v in phi.items()}
    expected = torch.autograd.grad(alg.loss(leaves, *query), list(leaves.values()))
    for (name, g), e in zip(grads.items(), expected):
        assert torch.allclose(g, e)


def test_second_order_differs_from_first_order():
    model = _tiny_modulated()
    support, query = _batches()
    fo, _ = _algorithm(model, first_order=True).meta_gradient(model_params(model), _steps(support), query)
    so, _ = _algorithm(model, first_order=False).meta_gradient(model_params(model), _steps(support), query)
    assert not torch.allclose(fo["base.fc.1.weight"], so["base.fc.1.weight"])


def test_cafeme_rejects_an_unmodulated_model():
    with pytest.raises(ValueError, match="modulated model"):
        _algorithm(build_model("cafeme_cnn_a", (1, 28, 28), 10))


@pytest.mark.parametrize("protocol, unseen", [("unseen", 0.2), ("seen", 0.0)])
def test_cafeme_runs_end_to_end_and_keeps_client_adam_state(protocol, unseen):
    cfg = RunConfig.from_dict({
        "data": {"dataset": "digits28", "num_clients": 10, "unseen_fraction": unseen,
                 "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 40}},
        "model": {"name": "cafeme_a"},
        "method": {"name": "cafeme", "params": {"adapt_steps": 2, "query_batches": 2}},
        "federation": {"rounds": 2, "clients_per_round": 3, "batch_size": 10},
        "evaluation": {"protocol": protocol, "params": {"steps": 2, "lr": 0.01}},
    })
    result = run_experiment(cfg, device="cpu")
    assert len(result.curve_mean) == 3
    assert 0.0 <= result.metrics["acc"] <= 1.0
