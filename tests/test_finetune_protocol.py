"""Protocol ``finetune_pretrained`` and the stage-2 baselines end to end (a tiny ResNet-18 on
CIFAR-10-format files): summary keys, the per-client arrays, Global Accuracy = the pretrained model
on every client's test split, batched == sequential, per-group pooled accuracy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fake_data import write_cifar10
from pfl_core.algorithms import METHODS
from pfl_core.config import RunConfig
from pfl_core.evaluation import EvalConfig
from pfl_core.experiment import prepare_run, run_experiment
from pfl_core.algorithms._lib.finetune import ClientOutcome, pretrained_state
from pfl_core.evaluation.finetune_pretrained import FinetunePretrained, summarise_outcomes
from pfl_core.models.kld_bn import bn_mode, forward_bn, load_pretrained
from pfl_core.training import model_params


def config(method="ft_bn_c", execution_params=None, protocol=None, seed=0):
    return RunConfig.from_dict({
        "data": {"dataset": "cifar10", "num_clients": 2, "partition": {"name": "iid"},
                 "client_splits": {"val": 0.2, "test": 0.2}},
        "model": {"name": "resnet18_cifar", "params": {"width": 2}},
        "method": {"name": method, "params": execution_params or {}},
        "federation": {"rounds": 0, "clients_per_round": 2, "batch_size": 32},
        "evaluation": {"protocol": "finetune_pretrained",
                       "params": {"epochs": 1, "finetune_splits": ["train", "val"], "augment": False,
                                  "lr": 0.05, **(protocol or {})}},
        "seed": seed,
    })


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    """CIFAR-10-format files of 50 train images: 2 clients of 15 train + 5 val + 5 test images
    (one fine-tuning step per epoch: a ResNet step is slow on a shared CPU)."""
    root = tmp_path_factory.mktemp("cifar")
    with pytest.MonkeyPatch.context() as mp:
        write_cifar10(root, 10, mp)
        mp.setenv("PFL_DOWNLOAD", "0")
        yield str(root)


_RUNS: dict = {}


def run(cifar_dir, method="ft_bn_c", execution="sequential", **params):
    """One run per (method, execution, params) for the whole module."""
    key = (method, execution, tuple(sorted(params.items())))
    if key not in _RUNS:
        _RUNS[key] = run_experiment(config(method, params), device="cpu", data_dir=cifar_dir, execution=execution)
    return _RUNS[key]


def test_ft_bn_c_run_logs_pooled_accuracy_and_the_per_client_arrays(cifar_dir):
    result = run(cifar_dir)
    arrays = result.arrays["personalization"]
    assert sorted(arrays) == ["beta", "cid", "correct", "eta", "group", "total", "x", "xi"]
    assert arrays["beta"].shape == (2, 20) and (arrays["beta"] == 1).all()
    assert arrays["eta"].shape == (2, 62) and np.allclose(arrays["eta"], 0.05)  # the protocol's FT lr
    assert arrays["xi"].shape == (2, 20) and arrays["x"].shape == (2, 82)
    pooled = 100 * arrays["correct"].sum() / arrays["total"].sum()
    assert result.metrics["acc_pooled"] == pytest.approx(pooled)
    assert result.metrics["acc"] == pytest.approx(np.mean(100 * arrays["correct"] / arrays["total"]))
    assert [c["num_samples"] for c in result.clients] == arrays["total"].tolist()


def test_global_model_is_the_pretrained_model_on_every_test_split(cifar_dir):
    setup = prepare_run(config("global_model"), torch.device("cpu"), cifar_dir)
    result = run(cifar_dir, "global_model")
    state = pretrained_state({"params": model_params(setup.model)}, setup.model)
    params, buffers = load_pretrained(setup.model, state, "pretrained")
    rows = torch.cat([setup.fed.clients[c].splits["test"] for c in setup.fed.train_clients])
    x, y = setup.fed.dataset.batch(rows)
    with bn_mode(setup.model, "init"), torch.no_grad():
        logits, _ = forward_bn(setup.model, params, buffers, x)
    assert result.metrics["acc_pooled"] == pytest.approx(100 * float((logits.argmax(1) == y).double().mean()))
    assert (result.arrays["personalization"]["beta"] == 0).all()


@pytest.mark.parametrize("method", ["ft_bn_c"])
def test_batched_execution_equals_sequential(cifar_dir, method):
    sequential, batched = run(cifar_dir, method), run(cifar_dir, method, "batched")
    assert sequential.metrics["acc_pooled"] == batched.metrics["acc_pooled"]
    assert sequential.metrics["eval_loss"] == pytest.approx(batched.metrics["eval_loss"], rel=1e-5)


def test_baselines_see_the_same_batches_and_differ_in_their_statistics(cifar_dir):
    losses = [run(cifar_dir, m).metrics["eval_loss"] for m in ("ft_bn_c", "ft_bn_g", "ft_bn_i", "global_model")]
    assert len({round(v, 9) for v in losses}) == 4


def test_group_accuracy_is_pooled_within_each_group():
    outcomes = [ClientOutcome(0, 1, 1, 0.5, "snow"), ClientOutcome(1, 0, 3, 1.5, "snow"),
                ClientOutcome(2, 2, 2, 0.0, "fog")]
    summary = summarise_outcomes(outcomes)
    assert summary["acc_group/snow"] == pytest.approx(25.0)
    assert summary["acc_group/fog"] == pytest.approx(100.0)
    assert summary["acc_pooled"] == pytest.approx(50.0)
    assert summary["acc"] == pytest.approx((100 + 0 + 100) / 3)
    assert summary["eval_loss"] == pytest.approx((0.5 + 0.5 + 0.0) / 3)


def test_protocol_errors_name_the_fix(cifar_dir):
    setup = prepare_run(config(), torch.device("cpu"), cifar_dir)
    unseen = FinetunePretrained(EvalConfig(clients="unseen"))
    with pytest.raises(ValueError, match="unseen"):
        unseen.client_ids(setup.fed)
    missing = FinetunePretrained(EvalConfig(finetune_splits=["train", "support"]))
    with pytest.raises(ValueError, match="finetune_splits"):
        missing.client_ids(setup.fed)
    fedavg = METHODS.get("fedavg")(setup.model, METHODS.get("fedavg").hyper_class())
    with pytest.raises(ValueError, match="finetune_recipe"):
        FinetunePretrained(EvalConfig()).evaluate(fedavg, {"params": model_params(setup.model)}, {})


def test_tuning_tests_on_val_and_fine_tunes_without_it(cifar_dir):
    protocol = FinetunePretrained(EvalConfig(finetune_splits=["train", "val"]), target="validation")
    assert protocol.test_split == "val" and protocol.finetune_splits == ["train"]
    with pytest.raises(ValueError, match="nothing to fine-tune"):
        _ = FinetunePretrained(EvalConfig(finetune_splits=["val"]), target="validation").finetune_splits


def test_each_client_gets_its_own_recipe_from_its_own_inputs(cifar_dir):
    """The protocol hands the method each client's meta-net inputs and context (L2P's per-client
    lambda); the recipes' betas are what the arrays record."""
    from pfl_core.algorithms.ft_bn import FTBNG
    from pfl_core.federation import make_contexts

    seen = []

    class PerClient(FTBNG):
        def finetune_recipe(self, server, pretrained, inputs, client=None):
            seen.append((client.cid, inputs.xi.clone()))
            recipe = super().finetune_recipe(server, pretrained, inputs, client)
            recipe.betas = torch.full_like(recipe.betas, client.cid / 10)
            return recipe

    setup = prepare_run(config(), torch.device("cpu"), cifar_dir)
    protocol = FinetunePretrained(EvalConfig(epochs=0, augment=False, finetune_splits=["train", "val"]))
    ids = protocol.client_ids(setup.fed)
    contexts = make_contexts(setup.fed, ids, setup.cfg.federation, setup.streams, "eval", 32)
    result = protocol.evaluate(PerClient(setup.model, FTBNG.hyper_class()), {"params": model_params(setup.model)},
                               contexts)
    arrays = result.arrays["personalization"]
    assert [cid for cid, _ in seen] == ids == arrays["cid"].tolist()
    np.testing.assert_allclose(arrays["beta"][:, 0], [cid / 10 for cid in ids])
    np.testing.assert_allclose(arrays["xi"], np.stack([xi.numpy() for _, xi in seen]))
    assert not np.allclose(arrays["xi"][0], arrays["xi"][1])  # two clients' own data


