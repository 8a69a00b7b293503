"""Table 6 ARI, Figures 3/5 distance maps, Figures 2/4 sparsity and per-layer statistics
(pfl_core/analysis/personalization.py) on hand-made client vectors."""
import math

import numpy as np
import pytest

from pfl_core.analysis.personalization import (ClusteringSettings, cluster_distance_map, layer_distribution,
                                               lr_sparsity, pairwise_distances, spectral_ari, spectral_clusters)


def _blobs(domains, spread, seed=0):
    """Clients of each domain around that domain's own centre (centres 3 apart, within-RBF reach)."""
    rng = np.random.default_rng(seed)
    centres = {d: np.eye(4)[i] * 3.0 for i, d in enumerate(sorted(set(domains)))}
    return np.stack([centres[d] + spread * rng.standard_normal(4) for d in domains])


def test_ari_of_well_separated_domains_is_one():
    domains = ["clipart"] * 6 + ["real"] * 6 + ["sketch"] * 6
    assert spectral_ari(_blobs(domains, 0.05), domains) == pytest.approx(1.0)


def test_ari_does_not_depend_on_label_names_or_client_order():
    domains = np.array([0] * 5 + [1] * 5 + [2] * 5)
    x = _blobs(domains.tolist(), 0.05)
    order = np.random.default_rng(1).permutation(len(domains))
    renamed = np.array(["c", "a", "b"])[domains]
    assert spectral_ari(x[order], renamed[order]) == pytest.approx(1.0)


def test_ari_of_vectors_that_ignore_the_domain_is_near_zero():
    """Clients identical up to noise shared across domains: no clustering can match the domains."""
    rng = np.random.default_rng(0)
    domains = np.repeat(np.arange(3), 20)
    ari = spectral_ari(rng.standard_normal((60, 2)) * 0.1, domains)
    assert abs(ari) < 0.2


def test_one_client_per_domain_is_a_perfect_clustering():
    """Office-Caltech-10: 4 clients, 4 domains; each client is its own cluster (ARI 1, Table 6)."""
    assert spectral_ari(np.random.default_rng(0).standard_normal((4, 20)), ["a", "c", "d", "w"]) == 1.0


def test_n_clusters_defaults_to_the_number_of_domains_and_can_be_set():
    domains = [0] * 4 + [1] * 4 + [2] * 4
    x = _blobs(domains, 0.05)
    assert len(set(spectral_clusters(x, 3))) == 3
    two = spectral_ari(x, domains, ClusteringSettings(n_clusters=2))
    assert 0 < two < 1  # two of the three domains merged


def test_clustering_rejects_bad_inputs():
    with pytest.raises(ValueError, match="domain labels"):
        spectral_ari(np.zeros((3, 2)), [0, 1])
    with pytest.raises(ValueError, match="NaN"):
        spectral_clusters(np.array([[np.nan, 0.0], [1, 1], [2, 2]]), 2)


def test_distance_map_by_hand():
    # domain a: clients at 0 and 2 (d_aa = 2); domain b: clients at 10 and 11 (d_bb = 1)
    x = np.array([[0.0], [2.0], [10.0], [11.0]])
    dmap, names = cluster_distance_map(x, ["a", "a", "b", "b"])
    assert names == ["a", "b"]
    d_ab = (10 + 11 + 8 + 9) / 4
    np.testing.assert_allclose(np.diag(dmap), 0.0, atol=1e-12)
    assert dmap[0, 1] == pytest.approx(math.log(d_ab / (math.sqrt(2) * math.sqrt(1))))
    np.testing.assert_allclose(dmap, dmap.T)


