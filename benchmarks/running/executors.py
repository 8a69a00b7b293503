"""Where runs execute: an *executor* runs ``fn(*args)`` for each call it pulls and yields every
outcome as it completes; the sweep (:mod:`benchmarks.running.sweep`) alone writes them to MLflow.

:class:`LocalExecutor` (``--executor local``, the default)
    This process (``--jobs 1``, with a per-round progress bar) or a pool of ``--jobs N`` spawned
    worker processes on this machine, also N processes packed on one GPU with ``--device cuda``.
:class:`RayExecutor` (``--executor ray``)
    One Ray task per run, on a local Ray instance started here (``--jobs`` x ``--threads`` CPUs,
    shut down at the end) or on an existing cluster (``--address``). Each task reserves
    ``--threads`` CPUs and ``--gpus-per-run`` of a GPU (0.25: four runs share a GPU). A task whose
    worker died is retried ``--max-retries`` times, then its run is logged FAILED.

Threads: every run computes with ``torch.set_num_threads(T)``, ``T = --threads``, by default
:data:`DEFAULT_THREADS` (1) whatever ``--jobs`` and the executor: the intra-op thread count
changes how float sums are split, hence the last bits of a run's numbers, so a fixed default makes
``--jobs 1`` and ``--jobs 8`` give bit-identical results (docs/reliability.md). It is not part
of the config hash (like the device, it changes rounding, not what is computed); each run records
it (tag ``torch_threads``, ``run_info.json``).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator


from benchmarks.suite.schema import SuiteError
from benchmarks.running.lifecycle import signals_held, worker_init
from benchmarks.running.worker import DEFAULT_THREADS, ready


class ExecutorError(SuiteError):
    """Bad executor options, Ray missing or unreachable; the message names the fix."""


def check_threads(threads: int | None) -> int:
    """``threads`` or :data:`DEFAULT_THREADS`; below 1 is an error naming the flag."""
    if threads is not None and threads < 1:
        raise ExecutorError(f"--threads must be >= 1, got {threads}")
    return threads or DEFAULT_THREADS



# -- executors: run fn(*args) for each (key, args) pulled, yield (key, value, error) as each completes --
# Calls are pulled lazily, one per free worker, so that a runner claims a run (benchmarks.store.claims) only
# when a worker can start it and several runners split a sweep instead of each claiming all of it.
Calls = Iterable[tuple[Hashable, tuple]]
Completed = Iterator[tuple[Hashable, Any, BaseException | None]]


class WorkerDied(RuntimeError):
    """A worker process died (killed, out of memory, crashed interpreter) while running a call."""


@dataclass
class LocalExecutor:
    """This process (``jobs <= 1``) or a pool of ``jobs`` spawned processes on this machine.

    Workers run :func:`benchmarks.running.lifecycle.worker_init`: they ignore Ctrl-C and die with the
    parent. When a worker dies, the pool breaks and every call in flight fails with it: the pool is
    rebuilt, and the calls of that break are retried one at a time (alone, so that a second death
    names its call); a call whose worker died ``max_deaths`` times is yielded with a
    :class:`WorkerDied` error and the sweep goes on. On an exception in the consumer (Ctrl-C,
    SIGTERM) queued calls are dropped and the workers killed."""

    jobs: int = 1
    threads: int | None = None
    """Torch threads of each run; None: DEFAULT_THREADS."""
    max_deaths: int = 2
    remote = False  # workers share this machine's files (MLflow store, suites)

    _warm: ProcessPoolExecutor | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.threads = check_threads(self.threads)

    @property
    def in_process(self) -> bool:
        return self.jobs <= 1

    def start(self) -> None:
        """Start the worker processes now, so that they import the run code while this process
        opens the store; the next :meth:`map` takes them. Nothing for an in-process executor."""
        if self.in_process or self._warm is not None:
            return
        self._warm = new_pool(self.jobs)
        for _ in range(self.jobs):  # one submit per worker: the pool spawns a process for each
            submit(self._warm, ready)

    def close(self) -> None:
        """Shut down workers started by :meth:`start` that no :meth:`map` took (nothing to run)."""
        pool, self._warm = self._warm, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def take_pool(self) -> ProcessPoolExecutor:
        """The pool started by :meth:`start`, else a new one."""
        pool, self._warm = self._warm, None
        return pool or new_pool(self.jobs)

    def describe(self) -> str:
        if self.in_process:
            return f"in this process, {self.threads} torch thread(s)"
        return f"{self.jobs} worker processes x {self.threads} torch thread(s)"

    def map(self, fn: Callable, calls: Calls) -> Completed:
        if self.in_process:
            for key, args in calls:
                yield key, fn(*args), None
            return
        yield from _PoolRun(self, fn, iter(calls)).completed()


def new_pool(jobs: int) -> ProcessPoolExecutor:
    """A pool of ``jobs`` spawned workers (:func:`~benchmarks.running.lifecycle.worker_init`)."""
    with signals_held():  # its queues may start multiprocessing's resource tracker process
        return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=worker_init, initargs=(os.getpid(),))


def submit(pool: ProcessPoolExecutor, fn: Callable, *args) -> Future:
    """``pool.submit``, which may start a worker process: signals wait until it has (never cut halfway)."""
    with signals_held():
        return pool.submit(fn, *args)


class _PoolRun:
    """One ``LocalExecutor.map`` over a process pool, rebuilt when a worker dies."""

    def __init__(self, executor: LocalExecutor, fn: Callable, calls: Iterator):
        self.executor, self.fn, self.calls = executor, fn, calls
        self.deaths: dict[Hashable, int] = {}
        self.suspects: list[tuple[Hashable, tuple]] = []  # in flight when a worker died: retried alone
        self.pool = executor.take_pool()

    def _next(self, in_flight: dict) -> tuple[Hashable, tuple] | None:
        """The next call to submit: a suspect only into an empty pool, and then nothing beside it."""
        if any(key in self.deaths for key, _ in in_flight.values()):
            return None
        if self.suspects:
            return self.suspects.pop(0) if not in_flight else None
        return next(self.calls, None)

    def completed(self) -> Completed:
        in_flight: dict = {}  # future -> (key, args)
        try:
            while True:
                while len(in_flight) < self.executor.jobs:
                    call = self._next(in_flight)
                    if call is None:
                        break
                    in_flight[submit(self.pool, self.fn, *call[1])] = call
                if not in_flight:
                    self.pool.shutdown(wait=True)  # idle workers exit on their own, releasing their locks
                    return
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                broken = []
                for future in done:
                    key, args = in_flight.pop(future)
                    error = future.exception()
                    if isinstance(error, BrokenProcessPool):
                        broken.append((key, args))
                    else:
                        yield key, None if error else future.result(), error
                if broken:
                    yield from self._after_break(broken + list(in_flight.values()))
                    in_flight = {}
        finally:
            self._kill()

    def _after_break(self, lost: list[tuple[Hashable, tuple]]) -> Completed:
        """A worker died: rebuild the pool; fail the calls that died too often, retry the others."""
        self._kill()
        self.pool = new_pool(self.executor.jobs)
        for key, args in lost:
            self.deaths[key] = self.deaths.get(key, 0) + 1
            if self.deaths[key] >= self.executor.max_deaths:
                yield key, None, WorkerDied(
                    f"the worker process died {self.deaths[key]} time(s) while running this run (killed, "
                    f"out of memory or crashed; the last time it ran alone); the next sweep runs it again")
            else:
                self.suspects.append((key, args))

    def _kill(self) -> None:
        """Drop queued calls and kill the workers now (they hold no store and no claim); nothing
        after a graceful shutdown. A killed worker may hold the call queue's semaphore, which
        Python's resource tracker then reports as leaked at exit: the normal end never kills."""
        processes = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=5)


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
    """CPUs each task reserves and torch threads it runs; None: DEFAULT_THREADS."""
    address: str | None = None
    gpus_per_run: float | None = None
    """GPU fraction each task reserves (0.25: four per GPU); None: 0 with device cpu or no GPU, else 1."""
    max_retries: int = 2
    device: str = "auto"
    remote = True  # workers may run on other machines: they get no MLflow store and no relative path
    in_process = False

    def __post_init__(self):
        import_ray()  # fail before anything runs
        self.threads = check_threads(self.threads)
        gpus = self.gpus_per_run
        if gpus is not None and (gpus < 0 or (gpus > 1 and gpus != int(gpus))):
            raise ExecutorError(f"--gpus-per-run must be a fraction in [0, 1] or a whole number, got {gpus}")
        if self.max_retries < 0:
            raise ExecutorError(f"--max-retries must be >= 0, got {self.max_retries}")

    def start(self) -> None:
        """Nothing: :meth:`map` starts or joins Ray."""

    def close(self) -> None:
        """Nothing: :meth:`map` shuts down what it started."""

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
            calls, pending = iter(calls), {}
            cap = self._in_flight(ray)
            try:
                while True:
                    while len(pending) < cap and (call := next(calls, None)) is not None:
                        pending[task.remote(*call[1])] = call[0]
                    if not pending:
                        return
                    (ref,), _ = ray.wait(list(pending), num_returns=1)
                    key = pending.pop(ref)
                    try:
                        value, error = ray.get(ref), None
                    except ray.exceptions.RayTaskError as err:  # fn raised: its own exception
                        value, error = None, err.as_instanceof_cause()
                    except ray.exceptions.RayError as err:  # worker crashed, killed (OOM), node lost
                        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                        value, error = None, WorkerLost(f"Ray worker lost on each of {1 + self.max_retries} "
                                                        f"attempt(s) (--max-retries {self.max_retries}): "
                                                        f"{type(err).__name__}: {first}")
                    yield key, value, error
            finally:
                for ref in pending:  # interrupted: stop what still runs for us
                    ray.cancel(ref, force=True)
        finally:
            if started_here:
                ray.shutdown()

    def _in_flight(self, ray) -> int:
        """Tasks submitted at once: --jobs, or on a cluster as many as its CPUs hold (at least
        --jobs); the rest are pulled (and claimed) as tasks complete."""
        cpus = int(ray.cluster_resources().get("CPU", 0)) // max(1, self.threads)
        return max(1, self.jobs, cpus if self.address else 0)
