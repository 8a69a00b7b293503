"""A method that does not carry BatchNorm running statistics on a model that keeps them (KLD-BN) is
rejected when the configuration is loaded (issue 28 item 9), and both declarations it rests on
are held to the facts: a model builder's mark to the built model, a method's ``keeps_bn_state``
to what one round does to the server's statistics."""
from __future__ import annotations

import copy
from dataclasses import fields

import pytest
import torch

from benchmarks.suite.spec import load_suite
from benchmarks.suite.schema import SuiteError
from pfl_core.algorithms import METHODS
from pfl_core.bn_support import bn_methods, check_bn_support
from pfl_core.config import FederationConfig, RunConfig
from pfl_core.engine import Executor
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.experiment import run_experiment
from pfl_core.federation import Federation, lockstep_round
from pfl_core.fields import ConfigError
from pfl_core.models import MODELS, build_model, model_keeps_bn_state
from pfl_core.models.kld_bn import has_bn_state
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from conftest import tiny_suite_dict, write_suite
from pfl_core.data.federated import ArrayDataset
from tests.helpers import make_method, one_thread, tiny_federation, tiny_resnet  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

#: an input shape (and small params) each registered model builds for
SHAPES = {
    "cafeme_a": ((1, 28, 28), {}), "cafeme_b": ((3, 32, 32), {}), "cafeme_cnn_a": ((1, 28, 28), {}),
    "cafeme_cnn_b": ((3, 32, 32), {}), "cgpfl_cnn": ((3, 32, 32), {}), "conv4": ((3, 32, 32), {}),
    "conv4_frl": ((3, 32, 32), {}), "dnn": ((6,), {}), "le_embedding": ((3, 32, 32), {}),
    "lenet": ((3, 32, 32), {}), "mlr": ((6,), {}), "pfedgp_cnn": ((3, 32, 32), {}),
    "resnet18_audio": ((1, 32, 32), {"width": 4}), "resnet18_cifar": ((3, 8, 8), {"width": 4}),
    "resnet18_imagenet": ((3, 32, 32), {"width": 4}),
}
#: methods whose BN state is tested where the method is (they need a stage 1 or episodes)
ELSEWHERE = {
    "fedl2p": "tests/test_fedl2p.py", "l2p": "tests/test_fedl2p.py",
    "metavers": "tests/test_bn_running_stats.py", "ft_bn_c": "trains nothing", "ft_bn_g": "trains nothing",
    "ft_bn_i": "trains nothing", "global_model": "trains nothing",
}


def test_every_model_builder_is_marked_as_its_models_are():
    assert sorted(SHAPES) == MODELS.names(), "add the new model's input shape to SHAPES"
    for name, (shape, params) in SHAPES.items():
        model = build_model(name, shape, 3, **params)
        assert model_keeps_bn_state(name) == has_bn_state(model), name
    assert {n for n in SHAPES if model_keeps_bn_state(n)} == {
        "conv4", "conv4_frl", "resnet18_audio", "resnet18_cifar", "resnet18_imagenet"}


@pytest.mark.parametrize("name", [n for n in bn_methods() if n not in ELSEWHERE])
def test_a_method_that_says_it_carries_bn_state_moves_the_servers_statistics_in_a_round(name):
    torch.manual_seed(0)
    model = tiny_resnet()
    split = "head_prefixes" in {f.name for f in fields(METHODS.get(name).hyper_class)}
    hp = {"head_prefixes": ["fc."]} if split else {}  # the ResNet's head
    algorithm = make_method(name, model, **hp)
    fed = rgb_federation()
    cfg = FederationConfig(rounds=1, clients_per_round=2, batch_size=4)
    federation = Federation(algorithm, fed, model_params(model), cfg, SeenClients(EvalConfig()), RunStreams(0),
                            evaluate_clients=False)
    before = {k: v.clone() for k, v in federation.server["buffers"].items()}
    lockstep_round([federation], Executor("sequential"), 0)
    after = federation.server["buffers"]
    moved = [k for k in before if k.endswith("running_mean") and not torch.equal(before[k], after[k])]
    assert len(moved) == sum(k.endswith("running_mean") for k in before), f"{name} left BN statistics unchanged"


def test_the_methods_a_bn_model_needs_carry_it_and_the_others_do_not():
    for method in ("fedavg", "fedbabu", "perfedavg", "fedl2p", "l2p", "ft_bn_c", "global_model"):
        check_bn_support(method, "resnet18_cifar")  # FedL2P's stage 1 and stage 2
    for method in ("fedavg", "metavers"):
        check_bn_support(method, "conv4_frl")  # MetaVers Table 6
    for method in ("pfedme", "ifca", "local", "ditto", "fedrep"):
        check_bn_support(method, "lenet")  # no BN state: anything goes
        with pytest.raises(ConfigError, match=f"method '{method}' does not carry BatchNorm"):
            check_bn_support(method, "resnet18_cifar")


def rgb_federation():
    """Two clients of 8 random 3x6x6 images (``tiny_resnet``'s inputs)."""
    fed = tiny_federation(sizes=(8, 8), classes=3)
    gen = torch.Generator().manual_seed(0)
    fed.dataset = ArrayDataset("rgb6x6", torch.rand(len(fed.dataset.y), 3, 6, 6, generator=gen), fed.dataset.y, 3)
    return fed


def _bn_suite(tmp_path, method: str, model: dict):
    data = copy.deepcopy(tiny_suite_dict())
    data["grid"] = [{"name": "method", "key": "method.name", "values": [method]}]
    data["published"] = []
    data["base"]["model"] = model
    data["base"]["method"] = {"params": {}}
    return write_suite(tmp_path / "suites" / "tiny" / "bn.yaml", data)


def test_a_suite_pairing_a_kld_bn_model_with_such_a_method_fails_to_load_in_one_line(tmp_path):
    load_suite(_bn_suite(tmp_path, "fedavg", {"name": "resnet18_cifar"}))  # fedavg carries it
    with pytest.raises(SuiteError) as err:
        load_suite(_bn_suite(tmp_path, "pfedme", {"name": "resnet18_cifar"}))
    message = str(err.value)
    assert "\n" not in message
    assert "method 'pfedme' does not carry BatchNorm running statistics" in message
    assert "model 'resnet18_cifar'" in message and "use a method that carries them (fedavg" in message


def test_a_warm_start_step_and_a_direct_run_are_checked_too(tmp_path):
    path = _bn_suite(tmp_path, "fedavg", {"name": "resnet18_cifar", "warm_start": [{"name": "ditto", "params": {}}]})
    with pytest.raises(SuiteError, match="method 'ditto' does not carry"):
        load_suite(path)
    cfg = RunConfig.from_dict({"data": {"dataset": "no_such_data_is_loaded"}, "model": {"name": "conv4"},
                               "method": {"name": "ifca"}})
    with pytest.raises(ConfigError, match="method 'ifca' does not carry"):
        run_experiment(cfg, device="cpu")  # rejected before the data is looked up
