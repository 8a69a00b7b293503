"""FedL2P's fine-tune-then-test (pfl_core/algorithms/_lib/finetune.py): KLD-BN with beta 1 / beta 0 through the
fine-tune path equals plain BatchNorm with the client's / the pretrained statistics, BN I tests
with batch statistics, the batched path equals the sequential one, the host-side plans."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pfl_core.data.federated import ArrayDataset
from pfl_core.algorithms._lib.finetune import (ClientOutcome, FinetuneRecipe, client_meta_inputs, client_start, finetune,
                               finetune_clients, lr_tree, mean_accuracy, plan_client, pooled_accuracy, score_test)
from pfl_core.models.kld_bn import KLDBatchNorm2d, bn_names
from pfl_core.training import model_params


class Tiny(nn.Module):
    """conv -> BN -> ReLU -> conv -> BN -> ReLU -> mean pool -> fc; ``bn`` picks the BN class."""

    def __init__(self, bn=KLDBatchNorm2d, input_bn=False):
        super().__init__()
        self.input_bn = bn(2) if input_bn else None
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1, bias=False)
        self.bn1 = bn(3)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn2 = bn(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if self.input_bn is not None:
            x = self.input_bn(x)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


def _state(model, seed=0):
    """A 'pretrained' state: the model's parameters and made-up running statistics."""
    g = torch.Generator().manual_seed(seed)
    buffers = {}
    for name in bn_names(model):
        c = getattr(model, name).num_features
        buffers[f"{name}.running_mean"] = torch.randn(c, generator=g, dtype=torch.float64) * 0.3
        buffers[f"{name}.running_var"] = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    return {"params": model_params(model), "buffers": buffers}


def _model(**kw):
    torch.manual_seed(0)
    return Tiny(**kw).double()


def _batches(count, size, seed=1):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(size, 2, 5, 5, generator=g, dtype=torch.float64) for _ in range(count)],
            [torch.randint(0, 3, (size,), generator=g) for _ in range(count)])


def _reference(state, train, test, mode_train: str, mode_test: str, lr: float):
    """Plain ``nn.BatchNorm2d`` with the pretrained running statistics, manual SGD with autograd."""
    ref = _model(bn=nn.BatchNorm2d)
    ref.load_state_dict({**state["params"], **state["buffers"]}, strict=False)
    params = dict(ref.named_parameters())
    for x, y in zip(*train):
        ref.train(mode_train == "train")
        loss = F.cross_entropy(ref(x), y)
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads):
                p -= lr * g
    ref.train(mode_test == "train")
    with torch.no_grad():
        losses = [F.cross_entropy(ref(x), y, reduction="sum") for x, y in zip(*test)]
        correct = sum(int((ref(x).argmax(1) == y).sum()) for x, y in zip(*test))
    return ref, correct, float(sum(losses))


def _ours(model, state, recipe, train, test, lr):
    params, buffers = client_start(model, state, recipe)
    params, buffers = finetune(model, params, buffers, lr_tree(recipe, params, lr), *train)
    correct, loss = score_test(model, params, buffers, *test, test_mode=recipe.test_mode)
    return params, buffers, int(correct), float(loss)


@pytest.mark.parametrize("baseline", ["bn_c", "bn_g", "bn_i"])
def test_kld_bn_fine_tuning_equals_plain_batchnorm(baseline):
    """beta 1 + pretrained running start = plain BN fine-tuned in train mode (FT BN C); beta 0 =
    plain BN fine-tuned in eval mode with the pretrained statistics frozen (FT BN G); beta 1 +
    train-mode test = batch statistics at test too (FT BN I)."""
    model = _model()
    state = _state(model)
    train, test = _batches(4, 8), _batches(2, 6, seed=2)
    beta, mode_train, mode_test, test_mode = {"bn_c": (1.0, "train", "eval", "eval"),
                                              "bn_g": (0.0, "eval", "eval", "eval"),
                                              "bn_i": (1.0, "train", "train", "train")}[baseline]
    recipe = FinetuneRecipe(torch.full((2,), beta, dtype=torch.float64), 0.3, "pretrained", test_mode)
    params, buffers, correct, loss = _ours(model, state, recipe, train, test, 0.3)
    ref, ref_correct, ref_loss = _reference(state, train, test, mode_train, mode_test, 0.3)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach())
    if baseline == "bn_c":  # the client's running statistics moved exactly as plain BN's
        for name in ("bn1.running_mean", "bn1.running_var", "bn2.running_var"):
            torch.testing.assert_close(buffers[name], ref.state_dict()[name])
        assert int(buffers["bn1.num_batches_tracked"]) == 4
    assert correct == ref_correct
    assert loss == pytest.approx(ref_loss, rel=1e-10)