def test_distance_map_is_near_zero_off_diagonal_for_mixed_domains():
    """Domains whose clients are drawn from one distribution: off-diagonal blocks about 0."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 5))
    dmap, _ = cluster_distance_map(x, np.arange(300) % 3)
    assert np.abs(dmap).max() < 0.05


def test_distance_map_of_single_client_domains_is_nan():
    dmap, _ = cluster_distance_map(np.eye(3), ["a", "b", "b"])
    assert np.isnan(dmap[0]).all() and np.isnan(dmap[:, 0]).all()
    assert dmap[1, 1] == pytest.approx(0.0, abs=1e-12)


def test_pairwise_distances():
    np.testing.assert_allclose(pairwise_distances(np.array([[0.0, 0.0], [3.0, 4.0]])), [[0, 5], [5, 0]])


def test_sparsity_counts_zero_learning_rates_per_tensor():
    etas = np.array([[0.0, 1e-3, 0.0, 2e-3],
                     [0.0, 0.0, 0.0, 0.0],
                     [1e-9, 1.0, 1.0, 1.0]])
    np.testing.assert_allclose(lr_sparsity(etas), [0.5, 1.0, 0.0])
    with pytest.raises(ValueError, match="clients, tensors"):
        lr_sparsity(np.zeros(3))


def test_layer_distribution_per_column():
    values = np.array([[0.0, 1.0], [0.5, 1.0], [1.0, 1.0], [0.25, 1.0], [0.75, 1.0]])
    stats = layer_distribution(values)
    np.testing.assert_allclose(stats["median"], [0.5, 1.0])
    np.testing.assert_allclose(stats["q1"], [0.25, 1.0])
    np.testing.assert_allclose(stats["q3"], [0.75, 1.0])
    np.testing.assert_allclose(stats["min"], [0.0, 1.0])
    np.testing.assert_allclose(stats["max"], [1.0, 1.0])
    np.testing.assert_allclose(stats["mean"], [0.5, 1.0])


def _run_with_arrays(arrays):
    from types import SimpleNamespace

    from pfl_core.evaluation import EvalResult

    return SimpleNamespace(final=EvalResult([], {}, arrays={} if arrays is None else {"personalization": arrays}))


def test_personalization_analysis_reads_the_protocol_arrays():
    from pfl_core.analysis import parse_analyses

    domains = np.array(["clipart"] * 5 + ["real"] * 5)
    beta = _blobs(domains.tolist(), 0.05)
    eta = np.where(np.arange(8) < 2, 0.0, 1e-3) * np.ones((10, 8))
    eta[:5, 2] = 0.0  # clipart clients: 3 of 8 learning rates are 0, real clients 2 of 8
    arrays = {"group": domains, "xi": beta, "beta": beta, "x": beta, "eta": eta}
    (analysis,) = parse_analyses([{"name": "personalization", "random_state": 3}])
    out = analysis.run(None, _run_with_arrays(arrays))
    assert {k: out.metrics[k] for k in ("ari_xi", "ari_beta", "ari_x")} == pytest.approx(
        {"ari_xi": 1.0, "ari_beta": 1.0, "ari_x": 1.0})
    assert out.metrics["lr_sparsity"] == pytest.approx((5 * 3 / 8 + 5 * 2 / 8) / 10)
    figures = out.arrays["personalization_figures"]
    assert figures["domains"].tolist() == ["clipart", "real"] and figures["dmap_beta"].shape == (2, 2)
    assert figures["dmap_beta"][0, 1] > 0  # domains further apart than their clients
    assert figures["beta_box"].shape == (5, 4) and figures["eta_box"].shape == (5, 8)
    np.testing.assert_allclose(figures["sparsity"], [3 / 8] * 5 + [2 / 8] * 5)


def test_personalization_analysis_errors_name_the_fix():
    from pfl_core.analysis import parse_analyses

    (analysis,) = parse_analyses([{"name": "personalization"}])
    with pytest.raises(ValueError, match="finetune_pretrained"):
        analysis.run(None, _run_with_arrays(None))
    one = {"group": np.array(["a"] * 3), **{q: np.zeros((3, 2)) for q in ("xi", "beta", "x", "eta")}}
    with pytest.raises(ValueError, match="domains"):
        analysis.run(None, _run_with_arrays(one))
