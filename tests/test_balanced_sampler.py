"""``data.balanced_sampler``: the FedL2P code's class-balanced training loaders of Speech Commands
(``WeightedRandomSampler(w, len(w))``, w = n / count of the item's class; ``src/data/speech_commands.py``
L121-142) in local training and in FedL2P's meta-training and meta-net input pass."""
from __future__ import annotations

import pytest
import torch

from pfl_core.batching import BatchStream, balanced_weights
from pfl_core.config import FederationConfig
from pfl_core.evaluation import EvalConfig
from pfl_core.federation import make_contexts
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.helpers import fedl2p_round, l2p_federation, make_method, one_thread, tiny_resnet  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = {"inner_epochs": 1, "outer_epochs": 1, "lr_bnnet": 0.1, "lr_lrnet": 0.1, "lr_eta": 0.01}


def test_weights_are_n_over_the_class_count():
    weights = balanced_weights(torch.tensor([0, 0, 0, 1, 2, 2]))
    torch.testing.assert_close(weights, torch.tensor([2.0, 2.0, 2.0, 6.0, 3.0, 3.0], dtype=torch.float64))


def test_a_balanced_stream_draws_each_epoch_with_replacement_by_the_weights():
    labels = torch.tensor([0] * 8 + [1] * 2)
    index = torch.arange(100, 110)
    weights = balanced_weights(labels)
    stream = BatchStream(index, 4, torch.Generator().manual_seed(3), reshuffle=True, drop_last=False, weights=weights)
    gen = torch.Generator().manual_seed(3)
    first = torch.multinomial(weights, 10, replacement=True, generator=gen)  # BatchStream draws its order at start
    assert torch.equal(torch.cat(stream.epoch()), index[torch.multinomial(weights, 10, True, generator=gen)])
    assert not torch.equal(first, torch.arange(10))
    rare = sum(int((torch.cat(stream.epoch()) >= 108).sum()) for _ in range(300))
    assert rare / 3000 == pytest.approx(0.5, abs=0.05)  # unbalanced: 0.2


def test_only_the_train_streams_are_balanced():
    fed = l2p_federation(sizes=(10, 10))
    cfg = FederationConfig(batch_size=4, drop_last=False)
    ctx = make_contexts(fed, fed.train_clients, cfg, RunStreams(0), "batches", 4, balanced=True)[1]
    index = fed.clients[1].splits["train"]
    torch.testing.assert_close(ctx.streams["train"].weights, balanced_weights(fed.dataset.y[index]))
    assert ctx.streams["val"].weights is None and ctx.streams["test"].weights is None
    plain = make_contexts(fed, fed.train_clients, cfg, RunStreams(0), "batches", 4)[1]
    assert plain.streams["train"].weights is None


def test_fedl2p_meta_trains_on_balanced_train_batches_and_plain_val_batches():
    from pfl_core.batching import cycled_batches

    fed = l2p_federation(sizes=(10,), val=6)
    algorithm = make_method("fedl2p", tiny_resnet().double(), **{**FAST, "outer_epochs": 2})
    cfg = FederationConfig(batch_size=4, drop_last=False)
    ctx = make_contexts(fed, fed.train_clients, cfg, RunStreams(0), "batches", 4, balanced=True)[0]
    twin = make_contexts(fed, fed.train_clients, cfg, RunStreams(0), "batches", 4, balanced=True)[0]
    drawn = algorithm.draw(ctx, 0)
    plan = drawn.plan
    # drawn first from the same generator, in this order: the meta_augment draws, the input batches
    augment, inputs = algorithm.draw_augment(twin), algorithm.input_draws(twin)
    for name in augment:
        assert all(torch.equal(a, b) for a, b in zip(drawn.values["augment"][name].values(), augment[name].values()))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(drawn.values["inputs"], inputs))
    train = cycled_batches(fed.clients[0].splits["train"], 4, twin.streams["train"].generator,
                           twin.streams["train"].weights)
    inner = len(plan["inner"]) // len(plan["val"])
    for k, l_t in enumerate(plan["ltrain"]):  # per outer step: its inner batches, then its L_T batch
        for got in plan["inner"][k * inner:(k + 1) * inner] + [l_t]:
            assert torch.equal(got, next(train))
    val = torch.cat(plan["val"])
    assert sorted(val.tolist()) == sorted(fed.clients[0].splits["val"].tolist() * 2)  # two plain epochs