def test_beta_zero_and_one_differ_and_reset_start_differs_from_pretrained_start():
    model = _model()
    state = _state(model)
    train, test = _batches(3, 8), _batches(1, 6, seed=2)
    run = lambda beta, init: _ours(model, state, FinetuneRecipe(torch.full((2,), beta, dtype=torch.float64), 0.3,
                                                                init), train, test, 0.3)
    assert run(1.0, "pretrained")[3] != pytest.approx(run(0.0, "pretrained")[3], rel=1e-6)
    # eval after 3 steps from (0, 1): the running statistics keep a 0.9^3 share of (0, 1)
    reset, kept = run(1.0, "reset")[1], run(1.0, "pretrained")[1]
    pretrained_mean = state["buffers"]["bn1.running_mean"]
    torch.testing.assert_close(reset["bn1.running_mean"] - kept["bn1.running_mean"], -0.9 ** 3 * pretrained_mean)


def test_bn_g_equals_bn_c_when_the_client_data_has_the_pretrained_statistics():
    """One BN at the input, one full batch per step: when the pretrained statistics are the
    client data's own (mean, biased variance), beta 0 and beta 1 fine-tune identically."""
    model = _model(input_bn=True)
    x, y = _batches(1, 10)
    state = _state(model)
    state["buffers"]["input_bn.running_mean"] = x[0].mean(dim=(0, 2, 3))
    state["buffers"]["input_bn.running_var"] = x[0].var(dim=(0, 2, 3), unbiased=False)
    train, test = (x * 3, y * 3), _batches(1, 6, seed=2)
    betas = lambda first: torch.tensor([first, 1.0, 1.0], dtype=torch.float64)
    g = _ours(model, state, FinetuneRecipe(betas(0.0), 0.2, "pretrained"), train, test, 0.2)[0]
    c = _ours(model, state, FinetuneRecipe(betas(1.0), 0.2, "pretrained"), train, test, 0.2)[0]
    for name in g:
        torch.testing.assert_close(g[name], c[name])
    other = dict(state, buffers={**state["buffers"], "input_bn.running_mean": torch.zeros(2, dtype=torch.float64)})
    moved = _ours(model, other, FinetuneRecipe(betas(0.0), 0.2, "pretrained"), train, test, 0.2)[0]
    assert not torch.allclose(moved["fc.weight"], c["fc.weight"])


def test_per_tensor_learning_rates_of_zero_freeze_those_tensors():
    model = _model()
    state = _state(model)
    names = list(state["params"])
    lrs = [torch.tensor(0.0 if name.startswith("conv") else 0.5, dtype=torch.float64) for name in names]
    params, *_ = _ours(model, state, FinetuneRecipe(torch.ones(2, dtype=torch.float64), lrs), _batches(2, 8),
                       _batches(1, 4), 99.0)
    assert torch.equal(params["conv1.weight"], state["params"]["conv1.weight"])
    assert not torch.equal(params["fc.weight"], state["params"]["fc.weight"])
    with pytest.raises(ValueError, match="one lr per tensor"):
        lr_tree(FinetuneRecipe(torch.ones(2), [0.1, 0.2]), state["params"], 0.1)
    with pytest.raises(ValueError, match="BN layers"):
        client_start(model, state, FinetuneRecipe(torch.ones(5), 0.1))


