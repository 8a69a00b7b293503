"""DLG (Zhu et al. 2019) and the reconstruction metrics behind MetaVers Figure 3."""
import math

import pytest
import torch
from torch import nn

from pfl_core.attacks.dlg import (DLGConfig, classifier_gradient_target, dlg_attack, gradient_distance,
                                  infer_label_idlg, parameter_gradient, prototype_gradient_target,
                                  prototypical_loss)
from pfl_core.attacks.quality import reconstruction_quality
from pfl_core.models import build_model
from pfl_core.prototypes import class_prototypes

#: 40 dB = an RMS pixel error of 1% of the [0, 1] range; the random start scores about 5 dB and an
#: unrelated uniform-noise image about 8 dB, so only a reconstruction of *this* image passes.
RECOVERED_DB = 40.0


def tiny_classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.Sigmoid(), nn.Linear(32, 4)).double()


def tiny_embedding():
    """A two-layer sigmoid embedding with a ``forward(x, embed)`` like ``le_embedding``."""
    class Embedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(3 * 8 * 8, 32), nn.Linear(32, 6)

        def forward(self, x, embed=False):
            return self.fc2(torch.sigmoid(self.fc1(x.flatten(1))))
    torch.manual_seed(0)
    return Embedding().double()


def image(seed=1, side=8):
    return torch.rand(1, 3, side, side, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def params_of(model):
    return {k: v.detach() for k, v in model.named_parameters()}


def test_gradient_distance_is_the_sum_of_squared_differences():
    grads = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    shared = {"a": torch.tensor([0.0, 4.0]), "b": torch.tensor([[1.0]])}
    assert float(gradient_distance(grads, shared)) == 1.0 + 4.0 + 4.0


@pytest.mark.parametrize("label", ["dlg", "idlg", "known"])
def test_dlg_recovers_a_known_image_from_a_tiny_classifiers_gradient(label):
    model, x, y = tiny_classifier(), image(), torch.tensor([2])
    params = params_of(model)
    cfg = DLGConfig(iterations=30, label=label, seed=0)
    target = classifier_gradient_target(model, params, x, y, cfg)
    start = reconstruction_quality(x, target.dummies["image"])["psnr"]
    result = dlg_attack(target, params, cfg)
    quality = reconstruction_quality(x, result.reconstruction)
    assert start < 10 and quality["psnr"] > RECOVERED_DB and quality["ssim"] > 0.99
    assert result.gradient_distance[-1] < 1e-6 < result.gradient_distance[0]
    assert len(result.gradient_distance) == 31
    again = parameter_gradient(target.loss, params, result.dummies)  # the last value is the final distance
    assert result.gradient_distance[-1] == pytest.approx(float(gradient_distance(again, target.shared)))
    for k, v in model.named_parameters():  # the attack never moves the model
        assert torch.equal(v.detach(), params[k])
    if label == "dlg":  # the dummy label converges to the true class
        assert int(result.dummies["label_logits"].argmax()) == 2


def test_idlg_reads_the_label_from_the_last_bias_gradient():
    model = tiny_classifier()
    params = params_of(model)
    for y in range(4):
        shared = classifier_gradient_target(model, params, image(y), torch.tensor([y]),
                                            DLGConfig(label="known")).shared
        assert int(infer_label_idlg(shared, "3.bias")) == y
        assert (shared["3.bias"] < 0).sum() == 1  # p - onehot(y): negative only at y
    with pytest.raises(ValueError, match="bias"):
        infer_label_idlg(shared, "3.weight")


def test_the_true_unknowns_reproduce_the_shared_gradient_exactly():
    """The rehearsed losses are the clients' own: at the truth the gradient distance is 0."""
    model, x, y = tiny_classifier(), image(), torch.tensor([1])
    params = params_of(model)
    target = classifier_gradient_target(model, params, x, y, DLGConfig(label="known"))
    assert float(gradient_distance(parameter_gradient(target.loss, params, {"image": x}), target.shared)) == 0.0
    emb = tiny_embedding()
    eparams = params_of(emb)
    protos = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for leakage in (True, False):
        target = prototype_gradient_target(emb, eparams, x, y, protos, leakage, DLGConfig(label="known"))
        truth = {"image": x} if leakage else {"image": x, "prototypes": protos}
        assert set(target.dummies) == set(truth)
        assert float(gradient_distance(parameter_gradient(target.loss, eparams, truth), target.shared)) == 0.0


def test_metavers_gradient_is_the_prototypical_loss_gradient_and_the_loss_is_pluggable():
    emb, x, y = tiny_embedding(), image(), torch.tensor([0])
    params = params_of(emb)
    support = torch.rand(6, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    protos = class_prototypes(emb(support), torch.tensor([0, 0, 1, 1, 2, 2]), 3).detach()
    target = prototype_gradient_target(emb, params, x, y, protos, leakage=True)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    by_hand = torch.autograd.grad(prototypical_loss(emb, leaves, x, y, protos), list(leaves.values()))
    for (k, shared), g in zip(target.shared.items(), by_hand):
        torch.testing.assert_close(shared, g)
    calls = []

    def doubled(model, p, img, label, prototypes):
        calls.append(prototypes.shape)
        return 2 * prototypical_loss(model, p, img, label, prototypes)
    plugged = prototype_gradient_target(emb, params, x, y, protos, leakage=False,
                                        cfg=DLGConfig(label="known"), episode_loss=doubled)
    for k in target.shared:
        torch.testing.assert_close(plugged.shared[k], 2 * target.shared[k])
    parameter_gradient(plugged.loss, params, plugged.dummies)
    assert calls == [protos.shape, protos.shape]


def test_prototype_leakage_lets_dlg_recover_the_image():
    emb, x, y = tiny_embedding(), image(), torch.tensor([1])
    params = params_of(emb)
    protos = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cfg = DLGConfig(iterations=30, label="dlg")
    leaked = dlg_attack(prototype_gradient_target(emb, params, x, y, protos, True, cfg), params, cfg)
    assert reconstruction_quality(x, leaked.reconstruction)["psnr"] > RECOVERED_DB
    guessed = prototype_gradient_target(emb, params, x, y, protos, False, cfg)
    assert guessed.dummies["prototypes"].shape == protos.shape
    with pytest.raises(ValueError, match="iDLG"):
        prototype_gradient_target(emb, params, x, y, protos, True, DLGConfig(label="idlg"))


def test_dlg_runs_on_the_metavers_models():
    """One short attack per Figure 3 target on the real models (shapes and plumbing)."""
    x, y = image(side=32).float(), torch.tensor([3])
    cfg = DLGConfig(iterations=1, max_iter=2)
    lenet = build_model("lenet", (3, 32, 32), 10)
    result = dlg_attack(classifier_gradient_target(lenet, params_of(lenet), x, y, cfg), params_of(lenet), cfg)
    assert result.reconstruction.shape == x.shape and len(result.gradient_distance) == 2
    le = build_model("le_embedding", (3, 32, 32), 10)
    protos = torch.randn(4, 84)
    target = prototype_gradient_target(le, params_of(le), x, y, protos, False, cfg)
    assert dlg_attack(target, params_of(le), cfg).dummies["prototypes"].shape == (4, 84)


def test_psnr_and_ssim_of_identical_images_are_inf_and_one():
    x = image(side=32)
    assert reconstruction_quality(x, x.clone()) == {"psnr": math.inf, "ssim": 1.0}


def test_psnr_by_hand_and_clipping():
    x = torch.full((3, 8, 8), 0.5, dtype=torch.float64)
    x[0, 0, 0] = 0.0  # not constant, so SSIM is defined
    off = x + 0.1
    off[0, 0, 0] = 0.1
    assert reconstruction_quality(x, off)["psnr"] == pytest.approx(10 * math.log10(1 / 0.01))
    far = x.clone()
    far[1] = 5.0  # clipped to 1 before scoring: MSE = (1/3) * 0.25
    assert reconstruction_quality(x, far)["psnr"] == pytest.approx(10 * math.log10(1 / (0.25 / 3)))
    assert reconstruction_quality(x, off)["ssim"] < 1.0
