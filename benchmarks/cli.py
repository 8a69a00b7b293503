"""The ``pflbench`` command line: run, list and report suites."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.suite import SuiteError, load_suite, parse_only

SUITES_DIR = Path("suites")


def _tracker(args):
    from benchmarks.tracking import Tracker  # MLflow is slow to import; only when needed

    return Tracker(args.tracking_uri)


def cmd_run(args) -> int:
    suite = load_suite(args.suite)
    specs = suite.expand(args.profile, seeds=args.seeds, only=parse_only(args.only))
    if not specs:
        print(f"{suite.key}: no run matches --only {args.only}", file=sys.stderr)
        return 2
    tracker = _tracker(args)
    from benchmarks.runner import pending_runs, run_sweep

    if args.dry_run:
        todo, done = pending_runs(specs, tracker)
        for spec in specs:
            state = "FINISHED" if spec.config_hash in done else "pending"
            print(f"{spec.cell_id:50s} method={spec.method:12s} seed={spec.seed:<3d} "
                  f"hash={spec.config_hash} {state}")
        print(f"{len(specs)} runs ({len(specs) - len(todo)} already FINISHED, {len(todo)} to run); "
              f"profile={args.profile}, store={tracker.uri}")
        return 0
    summary = run_sweep(suite, specs, tracker, jobs=args.jobs, device=args.device,
                        data_dir=args.data_dir)
    print(f"{suite.key} [{args.profile}]: {summary.finished} finished, {summary.failed} failed, "
          f"{summary.skipped} skipped of {summary.total} runs in {summary.wall_s:.1f}s; "
          f"store: {tracker.uri}")
    rc = cmd_report(argparse.Namespace(**{**vars(args), "suites": [args.suite]})) if args.report else 0
    return 1 if summary.failed and args.strict else rc


def cmd_report(args) -> int:
    from benchmarks.report import write_report

    tracker = _tracker(args)
    for path in args.suites:
        suite = load_suite(path)
        md, csv, table = write_report(suite, tracker, args.profile, Path(args.out))
        runs = int(table["n_seeds"].sum())
        print(f"{suite.key} [{args.profile}]: {runs} finished runs -> {md}, {csv}")
    return 0


def cmd_list(args) -> int:
    from pfl_core.algorithms import METHODS
    from pfl_core.data import DATASETS, PARTITIONERS
    from pfl_core.evaluation import PROTOCOLS
    from pfl_core.models import MODELS

    registries = {"methods": METHODS, "datasets": DATASETS, "models": MODELS,
                  "partitioners": PARTITIONERS, "protocols": PROTOCOLS}
    if args.what == "suites":
        for path in sorted(SUITES_DIR.glob("*/*.yaml")):
            print(path)
    else:
        for name in registries[args.what].names():
            doc = (registries[args.what].get(name).__doc__ or "").strip().splitlines()
            print(f"{name:22s} {doc[0] if doc else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pflbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def store_args(p):
        p.add_argument("--tracking-uri", default=None,
                       help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///results/mlflow.db)")
        p.add_argument("--profile", default="paper", help="paper (default), quick, smoke, ...")

    run = sub.add_parser("run", help="run every cell x seed of a suite, skipping finished runs")
    run.add_argument("suite", help="path of a suite file, e.g. suites/demo/offline.yaml")
    store_args(run)
    run.add_argument("--seeds", type=int, nargs="+", default=None, help="override the profile's seeds")
    run.add_argument("--only", action="append", metavar="AXIS=LABEL[,LABEL]",
                     help="restrict to cells whose AXIS has one of the labels (repeatable)")
    run.add_argument("--jobs", type=int, default=1, help="parallel worker processes (default 1)")
    run.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    run.add_argument("--data-dir", default=None, help="dataset directory (default: $PFL_DATA_DIR or ~/.cache/pfl-data)")
    run.add_argument("--dry-run", action="store_true", help="list the expanded runs and exit")
    run.add_argument("--report", action="store_true", help="render the suite's report afterwards")
    run.add_argument("--out", default="reports", help="report folder (with --report)")
    run.add_argument("--strict", action="store_true", help="exit 1 if any run failed")
    run.set_defaults(func=cmd_run)

    report = sub.add_parser("report", help="render Markdown and CSV tables from the MLflow store")
    report.add_argument("suites", nargs="+", help="suite files")
    store_args(report)
    report.add_argument("--out", default="reports", help="output folder (default reports/)")
    report.set_defaults(func=cmd_report)

    lst = sub.add_parser("list", help="list registered components or suite files")
    lst.add_argument("what", choices=["methods", "datasets", "models", "partitioners", "protocols", "suites"])
    lst.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "data_dir", None):
        os.environ["PFL_DATA_DIR"] = args.data_dir
    try:
        return args.func(args)
    except SuiteError as err:
        print(f"pflbench: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
