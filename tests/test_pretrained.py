"""The two-stage pipeline in the core (issue 14): ``model.pretrained`` validation, the pretrained
state, and stage-2 runs starting from it (no MLflow here; the harness side is tests/test_stages.py)."""
import pytest
import torch
from torch import nn

from pfl_core.algorithms import METHODS
from pfl_core.config import RunConfig
from pfl_core.fields import ConfigError
from pfl_core.experiment import InProcessPretraining, run_experiment, run_experiments
from pfl_core.pretrained import final_state, load_into, state_of, untrained
from tests.helpers import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def stage1_config(rounds=2, seed=5, hidden=8) -> dict:
    return {"data": {"dataset": "digits28", "num_clients": 6, "subsample": 300},
            "model": {"name": "dnn", "params": {"hidden": hidden}},
            "method": {"name": "fedavg", "params": {"lr": 0.1, "local_steps": 2}},
            "federation": {"rounds": rounds, "clients_per_round": 3, "batch_size": 10},
            "seed": seed}


def stage2_config(seed=0, rounds=0, method="fedavg", **stage1) -> RunConfig:
    return RunConfig.from_dict({
        "data": {"dataset": "digits28", "num_clients": 4, "subsample": 200},
        "model": {"name": "dnn", "params": {"hidden": 8}, "pretrained": stage1_config(**stage1)},
        "method": {"name": method, "params": {"lr": 0.1, "local_steps": 1}},
        "federation": {"rounds": rounds, "clients_per_round": 2, "batch_size": 10},
        "seed": seed})


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


@pytest.mark.parametrize("pretrained, key", [
    ({"data": {"num_clients": "x"}}, "model.pretrained.data.num_clients"),
    ({"bogus": 1}, "model.pretrained.bogus"),
    ({"federation": {"clients_per_round": 500}}, "model.pretrained.federation.clients_per_round"),
    ({"model": {"name": "dnn"}}, "model.pretrained.model.name"),
    ({"model": {"pretrained": {"source": "imagenet"}}}, "model.pretrained.model.pretrained"),
    ({"source": "imagenet", "seed": 1}, "model.pretrained"),
    ({"source": "laion"}, "model.pretrained"),
    ({"source": "imagenet"}, "model.params.weights"),  # the model must be built with those weights
])
def test_bad_pretrained_blocks_name_their_dotted_key(pretrained, key):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"model": {"name": "mlr", "pretrained": pretrained}})
    assert err.value.key == key
    assert key.split(".")[-1] in str(err.value)


def test_pretrained_and_warm_start_exclude_each_other():
    with pytest.raises(ConfigError, match="model.warm_start") as err:
        RunConfig.from_dict({"model": {"pretrained": {"seed": 1}, "warm_start": [{"name": "fedavg"}]}})
    assert err.value.key == "model.warm_start"


def test_stage1_is_a_full_run_config_with_run_config_defaults():
    cfg = stage2_config()
    stage1 = cfg.stage1()
    assert stage1 == RunConfig.from_dict(stage1_config())
    assert stage1.seed == 5 and stage1.evaluation.protocol == RunConfig().evaluation.protocol
    assert RunConfig().stage1() is None and cfg.pretrained_source() is None


def test_stage2_starts_from_the_stage1_final_global_model():
    """Zero stage-2 rounds: the stage-2 global model is exactly stage 1's final one, and the method
    received that state as ``algorithm.pretrained``."""
    stage1 = run_experiment(RunConfig.from_dict(stage1_config()), device="cpu")
    stage2 = run_experiment(stage2_config(), device="cpu")
    assert _equal(stage2.final_state["params"], stage1.final_state["params"])
    own = run_experiment(RunConfig.from_dict({**stage2_config().to_dict(), "model": {
        "name": "dnn", "params": {"hidden": 8}}}), device="cpu")
    assert not _equal(own.final_state["params"], stage1.final_state["params"])  # not the own init
    assert stage2.info["pretrained"] == {"source": "stage1"}


def test_the_method_receives_the_state_and_trains_on_from_it(monkeypatch):
    seen = []
    original = METHODS.get("fedavg").init_server

    def spy(self, params):
        seen.append((self.pretrained, params))
        return original(self, params)

    monkeypatch.setattr(METHODS.get("fedavg"), "init_server", spy)
    given = state_of(nn.Sequential(nn.Flatten(), nn.Linear(784, 8), nn.ReLU(), nn.Linear(8, 10)))
    run_experiment(stage2_config(rounds=1), device="cpu", pretrained=lambda stage1: given)
    (received, init), = seen
    assert _equal(received["params"], given["params"]) and _equal(init, given["params"])


