"""Speech Commands features and augmentation as batched tensor code (fedl2p.md, "Speech Commands V2").

Stored rows (``speech_commands`` loader): float32 ``(N, 1 + 16000)``, column 0 the clip's length in
samples, then the waveform in [-1, 1] zero-padded to one second (:func:`split_rows`).

Features, as the FedL2P code's ``_wav2fbank`` and ``raw_audio_to_AST_spectrogram``:

1. Kaldi filter-bank energies of ``torchaudio.compliance.kaldi.fbank(waveform, htk_compat=True,
   sample_frequency=16000, use_energy=False, window_type='hanning', num_mel_bins=128, dither=0.0,
   frame_shift=10)`` (25 ms frames, pre-emphasis 0.97, DC offset removed, 512-point FFT power
   spectrum, 128 triangular mel bins over 20 Hz - 8 kHz, log floored at float32 epsilon). torchaudio
   does not import next to the PyTorch this project installs (its last release is built for older
   CUDA and torch versions), so :func:`kaldi_fbank` computes the same thing here, on a batch and on
   any device; the tests check it against ``kaldi-native-fbank`` (k2-fsa's C++ Kaldi front end);
2. pad with zero rows or crop to 128 frames (a clip shorter than one second has fewer frames);
3. ``(x + 4.2677393) / (2 * 4.5689974)``;
4. ``Resize((224, 224))`` of the (time, mel) image (bilinear), one channel: (N, 1, 224, 224).

Augmentation of training clips (``_apply_time_shift`` then ``_blend_with_background``), split into a
host-side :meth:`SpeechAugment.draw` and a pure :meth:`SpeechAugment.apply` on stored rows (before
the features): a shift s ~ U{-1600..1600} samples (+-100 ms; s < 0 drops the first |s| samples and
shortens the clip, s > 0 delays it behind s zeros), then with probability 0.8 a blend
``(1 - v) w + v n`` with v ~ U(0, 0.1) and n a random cut of one of the background-noise files as
long as the (shifted) clip.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

SAMPLE_RATE = 16000
CLIP = SAMPLE_RATE
"""Samples of one stored clip (one second)."""
FRAME_LENGTH, FRAME_SHIFT, FFT_SIZE = 400, 160, 512
NUM_MEL_BINS = 128
TARGET_FRAMES = 128
FBANK_MEAN, FBANK_STD = -4.2677393, 4.5689974
IMAGE_SIZE = 224


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths int64 (N,), waveforms (N, 16000)) of stored rows."""
    return rows[:, 0].round().long(), rows[:, 1:]


def join_rows(lengths: torch.Tensor, waveforms: torch.Tensor) -> torch.Tensor:
    """Stored rows of clips: each waveform zeroed from its length on."""
    keep = torch.arange(waveforms.shape[1], device=waveforms.device) < lengths.unsqueeze(1)
    return torch.cat([lengths.to(waveforms.dtype).unsqueeze(1), waveforms * keep], dim=1)


def _mel(freq: torch.Tensor | float) -> torch.Tensor | float:
    return 1127.0 * (torch.log1p(freq / 700.0) if isinstance(freq, torch.Tensor) else math.log1p(freq / 700.0))


