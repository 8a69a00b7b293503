"""CGPFL reproduction: pFedMe, APFL, L2SGD, CGPFL(-Heur), the classes_and_sizes split, the CIFAR CNN
and the cgpfl suites (shared/specs/cgpfl.md)."""
from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

import pfl_core.data.cgpfl_split  # noqa: F401  (registers classes_and_sizes)
from pfl_core.algorithms import METHODS
from pfl_core.algorithms.apfl import apfl_step
from pfl_core.algorithms.cgpfl import ContextUpdate, kmeans_labels
from pfl_core.algorithms.cgpfl_heur import choose_num_clusters
from pfl_core.algorithms.l2sgd import aggregation_branch, coin_counts, expected_step, local_branch
from pfl_core.algorithms.pfedme import prox_gradient_steps
from pfl_core.config import FederationConfig, RunConfig
from pfl_core.data import build_federated, partition
from pfl_core.data.federated import ArrayDataset
from pfl_core.evaluation import PROTOCOLS, EvalConfig
from pfl_core.federation import run_federation
from pfl_core.models import build_model, count_parameters
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.conftest import REPO_ROOT
from tests.helpers import make_method, one_thread, tiny_federation  # noqa: F401 (fixture)
from tests.test_training import _mlr_grad
from benchmarks.suite.file import read_suite_file


pytestmark = pytest.mark.usefixtures("one_thread")




def _federate(alg, fed, model, rounds=3, batch_size=2, init=None):
    cfg = FederationConfig(rounds=rounds, clients_per_round=0, batch_size=batch_size, drop_last=False)
    init = model_params(model) if init is None else init
    protocol = PROTOCOLS.get("seen")(EvalConfig(reduction="sample"))
    return run_federation(alg, fed, init, cfg, protocol, RunStreams(0))


# ---------------------------------------------------------------- CGPFL with K = 1 is pFedMe
def test_cgpfl_with_one_context_equals_pfedme_exactly():
    fed = tiny_federation(sizes=(6, 4, 5, 7))
    torch.manual_seed(0)
    model = build_model("mlr", (3,), 3)
    init = model_params(model)
    shared = dict(lr=0.05, personal_lr=0.1, lam=12.0, inner_steps=3, local_rounds=4)
    pfedme = make_method("pfedme", model, **shared, beta=1.0, weighting="uniform")
    cgpfl = make_method("cgpfl", model, **shared, num_clusters=1, alpha=1.0)
    a = _federate(pfedme, fed, model, init=init)
    b = _federate(cgpfl, fed, model, init=init)
    for name in init:
        assert torch.equal(a.server["params"][name], b.server["centers"][0][name])
        assert torch.equal(a.server["params"][name], b.server["params"][name])
    for cid in fed.train_clients:
        for name in init:
            assert torch.equal(a.contexts[cid].state["theta"][name], b.contexts[cid].state["theta"][name])
    assert a.final.summary == b.final.summary
    assert [h["train_loss"] for h in a.history] == [h["train_loss"] for h in b.history]
    assert not torch.equal(a.server["params"]["1.weight"], init["1.weight"])


