"""Speech Commands v2 (fedl2p.md, "Speech Commands V2"): speaker pools, splits, features, augmentation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fake_data import write_speech_commands
from pfl_core.data.audio import FBANK_MEAN, FBANK_STD, SpeechAugment, SpeechDraws, join_rows, kaldi_fbank, split_rows
from pfl_core.data import build_federated, load_dataset, load_sources
from pfl_core.data.speech_commands import CLASSES
from pfl_core.seeding import RunStreams


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("speech")
    write_speech_commands(base)
    return base


def _load(root, split, **params):
    return load_dataset("speech_commands", root, split, download=False, num_seen=2, num_unseen=2, **params)


def test_pools_are_the_speakers_with_most_files_and_each_word_is_cut_20_then_80_20(root):
    sets = {s: _load(root, s) for s in ("train", "val", "test")}
    # seen: the 2 training speakers with the most files (aa: 6 per word, cc: 5), then unseen: the
    # 2 validation/test speakers with the most (ee: 6, dd: 5; ff's 4 left out)
    per_word = {0: 6, 1: 5, 2: 6, 3: 5}
    for client, n in per_word.items():
        test = n - int(0.8 * n)
        train = int(0.8 * (n - test))
        sizes = {"train": train, "val": n - test - train, "test": test}
        for split, ds in sets.items():
            words = ds.y[(ds.groups == client) & (ds.y != CLASSES.index("silence"))]
            # yes -> 0, no -> 1, bed -> unknown (10), each word cut alike
            assert sorted(words.tolist()) == sorted([0, 1, 10] * sizes[split])
            silence = int(((ds.groups == client) & (ds.y == 11)).sum())
            assert silence == int(0.1 * 3 * sizes[split])
    assert sets["train"].unseen_groups == (2, 3) and sets["train"].num_classes == 12


def test_the_split_shuffle_is_seeded_a_named_deviation_from_the_unseeded_code(root):
    a, b, c = _load(root, "train"), _load(root, "train"), _load(root, "train", split_seed=5)
    assert torch.equal(a.x, b.x)
    assert not torch.equal(a.x, c.x) and "unseeded" in a.description


def test_clients_are_speakers_and_the_unseen_pool_is_held_out(root):
    ds = load_sources("speech_commands", ["train", "val", "test"], root, download=False, num_seen=2, num_unseen=2)
    fed = build_federated(ds, num_clients=4, partition="natural", partition_params={}, client_splits={},
                          unseen_fraction=0.0, streams=RunStreams(0),
                          source_splits={"train": "train", "val": "val", "test": "test"})
    assert fed.train_clients == [0, 1] and fed.unseen_clients == [2, 3]
    for client in fed.clients:
        assert client.meta["group"] == client.cid
        for split in ("train", "val", "test"):
            assert (ds.groups[client.splits[split]] == client.cid).all()
    with pytest.raises(ValueError, match="unseen_fraction to 0"):
        build_federated(ds, num_clients=4, partition="natural", partition_params={}, client_splits={},
                        unseen_fraction=0.25, streams=RunStreams(0),
                        source_splits={"train": "train", "val": "val", "test": "test"})


def test_features_are_a_224_image_of_128_frames_padded_with_normalised_zeros(root):
    ds = _load(root, "test")
    x, y = ds.batch(torch.arange(3))
    assert tuple(x.shape) == (3, 1, 224, 224) and ds.input_shape == (1, 224, 224)
    # a clip of 1,600 samples has 8 frames; frames 8..127 are zero rows, i.e. -mean / (2 std) after
    # normalisation, and stay so after the bilinear resize away from the border (rows >= 16 of 224)
    lengths, _ = split_rows(ds.x[:3])
    assert set(lengths.tolist()) <= {1600, 800}
    pad = (0 - FBANK_MEAN) / (2 * FBANK_STD)
    assert torch.allclose(x[:, 0, 20:], torch.full_like(x[:, 0, 20:], pad), atol=1e-6)
    assert not torch.allclose(x[:, 0, :8], torch.full_like(x[:, 0, :8], pad), atol=1e-3)


def test_fbank_equals_kaldi_native_fbank():
    knf = pytest.importorskip("kaldi_native_fbank")
    rng = np.random.default_rng(0)
    clips = [0.1 * rng.standard_normal(16000).astype(np.float32), 0.3 * rng.standard_normal(9000).astype(np.float32)]
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.window_type = "hanning"
    opts.mel_opts.num_bins = 80  # Kaldi refuses 128 bins on 512-point FFTs (an empty low filter)
    opts.use_energy = False
    lengths = torch.tensor([len(c) for c in clips])
    padded = torch.zeros(2, 16000)
    for i, c in enumerate(clips):
        padded[i, :len(c)] = torch.from_numpy(c)
    ours = kaldi_fbank(padded, lengths, num_bins=80)
    for i, clip in enumerate(clips):
        bank = knf.OnlineFbank(opts)
        bank.accept_waveform(16000, clip.tolist())
        bank.input_finished()
        ref = torch.tensor(np.stack([bank.get_frame(t) for t in range(bank.num_frames_ready)]))
        assert ref.shape[0] == {16000: 98, 9000: 54}[len(clip)]
        assert torch.allclose(ours[i, :len(ref)], ref, atol=1e-3)
        assert (ours[i, len(ref):] == 0).all()


def _augment(noise_len=50):
    noise = torch.arange(1.0, noise_len + 1).unsqueeze(0).repeat(2, 1)
    noise[1] *= -1
    return SpeechAugment(noise, torch.tensor([noise_len, noise_len - 10]), max_shift=5)


def test_time_shift_delays_behind_zeros_or_drops_the_start_and_shortens():
    aug = _augment()
    wave = torch.arange(1.0, 21.0).repeat(2, 1)
    wave = torch.cat([wave, torch.zeros(2, 10)], dim=1)
    rows = join_rows(torch.tensor([20, 20]), wave)
    draws = SpeechDraws(shift=torch.tensor([3, -4]), blend=torch.tensor([False, False]),
                        volume=torch.zeros(2), noise=torch.tensor([0, 0]), offset=torch.zeros(2))
    lengths, out = split_rows(aug.apply(rows, draws))
    assert lengths.tolist() == [20, 16]
    assert out[0, :20].tolist() == [0, 0, 0] + list(range(1, 18)) and (out[0, 20:] == 0).all()
    assert out[1, :16].tolist() == list(range(5, 21)) and (out[1, 16:] == 0).all()


def test_noise_blend_mixes_a_cut_of_the_chosen_file_at_the_drawn_volume():
    aug = _augment()
    rows = join_rows(torch.tensor([10, 10]), torch.ones(2, 12))
    # file 1 (length 40), room 40 - 10 = 30: offset 0.5 -> start 15, i.e. samples -(16..25)
    draws = SpeechDraws(shift=torch.tensor([0, 0]), blend=torch.tensor([True, False]),
                        volume=torch.tensor([0.25, 0.25]), noise=torch.tensor([1, 1]), offset=torch.tensor([0.5, 0.5]))
    lengths, out = split_rows(aug.apply(rows, draws))
    assert torch.allclose(out[0, :10], 0.75 * 1 + 0.25 * -torch.arange(16.0, 26.0))
    assert (out[0, 10:] == 0).all() and (out[1, :10] == 1).all()
    many = aug.draw(4000, np.random.default_rng(0))
    assert many.shift.min() == -5 and many.shift.max() == 5
    assert 0.77 < many.blend.float().mean() < 0.83 and 0 <= many.volume.min() and many.volume.max() < 0.1


def test_augmented_clips_give_features_of_the_same_shape(root):
    ds = _load(root, "train")
    aug = SpeechAugment(ds.extras["noise"], ds.extras["noise_lengths"])
    rows, _ = ds.raw_batch(torch.arange(4))
    out = ds.to_inputs(aug.apply(rows, aug.draw(4, np.random.default_rng(1))))
    assert out.shape == (4, 1, 224, 224) and torch.isfinite(out).all()
    assert not torch.allclose(out, ds.to_inputs(rows))


def test_a_speech_run_trains_resnet18_audio_on_the_seen_speakers(root):
    from pfl_core.config import RunConfig
    from pfl_core.experiment import run_experiment

    cfg = RunConfig.from_dict({
        "data": {"dataset": "speech_commands", "num_clients": 4, "unseen_fraction": 0.0, "client_splits": {},
                 "params": {"num_seen": 2, "num_unseen": 2},
                 "source_splits": {"train": "train", "val": "val", "test": "test"}, "partition": {"name": "natural"}},
        "model": {"name": "resnet18_audio", "params": {"width": 4}},
        "method": {"name": "fedavg", "params": {"lr": 0.01, "local_steps": 1}},
        "federation": {"rounds": 1, "clients_per_round": 2, "batch_size": 4},
        "evaluation": {"protocol": "seen"}})
    result = run_experiment(cfg, device="cpu", data_dir=str(root))
    assert np.isfinite(result.metrics["train_loss"]) and 0 <= result.metrics["acc"] <= 1
    assert sorted(c["cid"] for c in result.clients) == [0, 1]  # the seen pool; 2 and 3 are unseen


def test_the_background_noise_moves_with_the_dataset(root):
    ds = _load(root, "val")
    moved = ds.to("meta")
    assert moved.extras["noise"].device.type == "meta" and moved.x.device.type == "meta"
    assert ds.extras["noise"].device.type == "cpu"  # the original is left alone
