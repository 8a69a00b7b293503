import torch
import torch.nn.functional as F

from pfl_core.models import build_model
from pfl_core.training import average_params, batch_loss, gradients, model_params, sgd_step


def _mlr_grad(W, b, x, y):
    """Closed-form gradient of mean softmax cross-entropy for logits = x W^T + b."""
    p = torch.softmax(x @ W.T + b, dim=1)
    p[torch.arange(len(y)), y] -= 1
    return p.T @ x / len(y), p.mean(0)


def test_gradients_match_closed_form_for_logistic_regression():
    torch.manual_seed(0)
    model = build_model("mlr", (5,), 3)
    params = model_params(model)
    x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))
    grads, loss = gradients(model, params, x, y)
    gW, gb = _mlr_grad(params["1.weight"], params["1.bias"], x, y)
    assert torch.allclose(grads["1.weight"], gW, atol=1e-6)
    assert torch.allclose(grads["1.bias"], gb, atol=1e-6)
    assert torch.isclose(loss, F.cross_entropy(x @ params["1.weight"].T + params["1.bias"], y))


def test_gradients_match_finite_differences_on_a_small_network():
    torch.manual_seed(1)
    model = build_model("dnn", (4,), 3, hidden=6).double()
    params = {k: v.double() for k, v in model_params(model).items()}
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 3, (9,))
    grads, _ = gradients(model, params, x, y)
    eps = 1e-6
    for name in params:
        flat = params[name].flatten()
        for i in range(0, flat.numel(), max(1, flat.numel() // 5)):
            plus = {k: v.clone() for k, v in params.items()}
            minus = {k: v.clone() for k, v in params.items()}
            plus[name].view(-1)[i] += eps
            minus[name].view(-1)[i] -= eps
            numeric = (batch_loss(model, plus, x, y) - batch_loss(model, minus, x, y)) / (2 * eps)
            assert abs(float(numeric) - float(grads[name].view(-1)[i])) < 1e-6


def test_sgd_step_with_proximal_term_is_the_hand_computed_step():
    torch.manual_seed(2)
    model = build_model("mlr", (4,), 2)
    params = model_params(model)
    anchor = {k: torch.randn_like(v) for k, v in params.items()}
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    lr, mu = 0.3, 0.1
    new, _ = sgd_step(model, params, x, y, lr, prox_mu=mu, prox_anchor=anchor)
    gW, gb = _mlr_grad(params["1.weight"], params["1.bias"], x, y)
    expected_W = params["1.weight"] - lr * (gW + mu * (params["1.weight"] - anchor["1.weight"]))
    expected_b = params["1.bias"] - lr * (gb + mu * (params["1.bias"] - anchor["1.bias"]))
    assert torch.allclose(new["1.weight"], expected_W, atol=1e-6)
    assert torch.allclose(new["1.bias"], expected_b, atol=1e-6)


def test_average_params_is_normalised_weighted_mean():
    a = {"w": torch.tensor([1.0, 2.0])}
    b = {"w": torch.tensor([3.0, 6.0])}
    avg = average_params([a, b], [1, 3])
    assert torch.allclose(avg["w"], torch.tensor([2.5, 5.0]))
