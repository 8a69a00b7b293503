import torch

from pfl_core.batching import BatchStream


def _stream(n=10, b=3, seed=0, **kw):
    return BatchStream(torch.arange(100, 100 + n), b, torch.Generator().manual_seed(seed), **kw)


def test_fixed_order_is_shuffled_once_and_cycles():
    s = _stream()
    first = torch.cat(s.epoch())
    assert set(first.tolist()) <= set(range(100, 110)) and len(set(first.tolist())) == 9
    assert torch.equal(torch.cat(s.epoch()), first)  # same order every epoch
    cyclic = [s.next() for _ in range(2 * s.batches_per_epoch)]
    assert torch.equal(torch.cat(cyclic[:3]), torch.cat(cyclic[3:]))
    assert torch.equal(torch.cat(cyclic[:3]), first)


def test_drop_last_drops_the_incomplete_batch():
    s = _stream(n=10, b=3, drop_last=True)
    assert [len(b) for b in s.epoch()] == [3, 3, 3]
    assert s.batches_per_epoch == 3
    s = _stream(n=10, b=3, drop_last=False)
    assert [len(b) for b in s.epoch()] == [3, 3, 3, 1]
    assert sorted(torch.cat(s.epoch()).tolist()) == list(range(100, 110))


def test_split_smaller_than_a_batch_yields_one_short_batch():
    s = _stream(n=2, b=5, drop_last=True)
    assert s.short and [len(b) for b in s.epoch()] == [2]
    assert len(s.next()) == 2 and len(s.next()) == 2


def test_reshuffle_draws_a_new_order_per_epoch():
    s = _stream(n=30, b=5, reshuffle=True)
    a, b = torch.cat(s.epoch()), torch.cat(s.epoch())
    assert sorted(a.tolist()) == sorted(b.tolist()) and not torch.equal(a, b)


def test_same_seed_same_batches():
    assert torch.equal(torch.cat(_stream(seed=4).epoch()), torch.cat(_stream(seed=4).epoch()))
    assert not torch.equal(torch.cat(_stream(n=30, seed=4).epoch()), torch.cat(_stream(n=30, seed=5).epoch()))
