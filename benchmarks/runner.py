"""The suite runner: expand, skip what already FINISHED, run the rest, log every run.

Where runs execute is an *executor*; each yields every run's outcome as it completes and the
parent alone writes it to MLflow, so an interrupted sweep leaves no half-written run and resumes
where it stopped. A diverging run (NaN), a crashing run or a run whose worker died is logged as
FAILED with its reason and the sweep goes on.

:class:`LocalExecutor` (``--executor local``, the default)
    This process (``--jobs 1``, with a per-round progress bar) or a pool of ``--jobs N`` spawned
    worker processes on this machine, also N processes packed on one GPU with ``--device cuda``.
:class:`RayExecutor` (``--executor ray``)
    One Ray task per run, on a local Ray instance started here (``--jobs`` x ``--threads`` CPUs,
    shut down at the end) or on an existing cluster (``--address``). Each task reserves
    ``--threads`` CPUs and ``--gpus-per-run`` of a GPU (0.25: four runs share a GPU). A task whose
    worker died is retried ``--max-retries`` times, then its run is logged FAILED.

Threads: a worker runs ``torch.set_num_threads(T)`` with ``T = --threads``, by default
``max(1, cpu_count // jobs)`` so that N workers never oversubscribe the CPU, whether they compute
on it or only feed a GPU (one run in this process keeps torch's default unless ``--threads``; a Ray
cluster run defaults to 1). ``run_info.json`` records each run's ``torch_threads``.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm

from benchmarks.suite import RunSpec, Suite, SuiteError
from benchmarks.tracking import Tracker, command_line, git_state
from pfl_core.config import RunConfig
from pfl_core.experiment import run_experiment, run_experiments
from pfl_core.federation import DivergenceError

KILL_HOOK_ENV = "PFLBENCH_TEST_KILL_DIR"
"""Test hook (tests/test_ray.py): when this names a folder holding a file named after a run's config
hash, the worker that starts that run deletes the file and kills itself (SIGKILL), as a worker lost
mid-run; the run's next attempt runs normally. Inert when unset."""


@dataclass
class SweepSummary:
    total: int
    skipped: int
    finished: int
    failed: int
    wall_s: float
    parent_run_id: str | None = None
    """The sweep's parent MLflow run (:meth:`benchmarks.tracking.Tracker.start_sweep`)."""


class ExecutorError(SuiteError):
    """Bad executor options, Ray missing or unreachable; the message names the fix."""