def test_fedl2p_balanced_training_is_identical_on_both_paths_and_differs_from_plain():
    from tests.test_engine_equivalence import assert_same_run

    fed = l2p_federation(sizes=(8, 8))

    def run(execution, balanced):
        return fedl2p_round(fed, execution, FAST, balanced=balanced)

    sequential = run("sequential", True)
    assert_same_run(sequential, run("batched", True))
    plain = run("sequential", False)
    key = next(iter(plain.server["lambda"]))
    assert not torch.equal(plain.server["lambda"][key], sequential.server["lambda"][key])


def test_fedl2p_meta_net_inputs_come_from_one_balanced_draw_of_the_train_split():
    from pfl_core.algorithms._lib.meta_inputs import meta_inputs
    from pfl_core.batching import epoch_order

    fed = l2p_federation(sizes=(10,))
    torch.manual_seed(0)
    model = tiny_resnet().double()
    algorithm = make_method("fedl2p", model, **{**FAST, "meta_augment": "none"})
    server = algorithm.init_server(model_params(model))
    cfg = FederationConfig(batch_size=4, drop_last=False)
    ctx, twin = (make_contexts(fed, fed.train_clients, cfg, RunStreams(0), "batches", 4, balanced=True)[0]
                 for _ in range(2))
    xi, x = algorithm.client_inputs(server, ctx)
    order = epoch_order(fed.clients[0].splits["train"], twin.streams["train"].generator, twin.streams["train"].weights)
    with torch.no_grad():
        want = meta_inputs(model, server["params"], server["buffers"],
                           [fed.dataset.batch(i)[0] for i in torch.split(order, 4)])
    torch.testing.assert_close(xi, want[0])
    torch.testing.assert_close(x, want[1])


def test_evaluation_plans_draw_balanced_meta_and_fine_tuning_epochs():
    from pfl_core.algorithms._lib.finetune import _seed, plan_client
    from pfl_core.batching import epoch_order

    index, labels = torch.arange(20, 30), torch.tensor([0] * 8 + [1] * 2)
    weights = balanced_weights(labels)
    plan = plan_client(3, index, torch.arange(5), 2, 4, 50, 7, weights=weights)
    gen = torch.Generator().manual_seed(_seed(7, 3))
    epochs = [epoch_order(index, gen, weights) for _ in range(3)]  # the meta-net input epoch, then 2
    assert torch.equal(torch.cat(plan.meta), epochs[0])
    assert torch.equal(torch.cat(plan.train), torch.cat(epochs[1:]))
    plain = plan_client(3, index, torch.arange(5), 2, 4, 50, 7)
    assert sorted(torch.cat(plain.meta).tolist()) == index.tolist()


@pytest.mark.parametrize("balanced", [False, True])
def test_finetune_pretrained_balances_its_clients_plans_when_asked(monkeypatch, balanced):
    import pfl_core.evaluation.finetune_pretrained as protocol_module
    from pfl_core.evaluation.finetune_pretrained import FinetunePretrained

    seen = []

    def recording(*args, **kwargs):
        seen.append(args[-1] if len(args) > 8 else kwargs.get("weights"))
        return plan_client(*args, **kwargs)

    plan_client = protocol_module.plan_client
    monkeypatch.setattr(protocol_module, "plan_client", recording)
    fed = l2p_federation(sizes=(6, 6))
    model = tiny_resnet().double()
    contexts = make_contexts(fed, fed.train_clients, FederationConfig(batch_size=4), RunStreams(0), "eval", 4)
    protocol = FinetunePretrained(EvalConfig(epochs=0, augment=False, balanced=balanced))
    protocol.evaluate(make_method("ft_bn_c", model), {"params": model_params(model)}, contexts)
    assert len(seen) == 2
    for cid, weights in zip(fed.train_clients, seen):
        if balanced:
            torch.testing.assert_close(weights, balanced_weights(fed.dataset.y[fed.clients[cid].splits["train"]]))
        else:
            assert weights is None