# ---------------------------------------------------------------- k-means on planted clusters
def _planted(per=5, dim=6, seed=0):
    rng = np.random.default_rng(seed)
    centres = np.array([[10.0] * dim, [-10.0] * dim, [10.0] * (dim // 2) + [-10.0] * (dim - dim // 2)])
    x = np.concatenate([c + rng.normal(0, 0.1, (per, dim)) for c in centres])
    truth = np.repeat(np.arange(3), per)
    return x, truth


def _same_partition(a, b):
    return all((a[i] == a[j]) == (b[i] == b[j]) for i, j in itertools.combinations(range(len(a)), 2))


def test_kmeans_recovers_planted_clusters_and_is_seeded():
    x, truth = _planted()
    labels = kmeans_labels(x, 3, seed=7)
    assert _same_partition(labels, truth)
    assert np.array_equal(labels, kmeans_labels(x, 3, seed=7))
    assert np.array_equal(kmeans_labels(x, 1, seed=7), np.zeros(len(x)))


@pytest.mark.parametrize("spread", [0.05, 0.0])  # planted contexts, then pure noise (no clear clusters)
def test_kmeans_in_span_coordinates_gives_the_labels_of_full_dimension_kmeans(spread):
    """kmeans_labels clusters the points in an orthonormal basis of their span; scikit-learn on the
    raw 40 x 5,000 vectors (with its default tolerance) gives the same labels, seed by seed."""
    import warnings

    from sklearn.cluster import KMeans

    from pfl_core.algorithms.cgpfl import span_coordinates

    rng = np.random.default_rng(3)
    for seed in range(12):
        offset = rng.normal(size=5000)  # a large shared component, as client models have
        centres = rng.normal(size=(4, 5000)) * spread
        x = (offset + centres[rng.integers(0, 4, 40)] + 0.01 * rng.normal(size=(40, 5000)))
        x = x.astype(np.float32).astype(np.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            full = KMeans(n_clusters=4, init="k-means++", n_init=10, max_iter=300, random_state=seed).fit_predict(x)
        assert np.array_equal(kmeans_labels(x, 4, seed=seed), full), seed
    z = span_coordinates(x)
    assert z.shape == (40, 40)
    d_full = ((x[:, None] - x[None]) ** 2).sum(-1)
    assert np.allclose(((z[:, None] - z[None]) ** 2).sum(-1), d_full, rtol=1e-9, atol=1e-9 * d_full.max())


def test_cgpfl_server_step_sets_contexts_to_cluster_means_and_reassigns_clients():
    x, truth = _planted(per=4, dim=4)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False))  # 4 parameters
    alg = make_method("cgpfl", model, num_clusters=3, alpha=1.0)
    server = alg.init_server({"0.weight": torch.zeros(2, 2, dtype=torch.float64)})
    updates = [ContextUpdate({"0.weight": torch.tensor(row).view(2, 2)}, 10, torch.tensor(0.0), cid=i)
               for i, row in enumerate(x)]
    server = alg.aggregate(server, updates)
    assign = np.array([server["assign"][i] for i in range(len(x))])
    assert _same_partition(assign, truth)
    for k in range(3):
        members = x[assign == k]
        assert np.allclose(server["centers"][k]["0.weight"].reshape(-1).numpy(), members.mean(axis=0))
    assert sorted(server["sizes"]) == [4, 4, 4]


def test_cgpfl_alpha_step_and_empty_cluster_keeps_its_centre():
    model = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False))
    alg = make_method("cgpfl", model, num_clusters=3, alpha=0.5)
    server = alg.init_server({"0.weight": torch.zeros(1, 1, dtype=torch.float64)})
    # two distinct uploads for K = 3: one context stays empty and keeps omega^0 = 0
    values = [4.0, 4.0, 8.0, 8.0]
    updates = [ContextUpdate({"0.weight": torch.tensor([[v]], dtype=torch.float64)}, 1, torch.tensor(0.0), cid=i)
               for i, v in enumerate(values)]
    server = alg.aggregate(server, updates)
    centres = sorted(float(c["0.weight"]) for c in server["centers"])
    assert centres == [0.0, 2.0, 4.0]  # (1 - 0.5) * 0 + 0.5 * mean, and the empty one kept
    assert sorted(server["sizes"]) == [0, 2, 2]


def _uploads(rows, size=10):
    return [ContextUpdate({"0.weight": torch.tensor(row, dtype=torch.float64).view(2, 2)}, size, torch.tensor(0.0),
                          cid=i) for i, row in enumerate(rows)]


