"""Office/DomainNet augmentation: flip + rotation draws and their pure apply (fedl2p.md)."""
from __future__ import annotations

import torch
from torchvision.transforms.v2 import functional as TF

from pfl_core.data.augment.flip_rotate import draw_flip_rotate, flip_rotate


def test_flip_rotate_equals_torchvision_per_image():
    x = torch.rand(6, 3, 20, 24, generator=torch.Generator().manual_seed(0))
    draws = draw_flip_rotate(6, torch.Generator().manual_seed(1))
    got = flip_rotate(x, draws)
    for i in range(6):
        image = TF.horizontal_flip(x[i]) if draws.flip[i] else x[i]
        want = TF.rotate(image, float(draws.angle[i]), interpolation=TF.InterpolationMode.NEAREST, fill=0.0)
        assert torch.equal(got[i], want)  # the same grid, the same nearest pixels
    assert torch.equal(flip_rotate(x, draws._replace(angle=torch.zeros(6), flip=torch.zeros(6, dtype=torch.bool))), x)


def test_quarter_turn_is_counter_clockwise_and_flip_mirrors():
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    quarter = flip_rotate(x, draws=draw_flip_rotate(1, torch.Generator())._replace(
        flip=torch.tensor([False]), angle=torch.tensor([90.0])))
    assert torch.equal(quarter, torch.rot90(x, 1, dims=(2, 3)))
    mirrored = flip_rotate(x, draws=draw_flip_rotate(1, torch.Generator())._replace(
        flip=torch.tensor([True]), angle=torch.tensor([0.0])))
    assert torch.equal(mirrored, x.flip(-1))


def test_draws_are_per_sample_or_shared_within_the_bounds():
    many = draw_flip_rotate(4000, torch.Generator().manual_seed(0))
    assert many.angle.min() >= -30 and many.angle.max() <= 30 and many.angle.std() > 15
    assert 0.45 < many.flip.float().mean() < 0.55
    shared = draw_flip_rotate(5, torch.Generator().manual_seed(0), shared=True)
    assert len(set(shared.angle.tolist())) == 1 and len(set(shared.flip.tolist())) == 1 and len(shared.angle) == 5


def test_flip_rotate_runs_under_vmap_over_stacked_clients():
    x = torch.rand(2, 3, 3, 8, 8)  # 2 clients x a batch of 3 images
    draws = [draw_flip_rotate(3, torch.Generator().manual_seed(k)) for k in range(2)]
    stacked = type(draws[0])(*(torch.stack(t) for t in zip(*draws)))
    batched = torch.func.vmap(flip_rotate)(x, stacked)
    for k in range(2):
        assert torch.equal(batched[k], flip_rotate(x[k], draws[k]))
