"""``make gpu-lend``: the one prepared command of a GPU lend (a short loan of one GPU, with no MLflow,
no Optuna, no network), run as ``python -m benchmarks.running.gpu_lend`` from the checkout.

In this order, inside ``--budget-s`` seconds in all:

1. ``check``: the core of ``pflbench gpu-check`` (:mod:`benchmarks.running.gpu_check`): the ``gpu``-marked
   tests (CUDA against the CPU, each method's step captured or not) and the speed benchmark on the
   suite's workloads, in at most ``--check-s`` seconds; its report is ``<out>/gpu-<device>.md``.
2. ``runs``: the suite's runs of ``--profile`` (filtered by ``--only``) on the fastest path: clients
   batched, the seeds of a cell in lockstep, each vmapped step captured as a CUDA graph where it
   records (a method whose capture fails falls back to the eager batched step, and its
   ``step_capture`` tag says so), ``--jobs`` cells at a time on the one GPU. Runs already recorded
   under ``--records-dir`` (the committed records) are skipped. A cell is started only while at
   least ``--min-start-s`` seconds are left; at the deadline the cells still running are stopped
   (their workers killed) and listed: only whole runs are recorded, each written atomically by
   this process (:mod:`benchmarks.store.records`).
3. ``out``: ``<out>/records.tar.gz`` (rewritten after every finished cell, so a kill keeps what
   finished), ``<out>/lend.md`` (what ran, what was skipped, what did not finish, timings) and the
   GPU report: three files (with the caller's log, four), within a lend's eight-file limit.

Back on a machine with the store: ``pflbench import <records>`` (after unpacking), then
``pflbench snapshot``. Without CUDA (the rehearsal, ``make device-rehearsal``) every step runs on the
CPU with what the arguments allow.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.running.gpu_check import Step, _run, render
from benchmarks.store.records import recorded_hashes, write_record
from benchmarks.store.run_tags import command_line, git_state
from benchmarks.suite.spec import load_suite, parse_only
from pfl_core.atomic_file import atomic_path

DEFAULT_RECORDS = "reports/reproduced/records"
"""Where the committed records live (``<suite key>/<config hash>.json``)."""


class Deadline(BaseException):
    """The budget is spent: stop the cells still running (a BaseException, so that no run catches it)."""


def _alarm(_signum, _frame):
    raise Deadline()


def check_steps(cuda: bool, workloads: list[str], budget_s: float) -> list[Step]:
    """Step 1: the gpu tests, then the speed benchmark of ``workloads``, in ``budget_s`` in all."""
    started = time.perf_counter()
    py = [sys.executable, "-m"]
    tests = _run("gpu tests", [*py, "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
                               "tests/test_gpu_paths.py"], int(max(budget_s * 0.5, 10)))
    left = budget_s - (time.perf_counter() - started)
    speed_args = (["--devices", "cuda", "--capture", "--rounds", "2"] if cuda else
                  ["--devices", "cpu", "--rounds", "1", "--seeds", "1", "--threads", "1"])
    speed = _run("speed", [*py, "benchmarks.timing.speed", *speed_args, "--only", *workloads], int(max(left, 10)))
    return [tests, speed]


def pending_groups(specs, done: set[str], first: list[str]) -> list[list]:
    """The seeds of each cell not yet recorded, in lockstep groups: cells of the ``first`` methods
    first, then the suite's order."""
    groups: dict[str, list] = {}
    for spec in specs:
        if spec.config_hash not in done:
            groups.setdefault(spec.cell_id, []).append(spec)
    ordered = list(groups.values())
    return sorted(ordered, key=lambda g: (g[0].method not in first, first.index(g[0].method)
                                          if g[0].method in first else 0))


def pack(records: Path, out: Path) -> Path:
    """``<out>/records.tar.gz`` of every record written so far (atomically replaced)."""
    target = out / "records.tar.gz"
    with atomic_path(target) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(records.rglob("*.json")):
            tar.add(path, arcname=str(path.relative_to(records)))
    return target


