"""The suite runner: expand, skip what already FINISHED, claim and run the rest, log every run.

Runs execute on an executor (:mod:`benchmarks.executors`), which yields every run's outcome as it
completes; the parent alone writes it to MLflow, into the run it claimed before the computation
started (:mod:`benchmarks.claims`), so concurrent runners never compute a configuration twice and
an interrupted sweep leaves no RUNNING debris (docs/reliability.md). A diverging run (NaN), a
crashing run or a run whose worker died is logged as FAILED with its reason and the sweep goes on.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.suite import RunSpec, Suite
from benchmarks.claims import LEASE_S, ClaimBook
from benchmarks.experiment_owner import check_owner
from benchmarks.lifecycle import Interrupted, signals_interrupt
from benchmarks.reuse import reuse_finished
from benchmarks.tracking import Tracker, command_line, git_state
from benchmarks.stages import Resolution, resolve_stage1, sweep_tags
from benchmarks.worker import DEFAULT_THREADS, KILL_HOOK_ENV, CheckpointPlan, WorkerArgs, execute_specs
from benchmarks.executors import ExecutorError, LocalExecutor, RayExecutor


__all__ = ["DEFAULT_THREADS", "KILL_HOOK_ENV", "CheckpointPlan", "execute_specs", "run_sweep"]

@dataclass
class SweepSummary:
    total: int
    skipped: int
    finished: int
    failed: int
    wall_s: float
    elsewhere: int = 0
    """Runs another runner claimed (or finished) while this sweep ran: left to it."""
    parent_run_id: str | None = None
    """The sweep's parent MLflow run (:meth:`benchmarks.tracking.Tracker.start_sweep`)."""
    pretrained_reused: int = 0
    """Distinct stage-1 models the pending runs needed that the store held (:mod:`benchmarks.stages`)."""
    pretrained_trained: int = 0
    """Distinct stage-1 models this sweep trained (each once) before its runs."""
    pretrained_failed: int = 0
    reused: int = 0
    """Runs FINISHED in another suite of the store (same config hash), copied here with their
    provenance instead of computed (:mod:`benchmarks.reuse`); not counted in ``finished``."""


def default_checkpoint_dir(tracking_uri: str) -> Path:
    """Checkpoints of a SQLite store live beside its database (``checkpoints/``), else under
    ``results/checkpoints``."""
    if tracking_uri.startswith("sqlite:///"):
        return Path(tracking_uri[len("sqlite:///"):]).parent.resolve() / "checkpoints"
    return Path("results", "checkpoints").resolve()