def test_cgpfl_clients_start_from_their_own_context_model():
    """Algorithm 1 line 4: client i receives omega_{k(i)} (theta and w start there); a client not yet
    assigned gets context 0."""
    from pfl_core.engine.contract import ClientContext

    fed = tiny_federation(sizes=(3, 3, 3))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False))
    alg = make_method("cgpfl", model, num_clusters=2)
    server = alg.init_server({"0.weight": torch.zeros(2, 2, dtype=torch.float64)})
    centres = [{"0.weight": torch.full((2, 2), float(v), dtype=torch.float64)} for v in (1, 2)]
    server = {**server, "centers": centres, "assign": {0: 1, 1: 0}}
    for cid, k in ((0, 1), (1, 0), (2, 0)):
        carry = alg.carry_in(server, ClientContext(fed.clients[cid], fed.dataset, {}), 0)
        assert torch.equal(carry["w"]["0.weight"], centres[k]["0.weight"])
        assert torch.equal(carry["theta"]["0.weight"], centres[k]["0.weight"])


def test_cgpfl_heur_chooses_k_once_and_records_it():
    """K is chosen at the first aggregation only (paper Section 4.4) and kept, even when later
    uploads would choose another K; the run records the choice."""
    x, _ = _planted(per=4, dim=4)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False))
    alg = make_method("cgpfl_heur", model, mu=1.0, mu_scale="absolute")
    server = alg.init_server({"0.weight": torch.zeros(2, 2, dtype=torch.float64)})
    server = alg.aggregate(server, _uploads(x))
    assert server["num_clusters"] == 3 and server["heur"]["chosen"] == 3
    flat = np.random.default_rng(1).normal(0, 0.01, x.shape)  # one blob: the solver alone would pick 1
    best, _ = choose_num_clusters(flat, np.ones(len(flat)), list(range(1, 7)), mu=1.0, mu_scale="absolute",
                                  penalty="kd", seed=0)
    assert best.k == 1
    server = alg.aggregate(server, _uploads(flat))
    assert server["num_clusters"] == 3 and len(server["centers"]) == 3
    info = alg.run_info(server)
    assert info["cgpfl_heur_chosen_k"] == 3 and info["cgpfl_heur_candidates"] == list(range(1, 7))
    assert info["cgpfl_contexts"] == 3
    assert alg.run_metrics(server) == {"cgpfl_contexts": 3.0, "cgpfl_heur_chosen_k": 3.0}


def test_relative_mu_at_most_one_always_chooses_one_context():
    """With mu_scale relative and penalty K*d, (11) is d (K + mu cost(K)/cost(1)): mu <= 1 gives K = 1."""
    x, _ = _planted(per=5, dim=6)
    for mu in (1e-3, 1e-2, 1e-1, 1.0):
        best, _ = choose_num_clusters(x, np.ones(len(x)), list(range(1, 8)), mu=mu, mu_scale="relative",
                                      penalty="kd", seed=0)
        assert best.k == 1
    best, _ = choose_num_clusters(x, np.ones(len(x)), list(range(1, 8)), mu=10.0, mu_scale="relative",
                                  penalty="kd", seed=0)
    assert best.k == 3


def test_cgpfl_heur_picks_the_planted_k_and_requires_mu():
    x, _ = _planted(per=5, dim=6)
    w = np.ones(len(x))
    best, fits = choose_num_clusters(x, w, list(range(1, 8)), mu=100.0, mu_scale="relative",
                                     penalty="kd", seed=0)
    assert best.k == 3
    assert [f.k for f in fits] == list(range(1, 8))
    assert fits[0].cost > fits[2].cost > 0
    tiny, _ = choose_num_clusters(x, w, list(range(1, 8)), mu=1e-3, mu_scale="relative", penalty="kd", seed=0)
    assert tiny.k == 1  # a negligible mu leaves only the complexity term
    with pytest.raises(ValueError, match="mu"):
        METHODS.get("cgpfl_heur").hyper_class.from_dict({})


def test_cgpfl_paper_literal_omega_rate():
    hp = METHODS.get("cgpfl").hyper_class
    assert hp(lr=0.005, lam=12.0).pull_rate == pytest.approx(0.06)
    assert hp(lr=0.005, omega_update="paper_literal", literal_n=40).pull_rate == pytest.approx(2.5e-4)