def mel_banks(num_bins: int = NUM_MEL_BINS, low_freq: float = 20.0, device=None, dtype=torch.float32) -> torch.Tensor:
    """Kaldi's triangular mel filters (num_bins, FFT_SIZE // 2 + 1), the last (Nyquist) column 0."""
    mel_low, mel_high = _mel(low_freq), _mel(SAMPLE_RATE / 2)
    delta = (mel_high - mel_low) / (num_bins + 1)
    b = torch.arange(num_bins, device=device, dtype=dtype).unsqueeze(1)
    left, center, right = mel_low + b * delta, mel_low + (b + 1) * delta, mel_low + (b + 2) * delta
    mel = _mel(SAMPLE_RATE / FFT_SIZE * torch.arange(FFT_SIZE // 2, device=device, dtype=dtype)).unsqueeze(0)
    up, down = (mel - left) / (center - left), (right - mel) / (right - center)
    return F.pad(torch.clamp(torch.minimum(up, down), min=0.0), (0, 1))


def num_frames(lengths: torch.Tensor) -> torch.Tensor:
    """Kaldi's frame count with ``snip_edges``: 1 + (n - 400) // 160 (0 below one frame)."""
    return torch.where(lengths >= FRAME_LENGTH, 1 + (lengths - FRAME_LENGTH) // FRAME_SHIFT, 0)


def kaldi_fbank(waveforms: torch.Tensor, lengths: torch.Tensor, num_bins: int = NUM_MEL_BINS) -> torch.Tensor:
    """Log mel filter-bank energies (N, 98, num_bins) of one-second ``waveforms`` (N, 16000); frames at
    or beyond a clip's own frame count (:func:`num_frames` of ``lengths``) are 0. With 128 bins the
    lowest filters hold no FFT bin (Kaldi itself refuses: "num_mel_bins too large"); like torchaudio,
    their energy is 0 and their log the floor."""
    frames = waveforms.unfold(1, FRAME_LENGTH, FRAME_SHIFT)  # (N, T, 400)
    frames = frames - frames.mean(dim=2, keepdim=True)
    previous = torch.cat([frames[..., :1], frames[..., :-1]], dim=2)
    frames = frames - 0.97 * previous
    window = torch.hann_window(FRAME_LENGTH, periodic=False, device=waveforms.device, dtype=waveforms.dtype)
    spectrum = torch.fft.rfft(frames * window, n=FFT_SIZE).abs().pow(2.0)
    energies = spectrum @ mel_banks(num_bins, device=waveforms.device, dtype=waveforms.dtype).T
    eps = torch.finfo(torch.float32).eps
    logs = torch.clamp(energies, min=eps).log()
    valid = torch.arange(logs.shape[1], device=logs.device) < num_frames(lengths).unsqueeze(1)
    return logs * valid.unsqueeze(2)


def speech_features(rows: torch.Tensor) -> torch.Tensor:
    """Model inputs (N, 1, 224, 224) of stored rows (module docstring, steps 1-4)."""
    lengths, waveforms = split_rows(rows)
    bank = kaldi_fbank(waveforms, lengths)
    bank = F.pad(bank, (0, 0, 0, max(TARGET_FRAMES - bank.shape[1], 0)))[:, :TARGET_FRAMES]
    image = ((bank - FBANK_MEAN) / (2 * FBANK_STD)).unsqueeze(1)
    return F.interpolate(image, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)


class SpeechDraws(NamedTuple):
    """Host-side draws of :class:`SpeechAugment` for a batch of n clips (CPU tensors; a tuple of
    equally long tensors like :class:`~pfl_core.data.augment.crop_flip.CropFlip`, so the engine
    stacks and reshapes either the same way)."""

    shift: torch.Tensor      # int64 (n,), in [-max_shift, max_shift]
    blend: torch.Tensor      # bool (n,)
    volume: torch.Tensor     # float (n,), in [0, max_volume)
    noise: torch.Tensor      # int64 (n,), which background file
    offset: torch.Tensor     # float (n,), in [0, 1): where the cut starts, as a share of the free room


@dataclass
class SpeechAugment:
    """The code's training augmentation of Speech Commands clips (module docstring).

    ``noise``: the background-noise waveforms, float (F, L_max) zero-padded, and ``noise_lengths``
    (F,) their lengths (the loader's ``extras``)."""

    noise: torch.Tensor
    noise_lengths: torch.Tensor
    max_shift: int = SAMPLE_RATE // 10
    """Time shift bound in samples (the code: ``sample_rate / 10``, +-100 ms)."""
    blend_probability: float = 0.8
    """``background_frequency`` of the code (HelloEdge's value)."""
    max_volume: float = 0.1
    """``background_volume`` of the code: v ~ U(0, max_volume)."""

    def draw(self, n: int, rng: np.random.Generator) -> SpeechDraws:
        """All randomness of one batch of ``n`` clips."""
        return SpeechDraws(
            shift=torch.from_numpy(rng.integers(-self.max_shift, self.max_shift + 1, n)),
            blend=torch.from_numpy(rng.random(n) < self.blend_probability),
            volume=torch.from_numpy(rng.uniform(0.0, self.max_volume, n)).float(),
            noise=torch.from_numpy(rng.integers(0, len(self.noise_lengths), n)),
            offset=torch.from_numpy(rng.random(n)).float(),
        )

    def apply(self, rows: torch.Tensor, draws: SpeechDraws) -> torch.Tensor:
        """Augmented stored rows (pure tensor code, any device; keep ``noise`` on the rows' device,
        e.g. from the dataset's ``extras`` after ``ArrayDataset.to``)."""
        device = rows.device
        lengths, waveforms = split_rows(rows)
        shift = draws.shift.to(device)
        t = torch.arange(waveforms.shape[1], device=device).unsqueeze(0)
        source = t - shift.unsqueeze(1)
        new_lengths = lengths - torch.clamp(-shift, min=0)
        inside = (source >= 0) & (source < lengths.unsqueeze(1)) & (t < new_lengths.unsqueeze(1))
        shifted = torch.gather(waveforms, 1, source.clamp(0, waveforms.shape[1] - 1)) * inside
        noise, noise_lengths = self.noise.to(device), self.noise_lengths.to(device)
        which = draws.noise.to(device)
        room = (noise_lengths[which] - new_lengths).clamp(min=0)
        start = torch.minimum((draws.offset.to(device) * (room + 1)).long(), room)
        cut = torch.gather(noise[which], 1, (start.unsqueeze(1) + t).clamp(max=noise.shape[1] - 1))
        volume = (draws.volume.to(device) * draws.blend.to(device)).unsqueeze(1).to(waveforms.dtype)
        blended = (1.0 - volume) * shifted + volume * cut
        return join_rows(new_lengths, blended)
