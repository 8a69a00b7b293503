"""What a worker process runs: :func:`execute_specs`, one run or the seeds of a cell in lockstep.

Kept apart from :mod:`benchmarks.running.sweep` so that a spawned worker (``--jobs N``, a Ray task)
imports only the core and this module, never MLflow: the parent alone writes to the store, and
MLflow's import costs each worker seconds of start-up (``make demo`` starts two).

Threads: every run computes with ``torch.set_num_threads(T)``, ``T = --threads``, by default
:data:`DEFAULT_THREADS` (1), and NumPy's BLAS (the offline data generators) is held to the same
count: see :mod:`benchmarks.running.sweep`.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from threadpoolctl import threadpool_limits
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from benchmarks.suite.spec import RunSpec
from pfl_core.checkpoint import Checkpointing
from pfl_core.config import RunConfig
from pfl_core.experiment import run_experiment, run_experiments
from pfl_core.federation import DivergenceError
from pfl_core.pretrained import Provider, to_device
from pfl_core.seeding import use_deterministic

KILL_HOOK_ENV = "PFLBENCH_TEST_KILL_DIR"
"""Test hook (tests/test_ray.py, tests/test_reliability.py): when this names a folder holding a file
named after a run's config hash, the worker that starts that run deletes the file and kills itself
(SIGKILL), as a worker lost mid-run; the run's next attempt runs normally. A file ``<hash>.always``
kills every attempt, ``<hash>.round<N>`` kills it after round N, and ``<hash>.save<N>`` sends it
SIGUSR1 after round N instead (a checkpoint on request). Inert when unset."""

DEFAULT_THREADS = 1
"""Torch intra-op threads of every run unless ``--threads``: fixed, so that the numbers of a run do
not depend on ``--jobs`` (issue 15, item 3). Use ``--jobs`` to fill the cores."""

def _kill_hook(spec: RunSpec, after_round: int | None = None) -> None:
    """The test hook of :data:`KILL_HOOK_ENV`: before a run (``after_round`` None) or after its
    round ``after_round`` (a file ``<hash>.round<N>``, or ``<hash>.save<N>`` for SIGUSR1)."""
    folder = os.environ.get(KILL_HOOK_ENV)
    if not folder:
        return
    if after_round is None and os.path.exists(os.path.join(folder, spec.config_hash + ".always")):
        os.kill(os.getpid(), signal.SIGKILL)
    save = os.path.join(folder, f"{spec.config_hash}.save{after_round}")
    if after_round is not None and os.path.exists(save):
        os.remove(save)
        os.kill(os.getpid(), signal.SIGUSR1)
    name = spec.config_hash if after_round is None else f"{spec.config_hash}.round{after_round}"
    try:
        os.remove(os.path.join(folder, name))
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class CheckpointPlan:
    """Where and how often runs save their federation state (``--checkpoint-every``,
    ``--checkpoint-dir``): ``<folder>/<config hash>.pt``, every ``every`` rounds (0: never). A run
    with a checkpoint resumes from it; the parent deletes it once the run is logged."""

    folder: str
    every: int = 0

    def path(self, spec: RunSpec) -> Path:
        return Path(self.folder) / f"{spec.config_hash}.pt"

    def for_runs(self, specs: list[RunSpec]) -> Checkpointing | None:
        return Checkpointing([self.path(s) for s in specs], self.every) if self.every else None

    def discard(self, spec: RunSpec) -> None:
        self.path(spec).unlink(missing_ok=True)


class WorkerArgs(NamedTuple):
    """The arguments of :func:`execute_specs` after the specs that a sweep gives every unit of work."""

    device: str
    data_dir: str | None
    threads: int
    progress: bool
    execution: str
    checkpoints: CheckpointPlan | None
    deterministic: bool
    allow_tf32: bool = False


def _failure(started: float, err: BaseException) -> dict:
    if isinstance(err, DivergenceError):
        return {"started": started, "ended": time.time(), "error": f"diverged: {err}"}
    return {"started": started, "ended": time.time(), "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc()}


def _outcome(started: float, result, spec: RunSpec) -> dict:
    """A run's picklable outcome; a stage-1 run's (``spec.stage``) carries its final state on the CPU."""
    if spec.stage and result.final_state is None:
        return {"started": started, "ended": time.time(), "error": f"method {spec.method} keeps no global model "
                f"(server 'params'), so it cannot be the stage 1 of model.pretrained; pretrain with e.g. fedavg"}
    state = to_device(result.final_state, "cpu") if spec.stage else None
    return {"started": started, "state": state, "ended": time.time(), "metrics": result.metrics,
            "history": result.history, "clients": result.clients, "curve_mean": result.curve_mean,
            "curve_weighted": result.curve_weighted, "arrays": result.arrays,
            "info": {**result.info, "torch_threads": torch.get_num_threads(),
                     "deterministic": torch.are_deterministic_algorithms_enabled()}}


def ready() -> int:
    """A worker's first call from :meth:`benchmarks.running.executors.LocalExecutor.start`: unpickling it
    imports this module and the core, so the first run starts at once. Returns the worker's pid."""
    return os.getpid()