# ---------------------------------------------------------------- pFedMe inner solve
@pytest.mark.parametrize("hidden_l2", [0.0, 0.01])
def test_prox_inner_solve_reaches_the_closed_form_proximal_optimum(hidden_l2):
    a = torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)
    c = torch.tensor([2.0, -1.0, 4.0], dtype=torch.float64)
    w = {"p": torch.tensor([0.5, 0.5, -2.0], dtype=torch.float64)}
    lam = 12.0

    def quad(theta):  # f = 1/2 (theta - c)^T diag(a) (theta - c)
        d = theta["p"] - c
        return {"p": a * d}, 0.5 * (a * d * d).sum()

    theta, _ = prox_gradient_steps(quad, {"p": torch.zeros(3, dtype=torch.float64)}, w, 500, 0.05, lam, hidden_l2)
    expected = (a * c + lam * w["p"]) / (a + lam + hidden_l2)
    assert torch.allclose(theta["p"], expected, atol=1e-10)


# ---------------------------------------------------------------- APFL
def test_apfl_step_matches_hand_computation():
    torch.manual_seed(3)
    model = build_model("mlr", (4,), 3)
    w = model_params(model)
    v = {k: p + 0.3 * torch.randn_like(p) for k, p in w.items()}
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    alpha, lr = 0.4, 0.1
    new_w, new_v, new_alpha, _ = apfl_step(model, w, v, torch.tensor(alpha, dtype=torch.float64), x, y, lr, lr)
    W, b, V, c = w["1.weight"], w["1.bias"], v["1.weight"], v["1.bias"]
    gW, gb = _mlr_grad(W, b, x, y)
    Mb, mb = alpha * V + (1 - alpha) * W, alpha * c + (1 - alpha) * b
    hW, hb = _mlr_grad(Mb, mb, x, y)
    assert torch.allclose(new_w["1.weight"], W - lr * gW, atol=1e-6)
    assert torch.allclose(new_v["1.weight"], V - lr * alpha * hW, atol=1e-6)
    assert torch.allclose(new_v["1.bias"], c - lr * alpha * hb, atol=1e-6)
    dot = float(((V - W) * hW).sum() + ((c - b) * hb).sum())
    assert new_alpha == pytest.approx(min(1.0, max(0.0, alpha - lr * dot)), abs=1e-6)


def test_apfl_runs_and_predicts_with_the_mixture():
    fed = tiny_federation()
    torch.manual_seed(0)
    model = build_model("mlr", (3,), 3)
    alg = make_method("apfl", model, lr=0.1, local_steps=3)
    result = _federate(alg, fed, model, rounds=2)
    state = result.contexts[0].state
    mixed = alg.predictor(result.server, result.contexts[0])
    a = state["alpha"]
    expected = a * state["v"]["1.weight"] + (1 - a) * result.server["params"]["1.weight"]
    assert torch.allclose(mixed["1.weight"], expected)
    assert 0.0 <= a <= 1.0


# ---------------------------------------------------------------- L2SGD
def test_l2sgd_expected_step_is_a_gradient_step_on_the_penalized_objective():
    torch.manual_seed(0)
    x = {"p": torch.randn(5, dtype=torch.float64)}
    grad = {"p": torch.randn(5, dtype=torch.float64)}
    x_bar = {"p": torch.randn(5, dtype=torch.float64)}
    lr, lam, p = 0.005, 12.0, 0.1
    c = METHODS.get("l2sgd").hyper_class(lr=lr, lam=lam, p=p).mix_rate
    assert c == pytest.approx(lr * (1 - p) * lam / p)
    mean = {k: (1 - p) * local_branch(x, grad, lr)[k] + p * aggregation_branch(x, x_bar, c)[k] for k in x}
    assert torch.allclose(mean["p"], expected_step(x, grad, x_bar, lr, lam, p)["p"], atol=1e-12)
    twice = aggregation_branch(aggregation_branch(x, x_bar, c), x_bar, c)
    assert torch.allclose(twice["p"], aggregation_branch(x, x_bar, c, times=2)["p"], atol=1e-12)


