"""Speech Commands v2, 12 classes, speakers as clients (fedl2p.md, "Speech Commands V2").

On disk: the official archive unpacked as ``<data dir>/speech_commands_v0.02/``: one folder per word
of ``<speaker>_nohash_<k>.wav`` (16 kHz 16-bit PCM mono), ``validation_list.txt`` and
``testing_list.txt`` (``<word>/<file>.wav`` per line), and ``_background_noise_/`` with the six noise
recordings. Never downloaded (2.3 GB).

Clients, as the FedL2P code builds them (``get_speechcommands_and_partition_it``):

* a speaker is a validation/test speaker when its first file (sorted paths) is in one of the lists,
  else a training speaker; the **seen pool** is the ``num_seen`` (250) training speakers with the
  most training files, the **unseen pool** the ``num_unseen`` (50) validation+test speakers with the
  most files (ties keep the order of first appearance: a stable sort);
* per client and per word: 20% test (n - int(0.8 n)), then of the rest int(0.8 m) train and the
  remainder val, after a shuffle. The code's shuffle is ``np.random.default_rng()`` without a seed,
  so its split cannot be reproduced: here ``default_rng(split_seed)`` (one generator over clients
  and words in order), fedl2p.md difference 12, logged in the dataset description;
* labels: the 10 words, every other word ``unknown`` (10), and ``silence`` (11): each client split
  gets int(0.1 n) extra one-second clips cut from a background-noise file. The code cuts a fresh
  random clip at every access; here each silence clip is cut once, by ``default_rng([split_seed, k])``
  for split k = 1, 2, 3 (train, val, test).

Rows are the waveforms (:mod:`pfl_core.data.audio`: float32 (N, 1 + 16000), the clip length first);
``inputs`` turns a batch (``batch``, or ``raw_batch`` then augmentation then ``to_inputs``) into
the (N, 1, 224, 224) fbank image, ``extras`` holds the background noise for
:class:`pfl_core.data.audio.SpeechAugment`. ``groups`` is the client: seen speakers 0..249,
unseen 250..299 (``unseen_groups``: the builder makes them the run's unseen clients). Use the
``natural`` partitioner with ``num_clients`` = 300 and ``data.source_splits: {train: train, val:
val, test: test}``.
"""
from __future__ import annotations

import wave
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from pfl_core.data.audio import CLIP, SAMPLE_RATE, join_rows, speech_features
from pfl_core.fields import NonNegativeInt, Probability
from pfl_core.data.datasets import DATASETS, DatasetNotFoundError
from pfl_core.data.federated import ArrayDataset

FOLDER = "speech_commands_v0.02"
NOISE_FOLDER = "_background_noise_"
HASH_DIVIDER = "_nohash_"
WORDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
CLASSES = WORDS + ("unknown", "silence")
NOISE_FILES = ("doing_the_dishes.wav", "dude_miaowing.wav", "exercise_bike.wav", "pink_noise.wav",
               "running_tap.wav", "white_noise.wav")
"""The code's ``BKG_NOISE``, in its order."""


def read_wav(path: Path) -> np.ndarray:
    """A 16-bit PCM mono WAV as float32 in [-1, 1) (torchaudio.load's scaling: / 32768)."""
    with wave.open(str(path), "rb") as f:
        if f.getsampwidth() != 2 or f.getnchannels() != 1 or f.getframerate() != SAMPLE_RATE:
            raise DatasetNotFoundError(f"{path}: expected 16 kHz 16-bit mono PCM, got {f.getframerate()} Hz, "
                                       f"{8 * f.getsampwidth()} bit, {f.getnchannels()} channel(s)")
        return np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").astype(np.float32) / 32768.0


def _speaker(rel: str) -> str:
    return Path(rel).name.split(HASH_DIVIDER)[0]


def _scan(root: Path) -> tuple[list[str], set[str], set[str]]:
    """(sorted ``word/file.wav`` of every utterance, validation list, testing list)."""
    lists = [root / "validation_list.txt", root / "testing_list.txt"]
    if not root.is_dir() or not all(p.is_file() for p in lists):
        raise DatasetNotFoundError(
            f"Speech Commands v2 not found under {root.parent} (expected {root}/<word>/<speaker>_nohash_<k>.wav, "
            f"validation_list.txt, testing_list.txt and {NOISE_FOLDER}/); unpack speech_commands_v0.02.tar.gz "
            f"into {root}, or set PFL_DATA_DIR / --data-dir")
    files = sorted(p.relative_to(root).as_posix() for p in root.glob("*/*.wav")
                   if p.parent.name != NOISE_FOLDER and HASH_DIVIDER in p.name)
    val, test = ({line.strip() for line in p.read_text().splitlines() if line.strip()} for p in lists)
    return files, val, test


def speaker_pools(files: list[str], val: set[str], test: set[str], num_seen: int,
                  num_unseen: int) -> tuple[list[list[str]], list[list[str]]]:
    """The files of the seen and the unseen speakers, most files first (module docstring)."""
    first: dict[str, str] = {}
    by_speaker: dict[str, list[str]] = defaultdict(list)
    for rel in files:
        first.setdefault(_speaker(rel), rel)
        by_speaker[_speaker(rel)].append(rel)
    held = val | test
    train_ids = [s for s, rel in first.items() if rel not in held]
    unseen_ids = [s for s, rel in first.items() if rel in val] + [s for s, rel in first.items() if rel in test]
    seen = sorted(([f for f in by_speaker[s] if f not in held] for s in train_ids), key=len, reverse=True)
    unseen = sorted(([f for f in by_speaker[s] if f in held] for s in unseen_ids), key=len, reverse=True)
    if len(seen) < num_seen or len(unseen) < num_unseen:
        raise ValueError(f"speech_commands: {len(seen)} training and {len(unseen)} validation/test speakers "
                         f"found, fewer than num_seen={num_seen} / num_unseen={num_unseen}")
    return seen[:num_seen], unseen[:num_unseen]