def execute_specs(specs: list[RunSpec], device: str, data_dir: str | None, threads: int = DEFAULT_THREADS,
                  progress: bool = False, execution: str = "auto",
                  checkpoints: CheckpointPlan | None = None, deterministic: bool = False,
                  allow_tf32: bool = False, pretrained: Provider | None = None) -> list[dict]:
    """Run specs that differ only in their seed - in lockstep when there are several
    (:func:`pfl_core.experiment.run_experiments`) - with ``threads`` torch threads, and return one
    picklable outcome (metrics, history, clients) or error per spec. A group that fails is rerun
    one spec at a time, so that one diverging seed fails alone. ``checkpoints``: save and resume
    (:class:`CheckpointPlan`). ``deterministic``: :func:`pfl_core.seeding.use_deterministic` in this
    process first (recorded in ``run_info.json`` and the run's tags). ``allow_tf32``: TF32 on a CUDA
    device (``--allow-tf32``; off by default, :mod:`pfl_core.engine.device`). ``pretrained``: the provider
    of ``model.pretrained`` states (:mod:`benchmarks.running.stages`: the stored stage-1 runs)."""
    before, was_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    if deterministic:
        use_deterministic(True)
    try:
        # NumPy's BLAS (the offline generators: Synthetic's 100 multivariate normals) gets the same
        # count: its default, one thread per core, spins against the other workers (4x the CPU
        # time of one thread in `make demo`) for the same numbers
        with threadpool_limits(threads, user_api="blas"):
            return _execute(specs, device, data_dir, threads, progress, execution, checkpoints, pretrained,
                            allow_tf32)
    finally:  # a run in this process leaves the caller's settings as they were
        torch.set_num_threads(before)
        if deterministic and not was_deterministic:
            torch.use_deterministic_algorithms(False)


def _execute(specs: list[RunSpec], device: str, data_dir: str | None, threads: int, progress: bool,
             execution: str, checkpoints: CheckpointPlan | None, pretrained: Provider | None,
             allow_tf32: bool = False) -> list[dict]:
    for spec in specs:
        _kill_hook(spec)
    saving = checkpoints.for_runs(specs) if checkpoints else None
    started = time.time()
    cfgs = [RunConfig.from_dict(spec.config) for spec in specs]
    seeds = ",".join(str(spec.seed) for spec in specs)
    bar = tqdm(total=cfgs[0].federation.rounds, desc=f"  {specs[0].cell_id} seed={seeds}", leave=False,
               disable=not progress)

    def on_round(round_idx: int, metrics: dict) -> None:
        if bar.n < round_idx:  # resumed from a checkpoint: the bar starts at that round, its rate after it
            bar.initial = bar.n = bar.last_print_n = round_idx
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train_loss']:.3f}")
        _kill_hook(specs[0], after_round=round_idx + 1)

    try:
        with logging_redirect_tqdm(tqdm_class=type(bar)) if progress else contextlib.nullcontext():
            results = _compute(specs, cfgs, device, data_dir, on_round, execution, saving, pretrained, allow_tf32)
    except Exception as err:  # noqa: BLE001 - any crash of one run must not end the sweep
        if len(specs) > 1:
            bar.close()
            return [_execute([spec], device, data_dir, threads, progress, execution, checkpoints, pretrained,
                             allow_tf32)[0] for spec in specs]
        return [_failure(started, err)]
    finally:
        bar.close()
    return [_outcome(started, result, spec) for result, spec in zip(results, specs)]


def _compute(specs, cfgs, device, data_dir, on_round, execution, saving, pretrained, allow_tf32) -> list:
    """The runs of ``specs``: one alone, several in lockstep."""
    kwargs = dict(device=device, data_dir=data_dir, on_round=on_round, execution=execution,
                  checkpointing=saving, pretrained=pretrained, allow_tf32=allow_tf32)
    if len(specs) == 1:
        return [run_experiment(cfgs[0], **kwargs)]
    return run_experiments(cfgs, **kwargs)