def test_l2sgd_coin_flips_are_reproducible_with_geometric_means():
    """After the first round every round opens with the local flip that ended the previous round's
    aggregations: L >= 1 with E[L] = 1/p = 10 (not (1-p)/p = 9); only round 0 may have L = 0."""
    draws = [coin_counts(0, t, 0.1) for t in range(1, 3001)]
    assert draws == [coin_counts(0, t, 0.1) for t in range(1, 3001)]
    local = np.array([d[0] for d in draws])
    assert local.min() >= 1
    assert abs(local.mean() - 10.0) < 0.6  # E[L] = 1 / p; standard error ~0.17
    agg = np.mean([d[1] for d in draws])
    assert abs(agg - 1 / 0.9) < 0.05  # E[J] = 1 / (1 - p)
    first = np.array([coin_counts(s, 0, 0.1)[0] for s in range(3000)])
    assert first.min() == 0 and abs(first.mean() - 9.0) < 0.6  # round 0: L + 1 ~ Geometric(p)
    with pytest.raises(ValueError, match="aggregation coefficient"):
        METHODS.get("l2sgd").hyper_class(lr=0.03, lam=12.0, p=0.1)


def test_l2sgd_runs_on_a_tiny_federation():
    fed = tiny_federation()
    torch.manual_seed(0)
    model = build_model("mlr", (3,), 3)
    result = _federate(make_method("l2sgd", model, lr=0.05, lam=1.0, p=0.3), fed, model, rounds=4)
    assert np.isfinite(result.final.summary["acc_weighted"])


# ---------------------------------------------------------------- classes_and_sizes split
def _labels(n=60000, classes=10, seed=0):
    return np.random.default_rng(seed).permutation(np.arange(n) % classes)


def test_classes_and_sizes_gives_three_consecutive_classes_and_sizes_in_range():
    labels = _labels()
    parts = partition("classes_and_sizes", labels, 40, np.random.default_rng(1))
    assert len(parts) == 40
    for u, idx in enumerate(parts):
        assert 400 <= len(idx) <= 5000
        assert len(np.unique(idx)) == len(idx)  # without replacement within a client
        assert set(labels[idx].tolist()) == {u % 10, (u + 1) % 10, (u + 2) % 10}
        counts = [int((labels[idx] == (u + j) % 10).sum()) for j in range(3)]
        base, extra = divmod(len(idx), 3)
        assert counts == [base + extra, base, base]
    again = partition("classes_and_sizes", labels, 40, np.random.default_rng(1))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition("classes_and_sizes", labels, 40, np.random.default_rng(2))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_classes_and_sizes_disjoint_mode_never_shares_samples():
    labels = _labels()
    parts = partition("classes_and_sizes", labels, 40, np.random.default_rng(1), mode="disjoint")
    everything = np.concatenate(parts)
    assert len(np.unique(everything)) == len(everything)
    assert all(len(set(labels[p].tolist())) <= 3 for p in parts)
    with pytest.raises(ValueError, match="mode"):
        partition("classes_and_sizes", labels, 40, np.random.default_rng(1), mode="nope")


def test_classes_and_sizes_with_a_quarter_test_split():
    labels = _labels(6000)
    data = ArrayDataset("toy", torch.zeros(len(labels), 1), torch.as_tensor(labels), 10)
    fed = build_federated(data, num_clients=40, partition="classes_and_sizes",
                          partition_params={"min_size": 40, "max_size": 120},
                          client_splits={"test": 0.25}, unseen_fraction=0.0, streams=RunStreams(0))
    for client in fed.clients:
        n = client.meta["n"]
        assert client.size("test") == n // 4 and client.size("train") == n - n // 4


def test_test_in_other_train_fraction_counts_rows_of_other_clients_train_splits():
    from pfl_core.data.cgpfl_split import test_in_other_train_fraction
    from pfl_core.data.federated import Client, FederatedData

    data = ArrayDataset("toy", torch.zeros(8, 1), torch.zeros(8, dtype=torch.long), 2)
    a = Client(0, {"train": torch.tensor([0, 1, 2]), "test": torch.tensor([3, 4])})
    b = Client(1, {"train": torch.tensor([3, 5]), "test": torch.tensor([0, 6])})
    assert test_in_other_train_fraction(FederatedData(data, [a, b], [0, 1])) == 0.5  # rows 3 and 0 of 3, 4, 0, 6
    lone = Client(0, {"train": torch.tensor([0])})
    assert test_in_other_train_fraction(FederatedData(data, [lone], [0])) is None


