"""FedL2P tests aimed at single-line bugs the behaviour tests let through (issue 28 item 7): each
failed with its bug planted (named in its docstring) and passes without it."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import pfl_core.evaluation.finetune_pretrained as protocol_module
from pfl_core.evaluation import EvalConfig
from pfl_core.experiment import prepare_run
from pfl_core.federation import make_contexts
from pfl_core.algorithms._lib.meta_inputs import meta_inputs
from pfl_core.models.metanets import LRNet
from pfl_core.training import model_params
from tests.helpers import l2p_federation, one_thread  # noqa: F401
from tests.test_fedl2p import contexts, make
from tests.test_finetune_protocol import cifar_dir, config  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lrnet_clamps_its_output_to_0_1000_and_passes_the_gradient_straight_through():
    """Bugs: no clamp; a plain clamp (no gradient where clamped)."""
    net = LRNet(num_modules=2, num_tensors=3)
    last = net.net[-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.copy_(torch.tensor([-5.0, 2000.0, 10.0]))
    out = net(torch.randn(4))
    assert out.tolist() == [0.0, 1000.0, 10.0]
    (grad,) = torch.autograd.grad(out.sum(), last.bias)
    assert grad.tolist() == [1.0, 1.0, 1.0]


def test_meta_net_inputs_come_from_the_clients_train_split():
    """Bug: xi and x computed on the validation split (FedL2P code: the train loader)."""
    fed = l2p_federation(sizes=(8,))
    algorithm, model = make()
    server = algorithm.init_server(model_params(model))
    ctx = contexts(fed)[0]
    xi, x = algorithm.client_inputs(server, ctx)
    index = ctx.client.splits["train"]
    batches = [ctx.dataset.batch(i)[0] for i in torch.split(index, ctx.streams["train"].batch_size)]
    want_xi, want_x = meta_inputs(model, server["params"], server["buffers"], batches)
    torch.testing.assert_close(xi, want_xi)
    torch.testing.assert_close(x, want_x)
    val = [ctx.dataset.batch(i)[0] for i in torch.split(ctx.client.splits["val"], ctx.streams["train"].batch_size)]
    assert not torch.allclose(meta_inputs(model, server["params"], server["buffers"], val)[0], xi)


def _spy_evaluation(monkeypatch, cifar_dir, evaluation_normalized=True):
    """Run ``finetune_pretrained`` (FT-BN-G, 0 epochs, augmentation on) and record the batches the
    meta-net inputs were computed on and the dataset and augmentation fine-tuning received."""
    from pfl_core.algorithms.ft_bn import FTBNG

    seen = {"meta": []}
    real_inputs, real_finetune = protocol_module.client_meta_inputs, protocol_module.finetune_clients

    def inputs(model, state, batches, start=None):
        seen["meta"].append([b.clone() for b in batches])
        return real_inputs(model, state, batches, start)

    def finetune(model, state, dataset, plans, recipes, lr, augment, *rest):
        seen.update(dataset=dataset, plans=plans, augment=augment)
        return real_finetune(model, state, dataset, plans, recipes, lr, augment, *rest)

    monkeypatch.setattr(protocol_module, "client_meta_inputs", inputs)
    monkeypatch.setattr(protocol_module, "finetune_clients", finetune)
    setup = prepare_run(config(), torch.device("cpu"), cifar_dir)
    protocol = protocol_module.FinetunePretrained(EvalConfig(epochs=0, augment=True, finetune_splits=["train", "val"]))
    ids = protocol.client_ids(setup.fed)
    ctxs = make_contexts(setup.fed, ids, setup.cfg.federation, setup.streams, "eval", 32)
    if not evaluation_normalized:
        dataset = replace(next(iter(ctxs.values())).dataset, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25),
                          evaluation_normalized=False)
        for ctx in ctxs.values():
            ctx.dataset = dataset
    protocol.evaluate(FTBNG(setup.model, FTBNG.hyper_class()), {"params": model_params(setup.model)}, ctxs)
    return seen


def test_evaluation_meta_net_inputs_are_computed_on_augmented_data(monkeypatch, cifar_dir):
    """Bug: the evaluation-time meta-net inputs computed on un-augmented batches (spec "Data",
    evaluation path: the meta pass is augmented like the fine-tuning batches)."""
    seen = _spy_evaluation(monkeypatch, cifar_dir)
    assert seen["augment"] is not None and seen["meta"]
    for batches, plan in zip(seen["meta"], seen["plans"]):
        augmented = plan.inputs(seen["dataset"], "meta", seen["augment"])[0]
        plain = plan.inputs(seen["dataset"], "meta", None)[0]
        for got, want, raw in zip(batches, augmented, plain):
            torch.testing.assert_close(got, want)
            assert not torch.equal(got, raw)


def test_the_protocol_evaluates_on_the_evaluation_path_of_the_dataset(monkeypatch, cifar_dir):
    """Bug: the protocol skips ``for_evaluation`` (Office: the code's evaluation batches are not
    normalised), so fine-tuning and meta inputs would see normalised images."""
    seen = _spy_evaluation(monkeypatch, cifar_dir, evaluation_normalized=False)
    assert seen["dataset"].mean is None and seen["dataset"].std is None and seen["dataset"].evaluation_normalized
    plan = seen["plans"][0]
    torch.testing.assert_close(seen["meta"][0][0], plan.inputs(seen["dataset"], "meta", seen["augment"])[0][0])
