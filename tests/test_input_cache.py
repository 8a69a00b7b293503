"""The input cache of ArrayDataset.batch: the normalised copy of the whole dataset gives the bits
that per-batch conversion gives, is never carried into a dataset with other statistics, and
respects its budget (PFL_INPUT_CACHE_MB)."""
from __future__ import annotations

import pytest
import torch

from pfl_core.data.federated import ArrayDataset, standardize


def _images(n=300, shape=(3, 8, 8)):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, *shape), generator=gen, dtype=torch.uint8), torch.randint(0, 10, (n,), generator=gen)


def _per_batch(ds: ArrayDataset, index: torch.Tensor) -> torch.Tensor:
    x, _ = ds.raw_batch(index)
    return ds.to_inputs(ds.normalize(x))


@pytest.mark.parametrize("mode", ["none", "pixel", "half"])
def test_cached_batches_are_the_per_batch_bits(mode, monkeypatch):
    monkeypatch.setenv("PFL_INPUT_CACHE_MB", "64")
    x, y = _images(20000)  # more than one 8,192-row chunk of the cache
    ds = standardize(ArrayDataset("img", x, y, 10), mode)
    index = torch.tensor([19999, 0, 8191, 8192, 5, 5, 12345])
    got, labels = ds.batch(index)
    assert ds.normalized_rows() is not None
    assert torch.equal(got, _per_batch(ds, index)) and torch.equal(labels, y[index])


def test_the_cache_is_not_carried_into_a_dataset_with_other_statistics(monkeypatch):
    monkeypatch.setenv("PFL_INPUT_CACHE_MB", "64")
    ds = standardize(ArrayDataset("img", *_images(), 10), "half")
    index = torch.arange(7)
    ds.batch(index)
    raw = ArrayDataset("img", ds.x, ds.y, 10)
    assert torch.equal(raw.batch(index)[0], ds.x[index].float() / 255.0)
    evaluation = standardize(ds, "pixel")
    assert torch.equal(evaluation.batch(index)[0], _per_batch(evaluation, index))
    assert not torch.equal(evaluation.batch(index)[0], ds.batch(index)[0])


def test_budget_zero_or_too_small_keeps_per_batch_conversion(monkeypatch):
    ds = standardize(ArrayDataset("img", *_images(), 10), "pixel")
    monkeypatch.setenv("PFL_INPUT_CACHE_MB", "0")
    assert ds.normalized_rows() is None
    monkeypatch.setenv("PFL_INPUT_CACHE_MB", str(300 * 192 * 4 / 2 ** 20 * 0.99))  # just under the float copy
    assert ds.normalized_rows() is None
    monkeypatch.setenv("PFL_INPUT_CACHE_MB", str(300 * 192 * 4 / 2 ** 20))
    assert ds.normalized_rows() is not None
    index = torch.tensor([3, 1, 299])
    assert torch.equal(ds.batch(index)[0], _per_batch(ds, index))


def test_float_features_without_statistics_are_their_own_cache():
    x = torch.randn(50, 6)
    ds = ArrayDataset("feat", x, torch.zeros(50, dtype=torch.int64), 2)
    assert ds.normalized_rows() is x
    assert ArrayDataset("f64", x.double(), torch.zeros(50, dtype=torch.int64), 2).batch(torch.arange(3))[0].dtype == torch.float64