def test_table1_suite_splits_every_client_75_25():
    """The suite's data section: train = floor(0.75 n), test = the rest (CGPFL paper Section 5.1)."""
    from pfl_core.experiment import prepare_run

    suite = _load("table1")
    spec = suite.expand("smoke", only={"setting": ["mnist-mlr"], "method": ["FedAvg"]})[0]
    config = copy.deepcopy(spec.config)
    config["data"]["dataset"] = "digits28"
    fed = prepare_run(RunConfig.from_dict(config), torch.device("cpu")).fed
    assert len(fed.clients) == 40 and fed.unseen_clients == []
    for client in fed.clients:
        n = client.size("train") + client.size("test")
        assert 30 <= n <= 60 and set(client.splits) == {"train", "test"}
        assert client.size("train") == int(np.floor(0.75 * n))


# ---------------------------------------------------------------- model
def test_cgpfl_cnn_has_52202_parameters():
    model = build_model("cgpfl_cnn", (3, 32, 32), 10)
    assert count_parameters(model) == 52202
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


# ---------------------------------------------------------------- suites
SUITES = {"table1": (45, 5), "fig1": (14, 5), "fig2": (14, 5), "fig3": (112, 5)}


def _load(name):
    from benchmarks.suite.spec import load_suite

    path = REPO_ROOT / "suites" / "cgpfl" / f"{name}.yaml"
    raw = read_suite_file(path)
    needed = {v["set"]["method.name"] for axis in raw["grid"] if axis["name"] == "method" for v in axis["values"]}
    missing = sorted(needed - set(METHODS.names()))
    if missing:
        pytest.skip(f"{name}.yaml needs methods not registered yet: {missing}")
    return load_suite(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SUITES))
def test_cgpfl_suites_load_and_expand_to_the_published_grid(name):
    suite = _load(name)
    cells, seeds = SUITES[name]
    assert len(suite.cells()) == cells
    assert len(suite.expand("paper")) == cells * seeds
    assert len(suite.expand("smoke")) == cells
    if name == "table1":
        assert len(suite.published) == 45
        assert all(p["source"] for p in suite.published)
        pub = {tuple(p["cell"].values()): p["mean"] for p in suite.published}
        assert pub[("mnist-mlr", "CGPFL-Heur")] == 97.41
        assert pub[("cifar10-cnn", "FedAvg")] == 46.34


@pytest.mark.parametrize("method", ["CGPFL-K4", "CGPFL-Heur", "pFedMe-PM"])
def test_table1_smoke_cell_runs_end_to_end_on_offline_digits(method):
    from pfl_core.experiment import run_experiment

    suite = _load("table1")
    spec = suite.expand("smoke", only={"setting": ["mnist-mlr"], "method": [method]})[0]
    config = copy.deepcopy(spec.config)
    config["data"]["dataset"] = "digits28"  # offline stand-in for MNIST: no download
    result = run_experiment(RunConfig.from_dict(config), device="cpu")
    assert 0.0 <= result.metrics["acc_weighted"] <= 1.0
    assert result.info["num_train_clients"] == 40
    assert len(result.history) == 2 and "acc_weighted" in result.history[-1]
    assert 0.0 < result.info["test_in_other_train_fraction"] < 1.0  # overlap mode: clients share rows
    if method == "CGPFL-Heur":
        assert 1 <= result.info["cgpfl_heur_chosen_k"] <= 20
        assert result.metrics["cgpfl_heur_chosen_k"] == result.info["cgpfl_heur_chosen_k"]  # snapshots carry it
    if method != "pFedMe-PM":
        assert result.metrics["cgpfl_contexts"] == result.info["cgpfl_contexts"]
    else:
        assert "cgpfl_contexts" not in result.metrics