def _dataset(n=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ArrayDataset("toy", torch.randn(n, 2, 5, 5, generator=g, dtype=torch.float64),
                        torch.randint(0, 3, (n,), generator=g), 3)


def test_plan_draws_ceil_n_over_32_steps_per_epoch_shuffled_each_epoch():
    data = _dataset()
    index, test = torch.arange(50), torch.arange(50, 110)
    plan = plan_client(7, index, test, epochs=3, batch_size=32, test_batch_size=50, seed=5)
    assert [b.numel() for b in plan.train] == [32, 18] * 3  # ceil(50/32) * e steps, the last one short
    assert [b.numel() for b in plan.meta] == [32, 18]
    assert [b.numel() for b in plan.test] == [50, 10]
    xs, ys = plan.inputs(data, "test")
    torch.testing.assert_close(torch.cat(xs), data.x[test])  # fixed order
    epochs = [torch.cat(plan.train[2 * e:2 * e + 2]) for e in range(3)]
    for e in epochs:  # every epoch is a permutation of the client's samples
        assert sorted(e.tolist()) == index.tolist()
    assert not torch.equal(epochs[0], epochs[1])
    again, other = plan_client(7, index, test, 3, 32, 50, 5), plan_client(8, index, test, 3, 32, 50, 5)
    assert torch.equal(again.train[0], plan.train[0]) and not torch.equal(other.train[0], plan.train[0])


def test_plan_augments_meta_and_train_batches_with_their_own_seeded_draws():
    data = _dataset()
    def augment(dataset, index, generator):
        x, y = dataset.batch(index)
        return x + torch.rand(x.shape[0], 1, 1, 1, generator=generator, dtype=x.dtype), y

    plan = plan_client(1, torch.arange(40), torch.arange(40, 50), 1, 32, 50, seed=0)
    train, again = plan.inputs(data, "train", augment)[0], plan.inputs(data, "train", augment)[0]
    plain = plan.inputs(data, "train")[0]
    assert all(torch.equal(a, b) for a, b in zip(train, again))  # the same draws on every call
    shift = train[0] - plain[0]
    assert not torch.equal(train[0], plain[0]) and shift.flatten(1).std(1).max() < 1e-12  # per sample
    assert len(set(shift[:, 0, 0, 0].tolist())) == len(shift)
    assert not torch.equal(plan.inputs(data, "meta", augment)[0][0] - plan.inputs(data, "meta")[0][0], shift)
    assert torch.equal(plan.inputs(data, "test", augment)[0][0], data.x[40:50])  # the test split never is


def _plans(sizes, data):
    plans, start = [], 0
    for cid, (n_train, n_test) in enumerate(sizes):
        train, test = torch.arange(start, start + n_train), torch.arange(start + n_train, start + n_train + n_test)
        start += n_train + n_test
        plans.append(plan_client(cid, train, test, 2, 8, 5, seed=3, group=f"g{cid % 2}"))
    return plans


def test_batched_equals_sequential_over_clients_of_unequal_sizes():
    model = _model()
    state = _state(model)
    data = _dataset()
    plans = _plans([(12, 7), (12, 7), (12, 7), (9, 4), (9, 4)], data)
    g = torch.Generator().manual_seed(4)
    n = len(state["params"])
    recipes = [FinetuneRecipe(torch.rand(2, generator=g, dtype=torch.float64),
                              list(torch.rand(n, generator=g, dtype=torch.float64) * 0.5), "reset", "eval")
               for _ in plans]
    recipes[1] = FinetuneRecipe(torch.ones(2, dtype=torch.float64), 0.1, "pretrained", "train")
    def augment(dataset, index, generator):
        x, y = dataset.batch(index)
        return x.flip(-1) * (1 + torch.rand(x.shape[0], 1, 1, 1, generator=generator, dtype=x.dtype)), y

    sequential = finetune_clients(model, state, data, plans, recipes, 0.1, augment, batched=False)
    for stack_size in (0, 2):
        batched = finetune_clients(model, state, data, plans, recipes, 0.1, augment, batched=True,
                                   stack_size=stack_size)
        for s, b in zip(sequential, batched):
            assert (s.cid, s.correct, s.total, s.group) == (b.cid, b.correct, b.total, b.group)
            assert b.loss == pytest.approx(s.loss, rel=1e-10)
    assert [o.total for o in sequential] == [7, 7, 7, 4, 4]


def test_no_finetuning_recipe_tests_the_pretrained_model():
    model = _model()
    state = _state(model)
    data = _dataset()
    plans = _plans([(12, 7)], data)
    frozen = FinetuneRecipe(torch.zeros(2, dtype=torch.float64), 0.0, "pretrained", finetune=False)
    tuned = FinetuneRecipe(torch.zeros(2, dtype=torch.float64), 0.5, "pretrained")
    out = finetune_clients(model, state, data, plans, [frozen], 0.1)[0]
    params, buffers = client_start(model, state, frozen)
    correct, loss = score_test(model, params, buffers, *plans[0].inputs(data, "test"))
    assert (out.correct, out.loss) == (int(correct), pytest.approx(float(loss)))
    assert finetune_clients(model, state, data, plans, [tuned], 0.1)[0].loss != pytest.approx(out.loss)


def test_pooled_and_mean_accuracy_differ_on_unequal_test_sizes():
    outcomes = [ClientOutcome(0, correct=1, total=1, loss=0.0), ClientOutcome(1, correct=0, total=3, loss=0.0)]
    assert pooled_accuracy(outcomes) == pytest.approx(25.0)
    assert mean_accuracy(outcomes) == pytest.approx(50.0)
    assert math.isnan(mean_accuracy([]))


def test_meta_inputs_are_the_foundations_on_the_pretrained_state():
    model = _model()
    state = _state(model)
    x, _ = _batches(2, 6)
    inputs = client_meta_inputs(model, state, x)
    assert inputs.xi.shape == (2,) and inputs.lr_stats.shape == (2 * 5,)
    assert (inputs.xi >= 0).all()


def test_skip_nonfinite_keeps_the_parameters_of_a_nan_step_and_moves_the_statistics():
    model = _model()
    state = _state(model)
    xs, ys = _batches(3, 6)
    xs[1] = xs[1].clone()
    xs[1][0, 0, 0, 0] = float("nan")  # the second step's loss is NaN
    recipe = FinetuneRecipe(torch.ones(2, dtype=torch.float64), 0.3, "pretrained", skip_nonfinite=True)
    params, buffers = client_start(model, state, recipe)
    lrs = lr_tree(recipe, params, 0.3)
    skipped, skipped_buffers = finetune(model, params, buffers, lrs, xs, ys, skip_nonfinite=True)
    clean, _ = finetune(model, params, buffers, lrs, [xs[0], xs[2]], [ys[0], ys[2]])
    for name in clean:
        torch.testing.assert_close(skipped[name], clean[name])
    assert int(skipped_buffers["bn1.num_batches_tracked"]) == 3
    assert torch.isnan(skipped_buffers["bn1.running_mean"]).any()  # the NaN batch's forward ran (the code's order)
    nan, _ = finetune(model, params, buffers, lrs, xs, ys)
    assert torch.isnan(nan["fc.weight"]).all()  # the plain FT client does not skip
    data = _dataset()
    data.x[3, 0, 0, 0] = float("nan")  # a training sample of client 0
    plans = _plans([(12, 7), (12, 7), (12, 7)], data)
    outs = [finetune_clients(model, state, data, plans, [recipe] * 3, 0.3, batched=b) for b in (False, True)]
    assert [o.correct for o in outs[0]] == [o.correct for o in outs[1]]
    torch.testing.assert_close(torch.tensor([o.loss for o in outs[0]]), torch.tensor([o.loss for o in outs[1]]),
                               equal_nan=True)
    assert math.isfinite(outs[0][1].loss)