def test_in_process_stage1_runs_once_for_the_seeds_of_a_cell():
    calls = []
    provider = InProcessPretraining("cpu")
    counting = lambda stage1: calls.append(stage1) or provider(stage1)  # noqa: E731
    a, b = run_experiments([stage2_config(seed=0, rounds=1), stage2_config(seed=1, rounds=1)], device="cpu",
                           pretrained=counting)
    assert len(calls) == 2 and calls[0] == calls[1]  # asked per run ...
    assert len(provider.states) == 1  # ... trained once
    assert a.metrics != b.metrics  # the seeds still differ in stage 2


def test_untrained_provider_keeps_the_models_own_initialisation():
    plain = RunConfig.from_dict({**stage2_config().to_dict(), "model": {"name": "dnn", "params": {"hidden": 8}}})
    own = run_experiment(plain, device="cpu")
    stand_in = run_experiment(stage2_config(), device="cpu", pretrained=untrained)
    assert _equal(stand_in.final_state["params"], own.final_state["params"])


def test_a_stage1_model_of_another_shape_is_a_clear_error():
    cfg = stage2_config(hidden=16)  # stage 1 trains a dnn of width 16, stage 2 is width 8
    with pytest.raises(ValueError, match="model.pretrained: .*shape"):
        run_experiment(cfg, device="cpu", pretrained=InProcessPretraining("cpu"))


def test_state_keeps_only_running_statistics_and_loads_them_into_batchnorm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    server = {"params": {k: v + 1 for k, v in model.named_parameters()},
              "buffers": {"1.running_mean": torch.full((4,), 2.0), "1.running_var": torch.full((4,), 3.0),
                          "1.num_batches_tracked": torch.tensor(7)}}
    state = final_state(model, server)
    assert sorted(state["buffers"]) == ["1.running_mean", "1.running_var"]
    assert _equal(state["params"], server["params"])
    state_without = final_state(model, {"params": server["params"]})  # no functional BN state: the module's
    assert torch.equal(state_without["buffers"]["1.running_var"], torch.ones(4))
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    load_into(fresh, state)
    assert torch.equal(fresh[1].running_mean, torch.full((4,), 2.0))
    assert torch.equal(fresh[1].running_var, torch.full((4,), 3.0))
    assert _equal(dict(fresh.named_parameters()), server["params"])
    with pytest.raises(ValueError, match="parameters differ"):
        load_into(nn.Sequential(nn.Linear(3, 4)), state)


def test_a_kld_bn_resnet_state_round_trips_into_load_pretrained():
    """The contract between stage 1 and stage 2: a BN-aware stage 1 keeps its running statistics
    in ``server["buffers"]`` (``forward_bn``); its state gives KLD-BN's mu_pt / sigma2_pt, and a
    stage-2 ResNet loaded with it holds the stage-1 parameters and statistics."""
    from pfl_core.models import build_model
    from pfl_core.models.kld_bn import bn_mode, bn_names, forward_bn, load_pretrained, model_buffers

    torch.manual_seed(0)
    model = build_model("resnet18_cifar", (3, 32, 32), 10, width=4)
    params = {k: v.detach() + 0.01 for k, v in model.named_parameters()}
    with bn_mode(model, "train"):
        _, buffers = forward_bn(model, params, model_buffers(model), torch.randn(4, 3, 32, 32))
    state = final_state(model, {"params": params, "buffers": buffers})
    names = bn_names(model)
    assert sorted(state["buffers"]) == sorted(f"{n}.{k}" for n in names for k in ("running_mean", "running_var"))
    _, client = load_pretrained(model, state, "reset")
    first = names[0]
    assert torch.equal(client[f"{first}.init_running_mean"], buffers[f"{first}.running_mean"])
    assert not torch.equal(buffers[f"{first}.running_mean"], torch.zeros_like(buffers[f"{first}.running_mean"]))
    stage2 = build_model("resnet18_cifar", (3, 32, 32), 10, width=4)
    load_into(stage2, state)
    assert _equal(dict(stage2.named_parameters()), params)
    assert torch.equal(dict(stage2.named_buffers())[f"{first}.running_var"], buffers[f"{first}.running_var"])