# the named conventions every CGPFL suite cell of these methods must run with (issue 11, item 8)
CONVENTIONS = {
    "pfedme": {"predictor": "local", "theta_start": "received", "hidden_l2": 0.0, "beta": 1.0},
    "cgpfl": {"predictor": "local", "theta_start": "received", "alpha": 1.0},
    "cgpfl_heur": {"predictor": "local", "theta_start": "received", "mu_scale": "relative"},
    "perfedavg": {"beta": 0.001, "skip_logging_batch": False, "weighting": "samples", "variant": "hf"},
    "ditto": {"schedule": "interleaved", "weighting": "uniform", "anchor": "global", "global_optimizer": "sgd",
              "evaluate_personal": True},
    "l2sgd": {"variant": "loopless"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SUITES))
def test_cgpfl_suites_run_the_baselines_with_their_codes_conventions(name):
    suite = _load(name)
    seen = set()
    for spec in suite.expand("paper"):
        method = spec.config["method"]
        for key, value in CONVENTIONS.get(method["name"], {}).items():
            assert method["params"][key] == value, (spec.cell, key)
        seen.add(method["name"])
    assert {"pfedme", "cgpfl"} <= seen
    for spec in suite.expand("theta_predictor"):
        if spec.config["method"]["name"] in ("pfedme", "cgpfl", "cgpfl_heur"):
            assert spec.config["method"]["params"]["predictor"] == "theta"
    assert all(s.config["data"]["partition"]["mode"] == "disjoint" for s in suite.expand("disjoint"))
    if name == "table1":
        l2sgd = [s for s in suite.expand("ditto_code_baselines") if s.config["method"]["name"] == "l2sgd"]
        apfl = [s for s in suite.expand("ditto_code_baselines") if s.config["method"]["name"] == "apfl"]
        assert l2sgd and all(s.config["method"]["params"]["variant"] == "mean_regularized" for s in l2sgd)
        assert apfl and not any(s.config["method"]["params"]["adaptive_alpha"] for s in apfl)
        assert suite.metric["also"] == ["max_over_rounds"]


@pytest.mark.slow
def test_table1_pfedme_code_profile_runs_the_code_lineages_conventions():
    """Profile pfedme_code (docs/papers/cgpfl.md, code conventions): Per-FedAvg scored after a step
    at alpha and one at beta on the next test batches with the README's fine-tuned beta, FedTorch's
    fixed-alpha APFL, the maximum over rounds as the headline; every other cell is the paper's run."""
    from benchmarks.reporting.metric import metric_spec

    suite = _load("table1")
    paper = {(s.cell_id, s.seed): s for s in suite.expand("paper")}
    beta = {"mnist-mlr": 0.003, "fmnist-mlr": 0.003, "mnist-dnn": 0.001, "fmnist-dnn": 0.001, "cifar10-cnn": 0.001}
    for spec in suite.expand("pfedme_code"):
        params, evaluation = spec.config["method"]["params"], spec.config["evaluation"]["params"]
        assert spec.config["federation"]["eval_every"] == 1
        if spec.method == "perfedavg":
            alpha = params["alpha"]
            assert params["beta"] == beta[spec.cell["setting"]]
            assert evaluation["steps"] == 2 and evaluation["step_lrs"] == [alpha, params["beta"]]
            assert (evaluation["adapt_split"], evaluation["adapt_batches"]) == ("evaluated", "continue")
        elif spec.method == "apfl":
            assert (params["adaptive_alpha"], params["alpha_init"], params["weighting"]) == (False, 0.5, "uniform")
            assert (params["step_order"], params["mix_with"]) == ("w_first", "local")
        else:
            assert spec.config_hash == paper[(spec.cell_id, spec.seed)].config_hash
    metric = metric_spec(suite, "pfedme_code")
    assert (metric.aggregate, metric.also) == ("max_over_rounds", ("final",))
    assert metric_spec(suite).aggregate == "final"
