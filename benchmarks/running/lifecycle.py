"""Process lifecycle of a sweep: signals in the parent, workers that die with their parent.

* :func:`signals_interrupt`: inside it, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` (a
  ``KeyboardInterrupt``) in the main thread, held while a store write is shielded, so one
  ``except`` path cancels the queued work, kills the workers and marks the claimed runs KILLED
  (:func:`benchmarks.running.sweep.run_sweep`).
* :func:`signals_held`: holds those signals the same way around any block the active guard must
  not cut, such as the start of a worker process (cut between its spawn and the pipe write of its
  start-up data, the new worker dies with a traceback: "Ran out of input").
* :func:`save_on_signal`: the SIGUSR1 handler of the parent (inside :func:`signals_interrupt`) and of
  every worker: each run in progress saves a checkpoint at the end of its current round
  (:func:`pfl_core.checkpoint.request_save`) and goes on; the parent passes the signal to its worker
  processes (not to Ray's). For a scheduler's warning before a time limit (SLURM's ``--signal``) or
  a machine about to be taken back: no finished round is lost.
* :func:`worker_init`: the initializer of every worker process. It ignores SIGINT (a Ctrl-C in the
  terminal reaches the whole process group; the parent alone decides), takes SIGUSR1 as above, asks the kernel to SIGKILL
  it when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), and watches its parent pid from a
  thread (any OS, and a parent that died before the ``prctl``), so a kill -9 of the parent leaves
  no orphan computing on.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import threading

from pfl_core.checkpoint import request_save

PR_SET_PDEATHSIG = 1
PARENT_WATCH_S = 1.0
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143, "SIGHUP": 129}
"""Exit status of ``pflbench`` after each signal (128 + its number, the shell's convention)."""
SAVE_SIGNAL = "SIGUSR1"
"""The signal that asks the runs in progress for a checkpoint (:func:`save_on_signal`)."""


class Interrupted(KeyboardInterrupt):
    """A sweep stopped by a signal; ``signal_name`` says which."""

    def __init__(self, signal_name: str = "SIGINT"):
        super().__init__(signal_name)
        self.signal_name = signal_name

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signal_name, 130)


class SignalGuard:
    """While active (:func:`signals_interrupt`), SIGINT, SIGTERM and SIGHUP raise
    :class:`Interrupted` in the main thread, except inside :meth:`shielded` (a write to the
    store, which an exception in the middle would leave holding the SQLite lock): there the
    signal is held and raised when the shielded block ends."""

    def __init__(self):
        self.depth = 0
        self.pending: str | None = None

    def handler(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.depth:
            self.pending = self.pending or name
            return
        raise Interrupted(name)

    @contextlib.contextmanager
    def shielded(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending:
            name, self.pending = self.pending, None
            raise Interrupted(name)


_active: SignalGuard | None = None


def signals_held():
    """The active guard's :meth:`SignalGuard.shielded` (a signal inside waits for the block's end);
    a no-op outside :func:`signals_interrupt`."""
    return _active.shielded() if _active is not None else contextlib.nullcontext()


@contextlib.contextmanager
def signals_interrupt():
    """A :class:`SignalGuard` active inside the block; the previous handlers come back on exit.
    Outside the main thread the guard is inert (Python delivers signals to the main thread)."""
    guard = SignalGuard()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    names = [s for s in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, s)]
    global _active
    previous = {name: signal.signal(getattr(signal, name), guard.handler) for name in names}
    if hasattr(signal, SAVE_SIGNAL):
        previous[SAVE_SIGNAL] = signal.signal(getattr(signal, SAVE_SIGNAL), save_on_signal)
    outer, _active = _active, guard
    try:
        yield guard
    finally:
        _active = outer
        for name, old in previous.items():
            signal.signal(getattr(signal, name), old)


def save_on_signal(signum, _frame) -> None:
    """SIGUSR1: the runs of this process save a checkpoint after their current round and go on;
    passed on to this process's worker processes (none in a worker)."""
    request_save()
    for child in multiprocessing.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)


def _die_with_parent_linux() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watch thread alone
        pass


def _watch_parent(parent_pid: int) -> None:
    stop = threading.Event()
    while not stop.wait(PARENT_WATCH_S):
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_init(parent_pid: int) -> None:
    """Initializer of a worker process started by ``parent_pid`` (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, SAVE_SIGNAL):
        signal.signal(getattr(signal, SAVE_SIGNAL), save_on_signal)
    _die_with_parent_linux()
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