def test_a_val_split_evaluation_keeps_the_run_seed(cifar_dir):
    """evaluation.params.val_split: val tests the val split with the run's evaluation streams,
    fine-tuning on train alone."""
    seen = []

    class Recording(FinetunePretrained):
        def _evaluate(self, algorithm, server, contexts, executor=None, evaluated_round=1):
            seen.append((self.seed, self.test_split, self.finetune_splits))
            return super()._evaluate(algorithm, server, contexts, executor, evaluated_round)

    from pfl_core.federation import make_contexts

    setup = prepare_run(config("global_model"), torch.device("cpu"), cifar_dir)
    protocol = Recording(EvalConfig(epochs=0, augment=False, finetune_splits=["train", "val"], val_split="val"))
    protocol.seed = 17
    contexts = make_contexts(setup.fed, protocol.client_ids(setup.fed), setup.cfg.federation, setup.streams, "eval", 32)
    result = protocol.evaluate(setup.algorithm, {"params": model_params(setup.model)}, contexts)
    assert seen == [(17, "test", ["train", "val"]), (17, "val", ["train"])]
    assert "val_acc_pooled" in result.summary and "acc_pooled" in result.summary


def test_suites_may_tabulate_group_and_pooled_accuracy(tmp_path):
    """A suite's metric.key may name acc_pooled and any acc_group/<group> (not round/ history)."""
    from benchmarks.suite.spec import load_suite
    from benchmarks.suite.schema import SuiteError
    from conftest import tiny_suite_dict, write_suite

    for key in ("acc_pooled", "acc_group/snow"):
        data = tiny_suite_dict()
        data["metric"]["key"] = key
        assert load_suite(write_suite(tmp_path / "suites" / "tiny" / "mini.yaml", data)).metric["key"] == key
    data = tiny_suite_dict()
    data["metric"].update(key="round/acc_group/snow", aggregate="best_val_round")
    with pytest.raises(SuiteError, match="metric.key"):
        load_suite(write_suite(tmp_path / "suites" / "tiny" / "mini.yaml", data))


