import numpy as np
import torch
import pytest

from pfl_core.config import RunConfig
from pfl_core.fields import ConfigError
from pfl_core.experiment import resolve_device, run_experiment
from pfl_core.seeding import RunStreams


def _config(method="fedavg", seed=0, **federation):
    return RunConfig.from_dict({
        "data": {"dataset": "digits28", "num_clients": 10, "unseen_fraction": 0.2,
                 "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 20}},
        "model": {"name": "mlr"},
        "method": {"name": method, "params": {"lr": 0.05, "local_steps": 2}},
        "federation": {"rounds": 3, "clients_per_round": 4, "batch_size": 10, **federation},
        "evaluation": {"protocol": "unseen", "params": {"steps": 3, "lr": 0.05}},
        "seed": seed,
    })


def test_same_config_twice_gives_identical_metrics():
    a, b = run_experiment(_config(), device="cpu"), run_experiment(_config(), device="cpu")
    assert a.metrics == b.metrics
    assert a.history == b.history
    assert a.clients == b.clients


def test_changing_only_the_method_keeps_partition_and_client_sampling():
    runs = [run_experiment(_config(m), device="cpu") for m in ("fedavg", "local", "fedavg_ft")]
    assert len({r.info["partition_digest"] for r in runs}) == 1
    assert len({r.info["sampling_digest"] for r in runs}) == 1
    assert len({r.metrics["acc_last3"] for r in runs}) > 1  # the methods do differ
    other_seed = run_experiment(_config(seed=1), device="cpu")
    assert other_seed.info["partition_digest"] != runs[0].info["partition_digest"]
    assert other_seed.info["sampling_digest"] != runs[0].info["sampling_digest"]


def test_history_has_one_row_per_round_and_evaluates_on_schedule():
    result = run_experiment(_config("fedavg_ft", eval_every=2, rounds=4), device="cpu")
    assert [row["round"] for row in result.history] == [1, 2, 3, 4]
    assert ["acc" in row for row in result.history] == [False, True, False, True]
    assert len(result.curve_mean) == 4  # steps 0..3
    assert result.info["dataset_offline"] is True


def test_unknown_config_key_names_its_path():
    with pytest.raises(ConfigError, match="federation.round"):
        RunConfig.from_dict({"federation": {"round": 3}})


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert str(resolve_device("auto")) == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA device"):
        resolve_device("cuda")


def test_streams_are_reproducible_and_independent_per_purpose():
    s = RunStreams(7)
    assert np.array_equal(s.numpy("partition").random(5), RunStreams(7).numpy("partition").random(5))
    assert not np.array_equal(s.numpy("partition").random(5), s.numpy("sampling").random(5))
    assert not np.array_equal(s.numpy("batches", 1).random(5), s.numpy("batches", 2).random(5))
    assert s.seed_int("init") == RunStreams(7).seed_int("init") != RunStreams(8).seed_int("init")


def test_validation_target_evaluates_validation_clients_and_never_reads_test_data(monkeypatch):
    cfg = _config("fedavg_ft").to_dict()
    cfg["data"]["validation_fraction"] = 0.25
    cfg["evaluation"]["target"] = "validation"
    read = []
    from pfl_core.data.federated import ArrayDataset
    original = ArrayDataset.batch

    def spy(self, index):
        read.append(set(index.tolist()))
        return original(self, index)

    monkeypatch.setattr(ArrayDataset, "batch", spy)
    result = run_experiment(RunConfig.from_dict(cfg), device="cpu")
    assert result.info["num_validation_clients"] == 2 and result.info["num_train_clients"] == 6
    evaluated = {c["cid"] for c in result.clients}
    assert evaluated == set(result.info["validation_clients"])
    assert not evaluated & set(result.info["unseen_clients"])
    from pfl_core.data import build_federated, load_dataset

    d = RunConfig.from_dict(cfg).data
    partition = dict(d.partition)
    fed = build_federated(load_dataset("digits28"), num_clients=d.num_clients,
                          partition=partition.pop("name"), partition_params=partition,
                          client_splits=d.client_splits, unseen_fraction=d.unseen_fraction,
                          streams=RunStreams(0), validation_fraction=d.validation_fraction)
    assert fed.unseen_clients == result.info["unseen_clients"]
    test_rows = {int(i) for c in fed.unseen_clients for split in fed.clients[c].splits.values() for i in split}
    assert read and all(not (batch & test_rows) for batch in read)


def test_remainder_test_floors_the_train_part():
    cfg = _config().to_dict()
    cfg["data"].update(client_splits={"train": 0.75}, remainder="test", unseen_fraction=0.0)
    cfg["evaluation"] = {"protocol": "seen"}
    result = run_experiment(RunConfig.from_dict(cfg), device="cpu")
    for client in result.clients:
        n = client["meta"]["n"]
        assert client["num_samples"] == n - int(0.75 * n)


def test_subsample_keeps_a_seeded_subset_before_partitioning():
    cfg = _config().to_dict()
    cfg["data"]["subsample"] = 600
    a = run_experiment(RunConfig.from_dict(cfg), device="cpu")
    b = run_experiment(RunConfig.from_dict(cfg), device="cpu")
    assert sum(c["meta"]["n"] for c in a.clients) < 600
    assert a.info["partition_digest"] == b.info["partition_digest"]
    assert "subset of 600 of 1797" in a.info["dataset_description"]


def test_pixel_standardisation_and_half_normalisation():
    import torch

    from pfl_core.data import load_dataset
    from pfl_core.data.federated import standardize

    raw = load_dataset("digits28")
    pixel = standardize(raw, "pixel")
    x, _ = pixel.batch(torch.arange(len(raw)))
    assert x.mean(0).abs().max() < 1e-4
    sigma = (raw.x.float() / 255).std(0, unbiased=False)
    assert torch.allclose(x.std(0, unbiased=False), sigma / (sigma + 0.001), atol=1e-4)
    half, _ = standardize(raw, "half").batch(torch.arange(5))
    plain, _ = raw.batch(torch.arange(5))
    assert torch.allclose(half, (plain - 0.5) / 0.5)
    with pytest.raises(ValueError, match="normalize"):
        standardize(raw, "zscore")


def test_warm_start_chain_starts_from_the_predecessors_final_model(monkeypatch):
    import pfl_core.experiment as experiment

    cfg = _config("fedavg").to_dict()
    cfg["model"]["warm_start"] = [{"name": "local", "params": {"lr": 0.05, "local_steps": 1}},
                                  {"name": "fedavg", "params": {"lr": 0.05, "local_steps": 2}}]
    starts = []
    original = experiment.run_lockstep

    def spy(federations, executor, *rest):
        (federation,) = federations
        init = {k: v.clone() for k, v in federation.server["params"].items()}
        (result,) = original(federations, executor, *rest)
        starts.append((type(federation.algorithm).__name__, init, result.server["params"],
                       federation.evaluate_clients))
        return [result]

    monkeypatch.setattr(experiment, "run_lockstep", spy)
    run_experiment(RunConfig.from_dict(cfg), device="cpu")
    (name0, init0, end0, eval0), (name1, init1, end1, eval1), (name2, init2, _, eval2) = starts
    assert (name0, name1, name2) == ("Local", "FedAvg", "FedAvg") and (eval0, eval1, eval2) == (False, False, True)
    assert all(torch.equal(end0[k], init0[k]) for k in init0)  # Local never moves the server
    assert all(torch.equal(init1[k], end0[k]) and torch.equal(init2[k], end1[k]) for k in init0)
    assert not all(torch.equal(init2[k], init0[k]) for k in init0)
    cfg["model"]["warm_start"] = [{"method": "fedavg"}]
    with pytest.raises(ValueError, match="warm_start"):
        run_experiment(RunConfig.from_dict(cfg), device="cpu")


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_run_experiments_in_lockstep_give_each_seed_its_own_run(execution):
    from pfl_core.experiment import run_experiments

    cfgs = [_config("fedavg_ft", seed=s) for s in (0, 1)]
    together = run_experiments(cfgs, device="cpu", execution=execution)
    for cfg, run in zip(cfgs, together):
        alone = run_experiment(cfg, device="cpu", execution=execution)
        assert run.info["partition_digest"] == alone.info["partition_digest"]
        assert run.info["sampling_digest"] == alone.info["sampling_digest"]
        assert run.info["lockstep_runs"] == 2 and alone.info["lockstep_runs"] == 1
        assert run.info["execution"] == alone.info["execution"] == execution
        assert run.metrics == pytest.approx(alone.metrics, abs=1e-5)
        assert [h["train_loss"] for h in run.history] == pytest.approx([h["train_loss"] for h in alone.history], abs=1e-5)
    assert together[0].info["sampling_digest"] != together[1].info["sampling_digest"]


def test_lockstep_refuses_runs_that_differ_in_more_than_the_seed():
    from pfl_core.experiment import run_experiments

    with pytest.raises(ValueError, match="method settings"):
        run_experiments([_config("fedavg"), _config("local", seed=1)], device="cpu")


def test_auto_execution_is_chosen_by_cost_and_recorded():
    run = run_experiment(_config(), device="cpu")  # MLR: a client step of well under 100 MFLOP
    assert run.info["execution"] == "batched"
    assert "MFLOP per client step" in run.info["execution_choice"]
    assert "execution_choice" not in run_experiment(_config(), device="cpu", execution="sequential").info
    with pytest.raises(ValueError, match="execution must be one of"):
        run_experiment(_config(), device="cpu", execution="vectorised")


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_nan_in_evaluation_fine_tuning_fails_the_run(execution):
    """Issue 15 item 5: a fine-tuning step that diverges at evaluation (lr 1e38 overflows float32) is a
    DivergenceError naming the client and the step, on both evaluation paths, not a NaN loss in
    the table. Training itself is fine (the same run with a sane fine-tuning rate finishes)."""
    from pfl_core.federation import DivergenceError

    cfg = _config("fedavg_ft", rounds=1)
    assert np.isfinite(run_experiment(cfg, device="cpu", execution=execution).metrics["eval_loss"])
    cfg.evaluation.params["lr"] = 1e38
    with pytest.raises(DivergenceError, match=r"non-finite evaluation loss .* client \d+ .* step [1-3]\b"):
        run_experiment(cfg, device="cpu", execution=execution)