def empty_summary() -> dict:
    """What :func:`run_cells` returns, before any cell ran."""
    return {"finished": 0, "failed": 0, "cells_done": [], "cells_stopped": [], "cells_not_started": [],
            "seconds": {}}


def run_cells(args, suite, groups, records: Path, out: Path, deadline: float, echo) -> dict:
    """Step 2: run ``groups`` until ``deadline`` (time.monotonic), recording each finished run."""
    from benchmarks.running.executors import LocalExecutor
    from benchmarks.running.worker import execute_specs

    meta = {"paper": suite.paper, "table": suite.raw.get("table", "")}
    git = (args.git_commit, False) if args.git_commit else git_state()
    command = command_line()
    device = args.device
    executor = LocalExecutor(args.jobs, args.threads)
    started_cells: list[str] = []
    summary = empty_summary()
    t_start: dict[tuple, float] = {}

    def calls():
        for i, group in enumerate(groups):
            left = deadline - time.monotonic()
            if left < args.min_start_s:
                summary["cells_not_started"] += [g[0].cell_id for g in groups[i:]]
                return
            key = tuple(s.config_hash for s in group)
            t_start[key] = time.monotonic()
            started_cells.append(group[0].cell_id)
            echo(f"start {group[0].cell_id} seeds {','.join(str(s.seed) for s in group)} ({left:.0f} s left)")
            yield key, (group, device, args.data_dir, executor.threads, False, "batched", None, False,
                        args.allow_tf32)

    by_hash = {s.config_hash: s for g in groups for s in g}
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 0.01))
    results = executor.map(execute_specs, calls())
    try:
        for key, outcomes, error in results:
            group = [by_hash[h] for h in key]
            seconds = time.monotonic() - t_start[key]
            if error is not None:
                outcomes = [{"error": f"{type(error).__name__}: {error}"}] * len(group)
            for spec, outcome in zip(group, outcomes):
                if "error" in outcome:
                    summary["failed"] += 1
                    echo(f"FAILED {spec.cell_id} seed {spec.seed}: {outcome['error'][:300]}")
                    continue
                write_record(records, spec, meta, outcome, git, command)
                summary["finished"] += 1
            summary["cells_done"].append(group[0].cell_id)
            summary["seconds"][group[0].cell_id] = round(seconds, 1)
            capture = (outcomes[0].get("info") or {}).get("step_capture", "-")
            accs = [o.get("metrics", {}).get(suite.metric["key"]) for o in outcomes if "error" not in o]
            echo(f"done {group[0].cell_id}: {len(group)} run(s) in {seconds:.0f} s; {suite.metric['key']} "
                 f"{', '.join(f'{a:.2f}' for a in accs if a is not None)}; step_capture {capture}")
            pack(records, out)
    except Deadline:
        done = set(summary["cells_done"])
        summary["cells_stopped"] = [c for c in started_cells if c not in done]
        echo(f"deadline: stopping {len(summary['cells_stopped'])} running cell(s): {', '.join(summary['cells_stopped'])}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        results.close()  # kills the workers still running (benchmarks.running.executors)
        signal.signal(signal.SIGALRM, previous)
    return summary


def write_summary(out: Path, args, suite, specs, skipped: int, summary: dict, check: list[Step], wall: float,
                  device_name: str) -> Path:
    lines = [f"# GPU lend: {suite.key}, profile {args.profile}", "",
             f"Device {device_name}; budget {args.budget_s:.0f} s, wall {wall:.0f} s; --jobs {args.jobs}, capture "
             f"{os.environ.get('PFL_CAPTURE_STEP', 'off')}, TF32 {'on' if args.allow_tf32 else 'off'}; "
             f"`{command_line()}`", "",
             f"{len(specs)} run(s) selected ({' '.join(args.only or []) or 'all cells'}"
             f"{', seeds ' + ' '.join(map(str, args.seeds)) if args.seeds else ''}), {skipped} already recorded, "
             f"{summary['finished']} finished here, {summary['failed']} failed.", "",
             "| step | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.0f} |" for s in check]
    lines += ["", "| cell | state | seconds |", "| --- | --- | --- |"]
    lines += [f"| {c} | finished | {summary['seconds'][c]} |" for c in summary["cells_done"]]
    lines += [f"| {c} | stopped at the deadline | - |" for c in summary["cells_stopped"]]
    lines += [f"| {c} | not started (under --min-start-s left) | - |" for c in summary["cells_not_started"]]
    path = out / "lend.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.running.gpu_lend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="cafeme/table1")
    parser.add_argument("--profile", default="paper")
    parser.add_argument("--only", action="append", metavar="AXIS=LABEL[,LABEL]", default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="override the profile's seeds (the seeds of a cell already run elsewhere, left out)")
    parser.add_argument("--records-dir", default=DEFAULT_RECORDS, help="committed records: their runs are skipped")
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="where the GPU report, lend.md and records.tar.gz go (default $OUT, else a temp folder)")
    parser.add_argument("--budget-s", type=float, default=540, help="seconds for everything (default 540: 9 min)")
    parser.add_argument("--check-s", type=float, default=120, help="seconds for step 1 (default 120)")
    parser.add_argument("--min-start-s", type=float, default=240,
                        help="start a cell only while this many seconds are left (default 240, a harness choice)")
    parser.add_argument("--jobs", type=int, default=4,
                        help="cells at a time on the device (default 4, a harness choice; the first lend measured "
                             "about 1.2x one cell's throughput with 4)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default 1)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--capture-step", choices=("off", "cuda_graphs", "auto"), default="auto",
                        help="auto: cuda_graphs on CUDA, off elsewhere")
    parser.add_argument("--allow-tf32", action="store_true", help="TF32 on CUDA (recorded per run; default off)")
    parser.add_argument("--first", nargs="*", default=["cafeme"], help="methods whose cells start first")
    parser.add_argument("--workloads", nargs="*", default=["fedavg-rmnist", "cafeme-rmnist"],
                        help="speed-benchmark workloads of step 1")
    parser.add_argument("--skip-check", action="store_true", help="no step 1")
    parser.add_argument("--git-commit", default=None, help="the commit the records name (default: git here)")
    args = parser.parse_args(argv)

    import torch

    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    cuda = torch.cuda.is_available() and args.device != "cpu"
    args.device = "cuda" if cuda else "cpu"
    capture = ("cuda_graphs" if cuda else "off") if args.capture_step == "auto" else args.capture_step
    os.environ["PFL_CAPTURE_STEP"] = capture
    out = Path(args.out or tempfile.mkdtemp(prefix="pflbench-lend-"))
    out.mkdir(parents=True, exist_ok=True)
    records = Path(tempfile.mkdtemp(prefix="pflbench-records-"))

    def echo(text: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {text}", flush=True)

    suite = load_suite(args.suite)
    specs = suite.expand(args.profile, seeds=args.seeds, only=parse_only(args.only))
    done = recorded_hashes(args.records_dir, suite.key)
    groups = pending_groups(specs, done, args.first)
    skipped = sum(s.config_hash in done for s in specs)
    echo(f"{suite.key} [{args.profile}]: {len(specs)} run(s), {skipped} already recorded in {args.records_dir}, "
         f"{sum(map(len, groups))} to run in {len(groups)} cell(s); device {args.device}, capture {capture}, "
         f"--jobs {args.jobs}, budget {args.budget_s:.0f} s")

    from pfl_core.engine.device import configure_device

    configure_device(args.device, args.allow_tf32)
    check: list[Step] = []
    if not args.skip_check:
        check = check_steps(cuda, args.workloads, min(args.check_s, max(deadline - time.monotonic() - 60, 10)))
        for step in check:
            echo(f"check: {step.name} {step.status} ({step.seconds:.0f} s)")
        slug = "cpu-rehearsal" if not cuda else torch.cuda.get_device_name().lower().replace(" ", "-")
        (out / f"gpu-{slug}.md").write_text(render(check, cuda))
    summary = run_cells(args, suite, groups, records, out, deadline, echo) if groups else empty_summary()
    pack(records, out)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    path = write_summary(out, args, suite, specs, skipped, summary, check, time.monotonic() - t0, name)
    echo(f"{summary['finished']} run(s) recorded in {out / 'records.tar.gz'}; summary {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
