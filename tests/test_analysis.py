"""Post-run analyses (evaluation.analyses): the t-SNE embeddings and the DLG attack of a run."""
import numpy as np
import pytest
import torch

from benchmarks.suite.schema import SuiteError, validate_config
from fake_data import write_cifar10
from pfl_core.analysis import parse_analyses
from pfl_core.analysis.leakage import client_prototypes
from pfl_core.config import RunConfig
from pfl_core.fields import ConfigError
from pfl_core.experiment import prepare_run, run_experiment
from pfl_core.federation import FederationResult
from pfl_core.prototypes import class_prototypes
from pfl_core.training import embed, model_params


def cifar_config(model="lenet", rounds=0, analyses=(), seed=0):
    return RunConfig.from_dict({
        "data": {"dataset": "cifar10", "num_clients": 4, "partition": {"name": "iid"},
                 "client_splits": {"test": 0.25}},
        "model": {"name": model},
        "method": {"name": "fedavg", "params": {"lr": 0.01, "local_steps": 1}},
        "federation": {"rounds": rounds, "clients_per_round": 2, "batch_size": 10},
        "evaluation": {"protocol": "seen", "params": {"reduction": "sample"}, "analyses": list(analyses)},
        "seed": seed,
    })


@pytest.fixture
def cifar_dir(tmp_path, monkeypatch):
    write_cifar10(tmp_path, 20, monkeypatch)  # 100 train images, labels cycling over 10 classes
    monkeypatch.setenv("PFL_DOWNLOAD", "0")
    return str(tmp_path)


def at_init(cfg, data_dir):
    setup = prepare_run(cfg, torch.device("cpu"), data_dir)
    result = FederationResult(setup.algorithm.init_server(model_params(setup.model)))
    return setup, result


def test_embeddings_are_the_evaluated_models_features_of_sampled_test_rows(cifar_dir):
    setup, result = at_init(cifar_config(analyses=[{"name": "embeddings", "samples": 15}]), cifar_dir)
    out = setup.analyses[0].run(setup, result)
    arrays = out.arrays["embeddings"]
    assert out.metrics == {"embeddings_logged": 15.0}
    assert arrays["embeddings"].shape == (15, 84) and arrays["embeddings"].dtype == np.float32
    index = torch.as_tensor(arrays["index"])
    x, y = setup.fed.dataset.batch(index)
    expected = embed(setup.model, result.server["params"], x)  # lenet: ReLU(fc2)
    np.testing.assert_allclose(arrays["embeddings"], expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(arrays["labels"], y.numpy())
    tests = {c.cid: set(c.splits["test"].tolist()) for c in setup.fed.clients}
    assert all(int(r) in tests[int(c)] for r, c in zip(arrays["index"], arrays["clients"]))
    assert len(set(arrays["index"].tolist())) == 15  # without replacement
    again = setup.analyses[0].run(setup, result).arrays["embeddings"]
    np.testing.assert_array_equal(again["index"], arrays["index"])  # seeded
    everything = parse_analyses([{"name": "embeddings", "samples": 10_000}])[0].run(setup, result)
    assert everything.metrics["embeddings_logged"] == sum(len(t) for t in tests.values())


def test_client_prototypes_are_class_means_of_the_clients_train_embeddings(cifar_dir):
    setup, result = at_init(cifar_config(model="le_embedding"), cifar_dir)
    from pfl_core.analysis.base import evaluated_contexts
    ctx = next(iter(evaluated_contexts(setup, result, "t").values()))
    params = result.server["params"]
    x, y = ctx.dataset.batch(ctx.client.splits["train"])
    classes = sorted(set(y.tolist()))
    label = torch.tensor([classes[2]])
    protos, rank = client_prototypes(setup.model, params, ctx, label)
    assert int(rank) == 2 and protos.shape == (len(classes), 84)
    for k, c in enumerate(classes):
        torch.testing.assert_close(protos[k], embed(setup.model, params, x[y == c]).mean(0).detach())
    torch.testing.assert_close(protos, class_prototypes(embed(setup.model, params, x), torch.searchsorted(
        torch.tensor(classes), y), len(classes)).detach())


def test_a_run_with_analyses_reports_their_metrics_and_arrays(cifar_dir):
    analyses = [{"name": "embeddings", "samples": 12},
                {"name": "dlg", "target": "classifier", "iterations": 2, "max_iter": 2}]
    result = run_experiment(cifar_config(rounds=1, analyses=analyses), device="cpu", data_dir=cifar_dir)
    assert result.metrics["embeddings_logged"] == 12.0
    assert {"dlg_psnr", "dlg_ssim", "dlg_gradient_distance"} <= set(result.metrics)
    dlg = result.arrays["dlg"]
    assert dlg["original"].shape == dlg["reconstruction"].shape == (3, 32, 32)
    assert 0.0 <= dlg["original"].min() and dlg["original"].max() <= 1.0  # pixels
    assert len(dlg["gradient_distance"]) == 3  # the start and after each of the 2 steps
    proto = run_experiment(cifar_config(model="le_embedding", analyses=[
        {"name": "dlg", "target": "prototypes", "leakage": False, "iterations": 1, "max_iter": 2}]),
        device="cpu", data_dir=cifar_dir)
    assert np.isfinite(proto.metrics["dlg_ssim"])
    plain = run_experiment(cifar_config(), device="cpu", data_dir=cifar_dir)
    assert plain.arrays == {} and "dlg_psnr" not in plain.metrics


@pytest.mark.parametrize("entry, key", [
    ({"name": "dlg", "target": "prototypes", "label": "idlg"}, "evaluation.analyses[0].label"),
    ({"name": "dlg", "leakage": True}, "evaluation.analyses[0].leakage"),
    ({"name": "dlg", "iterations": 0}, "evaluation.analyses[0].iterations"),
    ({"name": "embeddings", "sample": 5}, "evaluation.analyses[0].sample"),
    ({"name": "tsne"}, "evaluation.analyses[0].name"),
])
def test_bad_analyses_are_rejected_naming_the_key(entry, key):
    with pytest.raises(ConfigError) as err:
        parse_analyses([entry])
    assert err.value.key == key
    config = cifar_config(analyses=[entry]).to_dict()
    with pytest.raises(SuiteError, match=r"evaluation\.analyses\[0\]"):
        validate_config(config, "suite.yaml: grid")


@pytest.mark.parametrize("mode", ["none", "half", "pixel"])
def test_to_pixels_undoes_the_datasets_normalisation(cifar_dir, mode):
    from pfl_core.analysis.base import to_pixels
    from pfl_core.data import load_dataset
    from pfl_core.data.federated import standardize

    raw = load_dataset("cifar10", data_dir=cifar_dir, split="train")
    index = torch.arange(5)
    pixels, _ = raw.batch(index)
    normalised = standardize(raw, mode)
    x, _ = normalised.batch(index)
    assert (mode == "none") == torch.equal(x, pixels)
    torch.testing.assert_close(to_pixels(normalised, x), pixels, rtol=1e-5, atol=1e-5)
