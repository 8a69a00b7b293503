"""CAFeMe datasets (cafeme.md, "Data"): RMNIST, LEAF FEMNIST and Meta-Dataset clients, each read
from tiny files written in the real formats (MNIST idx, LEAF JSON, Meta-Dataset TFRecords)."""
from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pfl_core.data import DatasetNotFoundError, build_federated, load_dataset, partition
from pfl_core.data.rmnist import rotate_images, rotation_chunks
from pfl_core.seeding import RunStreams

from fake_data import femnist_files, write_folder, write_mnist, write_records

SHARED_DATA = Path(
    os.environ.get("PFL_SHARED_MNIST", Path(__file__).parents[2] / "shared" / "data")
)


# ----------------------------------------------------------------------------------------- RMNIST
def expected_spot(r: int, c: int, degrees: float) -> tuple[float, float]:
    """Where pixel (r, c) lands after a counter-clockwise rotation about the centre (13.5, 13.5)."""
    t = math.radians(degrees)
    dx, dy = c - 13.5, 13.5 - r  # y up
    row = 13.5 - (dx * math.sin(t) + dy * math.cos(t))
    return row, 13.5 + (dx * math.cos(t) - dy * math.sin(t))


def test_rmnist_groups_and_angles(tmp_path):
    images, labels = write_mnist(tmp_path)
    ds = load_dataset("rmnist", tmp_path, "train", download=False, num_groups=10, rotation_seed=3)
    assert ds.name == "rmnist" and ds.num_classes == 10 and not ds.offline
    assert ds.x.shape == (100, 1, 28, 28) and ds.x.dtype == torch.uint8
    assert np.array_equal(ds.y.numpy(), labels)  # MNIST order and labels are kept
    assert np.bincount(ds.groups.numpy()).tolist() == [10] * 10
    chunks = rotation_chunks(100, 10, 3)
    landed = 0
    for k, chunk in enumerate(chunks):
        assert set(np.flatnonzero(ds.groups.numpy() == k)) == set(chunk.tolist())
        for i in chunk[:3]:
            want = rotate_images(torch.from_numpy(images[i][None, None]), 20.0 * k)[0]
            assert torch.equal(ds.x[i], want)
            # independent check: the bright pixel lands next to the analytic CCW position (nearest
            # sampling may copy it to two neighbouring pixels or, rarely, drop it)
            (r, c), = np.argwhere(images[i] > 0)
            er, ec = expected_spot(r, c, 20.0 * k)
            bright = np.argwhere(ds.x[i, 0].numpy() > 0)
            landed += len(bright) > 0
            assert set(ds.x[i].unique().tolist()) <= {0, int(images[i].max())}
            for r2, c2 in bright:
                assert abs(r2 - er) <= 1 and abs(c2 - ec) <= 1, (k, (r, c), (r2, c2), (er, ec))
    assert landed >= 25
    # exact quarter/half turns: counter-clockwise about the centre, no expand
    x = torch.zeros(1, 1, 28, 28, dtype=torch.uint8)
    x[0, 0, 3, 20] = 255
    assert (rotate_images(x, 90)[0, 0] > 0).nonzero().tolist() == [[7, 3]]
    assert (rotate_images(x, 180)[0, 0] > 0).nonzero().tolist() == [[24, 7]]
    assert "180 degrees" in ds.description and "seed 3" in ds.description


def test_rmnist_seed_and_params(tmp_path):
    write_mnist(tmp_path)
    a = load_dataset("rmnist", tmp_path, "train", download=False)
    b = load_dataset("rmnist", tmp_path, "train", download=False)
    c = load_dataset("rmnist", tmp_path, "train", download=False, rotation_seed=1)
    assert torch.equal(a.x, b.x) and torch.equal(a.groups, b.groups)
    assert not torch.equal(a.groups, c.groups)
    four = load_dataset("rmnist", tmp_path, "train", download=False, num_groups=4, angle_step=90.0)
    assert np.bincount(four.groups.numpy()).tolist() == [25] * 4
    i = int(np.flatnonzero(four.groups.numpy() == 2)[0])
    plain = load_dataset("mnist", tmp_path, download=False).x
    assert torch.equal(four.x[i, 0], torch.flip(plain[i, 0], (0, 1)))
    with pytest.raises(DatasetNotFoundError, match="MNIST not found"):
        load_dataset("rmnist", tmp_path / "empty", download=False)


