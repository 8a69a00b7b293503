"""pFedGP (label_regression head): the kernel and the GP posterior against hand computations, the
objectives' gradients against finite differences, the stratified split, the client-restricted
prediction, the backbone, and the batched path on stacked clients."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pfl_core.algorithms._lib import gp
from pfl_core.config import FederationConfig
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.engine import Executor
from pfl_core.engine.plans import make_buckets
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import make_contexts, run_federation
from pfl_core.models import build_model, count_parameters
from pfl_core.seeding import RunStreams
from pfl_core.training import embed, model_params
from tests.helpers import make_method, one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_kernel_against_a_hand_computation():
    a = torch.tensor([[3.0, 4.0]], dtype=torch.float64)  # normalised: (0.6, 0.8)
    b = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    k = gp.rbf_kernel(a, b, outputscale=8.0, lengthscale=2.0)
    # ||(0.6, 0.8) - (1, 0)||^2 = 0.8, ||(0.6, 0.8) - (0, 1)||^2 = 0.4; exp(-d / (2 * 2^2))
    assert k[0].tolist() == pytest.approx([8 * math.exp(-0.8 / 8), 8 * math.exp(-0.4 / 8)], rel=1e-12)
    assert gp.rbf_kernel(b, b, 3.0, 1.0).diagonal().tolist() == pytest.approx([3.0, 3.0])


def test_posterior_and_likelihoods_on_a_two_point_problem():
    """K = [[2, 1], [1, 2]] + noise 1 -> (K + I)^-1 = [[3, -1], [-1, 3]] / 8."""
    k_train = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    k_cross = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    targets = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    mean, var = gp.posterior(k_train, k_cross, torch.tensor([2.0], dtype=torch.float64), targets, noise=1.0)
    # mean = k_*^T (K + I)^-1 Y = [1, 0] [[3, -1], [-1, 3]] / 8 = [3/8, -1/8]; var = 2 - 3/8
    assert mean[0].tolist() == pytest.approx([3 / 8, -1 / 8], rel=1e-12)
    assert var.tolist() == pytest.approx([2 - 3 / 8], rel=1e-12)
    # predictive: sum over the masked classes of log N(t | mean, var + noise)
    t = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    s2 = 2 - 3 / 8 + 1.0
    logn = lambda x, m: -0.5 * ((x - m) ** 2 / s2 + math.log(2 * math.pi * s2))
    both = gp.predictive_nll(mean, var, t, 1.0, torch.tensor([1.0, 1.0], dtype=torch.float64))
    first = gp.predictive_nll(mean, var, t, 1.0, torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert float(both) == pytest.approx(-(logn(1, 3 / 8) + logn(0, -1 / 8)), rel=1e-12)
    assert float(first) == pytest.approx(-logn(1, 3 / 8), rel=1e-12)
    # marginal: -sum_c log N(y_c | 0, K + I) / n, against torch.distributions
    mvn = torch.distributions.MultivariateNormal(torch.zeros(2, dtype=torch.float64), k_train + torch.eye(2))
    expected = -(mvn.log_prob(targets[:, 0]) + mvn.log_prob(targets[:, 1])) / 2
    marginal = gp.marginal_nll(k_train, targets, 1.0, torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert float(marginal) == pytest.approx(float(expected), rel=1e-12)


def tiny_backbone():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()


def balanced_federation(clients=3, per_class=4, classes=(0, 1), num_classes=3, seed=0) -> FederatedData:
    """float64 features; every client holds ``per_class`` train and 2 test samples of ``classes``."""
    gen = torch.Generator().manual_seed(seed)
    xs, ys, splits, start = [], [], [], 0
    for _ in range(clients):
        labels = torch.tensor([c for c in classes for _ in range(per_class + 1)])
        xs.append(torch.randn(labels.numel(), 3, generator=gen, dtype=torch.float64) + labels[:, None])
        ys.append(labels)
        order = torch.arange(start, start + labels.numel())
        test = order[per_class::per_class + 1]
        splits.append({"train": order[~torch.isin(order, test)], "test": test})
        start += labels.numel()
    dataset = ArrayDataset("balanced", torch.cat(xs), torch.cat(ys), num_classes)
    return FederatedData(dataset, [Client(c, s) for c, s in enumerate(splits)], list(range(clients)))


@pytest.mark.parametrize("objective", ["predictive_likelihood", "marginal_likelihood"])
def test_objective_gradient_matches_finite_differences(objective):
    fed = balanced_federation()
    model = tiny_backbone()
    algorithm = make_method("pfedgp", model, gp_head="label_regression", objective=objective, noise=0.1)
    algorithm.prepare(fed)
    params = model_params(model)
    x, y = fed.dataset.batch(fed.clients[0].splits["train"])
    held = (x[::2], y[::2]) if objective == "predictive_likelihood" else None
    fit = (x[1::2], y[1::2]) if held is not None else (x, y)
    mask = algorithm.class_mask(y, x)

    def loss_of(weight):
        return algorithm.gp_loss({**params, "0.weight": weight}, fit, held, mask)

    assert torch.autograd.gradcheck(loss_of, (params["0.weight"].clone().requires_grad_(True),), eps=1e-6, atol=1e-6)


def test_draw_splits_each_class_into_fit_and_held_out_parts():
    fed = balanced_federation(per_class=5, classes=(0, 2))
    algorithm = make_method("pfedgp", tiny_backbone(), gp_head="label_regression", inner_steps=2)
    cfg = FederationConfig(batch_size=4)
    ctx = make_contexts(fed, [1], cfg, RunStreams(0), "batches", 4)[1]
    plan = algorithm.draw(ctx, 0)
    train = fed.clients[1].splits["train"]
    for fit, held in zip(plan["fit"], plan["held_out"]):
        assert sorted(torch.cat([fit, held]).tolist()) == sorted(train.tolist())
        assert fed.dataset.y[held].tolist().count(0) == 2 and fed.dataset.y[held].tolist().count(2) == 2  # int(5 * .5)
    assert not torch.equal(plan["held_out"][0], plan["held_out"][1])  # a fresh split every step
    marginal = make_method("pfedgp", tiny_backbone(), gp_head="label_regression", objective="marginal_likelihood").draw(ctx, 0)
    assert set(marginal) == {"fit"} and torch.equal(marginal["fit"][0], train)


@pytest.mark.parametrize("head", ["tree_pg", "label_regression"])
def test_predictions_stay_among_the_clients_training_classes(head):
    fed = balanced_federation(classes=(0, 1), num_classes=3)
    algorithm = make_method("pfedgp", tiny_backbone(), gp_head=head)
    algorithm.prepare(fed)
    ctx = make_contexts(fed, [0], FederationConfig(batch_size=4), RunStreams(0), "eval", 8)[0]
    x = torch.randn(20, 3, dtype=torch.float64) + 2.0  # even points near a class-2 location
    logits = algorithm.logits(model_params(algorithm.model), x, ctx)
    assert set(logits.argmax(1).tolist()) <= {0, 1} and bool((logits[:, 2] < -20).all())
    with pytest.raises(ValueError, match="train split"):
        algorithm.logits(model_params(algorithm.model), x, None)


def test_the_batched_path_stacks_clients_and_equals_the_sequential_path():
    fed = balanced_federation(clients=3, per_class=4)
    cfg = FederationConfig(rounds=2, clients_per_round=3, batch_size=4)
    protocol = SeenClients(EvalConfig(steps=0, reduction="sample"))
    runs = {}
    for execution in ("sequential", "batched"):
        algorithm = make_method("pfedgp", tiny_backbone(), gp_head="label_regression", inner_steps=2, lr=0.1)
        runs[execution] = run_federation(algorithm, fed, model_params(tiny_backbone()), cfg, protocol, RunStreams(0),
                                         executor=Executor(execution))
    for k, v in runs["sequential"].server["params"].items():
        torch.testing.assert_close(runs["batched"].server["params"][k], v, rtol=1e-9, atol=1e-12)
    assert not torch.equal(runs["sequential"].server["params"]["0.weight"], model_params(tiny_backbone())["0.weight"])
    assert runs["batched"].final.summary == pytest.approx(runs["sequential"].final.summary)
    plans = [algorithm.draw(ctx, 0) for ctx in runs["batched"].contexts.values()]
    assert len(make_buckets(plans, (), 0.0)) == 1  # equal class counts: one vmap call for all three


def test_backbone_is_the_lenet_trunk_with_an_84_by_84_output_layer():
    model = build_model("pfedgp_cnn", (3, 32, 32), 10)
    assert count_parameters(model) == count_parameters(build_model("le_embedding", (3, 32, 32), 10)) + 84 * 84 + 84
    x = torch.randn(2, 3, 32, 32)
    params = model_params(model)
    assert model(x).shape == (2, 84) and torch.equal(embed(model, params, x), model(x))
    expected = model.embed_dim(torch.relu(model.trunk(x)))
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("head", ["tree_pg", "label_regression"])
def test_a_configured_run_end_to_end_records_its_gp_head(head):
    from pfl_core.config import RunConfig
    from pfl_core.experiment import run_experiment

    cfg = RunConfig.from_dict({
        "data": {"dataset": "digits28", "num_clients": 6, "client_splits": {"test": 0.25},
                 "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 20}},
        "model": {"name": "mlr"},
        "method": {"name": "pfedgp", "params": {"gp_head": head, "gibbs_draws_train": 4, "gibbs_draws_test": 4, "pg_terms": 20}},
        "federation": {"rounds": 2, "clients_per_round": 3, "batch_size": 10},
        "evaluation": {"protocol": "seen"},
    })
    result = run_experiment(cfg, device="cpu", execution="batched")
    assert result.info["pfedgp_gp_head"] == head
    assert result.info["execution"] == ("sequential" if head == "tree_pg" else "batched")
    assert result.metrics["acc"] > 0.5  # a GP on a 10-class linear map of the pixels, on 2-4 classes


# ------------------------------------------------------------------ the paper's head: tree_pg
def test_polya_gamma_draws_have_the_pg1_mean_and_variance():
    """E[PG(1, c)] = tanh(c/2) / (2c); Var = (sinh c - c) / (4 c^3 cosh^2(c/2)) (1/24 at c = 0)."""
    gen = torch.Generator().manual_seed(0)
    for c in (0.0, 1.0, 4.0):
        draws = gp.sample_polya_gamma(torch.full((20000,), c, dtype=torch.float64), gen, terms=100)
        mean = 0.25 if c == 0 else math.tanh(c / 2) / (2 * c)
        var = 1 / 24 if c == 0 else (math.sinh(c) - c) / (4 * c ** 3 * math.cosh(c / 2) ** 2)
        assert float(draws.mean()) == pytest.approx(mean, rel=0.01)
        assert float(draws.var()) == pytest.approx(var, rel=0.05)
        assert bool((draws > 0).all())


def test_gauss_hermite_is_exact_for_polynomials():
    mean, var = torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([4.0, 0.5], dtype=torch.float64)
    second = gp.gauss_hermite_expectation(lambda f: f ** 2, mean, var)
    assert second.tolist() == pytest.approx([5.0, 4.5], rel=1e-12)


def test_pg_prediction_against_a_one_point_hand_computation():
    """N = 1 train point (class 0: kappa = 1/2), omega fixed: f* ~ N(k_s kappa / (1 + k omega),
    k_ss - k_s^2 omega / (1 + k omega)); P = exp(E[log sigmoid f*]) by brute-force integration."""
    k, k_s, k_ss, omega = 2.0, 1.5, 2.0, 0.3
    k_all = torch.tensor([[k, k_s], [k_s, k_ss]], dtype=torch.float64)
    probs = gp.pg_predictive_probs(k_all, 1, torch.tensor([0.5], dtype=torch.float64),
                                   torch.tensor([[omega]], dtype=torch.float64))
    mean = k_s * 0.5 / (1 + k * omega)
    var = k_ss - k_s ** 2 * omega / (1 + k * omega)
    f = torch.linspace(mean - 12 * var ** 0.5, mean + 12 * var ** 0.5, 200001, dtype=torch.float64)
    density = torch.exp(-0.5 * (f - mean) ** 2 / var) / math.sqrt(2 * math.pi * var)
    expected = math.exp(float(torch.trapezoid(density * torch.nn.functional.logsigmoid(f), f)))
    assert float(probs) == pytest.approx(expected, rel=1e-8)


def test_pg_predictive_gradient_matches_finite_differences():
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    kappa = torch.tensor([0.5, -0.5, 0.5, -0.5, 0.5], dtype=torch.float64)
    omega = gp.pg_gibbs(gp.rbf_kernel(z[:5], z[:5], 8.0, 1.0) + 1e-3 * torch.eye(5), kappa, 3, 2, gen, 50)

    def probs(features):
        k_all = gp.rbf_kernel(features, features, 8.0, 1.0) + 1e-3 * torch.eye(7, dtype=torch.float64)
        return gp.pg_predictive_probs(k_all, 5, kappa, omega)

    assert torch.autograd.gradcheck(probs, (z.clone().requires_grad_(True),), eps=1e-6, atol=1e-6)


def test_two_means_finds_the_best_partition_and_the_tree_follows_it():
    from pfl_core.algorithms._lib.gp_tree import TreeNode, build_tree, two_means

    points = torch.tensor([[0.0, 0.0], [10.0, 0.0], [10.5, 0.0], [0.4, 0.0], [11.0, 0.0]], dtype=torch.float64)
    assert two_means(points) == [0, 1, 1, 0, 1]
    # classes 0 and 3 near each other, 1, 2, 4 far away: the root splits {0, 3} | {1, 2, 4}
    labels = torch.tensor([c for c in range(5) for _ in range(3)])
    features = points[labels] + 0.01 * torch.randn(15, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tree = build_tree(features, labels)
    assert tree[0] == TreeNode((0, 3), (1, 2, 4))
    assert tree[1] == TreeNode((0,), (3,))
    assert tree[2] == TreeNode((1,), (2, 4)) and tree[3] == TreeNode((2,), (4,))
    assert len(tree) == 4  # C - 1 internal nodes
    assert build_tree(features[:3], labels[:3]) == []


def test_tree_class_probabilities_sum_to_one_over_the_clients_classes():
    from pfl_core.algorithms._lib.gp_tree import GibbsSettings, TreeGP, build_tree

    gen = torch.Generator().manual_seed(0)
    labels = torch.tensor([0, 0, 0, 2, 2, 2, 3, 3, 3])
    z = torch.randn(9, 4, generator=gen, dtype=torch.float64) + labels[:, None]
    tree_gp = TreeGP(8.0, 1.0, 1e-3, GibbsSettings(4, 2, 50), GibbsSettings(4, 2, 50), 0.5)
    fitted = tree_gp.fit_tree(z, labels, build_tree(z, labels), gen)
    present = torch.tensor([1.0, 0.0, 1.0, 1.0])
    probs = tree_gp.class_probs(fitted, present, torch.randn(5, 4, generator=gen, dtype=torch.float64))
    assert probs.sum(1).tolist() == pytest.approx([1.0] * 5, rel=1e-12)
    assert bool((probs[:, 1] == 0).all()) and bool((probs[:, [0, 2, 3]] > 0).all())
    # the training objective is finite and differentiable through the features
    feats = z.clone().requires_grad_(True)
    loss = tree_gp.loss(feats, labels, build_tree(z, labels), torch.Generator().manual_seed(1))
    loss.backward()
    assert math.isfinite(float(loss.detach())) and float(feats.grad.abs().sum()) > 0


def test_tree_head_runs_sequentially_and_reproducibly():
    fed = balanced_federation(clients=3, per_class=4, classes=(0, 1, 2), num_classes=3)
    cfg = FederationConfig(rounds=2, clients_per_round=2, batch_size=4)
    protocol = SeenClients(EvalConfig(steps=0, reduction="sample"))
    runs = []
    for execution in ("sequential", "batched", "batched"):
        algorithm = make_method("pfedgp", tiny_backbone(), lr=0.1, gibbs_draws_train=3, gibbs_draws_test=3,
                                pg_terms=30)
        assert Executor(execution).uses_batched(algorithm) is False  # tree_pg: the batched_fallback
        runs.append(run_federation(algorithm, fed, model_params(tiny_backbone()), cfg, protocol, RunStreams(0),
                                   executor=Executor(execution)))
    for run in runs[1:]:
        for k, v in runs[0].server["params"].items():
            assert torch.equal(run.server["params"][k], v)
        assert run.final.summary == runs[0].final.summary
    assert not torch.equal(runs[0].server["params"]["0.weight"], model_params(tiny_backbone())["0.weight"])


def test_tree_head_draws_each_clients_gibbs_chains_once_per_evaluation_with_a_val_split(monkeypatch):
    """With ``val_split`` the evaluation passes over the clients twice (test, then val); the val
    pass reuses each client's Gibbs draws and must give the numbers of a fresh fit."""
    from pfl_core.algorithms._lib.gp_tree import TreeGP

    fed = balanced_federation(clients=3, per_class=4, classes=(0, 1, 2), num_classes=3)
    for client in fed.clients:  # a val split: the first train sample of each class
        client.splits["val"] = client.splits["train"][::4]
    algorithm = make_method("pfedgp", tiny_backbone(), lr=0.1, gibbs_draws_train=3, gibbs_draws_test=3, pg_terms=30)
    cfg = FederationConfig(rounds=2, clients_per_round=2, batch_size=4)
    run = run_federation(algorithm, fed, model_params(tiny_backbone()), cfg,
                         SeenClients(EvalConfig(steps=0, reduction="sample")), RunStreams(0))
    calls = []
    original = TreeGP.gibbs_tree
    monkeypatch.setattr(TreeGP, "gibbs_tree", lambda self, *a: calls.append(1) or original(self, *a))

    both = SeenClients(EvalConfig(steps=0, reduction="sample", val_split="val"))
    algorithm.forget_fits()  # the run's last evaluation fitted these params
    summary = both.evaluate(algorithm, run.server, run.contexts).summary
    assert len(calls) == len(fed.clients)  # not twice: the val pass refits the factors only
    algorithm.forget_fits()  # a fresh fit of the val split
    alone = SeenClients(EvalConfig(steps=0, reduction="sample", split="val"))
    fresh = alone.evaluate(algorithm, run.server, run.contexts).summary
    assert len(calls) == 2 * len(fed.clients)
    assert {k: summary[f"val_{k}"] for k in fresh} == fresh


def test_the_evaluation_benchmark_gives_the_same_summary_on_both_paths():
    from benchmarks.timing.pfedgp_eval import main

    small = ["--train", "24", "--test", "6"]
    assert main(small) == main(small + ["--refit"])
