"""How many runs one device packs: the same runs swept with ``--jobs 1``, ``2``, ``4``, ... on one
device, each into a fresh MLflow store, with the wall-clock and runs per hour of each (the
``--jobs`` packing sweep of ``pflbench gpu-check``).

    python -m benchmarks.timing.packing demo/offline --profile quick --jobs 1 2 4 --device cuda

The first ``--runs`` runs of the profile (default 8) are swept once per ``--jobs`` value, exactly as
``pflbench run --jobs N`` sweeps them (worker processes, one torch thread each, the training stack
limit shared by ``N``: :mod:`pfl_core.engine.memory`). The best ``N`` is the one with the most runs
per hour; past it the device (or its memory) is full. Nothing is kept: the stores are temporary.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.suite.spec import load_suite, parse_only


@dataclass
class Packing:
    jobs: int
    runs: int
    failed: int
    wall_s: float

    @property
    def runs_per_hour(self) -> float:
        return 3600.0 * (self.runs - self.failed) / self.wall_s if self.wall_s > 0 else 0.0


def sweep_once(suite, specs, jobs: int, device: str, data_dir: str | None) -> Packing:
    """Sweep ``specs`` with ``jobs`` workers on ``device`` into a fresh temporary store."""
    from benchmarks.running.sweep import run_sweep
    from benchmarks.store.tracking import Tracker

    previous = os.environ.get("PFL_JOBS_PER_DEVICE")
    os.environ["PFL_JOBS_PER_DEVICE"] = str(jobs)  # as pflbench run --jobs sets it
    try:
        with tempfile.TemporaryDirectory(prefix="pflbench-packing-") as tmp:
            tracker = Tracker(f"sqlite:///{Path(tmp) / 'mlflow.db'}", Path(tmp) / "artifacts")
            started = time.perf_counter()
            summary = run_sweep(suite, specs, tracker, jobs=jobs, device=device, data_dir=data_dir,
                                echo=lambda *_: None, reuse=False)
            return Packing(jobs, len(specs), summary.failed, time.perf_counter() - started)
    finally:
        if previous is None:
            os.environ.pop("PFL_JOBS_PER_DEVICE", None)
        else:
            os.environ["PFL_JOBS_PER_DEVICE"] = previous


def table(rows: list[Packing]) -> str:
    lines = ["| jobs | runs | failed | wall s | runs per hour |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.jobs} | {r.runs} | {r.failed} | {r.wall_s:.1f} | {r.runs_per_hour:.0f} |" for r in rows]
    best = max(rows, key=lambda r: r.runs_per_hour)
    return "\n".join(lines) + f"\n\nmost runs per hour: --jobs {best.jobs}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.timing.packing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", help="a suite file or packaged name (e.g. demo/offline)")
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--only", action="append", metavar="AXIS=LABEL[,LABEL]")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4], help="worker counts to sweep (default 1 2 4)")
    parser.add_argument("--runs", type=int, default=8, help="runs swept per --jobs value (default 8)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    if args.runs < 1 or any(j < 1 for j in args.jobs):
        parser.error("--runs and every --jobs value must be >= 1")
    suite = load_suite(args.suite)
    specs = suite.expand(args.profile, only=parse_only(args.only))[: args.runs]
    rows = []
    for jobs in args.jobs:
        rows.append(sweep_once(suite, specs, jobs, args.device, args.data_dir))
        print(f"packing: --jobs {jobs}: {len(specs)} runs in {rows[-1].wall_s:.1f} s", flush=True)
    print(table(rows))
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