def test_rmnist_none_shards_dirichlet_partitions(tmp_path):
    write_mnist(tmp_path)
    ds = load_dataset("rmnist", tmp_path, "train", download=False)
    groups = ds.groups.numpy()
    streams = RunStreams(0)
    # "None": group_split gives clients m*g .. m*g+m-1 of rotation group g (here 20 clients x 5)
    fed = build_federated(ds, num_clients=20, partition="group_split", partition_params={},
                          client_splits={"eval": 0.2}, unseen_fraction=0.2, streams=streams)
    all_idx = torch.cat([torch.cat(list(c.splits.values())) for c in fed.clients]).numpy()
    assert sorted(all_idx.tolist()) == list(range(100))
    for cid, client in enumerate(fed.clients):
        idx = np.concatenate([v.numpy() for v in client.splits.values()])
        assert len(idx) == 5 and set(groups[idx]) == {cid // 2}
        assert client.size("eval") == 1
    again = partition("group_split", ds.y.numpy(), 20, streams.numpy("partition"), groups=groups)
    for part, client in zip(again, fed.clients):  # same seed, same clients
        assert set(part.tolist()) == set(torch.cat(list(client.splits.values())).tolist())
    with pytest.raises(ValueError, match="not divisible"):
        partition("group_split", ds.y.numpy(), 15, streams.numpy("partition"), groups=groups)
    # Shards / Dirichlet re-partition the rotated images by label; every image keeps its rotation
    raw = load_dataset("mnist", tmp_path, download=False).x
    for name, params in (("shards", {"num_shards": 20, "shards_per_client": 2}),
                         ("dirichlet", {"alpha": 0.3, "min_size": 1})):
        parts = partition(name, ds.y.numpy(), 10, streams.numpy("partition"), groups=None, **params)
        idx = np.concatenate(parts)
        assert len(idx) == len(set(idx.tolist())) == 100
        for i in idx[:20]:
            assert torch.equal(ds.x[i], rotate_images(raw[i : i + 1], 20.0 * groups[i])[0])


@pytest.mark.skipif(not (SHARED_DATA / "MNIST" / "raw").is_dir(), reason="real MNIST not present")
def test_real_rmnist_none_partition():
    ds = load_dataset("rmnist", SHARED_DATA, "train", download=False)
    assert ds.x.shape == (60_000, 1, 28, 28) and ds.x.dtype == torch.uint8
    assert np.bincount(ds.groups.numpy()).tolist() == [6000] * 10
    fed = build_federated(ds, num_clients=100, partition="group_split", partition_params={},
                          client_splits={"eval": 0.2}, unseen_fraction=0.2, streams=RunStreams(0))
    groups = ds.groups.numpy()
    for cid, client in enumerate(fed.clients):
        idx = np.concatenate([v.numpy() for v in client.splits.values()])
        assert len(idx) == 600 and set(groups[idx]) == {cid // 10}
        assert (client.size("eval"), client.size("train")) == (120, 480)
    assert len(fed.train_clients) == 80 and len(fed.unseen_clients) == 20
    # group 9 is 180 degrees: a half turn of the original MNIST digit
    mnist = load_dataset("mnist", SHARED_DATA, "train", download=False)
    i = int(np.flatnonzero(groups == 9)[0])
    assert torch.equal(ds.x[i, 0], torch.flip(mnist.x[i, 0], (0, 1)))


# ---------------------------------------------------------------------------------------- FEMNIST
def test_femnist_leaf_json(tmp_path):
    writers = femnist_files(tmp_path)
    ds = load_dataset("femnist", tmp_path, "train", download=False)
    assert ds.num_classes == 62 and ds.x.dtype == torch.uint8 and ds.x.shape == (17, 1, 28, 28)
    order = sorted(writers)
    sizes = np.bincount(ds.groups.numpy()).tolist()
    assert sizes == [len(writers[w]) for w in order]
    start = 0
    for gid, w in enumerate(order):
        for j, (img, lab) in enumerate(writers[w]):
            x, y = ds.batch(torch.tensor([start + j]))
            np.testing.assert_allclose(x[0, 0].numpy(), (0.5 - img / 255.0) / 0.5, atol=1e-6)
            assert int(y) == lab and int(ds.groups[start + j]) == gid
        start += len(writers[w])
    x, _ = ds.batch(torch.arange(len(ds)))
    assert x.min() >= -1 and x.max() <= 1
    # natural partition samples the requested number of writers, each client one whole writer
    rng = np.random.default_rng(0)
    parts = partition("natural", ds.y.numpy(), 3, rng, groups=ds.groups.numpy())
    assert len(parts) == 3
    for p in parts:
        g = set(ds.groups.numpy()[p].tolist())
        assert len(g) == 1 and len(p) == sizes[g.pop()]


def test_femnist_leaf_layout_float_and_missing(tmp_path):
    leaf_dir = tmp_path / "femnist" / "data" / "train"  # LEAF's own folder layout is accepted
    leaf_dir.mkdir(parents=True)
    x = np.full(784, 0.3)  # not a multiple of 1/255: kept as floats
    (leaf_dir / "a.json").write_text(json.dumps(
        {"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [x.tolist()], "y": [7]}}}))
    ds = load_dataset("femnist", tmp_path, "train", download=False)
    assert ds.x.dtype == torch.float32
    np.testing.assert_allclose(ds.batch(torch.tensor([0]))[0].numpy(), 0.4, atol=1e-6)
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("femnist", tmp_path / "none", "train", download=False)
    message = str(info.value)
    assert "\n" not in message and "preprocess.sh -s niid --sf 1.0 -k 0 -t sample" in message
    assert str(tmp_path / "none" / "femnist" / "train") in message


# ----------------------------------------------------------------------------------- Meta-Dataset
@pytest.fixture
def metadataset_dir(tmp_path):
    root = tmp_path / "metadataset"
    write_records(root / "records" / "aircraft", num_classes=12, per_class=8, base=200)
    write_records(root / "records" / "omniglot", num_classes=11, per_class=4, base=0)
    write_folder(root / "folders" / "mini_imagenet", num_classes=10, per_class=7)
    return tmp_path


def test_metadataset_records_are_real_tfrecords(metadataset_dir):
    from tfrecord.reader import example_loader

    path = metadataset_dir / "metadataset" / "records" / "aircraft" / "3.tfrecords"
    examples = list(example_loader(str(path), None, {"image": "byte", "label": "int"}))
    assert len(examples) == 8 and all(int(e["label"][0]) == 3 for e in examples)
    assert Image.open(io.BytesIO(examples[0]["image"])).format == "JPEG"


def test_metadataset_clients(metadataset_dir):
    sources = ["aircraft", "omniglot", "mini_imagenet"]
    params = dict(num_clients=12, images_per_class=6, sources=sources, client_seed=5)
    ds = load_dataset("metadataset", metadataset_dir, "train", download=False, **params)
    assert ds.x.dtype == torch.uint8 and ds.x.shape[1:] == (3, 32, 32) and ds.num_classes == 10
    assert "RGB" in ds.description and "BGR" in ds.description
    groups = ds.groups.numpy()
    assert np.array_equal(np.unique(groups), np.arange(12))
    parts = partition("natural", ds.y.numpy(), 12, np.random.default_rng(0), groups=groups)
    seen_sources = set()
    for cid, idx in enumerate(parts):
        assert np.array_equal(idx, np.flatnonzero(groups == cid))  # natural = the built clients
        x = ds.x[idx].numpy().astype(int)
        y = ds.y[idx].numpy()
        if (x[:, 0] == x[:, 1]).all() and (x[:, 1] == x[:, 2]).all():  # omniglot: gray, inverted
            source, per_class = "omniglot", 4
        else:
            red = int(np.median(x[:, 0]))
            source, per_class = ("aircraft", 6) if abs(red - 200) < 8 else ("mini_imagenet", 6)
            assert abs(red - (200 if source == "aircraft" else 100)) < 8
            # the class colour (green) is constant within a label: one class per label
            for label in range(10):
                greens = x[y == label, 1].reshape(per_class, -1).mean(axis=1)
                assert np.ptp(greens) < 8
        seen_sources.add(source)
        assert sorted(np.unique(y).tolist()) == list(range(10))
        assert np.bincount(y, minlength=10).tolist() == [per_class] * 10
        assert len(idx) == 10 * per_class
    assert seen_sources == set(sources)
    again = load_dataset("metadataset", metadataset_dir, "train", download=False, **params)
    assert torch.equal(ds.x, again.x) and torch.equal(ds.y, again.y)
    other = load_dataset("metadataset", metadataset_dir, "train", download=False,
                         **{**params, "client_seed": 6})
    assert not (torch.equal(ds.x, other.x) and torch.equal(ds.y, other.y))


def test_metadataset_pixels(metadataset_dir):
    one = load_dataset("metadataset", metadataset_dir, "train", download=False, num_clients=1,
                       images_per_class=60, sources="omniglot")
    assert len(one) == 40  # min(n_c = 4, 60) images of each of 10 classes
    # omniglot record (0, 20c, 8j) -> gray L = 0.299*0 + 0.587*20c + 0.114*8j, inverted
    x = one.x.numpy().astype(int)
    assert (x[:, 0] == x[:, 2]).all() and x.min() >= 255 - 0.587 * 200 - 0.114 * 24 - 6
    imagenet = load_dataset("metadataset", metadataset_dir, "train", download=False,
                            num_clients=1, images_per_class=2, sources=["mini_imagenet"],
                            image_size=16)
    assert imagenet.x.shape == (20, 3, 16, 16)
    assert (imagenet.x[:, 0] == 100).all()  # PNG folders are lossless: exact red channel


def test_metadataset_missing_source(metadataset_dir):
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("metadataset", metadataset_dir, "train", download=False,
                     sources=["aircraft", "dtd"])
    message = str(info.value)
    assert "'dtd'" in message and "\n" not in message
    assert str(metadataset_dir / "metadataset" / "records" / "dtd") in message
    with pytest.raises(ValueError, match="unknown sources"):
        load_dataset("metadataset", metadataset_dir, "train", download=False, sources=["fc100"])
    with pytest.raises(ValueError, match="fewer than classes_per_client"):
        load_dataset("metadataset", metadataset_dir, "train", download=False,
                     sources=["aircraft"], classes_per_client=13)
