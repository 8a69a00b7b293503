"""The suite runner: expand, skip what already FINISHED, claim and run the rest, log every run.

Runs execute on an executor (:mod:`benchmarks.running.executors`), which yields every run's outcome as it
completes; the parent alone writes it to MLflow, into the run it claimed before the computation
started (:mod:`benchmarks.store.claims`), so concurrent runners never compute a configuration twice and
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

from benchmarks.store.artifact_faults import damaged_artifacts, mark_damaged
from benchmarks.suite.spec import RunSpec, Suite
from benchmarks.store.claims import LEASE_S, ClaimBook
from benchmarks.store.ownership import check_owner
from benchmarks.running.lifecycle import Interrupted, signals_interrupt
from benchmarks.store.reuse import reuse_finished
from benchmarks.store.tracking import Tracker, command_line, git_state
from benchmarks.running.stages import Resolution, resolve_stage1, sweep_tags
from benchmarks.running.worker import DEFAULT_THREADS, KILL_HOOK_ENV, CheckpointPlan, WorkerArgs, execute_specs
from benchmarks.running.executors import ExecutorError, LocalExecutor, RayExecutor


__all__ = ["DEFAULT_THREADS", "KILL_HOOK_ENV", "CheckpointPlan", "Sweep", "SweepOptions", "execute_specs", "run_sweep"]

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
    """The sweep's parent MLflow run (:meth:`benchmarks.store.tracking.Tracker.start_sweep`)."""
    pretrained_reused: int = 0
    """Distinct stage-1 models the pending runs needed that the store held (:mod:`benchmarks.running.stages`)."""
    pretrained_trained: int = 0
    """Distinct stage-1 models this sweep trained (each once) before its runs."""
    pretrained_failed: int = 0
    reused: int = 0
    """Runs FINISHED in another suite of the store (same config hash), copied here with their
    provenance instead of computed (:mod:`benchmarks.store.reuse`); not counted in ``finished``."""


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
def pending_runs(specs: list[RunSpec], tracker: Tracker, echo=None) -> tuple[list[RunSpec], set[str]]:
    """(specs still to compute, config hashes FINISHED). A FINISHED run with an artifact cut short
    on disk (:mod:`benchmarks.store.artifact_faults`) is pending; with ``echo`` (a sweep) it is marked
    FAILED first, in one line naming the run and the file."""
    if not specs:
        return [], set()
    wanted = {s.config_hash for s in specs}
    done = set()
    for run in tracker.runs(specs[0].suite, "FINISHED"):
        key = run.data.tags.get("config_hash")
        if key not in wanted or key in done:
            continue
        damaged = damaged_artifacts(run)
        if not damaged:
            done.add(key)
        elif echo is not None:
            echo(f"{specs[0].suite}: {mark_damaged(tracker.client, run, damaged)}")
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


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep runs (``pflbench run``'s flags); nothing here enters a config hash."""

    jobs: int = 1
    device: str = "auto"
    data_dir: str | None = None
    execution: str = "auto"
    """``auto``/``sequential``/``batched``: how a run computes."""
    lockstep_seeds: bool = False
    """Run the pending seeds of each cell as one lockstep group (one unit of work)."""
    lease_s: float = LEASE_S
    checkpoint_every: int = 0
    checkpoint_dir: str | Path | None = None
    deterministic: bool = False
    command: str | None = None
    """The command recorded as the source of the parent run and of every run (default: this process's)."""
    reuse: bool = True
    allow_tf32: bool = False
    share_experiment: bool = False


def run_sweep(suite: Suite, specs: list[RunSpec], tracker: Tracker, echo=print,
              executor: LocalExecutor | RayExecutor | None = None, **options) -> SweepSummary:
    """Run every spec whose config hash has not FINISHED yet; log each as it completes, as a child
    of this call's parent run (``command``, default this process's command line, is the source of
    both; :meth:`benchmarks.store.tracking.Tracker.start_sweep`). ``options`` are :class:`SweepOptions`'
    fields; ``executor`` defaults to ``LocalExecutor(jobs)``. See :class:`Sweep`."""
    return Sweep(suite, tracker, SweepOptions(**options), executor, echo).run(specs)


class Sweep:
    """One sweep of a suite's runs on one store.

    Each run is claimed (:mod:`benchmarks.store.claims`, lease ``lease_s``) just before a worker starts
    it, so concurrent sweeps of the same suite on the same store split the runs; RUNNING runs of
    dead runners are marked KILLED first and recomputed. SIGINT/SIGTERM raise
    :class:`SweepInterrupted` after the workers are killed and the claimed runs marked KILLED.
    ``checkpoint_every`` N > 0 saves each run's state every N rounds under ``checkpoint_dir``
    (default :func:`default_checkpoint_dir`), keyed by config hash; a run that finds its
    checkpoint resumes from it (tag ``resumed_from_round``).

    With ``reuse`` (``pflbench run``'s default; ``--no-reuse`` turns it off) a pending run whose
    config hash FINISHED in another suite's experiment of the store is copied here with its
    provenance instead of computed (:mod:`benchmarks.store.reuse`).

    Runs with a stage-1 ``model.pretrained`` start once every distinct stage 1 they need is
    resolved: reused from the ``pretraining`` experiment by its config hash, or trained once by the
    same executor and logged there (:mod:`benchmarks.running.stages`).

    The suite's experiment must admit the suite's file, or ``share_experiment`` admits it
    (:mod:`benchmarks.store.ownership`): a refusal is raised before any run."""

    def __init__(self, suite: Suite, tracker: Tracker, options: SweepOptions,
                 executor: LocalExecutor | RayExecutor | None = None, echo=print):
        if options.checkpoint_every < 0:
            raise ExecutorError(f"--checkpoint-every must be >= 0 rounds, got {options.checkpoint_every}")
        self.suite, self.tracker, self.options, self.echo = suite, tracker, options, echo
        self.executor = executor or LocalExecutor(options.jobs)
        self.plan = CheckpointPlan(str(Path(options.checkpoint_dir or default_checkpoint_dir(tracker.uri)).resolve()),
                                   options.checkpoint_every) if options.checkpoint_every else None
        self.finished = self.failed = self.elsewhere = self.reused = 0
        self.held: dict[str, str] = {}  # config hash -> run id of our claim
        self.shield = contextlib.nullcontext  # signals_interrupt's guard once the sweep starts
        self.pretrained = None  # the stage-1 states (benchmarks.running.stages), resolved before any run is claimed
        self.resolution = Resolution(None)

    def run(self, specs: list[RunSpec]) -> SweepSummary:
        started = time.perf_counter()
        suite, tracker, opts, echo = self.suite, self.tracker, self.options, self.echo
        distinct = unique(specs)
        if len(distinct) < len(specs):
            echo(f"{suite.key}: {len(specs) - len(distinct)} duplicate run(s) (same config hash as another) run once")
        check_owner(tracker, suite, share=opts.share_experiment)  # one suite file per experiment, before any run
        self.claims = ClaimBook(tracker, suite.key, opts.lease_s)
        reaped = self.claims.reap_stale()
        if reaped:
            echo(f"{suite.key}: {len(reaped)} run(s) left RUNNING by a runner that died marked KILLED; recomputing them")
        self.todo, _ = pending_runs(distinct, tracker, echo)
        skipped = len(specs) - len(self.todo)
        if skipped:
            echo(f"{suite.key}: {skipped} of {len(specs)} runs already FINISHED or duplicated, skipping them")
        if self.todo:
            echo(f"{suite.key}: {len(self.todo)} run(s), {self.executor.describe()}, device {opts.device}")
        self.git = git_state()
        self.meta = {"paper": suite.paper, "table": suite.raw.get("table", "")}
        self.command = opts.command or command_line()
        self.parent = tracker.start_sweep(suite, specs[0].profile if specs else "", self.command, self.git)
        self.claims.own_sweep(self.parent)
        self.worker_args = WorkerArgs(opts.device, opts.data_dir, self.executor.threads, self.executor.in_process,
                                      opts.execution, self.plan, opts.deterministic, opts.allow_tf32)
        self.states_dir = Path(tempfile.mkdtemp(prefix="pflbench-pretrained-"))
        self.bar = tqdm(total=len(self.todo), desc=f"{suite.key} runs", unit="run")
        self.submitted = time.time()
        self._compute(skipped, len(specs))
        if self.elsewhere:
            echo(f"{suite.key}: {self.elsewhere} run(s) claimed or finished by another runner, left to it")
        r = self.resolution
        return SweepSummary(len(specs), skipped, self.finished, self.failed, time.perf_counter() - started,
                            elsewhere=self.elsewhere, parent_run_id=self.parent, pretrained_reused=r.reused,
                            pretrained_trained=r.trained, pretrained_failed=r.failed, reused=self.reused)

    def _compute(self, skipped: int, total: int) -> None:
        """Reuse, resolve stage 1, run the rest; on any exit release the claims and close the parent run."""
        interrupted = None
        results = None
        try:
            with signals_interrupt() as guard:
                self.shield = guard.shielded
                if self.options.reuse and self.todo:
                    self.todo, self.reused, taken = reuse_finished(self.todo, self.tracker, self.claims, self.meta,
                                                                   self.git, self.parent, self.command, self.echo)
                    self.elsewhere += taken
                    self.bar.update(self.reused + taken)
                self.resolution = resolve_stage1(self.todo, self.tracker, self.executor, self.states_dir,
                                                 self.worker_args, self.meta, self.git, self.command,
                                                 sweep_tags(self.suite.key, self.parent), self.options.lease_s, self.echo)
                self.pretrained = self.resolution.provider
                by_hash = {spec.config_hash: spec for spec in self.todo}
                results = self.executor.map(execute_specs, self._claimed_calls())
                for key, outcomes, error in results:
                    group = [by_hash[h] for h in key]
                    if error is not None:
                        lost = {"started": self.submitted, "ended": time.time(), "error": f"{type(error).__name__}: {error}"}
                        outcomes = [lost] * len(group)
                    for spec, outcome in zip(group, outcomes):
                        with self.shield():
                            self._record(spec, outcome)
        except KeyboardInterrupt as err:  # SIGINT, SIGTERM, SIGHUP (benchmarks.running.lifecycle)
            interrupted = err
            if results is not None:
                results.close()  # kills the workers, drops the queue
            name = getattr(err, "signal_name", "SIGINT")
            killed = self.claims.release_all(f"interrupted by {name} before it finished; the next sweep recomputes it")
            raise SweepInterrupted(name, self.finished, self.failed, killed) from None
        except BaseException as err:  # an error, e.g. a full disk while a run is written (issue 29, item 3)
            interrupted = err
            if results is not None:
                results.close()
            with contextlib.suppress(Exception):  # the store itself may be what fails: then the next start reaps them
                self.claims.release_all(f"the sweep stopped on {type(err).__name__}: {err}; the next sweep recomputes "
                                        f"it", status="FAILED")
            raise
        finally:
            if results is not None:
                results.close()
            self.claims.close()
            self.bar.close()
            shutil.rmtree(self.states_dir, ignore_errors=True)
            counts = {"total": total, "skipped": skipped, "finished": self.finished, "failed": self.failed,
                      "reused": self.reused}
            if interrupted is None or isinstance(interrupted, KeyboardInterrupt):
                self.tracker.end_sweep(self.parent, counts, interrupted)
            else:
                with contextlib.suppress(Exception):  # never hide the error that stopped the sweep
                    self.tracker.end_sweep(self.parent, counts, interrupted)

    def _record(self, spec: RunSpec, outcome: dict) -> None:
        """Log one run's outcome into the run it claimed and release the claim."""
        run_id = self.held.pop(spec.config_hash)
        self.tracker.log(spec, self.meta, outcome, self.git, run_id=run_id, parent=self.parent, command=self.command)
        self.claims.done(run_id)
        if self.plan is not None:
            self.plan.discard(spec)
        if "error" in outcome:
            self.failed += 1
            self.bar.write(f"FAILED {spec.cell_id} seed={spec.seed}: {outcome['error']}")
        else:
            self.finished += 1
        self.bar.update(1)

    def _claimed_calls(self):
        """The units of work, each claimed when a worker is free for it (runs another runner
        holds or finished are left to it)."""
        for group in group_specs(self.todo, self.options.lockstep_seeds):
            won = []
            for spec in group:
                with self.shield():
                    run_id = self.claims.claim(spec.config_hash,
                                               self.tracker.run_tags(spec, self.meta, {}, self.git, self.parent,
                                                                     self.command))
                if run_id is None:
                    self.elsewhere += 1
                    self.bar.update(1)
                else:
                    self.held[spec.config_hash] = run_id
                    won.append(spec)
            if won:
                yield tuple(s.config_hash for s in won), (won, *self.worker_args, self.pretrained)
