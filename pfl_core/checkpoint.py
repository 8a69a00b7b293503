"""Checkpoints of a federation: everything a run needs to continue from round r exactly as if it
had never stopped.

A checkpoint holds the server state, every client's persistent state (personal models, optimiser
moments, cluster ids), every batch stream (generator state, current order, cursor), the client
sampler's generator, the history and sampled clients so far, the model's buffers and the global
torch/numpy/random generators. Evaluation contexts are rebuilt from the run seed at each
evaluation, so they need nothing. A run resumed from a checkpoint therefore gives bit-identical
numbers to an uninterrupted one on the same machine (tests/test_checkpoint.py).

A checkpoint also holds the wall-clock seconds its run had spent when it was saved (``elapsed_s``,
summed over the processes before): a resumed run's ``wall_s`` is its whole compute time, the rounds
lost to the kill (after the last checkpoint) not counted; ``wall_s_before_resume`` in its ``info``
is the part from earlier processes (None when the checkpoint predates the field).

Files are written atomically (:func:`pfl_core.atomic_file.atomic_path`): a kill during a save leaves
the previous checkpoint intact. :func:`request_save` asks the runs of this process for one more
save at the end of their current round, whatever ``every`` (``pflbench run`` calls it on SIGUSR1:
a scheduler's warning before a preemption, or the end of a working session). A checkpoint cut short anyway (a full disk, a bad copy) is named in
one logged warning and in the run's ``info`` (``checkpoint_discarded``), and the run starts again. Runs in lockstep are saved together at the same round; they resume
only if every one of them has a checkpoint of the same round (else all start again).
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pfl_core.atomic_file import atomic_path, remove_stale
from pfl_core.batching import BatchStream

FORMAT = 1
_log = logging.getLogger(__name__)


class _SaveRequest:
    """A flag a signal handler may set: a plain attribute (a lock such as ``threading.Event``'s could
    be held by the very thread the handler interrupts)."""

    pending = False


def request_save() -> None:
    """Ask every run in this process to save a checkpoint after its current round, even between two
    ``every``; the next save clears the request (logged in one warning). Only sets a flag: safe in a
    signal handler."""
    _SaveRequest.pending = True


def _stream_state(stream: BatchStream) -> dict:
    return {"generator": stream.generator.get_state(), "batches": stream._batches, "cursor": stream._cursor}


def _load_stream(stream: BatchStream, state: dict) -> None:
    stream.generator.set_state(state["generator"])
    stream._batches = [b.to(stream.index.device) for b in state["batches"]]
    stream._cursor = state["cursor"]


def federation_state(federation) -> dict:
    """The state of a :class:`pfl_core.federation.Federation` after its last finished round."""
    result = federation.result
    return {
        "server": result.server,
        "history": result.history,
        "sampled": result.sampled,
        "stopped_round": result.stopped_round,
        "sampler": federation.sampler.rng.bit_generator.state,
        "clients": {cid: {"state": ctx.state, "streams": {name: _stream_state(s) for name, s in ctx.streams.items()},
                          **({} if ctx.augment is None else {"augment": ctx.augment.generator.get_state()})}
                    for cid, ctx in federation.contexts.items()},
        "buffers": {name: b.detach().clone() for name, b in federation.algorithm.model.named_buffers()},
    }


def load_federation_state(federation, state: dict, device: torch.device) -> None:
    result = federation.result
    result.server, result.history, result.sampled = _to(state["server"], device), state["history"], state["sampled"]
    result.stopped_round = state.get("stopped_round")  # early stopping (absent from older checkpoints)
    federation.sampler.rng.bit_generator.state = state["sampler"]
    for cid, saved in state["clients"].items():
        ctx = federation.contexts[cid]
        ctx.state.clear()
        ctx.state.update(_to(saved["state"], device))
        for name, stream in saved["streams"].items():
            _load_stream(ctx.streams[name], stream)
        if "augment" in saved:  # data.augment: the generator of the training batches' draws
            ctx.augment.generator.set_state(saved["augment"])
    buffers = dict(federation.algorithm.model.named_buffers())
    for name, value in state["buffers"].items():
        buffers[name].copy_(value)


@dataclass
class Checkpointing:
    """Save runs in lockstep every ``every`` rounds to ``paths`` (one file per run), and resume them."""

    paths: list[Path]
    every: int
    discarded: str | None = None
    """Why a checkpoint found was not resumed from (cut short, unreadable), set by :meth:`available`."""
    clock_start: float | None = None
    """``time.perf_counter()`` when this process started the runs (set by the caller): saves add the
    seconds since then to :attr:`before_s`."""
    before_s: float | None = 0.0
    """Wall-clock seconds the runs spent in earlier processes, up to the checkpoint restored (0 for a
    fresh start; None: restored from a checkpoint without ``elapsed_s``)."""

    def __post_init__(self):
        if self.every < 1:
            raise ValueError(f"checkpoint every must be >= 1 round, got {self.every}")
        self.paths = [Path(p) for p in self.paths]

    def available(self) -> list[dict] | None:
        """The saved states of every run, if all exist at the same round; else None. A run starting
        removes the temporary files of a save killed midway (:func:`remove_stale`)."""
        for path in self.paths:
            remove_stale(path)
        if not all(p.is_file() for p in self.paths):
            return None
        states = []
        for path in self.paths:
            try:
                states.append(torch.load(path, map_location="cpu", weights_only=False))
            except Exception as err:  # noqa: BLE001 - a truncated or foreign file: named, then start again
                first = (str(err).splitlines() or [""])[0].split(". ")[0]
                self.discarded = (f"checkpoint {path} is cut short or unreadable ({path.stat().st_size} bytes; "
                                  f"{type(err).__name__}: {first}); the run starts again from round 0")
                _log.warning(self.discarded)
                return None
        if len({(s.get("format"), s.get("next_round")) for s in states}) != 1 or states[0].get("format") != FORMAT:
            return None
        return states

    def restore(self, federations: list, states: list[dict], device: torch.device) -> int:
        """Load ``states`` (from :meth:`available`) into ``federations``; return the round to
        continue from."""
        for federation, state in zip(federations, states):
            load_federation_state(federation, state["federation"], device)
        torch.set_rng_state(states[0]["torch_rng"])
        np.random.set_state(states[0]["numpy_rng"])
        random.setstate(states[0]["python_rng"])
        self.before_s = states[0].get("elapsed_s")
        return int(states[0]["next_round"])

    def due(self, round_idx: int, rounds: int) -> bool:
        """Save after ``round_idx`` (0-based)? Every ``every`` rounds, and after a round that ends
        with a save requested (:func:`request_save`); never after the last one."""
        return round_idx + 1 < rounds and ((round_idx + 1) % self.every == 0 or _SaveRequest.pending)

    def elapsed_s(self) -> float | None:
        """The runs' wall-clock seconds so far, earlier processes included (None: unknown)."""
        if self.before_s is None or self.clock_start is None:
            return None
        return self.before_s + time.perf_counter() - self.clock_start

    def save(self, federations: list, round_idx: int) -> None:
        requested, _SaveRequest.pending = _SaveRequest.pending, False
        common = {"format": FORMAT, "next_round": round_idx + 1, "torch_rng": torch.get_rng_state(),
                  "numpy_rng": np.random.get_state(), "python_rng": random.getstate(),
                  "elapsed_s": self.elapsed_s()}
        for federation, path in zip(federations, self.paths):
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                torch.save({**common, "federation": federation_state(federation)}, tmp)
        if requested:
            _log.warning("checkpoint saved on request after round %d: %s", round_idx + 1,
                         ", ".join(str(p) for p in self.paths))


def _to(value, device: torch.device):
    """``value`` with every tensor moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value
