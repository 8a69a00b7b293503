"""ImageNet weights for ``resnet18_imagenet`` through torchvision's weights API, cached in the data
directory (fedl2p.md, "Office / DomainNet"; tests write random weights where the cache is)."""
from __future__ import annotations

import math

import pytest
import torch

from pfl_core.data import DatasetNotFoundError
from pfl_core.models import build_model
from pfl_core.models.imagenet_weights import checkpoint_path, redraw_head
from pfl_core.models.kld_bn import bn_names, load_pretrained, model_buffers, running_stats


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A data directory whose cache holds a torchvision ResNet-18 with random weights and perturbed
    BN statistics; returns (directory, state dict)."""
    from torchvision.models import resnet18

    tmp_path = tmp_path_factory.mktemp("data")
    torch.manual_seed(123)
    reference = resnet18(weights=None)
    with torch.no_grad():
        for name, buf in reference.named_buffers():
            if name.endswith("running_mean"):
                buf.normal_()
            elif name.endswith("running_var"):
                buf.uniform_(0.5, 2.0)
    path = checkpoint_path(tmp_path)
    assert path == tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    path.parent.mkdir(parents=True)
    torch.save(reference.state_dict(), path)
    return tmp_path, reference.state_dict()


@pytest.fixture()
def cached(cache_dir, monkeypatch):
    """The cached state dict, with the run's data directory (``PFL_DATA_DIR``) on it, offline."""
    monkeypatch.setenv("PFL_DATA_DIR", str(cache_dir[0]))
    monkeypatch.setenv("PFL_DOWNLOAD", "0")
    return cache_dir[1]


def test_imagenet_weights_fill_the_trunk_and_bn_statistics_and_the_head_comes_from_the_seed(cached):
    torch.manual_seed(7)
    model = build_model("resnet18_imagenet", (3, 64, 64), 10, weights="imagenet")
    torch.manual_seed(7)
    plain = build_model("resnet18_imagenet", (3, 64, 64), 10)
    own = model.state_dict()
    for key, value in cached.items():
        if key.startswith("fc."):
            continue
        assert torch.equal(own[key], value), key
    assert own["fc.weight"].shape == (10, 512)
    assert torch.equal(own["fc.weight"], plain.state_dict()["fc.weight"])  # the run's init draw, not the file
    assert torch.equal(own["fc.bias"], plain.state_dict()["fc.bias"])
    # the BN running statistics become the pretrained statistics of a stage-2 client
    state = {"params": dict(model.named_parameters()), "buffers": running_stats(model, model_buffers(model))}
    _, buffers = load_pretrained(model, state)
    assert len(bn_names(model)) == 20
    assert torch.equal(buffers["layer3.0.downsample.1.init_running_mean"], cached["layer3.0.downsample.1.running_mean"])
    assert torch.equal(buffers["bn1.init_running_var"], cached["bn1.running_var"])


def test_offline_without_the_file_names_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PFL_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("PFL_DOWNLOAD", "0")
    expected = str(tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth")
    with pytest.raises(DatasetNotFoundError, match="resnet18-f37072fd.pth") as err:
        build_model("resnet18_imagenet", (3, 64, 64), 10, weights="imagenet")
    assert expected in str(err.value) and "PFL_DATA_DIR" in str(err.value)


def test_imagenet_weights_need_width_64_and_a_known_weights_name(cached):
    with pytest.raises(ValueError, match="width must be 64"):
        build_model("resnet18_imagenet", (3, 64, 64), 10, width=8, weights="imagenet")
    with pytest.raises(ValueError, match="'none' or 'imagenet'"):
        build_model("resnet18_imagenet", (3, 64, 64), 10, width=8, weights="imagenet21k")


def test_redraw_head_draws_linear_init_bounds_from_the_generator():
    params = {"fc.weight": torch.zeros(10, 256), "fc.bias": torch.zeros(10), "conv1.weight": torch.ones(3)}
    a = redraw_head(params, torch.Generator().manual_seed(0))
    b = redraw_head(params, torch.Generator().manual_seed(0))
    c = redraw_head(params, torch.Generator().manual_seed(1))
    bound = 1 / math.sqrt(256)
    assert torch.equal(a["fc.weight"], b["fc.weight"]) and not torch.equal(a["fc.weight"], c["fc.weight"])
    assert a["fc.weight"].abs().max() <= bound and a["fc.weight"].abs().max() > 0.9 * bound
    assert a["fc.bias"].abs().max() <= bound and a["conv1.weight"] is params["conv1.weight"]