def group_specs(specs: list[RunSpec], lockstep: bool) -> list[list[RunSpec]]:
    """The units of work: one spec each, or with ``lockstep`` the pending seeds of each cell together."""
    if not lockstep:
        return [[spec] for spec in specs]
    groups: dict[str, list[RunSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.cell_id, []).append(spec)
    return list(groups.values())



# -- the sweep ----------------------------------------------------------------------------------------
def pending_runs(specs: list[RunSpec], tracker: Tracker) -> tuple[list[RunSpec], set[str]]:
    done = tracker.finished_hashes(specs[0].suite) if specs else set()
    return [s for s in specs if s.config_hash not in done], done


def unique(specs: list[RunSpec]) -> list[RunSpec]:
    """The specs with distinct config hashes, in order: a configuration listed twice in a suite
    (a duplicate axis value, ``seeds: [0, 0]``) is one run."""
    return list({spec.config_hash: spec for spec in reversed(specs)}.values())[::-1]


class SweepInterrupted(Interrupted):
    """A sweep stopped by a signal, after its claimed runs were marked KILLED."""

    def __init__(self, signal_name: str, finished: int, failed: int, killed: int):
        super().__init__(signal_name)
        self.finished, self.failed, self.killed = finished, failed, killed

    def __str__(self) -> str:
        return (f"interrupted by {self.signal_name}: {self.finished} run(s) finished and {self.failed} failed "
                f"before it; {self.killed} run(s) in progress marked KILLED, queued runs not started; "
                f"run the same command again to resume")


def run_sweep(suite: Suite, specs: list[RunSpec], tracker: Tracker, jobs: int = 1,
              device: str = "auto", data_dir: str | None = None, echo=print,
              executor: LocalExecutor | RayExecutor | None = None, execution: str = "auto",
              lockstep_seeds: bool = False, lease_s: float = LEASE_S,
              checkpoint_every: int = 0, checkpoint_dir: str | Path | None = None,
              deterministic: bool = False, command: str | None = None, reuse: bool = True,
              allow_tf32: bool = False, share_experiment: bool = False) -> SweepSummary:
    """Run every spec whose config hash has not FINISHED yet; log each as it completes, as a child
    of this call's parent run (``command``, default this process's command line, is the source of
    both; :meth:`benchmarks.tracking.Tracker.start_sweep`).
    ``executor`` defaults to ``LocalExecutor(jobs)``. ``execution`` is how a run computes
    (``auto``/``sequential``/``batched``, never part of the config hash); ``lockstep_seeds`` runs
    the pending seeds of each cell as one lockstep group (one unit of work for the executor).

    Each run is claimed (:mod:`benchmarks.claims`, lease ``lease_s``) just before a worker starts
    it, so concurrent sweeps of the same suite on the same store split the runs; RUNNING runs of
    dead runners are marked KILLED first and recomputed. SIGINT/SIGTERM raise
    :class:`SweepInterrupted` after the workers are killed and the claimed runs marked KILLED.
    ``checkpoint_every`` N > 0 saves each run's state every N rounds under ``checkpoint_dir``
    (default :func:`default_checkpoint_dir`), keyed by config hash; a run that finds its
    checkpoint resumes from it (tag ``resumed_from_round``).

    With ``reuse`` (``pflbench run``'s default; ``--no-reuse`` turns it off) a pending run whose
    config hash FINISHED in another suite's experiment of the store is copied here with its
    provenance instead of computed (:mod:`benchmarks.reuse`).

    Runs with a stage-1 ``model.pretrained`` start once every distinct stage 1 they need is
    resolved: reused from the ``pretraining`` experiment by its config hash, or trained once by the
    same executor and logged there (:mod:`benchmarks.stages`).

    The suite's experiment must admit the suite's file, or ``share_experiment`` admits it
    (:mod:`benchmarks.experiment_owner`): a refusal is raised before any run."""
    started = time.perf_counter()
    executor = executor or LocalExecutor(jobs)
    if checkpoint_every < 0:
        raise ExecutorError(f"--checkpoint-every must be >= 0 rounds, got {checkpoint_every}")
    plan = CheckpointPlan(str(Path(checkpoint_dir or default_checkpoint_dir(tracker.uri)).resolve()),
                          checkpoint_every) if checkpoint_every else None
    distinct = unique(specs)
    if len(distinct) < len(specs):
        echo(f"{suite.key}: {len(specs) - len(distinct)} duplicate run(s) (same config hash as another) run once")
    check_owner(tracker, suite, share=share_experiment)  # one suite file per experiment, before any run
    claims = ClaimBook(tracker, suite.key, lease_s)
    reaped = claims.reap_stale()
    if reaped:
        echo(f"{suite.key}: {len(reaped)} run(s) left RUNNING by a runner that died marked KILLED; recomputing them")
    todo, _ = pending_runs(distinct, tracker)
    skipped = len(specs) - len(todo)
    if skipped:
        echo(f"{suite.key}: {skipped} of {len(specs)} runs already FINISHED or duplicated, skipping them")
    if todo:
        echo(f"{suite.key}: {len(todo)} run(s), {executor.describe()}, device {device}")
    git = git_state()
    meta = {"paper": suite.paper, "table": suite.raw.get("table", "")}
    command = command or command_line()
    parent = tracker.start_sweep(suite, specs[0].profile if specs else "", command, git)
    claims.own_sweep(parent)
    finished = failed = elsewhere = reused = 0
    held: dict[str, str] = {}  # config hash -> run id of our claim
    shield = contextlib.nullcontext  # signals_interrupt's guard once the sweep starts
    by_hash = {spec.config_hash: spec for spec in todo}
    worker_args = WorkerArgs(device, data_dir, executor.threads, executor.in_process, execution, plan, deterministic,
                             allow_tf32)
    pretrained = None  # the stage-1 states (benchmarks.stages), resolved before any run is claimed
    states_dir = Path(tempfile.mkdtemp(prefix="pflbench-pretrained-"))
    resolution = Resolution(None)
    bar = tqdm(total=len(todo), desc=f"{suite.key} runs", unit="run")

    def record(spec: RunSpec, outcome: dict) -> None:
        nonlocal finished, failed
        run_id = held.pop(spec.config_hash)
        tracker.log(spec, meta, outcome, git, run_id=run_id, parent=parent, command=command)
        claims.done(run_id)
        if plan is not None:
            plan.discard(spec)
        if "error" in outcome:
            failed += 1
            bar.write(f"FAILED {spec.cell_id} seed={spec.seed}: {outcome['error']}")
        else:
            finished += 1
        bar.update(1)

    def claimed_calls():
        """The units of work, each claimed when a worker is free for it (runs another runner
        holds or finished are left to it)."""
        nonlocal elsewhere
        for group in group_specs(todo, lockstep_seeds):
            won = []
            for spec in group:
                with shield():
                    run_id = claims.claim(spec.config_hash, tracker.run_tags(spec, meta, {}, git, parent, command))
                if run_id is None:
                    elsewhere += 1
                    bar.update(1)
                else:
                    held[spec.config_hash] = run_id
                    won.append(spec)
            if won:
                yield tuple(s.config_hash for s in won), (won, *worker_args, pretrained)

    submitted = time.time()
    interrupted = None
    results = None
    try:
        with signals_interrupt() as guard:
            shield = guard.shielded
            if reuse and todo:
                todo, reused, taken = reuse_finished(todo, tracker, claims, meta, git, parent, command, echo)
                elsewhere += taken
                bar.update(reused + taken)
            resolution = resolve_stage1(todo, tracker, executor, states_dir, worker_args, meta, git, command,
                                        sweep_tags(suite.key, parent), lease_s, echo)
            pretrained = resolution.provider
            results = executor.map(execute_specs, claimed_calls())
            for key, outcomes, error in results:
                group = [by_hash[h] for h in key]
                if error is not None:
                    lost = {"started": submitted, "ended": time.time(), "error": f"{type(error).__name__}: {error}"}
                    outcomes = [lost] * len(group)
                for spec, outcome in zip(group, outcomes):
                    with shield():
                        record(spec, outcome)
    except KeyboardInterrupt as err:  # SIGINT, SIGTERM, SIGHUP (benchmarks.lifecycle)
        interrupted = err
        if results is not None:
            results.close()  # kills the workers, drops the queue
        name = getattr(err, "signal_name", "SIGINT")
        killed = claims.release_all(f"interrupted by {name} before it finished; the next sweep recomputes it")
        raise SweepInterrupted(name, finished, failed, killed) from None
    except BaseException as err:  # an error, e.g. a full disk while a run is written (issue 29, item 3)
        interrupted = err
        if results is not None:
            results.close()
        with contextlib.suppress(Exception):  # the store itself may be what fails: then the next start reaps them
            claims.release_all(f"the sweep stopped on {type(err).__name__}: {err}; the next sweep recomputes it",
                               status="FAILED")
        raise
    finally:
        if results is not None:
            results.close()
        claims.close()
        bar.close()
        shutil.rmtree(states_dir, ignore_errors=True)
        counts = {"total": len(specs), "skipped": skipped, "finished": finished, "failed": failed, "reused": reused}
        if interrupted is None or isinstance(interrupted, KeyboardInterrupt):
            tracker.end_sweep(parent, counts, interrupted)
        else:
            with contextlib.suppress(Exception):  # never hide the error that stopped the sweep
                tracker.end_sweep(parent, counts, interrupted)
    if elsewhere:
        echo(f"{suite.key}: {elsewhere} run(s) claimed or finished by another runner, left to it")
    return SweepSummary(len(specs), skipped, finished, failed, time.perf_counter() - started, elsewhere=elsewhere,
                        parent_run_id=parent, pretrained_reused=resolution.reused,
                        pretrained_trained=resolution.trained, pretrained_failed=resolution.failed,
                        reused=reused)
