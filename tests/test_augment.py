"""pfl_core.data.augment.crop_flip: host-side crop/flip draws and the pure apply, checked against
torchvision.transforms.v2 on the same offsets (FedL2P spec, "Transforms")."""
from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from pfl_core.data.augment.crop_flip import (FEDL2P_CIFAR_MEAN, FEDL2P_CIFAR_STD, CropFlip, augment, crop_flip,
                              draw_crop_flip, normalize, stack_draws)
from pfl_core.data.federated import ArrayDataset


def images(n: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def torchvision_reference(x: torch.Tensor, draws: CropFlip) -> torch.Tensor:
    """v2: pad 4 with 0, crop 32x32 at (top, left), flip, Normalize - image by image."""
    out = []
    for img, top, left, flip in zip(x, *draws):
        img = TF.crop(TF.pad(img, [4], fill=0), int(top), int(left), 32, 32)
        if flip:
            img = TF.horizontal_flip(img)
        out.append(TF.normalize(img, list(FEDL2P_CIFAR_MEAN), list(FEDL2P_CIFAR_STD)))
    return torch.stack(out)


@pytest.mark.parametrize("shared", [False, True])
def test_augment_equals_torchvision_v2_on_the_same_offsets(shared):
    x = images(8)
    draws = draw_crop_flip(8, torch.Generator().manual_seed(3), shared=shared)
    assert torch.allclose(augment(x, draws), torchvision_reference(x, draws), atol=1e-6, rtol=0)


def test_extreme_offsets_and_flip_by_hand():
    x = torch.arange(2 * 32 * 32, dtype=torch.float32).view(2, 1, 32, 32)
    draws = CropFlip(torch.tensor([0, 8]), torch.tensor([8, 0]), torch.tensor([False, True]))
    out = crop_flip(x, draws)
    # image 0: shifted 4 rows down (black top rows), 4 columns left (black right columns)
    assert torch.equal(out[0, 0, :4], torch.zeros(4, 32)) and torch.equal(out[0, 0, :, 28:], torch.zeros(32, 4))
    assert torch.equal(out[0, 0, 4:, :28], x[0, 0, :28, 4:])
    # image 1: crop at (8, 0) then mirrored: output column c is cropped column 31 - c
    cropped = torch.zeros(32, 32)
    cropped[:28, 4:] = x[1, 0, 4:, :28]
    assert torch.equal(out[1, 0], cropped.flip(-1))


def test_draws_per_sample_and_shared():
    g = torch.Generator().manual_seed(0)
    per = draw_crop_flip(4000, g)
    assert per.top.min() == 0 and per.top.max() == 8 and per.left.min() == 0 and per.left.max() == 8
    assert 0.45 < per.flip.float().mean() < 0.55 and len(per.top.unique()) == 9
    shared = draw_crop_flip(32, g, shared=True)
    assert all(len(t.unique()) == 1 and len(t) == 32 for t in shared)
    again = draw_crop_flip(4000, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(per, again))


def test_crop_flip_under_vmap_equals_the_loop():
    xs = torch.stack([images(5, seed=s) for s in range(3)])
    g = torch.Generator().manual_seed(1)
    draws = [draw_crop_flip(5, g, shared=s == 1) for s in range(3)]
    stacked = stack_draws(draws)
    assert stacked.top.shape == (3, 5)
    batched = torch.func.vmap(augment)(xs, stacked)
    assert torch.equal(batched, torch.stack([augment(x, d) for x, d in zip(xs, draws)]))


def test_random_crop_distribution_matches_torchvision_transform():
    """The offsets we draw are uniform on [0, 8] like v2.RandomCrop's: the fraction of images whose
    top-left pixel is padding agrees (top or left < 4 pads; P = 1 - (5/9)^2)."""
    x = torch.ones(1000, 3, 32, 32)
    ours = crop_flip(x, draw_crop_flip(1000, torch.Generator().manual_seed(2)))
    torch.manual_seed(2)
    theirs = torch.stack([v2.RandomCrop(32, padding=4)(img) for img in x])
    expected = 1 - (5 / 9) ** 2
    for out in (ours, theirs):
        assert abs((out[:, 0, 0, 0] == 0).float().mean().item() - expected) < 0.05


def test_raw_batch_keeps_unnormalised_images():
    data = ArrayDataset("d", (torch.arange(2 * 3 * 4 * 4) % 256).to(torch.uint8).view(2, 3, 4, 4),
                        torch.tensor([0, 1]), 2, mean=FEDL2P_CIFAR_MEAN, std=FEDL2P_CIFAR_STD)
    raw, y = data.raw_batch(torch.tensor([1, 0]))
    assert torch.equal(raw, data.x[[1, 0]].float() / 255) and torch.equal(y, torch.tensor([1, 0]))
    normed, _ = data.batch(torch.tensor([1, 0]))
    assert torch.allclose(normed, normalize(raw, FEDL2P_CIFAR_MEAN, FEDL2P_CIFAR_STD), atol=1e-6)
    assert torch.allclose(data.normalize(raw), normed)