def default_threads(jobs: int) -> int:
    """Torch threads per worker when ``jobs`` workers share this machine: cpu_count // jobs, >= 1."""
    return max(1, (os.cpu_count() or 1) // max(1, jobs))


def _kill_hook(spec: RunSpec) -> None:
    folder = os.environ.get(KILL_HOOK_ENV)
    if folder:
        try:
            os.remove(os.path.join(folder, spec.config_hash))
        except FileNotFoundError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def _failure(started: float, err: BaseException) -> dict:
    if isinstance(err, DivergenceError):
        return {"started": started, "ended": time.time(), "error": f"diverged: {err}"}
    return {"started": started, "ended": time.time(), "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc()}


def _outcome(started: float, result) -> dict:
    return {"started": started, "ended": time.time(), "metrics": result.metrics,
            "history": result.history, "clients": result.clients, "curve_mean": result.curve_mean,
            "curve_weighted": result.curve_weighted,
            "info": {**result.info, "torch_threads": torch.get_num_threads()}}


def execute_specs(specs: list[RunSpec], device: str, data_dir: str | None, threads: int | None = None,
                  progress: bool = False, execution: str = "auto") -> list[dict]:
    """Run specs that differ only in their seed - in lockstep when there are several
    (:func:`pfl_core.experiment.run_experiments`) - and return one picklable outcome (metrics,
    history, clients) or error per spec. A group that fails is rerun one spec at a time, so that
    one diverging seed fails alone."""
    for spec in specs:
        _kill_hook(spec)
    if threads:
        torch.set_num_threads(threads)
    started = time.time()
    cfgs = [RunConfig.from_dict(spec.config) for spec in specs]
    seeds = ",".join(str(spec.seed) for spec in specs)
    bar = tqdm(total=cfgs[0].federation.rounds, desc=f"  {specs[0].cell_id} seed={seeds}", leave=False,
               disable=not progress)

    def on_round(round_idx: int, metrics: dict) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train_loss']:.3f}")

    try:
        if len(specs) == 1:
            results = [run_experiment(cfgs[0], device=device, data_dir=data_dir, on_round=on_round,
                                      execution=execution)]
        else:
            results = run_experiments(cfgs, device=device, data_dir=data_dir, on_round=on_round,
                                      execution=execution)
    except Exception as err:  # noqa: BLE001 - any crash of one run must not end the sweep
        if len(specs) > 1:
            bar.close()
            return [execute_specs([spec], device, data_dir, threads, progress, execution)[0] for spec in specs]
        return [_failure(started, err)]
    finally:
        bar.close()
    return [_outcome(started, result) for result in results]


def group_specs(specs: list[RunSpec], lockstep: bool) -> list[list[RunSpec]]:
    """The units of work: one spec each, or with ``lockstep`` the pending seeds of each cell together."""
    if not lockstep:
        return [[spec] for spec in specs]
    groups: dict[str, list[RunSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.cell_id, []).append(spec)
    return list(groups.values())


# -- executors: run fn(*args) for each call, yield (index, value, error) as each completes ----------
Completed = Iterator[tuple[int, Any, BaseException | None]]


@dataclass
class LocalExecutor:
    """This process (``jobs <= 1``) or a pool of ``jobs`` spawned processes on this machine."""

    jobs: int = 1
    threads: int | None = None
    """Torch threads per worker; None: default_threads(jobs) in a pool, torch's default in process."""
    remote = False  # workers share this machine's files (MLflow store, suites)

    def __post_init__(self):
        if self.threads is not None and self.threads < 1:
            raise ExecutorError(f"--threads must be >= 1, got {self.threads}")
        if self.jobs > 1 and not self.threads:
            self.threads = default_threads(self.jobs)

    @property
    def in_process(self) -> bool:
        return self.jobs <= 1

    def describe(self) -> str:
        if self.in_process:
            return f"in this process, {self.threads or torch.get_num_threads()} torch threads"
        return f"{self.jobs} worker processes x {self.threads} torch threads"

    def map(self, fn: Callable, calls: list[tuple]) -> Completed:
        if self.in_process:
            for index, args in enumerate(calls):
                yield index, fn(*args), None
            return
        with ProcessPoolExecutor(max_workers=self.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(fn, *args): index for index, args in enumerate(calls)}
            for future in as_completed(futures):
                error = future.exception()  # e.g. BrokenProcessPool: a worker process died
                yield futures[future], None if error else future.result(), error


class WorkerLost(RuntimeError):
    """A Ray task whose worker died (or was lost with its node) on every attempt."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise ExecutorError("--executor ray needs Ray: pip install -e '.[cluster]' (or pip install 'ray>=2.9')") from None
    return ray


@dataclass
class RayExecutor:
    """One Ray task per call: on the cluster at ``address``, else on a local Ray instance of
    ``jobs x threads`` CPUs started (and shut down) by :meth:`map`."""

    jobs: int = 1
    threads: int | None = None
    """CPUs each task reserves and torch threads it runs; None: 1 on a cluster, else default_threads(jobs)."""
    address: str | None = None
    gpus_per_run: float | None = None
    """GPU fraction each task reserves (0.25: four per GPU); None: 0 with device cpu or no GPU, else 1."""
    max_retries: int = 2
    device: str = "auto"
    remote = True  # workers may run on other machines: they get no MLflow store and no relative path
    in_process = False

    def __post_init__(self):
        import_ray()  # fail before anything runs
        if self.threads is not None and self.threads < 1:
            raise ExecutorError(f"--threads must be >= 1, got {self.threads}")
        self.threads = self.threads or (1 if self.address else default_threads(self.jobs))
        gpus = self.gpus_per_run
        if gpus is not None and (gpus < 0 or (gpus > 1 and gpus != int(gpus))):
            raise ExecutorError(f"--gpus-per-run must be a fraction in [0, 1] or a whole number, got {gpus}")
        if self.max_retries < 0:
            raise ExecutorError(f"--max-retries must be >= 0, got {self.max_retries}")

    def describe(self) -> str:
        where = f"Ray cluster {self.address}" if self.address else f"a local Ray instance of {self.jobs * self.threads} CPUs"
        gpus = "auto" if self.gpus_per_run is None else f"{self.gpus_per_run:g}"
        return (f"Ray tasks on {where}: {self.threads} CPU(s)/torch thread(s) and {gpus} GPU per run, "
                f"{self.max_retries} retries")

    def _gpus(self, ray) -> float:
        gpus = self.gpus_per_run
        if gpus is None:
            gpus = 0.0 if self.device == "cpu" or not ray.cluster_resources().get("GPU") else 1.0
        if self.device == "cuda" and not gpus:
            raise ExecutorError("--device cuda on Ray needs --gpus-per-run > 0 and a GPU in the cluster "
                                "(Ray hides the GPUs from a task that reserves none)")
        return gpus

    def map(self, fn: Callable, calls: list[tuple]) -> Completed:
        ray = import_ray()
        started_here = not ray.is_initialized()
        if started_here:
            where = {"address": self.address} if self.address else {
                "num_cpus": self.jobs * self.threads, "include_dashboard": False}
            try:
                ray.init(**where, logging_level=logging.WARNING)
            except Exception as err:  # noqa: BLE001 - no cluster there, or no local instance: one clear line
                what = f"cannot connect to the Ray cluster at --address {self.address}" if self.address else \
                    "cannot start a local Ray instance"
                raise ExecutorError(f"{what}: {type(err).__name__}: {err}") from None
        try:
            task = ray.remote(fn).options(num_cpus=self.threads, num_gpus=self._gpus(ray),
                                          max_retries=self.max_retries)
            pending = {task.remote(*args): index for index, args in enumerate(calls)}
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                index = pending.pop(ref)
                try:
                    value, error = ray.get(ref), None
                except ray.exceptions.RayTaskError as err:  # fn raised: its own exception
                    value, error = None, err.as_instanceof_cause()
                except ray.exceptions.RayError as err:  # worker crashed, killed (OOM), node lost
                    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    value, error = None, WorkerLost(f"Ray worker lost on each of {1 + self.max_retries} "
                                                    f"attempt(s) (--max-retries {self.max_retries}): "
                                                    f"{type(err).__name__}: {first}")
                yield index, value, error
        finally:
            if started_here:
                ray.shutdown()


# -- the sweep ----------------------------------------------------------------------------------------
def pending_runs(specs: list[RunSpec], tracker: Tracker) -> tuple[list[RunSpec], set[str]]:
    done = tracker.finished_hashes(specs[0].suite) if specs else set()
    return [s for s in specs if s.config_hash not in done], done


def run_sweep(suite: Suite, specs: list[RunSpec], tracker: Tracker, jobs: int = 1,
              device: str = "auto", data_dir: str | None = None, echo=print,
              executor: LocalExecutor | RayExecutor | None = None, execution: str = "auto",
              lockstep_seeds: bool = False, command: str | None = None) -> SweepSummary:
    """Run every spec whose config hash has not FINISHED yet; log each as it completes, as a child
    of this call's parent run (``command``, default this process's command line, is the source of
    both; :meth:`benchmarks.tracking.Tracker.start_sweep`). ``executor`` defaults to
    ``LocalExecutor(jobs)``. ``execution`` is how a run computes (``auto``/``sequential``/``batched``,
    never part of the config hash); ``lockstep_seeds`` runs the pending seeds of each cell as one
    lockstep group (one unit of work for the executor)."""
    started = time.perf_counter()
    executor = executor or LocalExecutor(jobs)
    todo, _ = pending_runs(specs, tracker)
    skipped = len(specs) - len(todo)
    if skipped:
        echo(f"{suite.key}: {skipped} of {len(specs)} runs already FINISHED, skipping them")
    if todo:
        echo(f"{suite.key}: {len(todo)} run(s), {executor.describe()}, device {device}")
    git = git_state()
    meta = {"paper": suite.paper, "table": suite.raw.get("table", "")}
    command = command or command_line()
    parent = tracker.start_sweep(suite, specs[0].profile if specs else "", command, git)
    finished = failed = 0
    bar = tqdm(total=len(todo), desc=f"{suite.key} runs", unit="run")

    def record(spec: RunSpec, outcome: dict) -> None:
        nonlocal finished, failed
        tracker.log(spec, meta, outcome, git, parent=parent, command=command)
        if "error" in outcome:
            failed += 1
            bar.write(f"FAILED {spec.cell_id} seed={spec.seed}: {outcome['error']}")
        else:
            finished += 1
        bar.update(1)

    submitted = time.time()
    interrupted = None
    groups = group_specs(todo, lockstep_seeds)
    calls = [(group, device, data_dir, executor.threads, executor.in_process, execution) for group in groups]
    try:
        for index, outcomes, error in executor.map(execute_specs, calls) if calls else ():
            if error is not None:
                lost = {"started": submitted, "ended": time.time(), "error": f"{type(error).__name__}: {error}"}
                outcomes = [lost] * len(groups[index])
            for spec, outcome in zip(groups[index], outcomes):
                record(spec, outcome)
    except BaseException as err:
        interrupted = err
        raise
    finally:
        bar.close()
        counts = {"total": len(specs), "skipped": skipped, "finished": finished, "failed": failed}
        tracker.end_sweep(parent, counts, interrupted)
    return SweepSummary(len(specs), skipped, finished, failed, time.perf_counter() - started, parent)