def client_split(files: list[str], rng: np.random.Generator) -> dict[str, list[str]]:
    """One client's ``train``/``val``/``test`` files: per word 20% test, then 80/20 train/val."""
    per_word: dict[str, list[str]] = defaultdict(list)
    for rel in files:
        per_word[rel.split("/")[0]].append(rel)
    out: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    for word_files in per_word.values():
        n = len(word_files)
        test_size = n - int(0.8 * n)
        val_size = n - test_size - int(0.8 * (n - test_size))
        order = list(word_files)
        rng.shuffle(order)
        out["test"] += order[:test_size]
        out["val"] += order[test_size:test_size + val_size]
        out["train"] += order[test_size + val_size:]
    return {k: sorted(v) for k, v in out.items()}


def _label(rel: str) -> int:
    word = rel.split("/")[0]
    return CLASSES.index(word) if word in WORDS else CLASSES.index("unknown")


def _silence(noise: list[np.ndarray], count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` one-second cuts, each of a random background file at a random offset."""
    cuts = []
    for _ in range(count):
        clip = noise[int(rng.integers(len(noise)))]
        start = int(rng.integers(0, len(clip) - CLIP + 1))
        cuts.append(clip[start:start + CLIP])
    return cuts


def _rows(clips: list[np.ndarray]) -> torch.Tensor:
    lengths = torch.tensor([min(len(c), CLIP) for c in clips], dtype=torch.int64)
    padded = np.zeros((len(clips), CLIP), dtype=np.float32)
    for i, c in enumerate(clips):
        padded[i, :min(len(c), CLIP)] = c[:CLIP]
    return join_rows(lengths, torch.from_numpy(padded))


@DATASETS.register("speech_commands")
def speech_commands(data_dir: Path, split: str, download: bool, num_seen: NonNegativeInt = 250,
                    num_unseen: NonNegativeInt = 50, split_seed: NonNegativeInt = 0,
                    silence_fraction: Probability = 0.1) -> ArrayDataset:
    """Speech Commands v2 as FedL2P's clients (module docstring): ``split`` of every client of the
    seen then the unseen pool (``all`` = train, val, test), 12 classes, rows = waveforms.

    ``num_seen`` / ``num_unseen``: the pools (250 / 50); ``split_seed``: the seeded shuffle that
    replaces the code's unseeded one (difference 12); ``silence_fraction``: the code's extra 10%
    of silence clips per client split."""
    root = data_dir / FOLDER
    files, val, test = _scan(root)
    noise = []
    for name in NOISE_FILES:
        if not (root / NOISE_FOLDER / name).is_file():
            raise DatasetNotFoundError(f"Speech Commands v2: background noise {root / NOISE_FOLDER / name} missing; "
                                       "unpack the whole archive")
        noise.append(read_wav(root / NOISE_FOLDER / name))
    seen, unseen = speaker_pools(files, val, test, num_seen, num_unseen)
    rng = np.random.default_rng(split_seed)
    parts = ("train", "val", "test") if split == "all" else (split,)
    per_client = [client_split(f, rng) for f in seen + unseen]
    silence_rng = {p: np.random.default_rng([split_seed, k]) for k, p in enumerate(("train", "val", "test"), 1)}
    clips: list[np.ndarray] = []
    labels: list[int] = []
    groups: list[int] = []
    for part in parts:
        for client, own in enumerate(per_client):
            extra = _silence(noise, int(len(own[part]) * silence_fraction), silence_rng[part])
            clips += [read_wav(root / rel) for rel in own[part]] + extra
            labels += [_label(rel) for rel in own[part]] + [CLASSES.index("silence")] * len(extra)
            groups += [client] * (len(own[part]) + len(extra))
    longest = max(len(n) for n in noise)
    noise_rows = torch.zeros(len(noise), longest)
    for i, n in enumerate(noise):
        noise_rows[i, :len(n)] = torch.from_numpy(n)
    return ArrayDataset(
        name="speech_commands", x=_rows(clips), y=torch.tensor(labels, dtype=torch.int64),
        num_classes=len(CLASSES), groups=torch.tensor(groups, dtype=torch.int64), inputs=speech_features,
        extras={"noise": noise_rows, "noise_lengths": torch.tensor([len(n) for n in noise])},
        unseen_groups=tuple(range(len(seen), len(seen) + len(unseen))),
        description=(f"Speech Commands v2 {split} split ({root}; {len(seen)} seen + {len(unseen)} unseen speakers, "
                     f"per-word 20% test then 80/20 train/val shuffled by default_rng({split_seed}) where the "
                     f"code's shuffle is unseeded; {silence_fraction:g} extra silence clips; Kaldi fbank 128 x 128 "
                     "-> 224 x 224)"),
    )


speech_commands.splits = ("train", "val", "test", "all")