def test_augmentation_is_chosen_per_dataset(cifar_dir):
    from pfl_core.data.federated import ArrayDataset
    from pfl_core.evaluation.finetune_pretrained import PER_SAMPLE_AUGMENT, crop_flip_augment

    protocol = FinetunePretrained(EvalConfig())
    assert protocol._augment(ArrayDataset("cifar10", torch.zeros(1, 3, 4, 4), torch.zeros(1), 10)) is crop_flip_augment
    assert set(PER_SAMPLE_AUGMENT) == {"cifar10", "cifar10c", "office_caltech10", "domainnet", "speech_commands"}
    with pytest.raises(ValueError, match="augment: false"):
        protocol._augment(ArrayDataset("mnist", torch.zeros(1, 3), torch.zeros(1), 10))


def test_cifar_augmentation_crops_and_flips_raw_images_then_normalises(cifar_dir):
    """Per-sample RandomCrop(32, 4) + flip of the [0, 1] images, then Normalize (pfl_core.data.augment.crop_flip,
    the FedL2P data module: this test runs once it is merged)."""
    augment = pytest.importorskip("pfl_core.data.augment.crop_flip")
    if not hasattr(augment, "draw_crop_flip"):
        pytest.skip("pfl_core.data.augment.crop_flip without the FedL2P crop/flip")
    from pfl_core.evaluation.finetune_pretrained import crop_flip_augment

    dataset = prepare_run(config(), torch.device("cpu"), cifar_dir).fed.dataset
    index = torch.arange(8)
    x, y = crop_flip_augment(dataset, index, torch.Generator().manual_seed(3))
    raw, labels = dataset.raw_batch(index)
    expected = dataset.normalize(augment.crop_flip(raw, augment.draw_crop_flip(8, torch.Generator().manual_seed(3))))
    torch.testing.assert_close(x, expected)
    assert torch.equal(y, labels) and not torch.equal(x, dataset.batch(index)[0])


def test_office_augmentation_flips_and_rotates_raw_images_then_normalises():
    """Per-sample flip + rotation of the [0, 1] images, then the dataset's normalisation
    (pfl_core.data.augment.flip_rotate, the FedL2P domains module: this test runs once it is merged)."""
    domains = pytest.importorskip("pfl_core.data.augment.flip_rotate")
    from pfl_core.data.federated import ArrayDataset
    from pfl_core.evaluation.finetune_pretrained import flip_rotate_augment

    g = torch.Generator().manual_seed(0)
    dataset = ArrayDataset("office_caltech10", torch.randint(0, 256, (6, 3, 16, 16), generator=g).to(torch.uint8),
                           torch.arange(6) % 3, 10, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    index = torch.arange(6)
    x, _ = flip_rotate_augment(dataset, index, torch.Generator().manual_seed(1))
    raw, _ = dataset.raw_batch(index)
    draws = domains.draw_flip_rotate(6, torch.Generator().manual_seed(1))
    torch.testing.assert_close(x, dataset.normalize(domains.flip_rotate(raw, draws)))
    assert not torch.equal(x, dataset.batch(index)[0])


def test_speech_commands_augmentation_shifts_and_mixes_the_clips_before_their_features(tmp_path):
    from fake_data import write_speech_commands
    from pfl_core.data.audio import SpeechAugment
    from pfl_core.data import load_dataset
    from pfl_core.evaluation.finetune_pretrained import speech_augment

    write_speech_commands(tmp_path)
    dataset = load_dataset("speech_commands", tmp_path, "train", download=False, num_seen=2, num_unseen=2)
    index = torch.arange(3)
    x, y = speech_augment(dataset, index, torch.Generator().manual_seed(2))
    again, _ = speech_augment(dataset, index, torch.Generator().manual_seed(2))
    assert x.shape == dataset.batch(index)[0].shape and torch.equal(x, again) and torch.isfinite(x).all()
    assert not torch.allclose(x, dataset.batch(index)[0])
    aug = SpeechAugment(dataset.extras["noise"], dataset.extras["noise_lengths"])
    rows, _ = dataset.raw_batch(index)
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(2))))
    torch.testing.assert_close(x, dataset.to_inputs(dataset.normalize(aug.apply(rows, aug.draw(3, rng)))))
