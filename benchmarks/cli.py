"""The ``pflbench`` command line: run, tune, list and report suites."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

from benchmarks import __version__
from benchmarks.suite.packaged import suite_names, suites_dir
from benchmarks.suite.spec import load_suite, parse_only
from benchmarks.suite.schema import SuiteError
from pfl_core.experiment import EXECUTION_CHOICES
from pfl_core.engine.capture import CAPTURES

TRACKING_URI_HELP = ("MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///<results dir>/mlflow.db, "
                     "the results dir being $PFLBENCH_RESULTS_DIR or the checkout's results/)")
SUITE_HELP = ("a packaged suite's name, e.g. demo/offline (pflbench list suites), or the path of a suite "
              "file, e.g. suites/demo/offline.yaml")
DEFAULT_CHECKPOINT_EVERY = 50
"""Rounds between checkpoints of a run (``--checkpoint-every``): a paper run of 1000-2000 rounds
killed mid-way loses at most 50 rounds; runs shorter than that never write one."""
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?|mps")


def device_arg(value: str) -> str:
    """``--device``: auto, cpu, cuda, cuda:N or mps, checked before anything runs."""
    if not DEVICE_PATTERN.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device; use auto, cpu, cuda, cuda:N or mps")
    return value


def check_local_device(args) -> None:
    """A CUDA device asked of this machine must exist, and so must one for ``--capture-step`` (a Ray
    cluster's workers are checked there)."""
    if args.executor != "local":
        return
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SuiteError(f"--device {args.device}: torch sees no CUDA device on this machine; use "
                         f"--device auto or cpu")
    capture = getattr(args, "capture_step", None)
    if capture not in (None, "off") and (args.device == "cpu" or not torch.cuda.is_available()):
        raise SuiteError(f"--capture-step {capture} needs a CUDA device (this run's device: {args.device}, "
                         f"CUDA available: {torch.cuda.is_available()}); drop --capture-step")


def _executor(args):
    """The executor of ``--executor local|ray`` and its options (run and tune)."""
    from benchmarks.running.executors import LocalExecutor, RayExecutor

    if args.executor == "local":
        ray_only = {"--address": args.address, "--gpus-per-run": args.gpus_per_run, "--max-retries": args.max_retries}
        given = [flag for flag, value in ray_only.items() if value is not None]
        if given:
            raise SuiteError(f"{', '.join(given)}: only with --executor ray")
        return LocalExecutor(args.jobs, args.threads)
    return RayExecutor(args.jobs, args.threads, address=args.address, gpus_per_run=args.gpus_per_run,
                       max_retries=2 if args.max_retries is None else args.max_retries, device=args.device)


def _tracker(args):
    from benchmarks.store.tracking import Tracker  # MLflow is slow to import; only when needed

    return Tracker(args.tracking_uri)


def cmd_report(args, rendered: list | None = None) -> int:
    """``pflbench report`` (:mod:`benchmarks.reporting.commands`; pandas and matplotlib load only here,
    never in a ``--jobs`` worker, which imports this module)."""
    from benchmarks.reporting.commands import cmd_report as report

    return report(args, rendered)


def cmd_snapshot(args) -> int:
    """``pflbench snapshot`` (:mod:`benchmarks.reporting.commands`)."""
    from benchmarks.reporting.commands import cmd_snapshot as snapshot

    return snapshot(args)


def cmd_run(args) -> int:
    suite = load_suite(args.suite)
    check_local_device(args)
    stack_settings(args)
    specs = suite.expand(args.profile, seeds=args.seeds, only=parse_only(args.only))
    if not specs:
        print(f"{suite.key}: no run matches --only {args.only}", file=sys.stderr)
        return 2
    from benchmarks.suite.preflight import preflight

    gaps = preflight(suite, specs, args.data_dir, data=not args.no_data_check,  # every cell, before any run
                     dry_run=args.dry_run)
    if args.dry_run:
        return dry_run(args, suite, specs, _tracker(args), gaps)
    executor = _executor(args)
    executor.start()  # the workers import the run code while the store opens
    try:
        return sweep_and_report(args, suite, specs, _tracker(args), executor)
    finally:
        executor.close()


def dry_run(args, suite, specs, tracker, gaps=()) -> int:
    """``--dry-run``: each run's hash and whether the store holds it FINISHED, or (without
    ``--no-reuse``) which other suite's run a sweep would copy for it; then, per dataset, what is
    missing, partial or failing its checksum and where it is expected (``gaps``, from the pre-flight,
    which downloads nothing in a dry run). Nothing runs (a suite file the experiment does not admit
    is refused as the sweep would refuse it); missing data does not fail it."""
    from benchmarks.store.ownership import check_owner
    from benchmarks.store.reuse import find_sources, other_experiments
    from benchmarks.running.sweep import pending_runs

    check_owner(tracker, suite, share=args.share_experiment, write=False)
    todo, done = pending_runs(specs, tracker)
    sources = {} if args.no_reuse else find_sources(tracker, todo, specs[0].suite)
    names = other_experiments(tracker, specs[0].suite) if sources else {}
    for spec in specs:
        state = "FINISHED" if spec.config_hash in done else "pending"
        if spec.config_hash in sources:
            source = sources[spec.config_hash]
            state = f"reuse: copy of {names.get(source.info.experiment_id, '?')} run {source.info.run_id}"
        print(f"{spec.cell_id:50s} method={spec.method:12s} seed={spec.seed:<3d} "
              f"hash={spec.config_hash} {state}")
    reused = f", {len(sources)} of them copied from other suites" if sources else ""
    print(f"{len(specs)} runs ({len(specs) - len(todo)} already FINISHED, {len(todo)} to run{reused}); "
          f"profile={args.profile}, store={tracker.public_uri}")
    if gaps:
        from pfl_core.data import resolve_data_dir

        print(f"data not ready under {resolve_data_dir(args.data_dir)} (a dry run downloads nothing):")
        for gap in gaps:
            print(gap.line())
    return 0


def sweep_and_report(args, suite, specs, tracker, executor) -> int:
    """The sweep of ``specs`` on ``executor``, then (``--report``) the suite's tables and PDF."""
    from benchmarks.store.claims import LEASE_S
    from benchmarks.running.sweep import SweepInterrupted, run_sweep

    try:
        summary = run_sweep(suite, specs, tracker, device=args.device, data_dir=args.data_dir,
                            executor=executor, execution=args.execution,
                            lockstep_seeds=args.lockstep_seeds, lease_s=args.lease or LEASE_S,
                            checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir,
                            deterministic=args.deterministic, command=getattr(args, "command_line", None),
                            reuse=not args.no_reuse, allow_tf32=args.allow_tf32,
                            share_experiment=args.share_experiment)
    except SweepInterrupted as stop:
        print(f"{suite.key} [{args.profile}]: {stop}", file=sys.stderr)
        return stop.exit_code
    elsewhere = f", {summary.elsewhere} left to another runner" if summary.elsewhere else ""
    elsewhere += f", {summary.reused} reused from other suites" if summary.reused else ""
    print(f"{suite.key} [{args.profile}]: {summary.finished} finished, {summary.failed} failed, "
          f"{summary.skipped} skipped{elsewhere} of {summary.total} runs in {summary.wall_s:.1f}s; "
          f"store: {tracker.public_uri}")
    rc, rendered = 0, []
    if args.report:
        rc = cmd_report(argparse.Namespace(**{**vars(args), "suites": [args.suite]}), rendered)
        from benchmarks.reporting.commands import report_files

        tracker.log_report(summary.parent_run_id, report_files(rendered, suite.key))
    from benchmarks.store.mlflow_ui import experiment_url, ui_base

    print(f"MLflow UI ({'make mlflow-ui, then ' if tracker.uri.startswith('sqlite:') else ''}open): "
          f"{experiment_url(ui_base(tracker.public_uri), tracker.experiment_id(suite.key))}")
    return 1 if summary.failed and not args.allow_failures else rc


def stack_settings(args) -> None:
    """``--stack-limit``, ``--jobs`` and ``--capture-step`` reach every run (workers inherit the
    environment) as ``PFL_STACK_LIMIT``, ``PFL_JOBS_PER_DEVICE`` (:mod:`pfl_core.engine.memory`) and
    ``PFL_CAPTURE_STEP`` (:mod:`pfl_core.engine.capture`)."""
    if getattr(args, "stack_limit", None) is not None:
        if args.stack_limit < 0:
            raise SuiteError(f"--stack-limit must be >= 0 (0: no limit), got {args.stack_limit}")
        os.environ["PFL_STACK_LIMIT"] = str(args.stack_limit)
    os.environ.setdefault("PFL_JOBS_PER_DEVICE", str(max(1, getattr(args, "jobs", 1) or 1)))
    if getattr(args, "capture_step", None):
        os.environ["PFL_CAPTURE_STEP"] = args.capture_step


def cmd_tune(args) -> int:
    """One Optuna study per (suite, cell, method, profile) on validation data (benchmarks.tuning.tune)."""
    from benchmarks.tuning.tune import tune
    from benchmarks.tuning.study import TuneOptions

    check_local_device(args)

    opts = TuneOptions(profile=args.profile, trials=args.trials, timeout=args.timeout, storage=args.storage,
                       jobs=args.jobs, seeds=tuple(args.seeds), validation_fraction=args.validation_fraction,
                       val_split=args.val_split, eval_points=args.eval_points, sampler=args.sampler,
                       sampler_seed=args.sampler_seed, pruner=args.pruner, pruner_startup=args.pruner_startup,
                       device=args.device, data_dir=args.data_dir, tracking_uri=args.tracking_uri,
                       write=not args.no_write)
    results = tune(args.suite, methods=args.method, cells=parse_only(args.cell), opts=opts, executor=_executor(args))
    failed = 0
    for r in results:
        counts = f"{r.n_complete} complete, {r.n_pruned} pruned, {r.n_failed} failed"
        if r.best_trial is None:
            failed += 1
            print(f"{r.study_name}: no complete trial ({counts})", file=sys.stderr)
            continue
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.best_params.items())
        print(f"{r.study_name}: best trial {r.best_trial} value={r.best_value:.4f} ({counts}); {params}"
              + (f" -> {r.tuned_file}" if r.tuned_file else ""))
    return 1 if failed else 0


def cmd_import(args) -> int:
    """``pflbench import RECORDS...``: run records (:mod:`benchmarks.store.records`, written where MLflow is
    absent: a lent GPU, another lab's machine) into the store, as if they had run here."""
    from benchmarks.store.records import import_records

    tracker = _tracker(args)
    counts = import_records(tracker, args.records)
    print(f"{counts['imported']} run(s) imported, {counts['skipped']} already FINISHED here, "
          f"{counts['refused']} refused; store {tracker.public_uri}")
    return 1 if counts["refused"] else 0


def cmd_list(args) -> int:
    from pfl_core.algorithms import METHODS
    from pfl_core.data import DATASETS, PARTITIONERS
    from pfl_core.evaluation import PROTOCOLS
    from pfl_core.models import MODELS

    registries = {"methods": METHODS, "datasets": DATASETS, "models": MODELS,
                  "partitioners": PARTITIONERS, "protocols": PROTOCOLS}
    if args.what == "suites":
        list_suites()
    else:
        for name in registries[args.what].names():
            doc = (registries[args.what].get(name).__doc__ or "").strip().splitlines()
            print(f"{name:22s} {doc[0] if doc else ''}")
    return 0


def cmd_show(args) -> int:
    """The suite as if written out in full (``extends`` merged), or with ``--only`` one run's config."""
    import yaml

    from benchmarks.suite.packaged import resolve_suite
    from benchmarks.suite.file import read_suite_file

    if not args.only:
        print(yaml.safe_dump(read_suite_file(resolve_suite(args.suite)), sort_keys=False, allow_unicode=True,
                             width=110), end="")
        return 0
    suite = load_suite(args.suite)
    specs = suite.expand(args.profile, None if args.seed is None else [args.seed], parse_only(args.only))
    cells = sorted({s.cell_id for s in specs})
    if len(cells) != 1:
        raise SuiteError(f"--only selects {len(cells)} cells of {suite.key}; name one (e.g. "
                         f"{' '.join('--only ' + c for c in cells[0].split(',')) if cells else '--only AXIS=LABEL'})")
    spec = specs[0]
    print(f"# {suite.key} {spec.cell_id} seed {spec.seed} profile {spec.profile}: config hash {spec.config_hash}")
    print(yaml.safe_dump(spec.config, sort_keys=False, allow_unicode=True, width=110), end="")
    return 0


def list_suites() -> None:
    """One line per packaged suite: its short name (what ``pflbench run`` takes), title and profiles."""
    from benchmarks.suite.file import read_suite_file

    for name in suite_names():
        raw = read_suite_file(suites_dir() / f"{name}.yaml")
        profiles = ", ".join(["paper", *(p for p in raw.get("profiles") or {} if p != "paper")])
        print(f"{name:20s} {raw.get('table', '')} (profiles: {profiles})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pflbench", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def executor_args(p, jobs_help):
        p.add_argument("--jobs", type=int, default=1, help=jobs_help)
        p.add_argument("--threads", type=int, default=None,
                       help="torch intra-op threads of every run (default 1, whatever --jobs: the numbers "
                            "then do not depend on --jobs; not part of the config hash, recorded per run)")
        p.add_argument("--executor", choices=["local", "ray"], default="local",
                       help="local: this process or --jobs worker processes (default); ray: Ray tasks")
        p.add_argument("--address", default=None,
                       help="Ray: the cluster to connect to (e.g. auto, HEAD:6379); default: start a local "
                            "Ray instance of --jobs x --threads CPUs and shut it down at the end")
        p.add_argument("--gpus-per-run", type=float, default=None, metavar="F",
                       help="Ray: GPU fraction each run reserves, e.g. 0.25 packs four runs per GPU "
                            "(default: 0 with --device cpu or no GPU in the cluster, else 1)")
        p.add_argument("--max-retries", type=int, default=None,
                       help="Ray: re-runs of a task whose worker died (default 2), then FAILED")

    def store_args(p):
        p.add_argument("--tracking-uri", default=None, help=TRACKING_URI_HELP)
        p.add_argument("--profile", default="paper", help="paper (default), quick, smoke, ...")

    run = sub.add_parser("run", help="run every cell x seed of a suite, skipping finished runs")
    run.add_argument("suite", help=SUITE_HELP)
    store_args(run)
    run.add_argument("--seeds", type=int, nargs="+", default=None, help="override the profile's seeds")
    run.add_argument("--only", action="append", metavar="AXIS=LABEL[,LABEL]",
                     help="restrict to cells whose AXIS has one of the labels (repeatable)")
    executor_args(run, "parallel worker processes, also packed on one GPU (default 1); with --executor ray "
                       "and no --address: the runs a local Ray instance runs at once")
    run.add_argument("--device", default="auto", type=device_arg, help="auto (CUDA if available), cpu or cuda")
    run.add_argument("--data-dir", default=None, help="dataset directory (default: $PFL_DATA_DIR or ~/.cache/pfl-data)")
    run.add_argument("--execution", choices=EXECUTION_CHOICES, default="auto",
                     help="how clients are computed: batched (vmapped stacks of clients), sequential (one at a "
                          "time, the reference) or auto (by the counted cost of a client step: batched on a GPU "
                          "and for small models on a CPU, tag execution_choice); never changes a number or "
                          "the config hash")
    run.add_argument("--stack-limit", type=int, default=None, metavar="N",
                     help="batched path: at most N clients per vmapped call (0: no limit); default: chosen "
                          "per run from the free GPU memory over --jobs and the model's step size, no limit on "
                          "a CPU (PFL_STACK_MEMORY_MB sets a budget); never changes a number (tag stack_limit)")
    run.add_argument("--capture-step", choices=CAPTURES, default=None,
                     help="batched path on CUDA: cuda_graphs records each vmapped client step shape once as "
                          "a CUDA graph and replays it (pfl_core/engine/capture.py); default off; never "
                          "changes a number or the config hash (tag step_capture)")
    run.add_argument("--lockstep-seeds", "--batch-seeds", action="store_true",
                     help="run the seeds of each cell together in lockstep, their clients stacked on the "
                          "batched path (one unit of work per cell for --jobs / Ray); for GPUs: on a CPU "
                          "it loses beyond a few seeds of a small model (docs/speed.md)")
    run.add_argument("--lease", type=float, default=None, metavar="SECONDS",
                     help="lease of a claimed run (default 60): another runner recomputes a run whose "
                          "runner died on another machine once its lease expired (on this machine: at once)")
    run.add_argument("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY, metavar="N",
                     help=f"save each run's federation state every N rounds and resume a killed run from it "
                          f"(default {DEFAULT_CHECKPOINT_EVERY}; 0: never)")
    run.add_argument("--checkpoint-dir", default=None,
                     help="checkpoint folder (default: checkpoints/ beside a SQLite store, else results/checkpoints)")
    run.add_argument("--deterministic", action="store_true",
                     help="PyTorch deterministic algorithms and CUBLAS_WORKSPACE_CONFIG in every worker (tagged "
                          "deterministic=true); like --execution, never part of the config hash")
    run.add_argument("--no-reuse", action="store_true",
                     help="compute runs that another suite of the store already finished (same config hash) "
                          "instead of copying them here with their provenance (tags reused_from.*)")
    run.add_argument("--share-experiment", action="store_true",
                     help="write into the suite's experiment even when another suite file (same paper/name) "
                          "owns it; admits this file from then on")
    run.add_argument("--allow-tf32", action="store_true",
                     help="let CUDA matmuls and cuDNN convolutions use TF32 (default off: GPU numbers then agree "
                          "with the CPU to float32 rounding; tagged allow_tf32); never part of the config hash")
    run.add_argument("--dry-run", action="store_true", help="list the expanded runs and exit (after the pre-flight)")
    run.add_argument("--no-data-check", action="store_true",
                     help="skip the pre-flight's data step (load, partition and protocol clients of every cell, "
                          "before any run and on --dry-run); the per-run checks stay")
    run.add_argument("--report", action="store_true", help="render the suite's report afterwards")
    run.add_argument("--out", default="reports", help="report folder (with --report)")
    run.add_argument("--beside-snapshot", action="append", metavar="FILE",
                     help="with --report: also render this committed snapshot first in the PDF (pflbench report "
                          "--beside-snapshot); repeatable")
    failures = run.add_mutually_exclusive_group()
    failures.add_argument("--allow-failures", action="store_true",
                          help="exit 0 even if runs failed (default: exit 1 when any run of this call failed; "
                               "the failed runs are logged FAILED with their reason either way)")
    failures.add_argument("--strict", action="store_true",
                          help="exit 1 when any run failed: the default since issue 15 (kept for old scripts)")
    run.set_defaults(func=cmd_run)

    from benchmarks.suite.code_reference import REPORT_HELP

    report = sub.add_parser("report", help="render tables (Markdown, LaTeX, CSV), figures and the "
                                           "paper's PDF from the MLflow store", epilog=REPORT_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_argument("suites", nargs="*", help="suite files or packaged suite names (their paper's PDF "
                                                  "covers the suites of the file's folder)")
    report.add_argument("--paper", default=None, help="every suite of suites/PAPER/*.yaml in the current directory, "
                                                      "else every packaged suite PAPER/<name> (pflbench list suites)")
    store_args(report)
    report.add_argument("--out", default="reports", help="output folder (default reports/)")
    report.add_argument("--beside-snapshot", action="append", metavar="FILE",
                        help="also render this committed snapshot first in the PDF, said to be one on page 1 "
                             "(make demo: the reproduced CGPFL Table 1 beside the demo's offline numbers); repeatable")
    report.add_argument("--from-snapshot", action="append", default=None, metavar="FILE",
                        help="render a committed snapshot (pflbench snapshot) instead of the store: its suite alone, "
                             "with a provenance page beside the table; repeatable (one file per suite: a paper's "
                             "snapshots in one PDF)")
    report.set_defaults(func=cmd_report)

    snap = sub.add_parser("snapshot", help="export a suite's finished runs from the store to one JSON file that "
                                           "`pflbench report --from-snapshot` renders without the store")
    snap.add_argument("suite", help=SUITE_HELP)
    snap.add_argument("--tracking-uri", default=None, help=TRACKING_URI_HELP)
    snap.add_argument("--profile", action="append", default=None, metavar="PROFILE",
                      help="export only this profile's runs; repeatable (default: every profile of the suite, "
                           "which `report --from-snapshot --profile` then selects from)")
    snap.add_argument("--only", action="append", metavar="KEY=VALUE",
                      help="export only these cells' runs (as for run); repeatable")
    target = snap.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", help="the snapshot file to write, e.g. reports/reproduced/cgpfl/table1.snapshot.json")
    target.add_argument("--into", metavar="FILE",
                        help="a committed snapshot to add the selected runs it lacks to (by run id), keeping "
                             "its records; each --note extends its provenance entry")
    snap.add_argument("--note", action="append", default=[], metavar="KEY=VALUE",
                      help="provenance to record (machine, command, data, wall-clock, ...); repeatable")
    snap.set_defaults(func=cmd_snapshot)

    imp = sub.add_parser("import", help="load run records (a folder or files; written by python -m "
                                        "benchmarks.running.gpu_lend) into the store as if they had run here")
    imp.add_argument("records", nargs="+", help="record files or folders holding them (<suite>/<hash>.json)")
    imp.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default as for run)")
    imp.set_defaults(func=cmd_import)

    tune = sub.add_parser("tune", help="Optuna studies of a suite's methods on validation data; the best "
                                       "parameters go to <suite>.tuned.yml")
    tune.add_argument("suite", help=SUITE_HELP)
    store_args(tune)
    tune.add_argument("--method", action="append", metavar="M",
                      help="method name or method-axis label (repeatable); 'all' = every method; default: the "
                           "suite's tuned.methods, else every method")
    tune.add_argument("--cell", action="append", metavar="AXIS=LABEL[,LABEL]",
                      help="restrict to cells whose AXIS has one of the labels (repeatable)")
    tune.add_argument("--trials", type=int, default=20, help="trial budget of each study (total; default 20)")
    tune.add_argument("--timeout", type=float, default=None, help="seconds per worker for this call")
    tune.add_argument("--storage", default=None,
                      help="Optuna RDB URL (default sqlite:///<results dir>/optuna.db; postgresql://... for many workers)")
    executor_args(tune, "workers sharing the storage, each running its share of the trials (default 1): "
                        "processes, or Ray tasks with --executor ray")
    tune.add_argument("--seeds", type=int, nargs="+", default=[1000, 1001],
                      help="tuning seeds, disjoint from the suite's seeds (default 1000 1001)")
    tune.add_argument("--validation-fraction", type=float, default=0.2,
                      help="unseen protocol: fraction of seen clients held out as validation clients (0.2)")
    tune.add_argument("--val-split", type=float, default=0.1,
                      help="seen protocol: val split carved out of each client's train part (0.1)")
    tune.add_argument("--eval-points", type=int, default=5, help="evaluations per run for pruning (5)")
    tune.add_argument("--sampler", choices=["tpe", "random"], default="tpe")
    tune.add_argument("--sampler-seed", type=int, default=0)
    tune.add_argument("--pruner", choices=["median", "hyperband", "none"], default="median")
    tune.add_argument("--pruner-startup", type=int, default=5, help="trials before the median pruner prunes (5)")
    tune.add_argument("--device", default="auto", type=device_arg, help="auto (CUDA if available), cpu or cuda")
    tune.add_argument("--data-dir", default=None, help="dataset directory (default: $PFL_DATA_DIR or ~/.cache/pfl-data)")
    tune.add_argument("--no-write", action="store_true", help="do not write the tuned-parameters file")
    tune.set_defaults(func=cmd_tune)

    check = sub.add_parser("gpu-check", help="check the GPU path and write reports/gpu/<device>.md (dry mode "
                                             "without CUDA: the CPU steps, and which steps need a GPU)")
    from benchmarks.running.gpu_check import add_arguments, cmd_gpu_check

    add_arguments(check)
    check.set_defaults(func=cmd_gpu_check)

    show = sub.add_parser("show", help="print a suite with its shared files merged in, or one run's resolved "
                                       "configuration and config hash (--only naming one cell)")
    show.add_argument("suite", help="a suite file or packaged name (e.g. cafeme/table1)")
    show.add_argument("--profile", default="paper")
    show.add_argument("--only", action="append", metavar="AXIS=LABEL[,LABEL]", help="select one cell (repeatable)")
    show.add_argument("--seed", type=int, default=None, help="the run's seed (default: the profile's first)")
    show.set_defaults(func=cmd_show)

    lst = sub.add_parser("list", help="list registered components or the packaged suites")
    lst.add_argument("what", choices=["methods", "datasets", "models", "partitioners", "protocols", "suites"])
    lst.set_defaults(func=cmd_list)
    return parser


def _masked_excepthook(kind, value, tb) -> None:
    """Print an uncaught exception's traceback with every password in a URI masked."""
    import traceback

    from benchmarks.store.location import mask_uri

    sys.stderr.write(mask_uri("".join(traceback.format_exception(kind, value, tb))))


def main(argv: list[str] | None = None) -> int:
    from benchmarks.store.location import StoreError, mask_uri

    sys.excepthook = _masked_excepthook  # tracebacks too keep store passwords out
    from benchmarks.store.faults import quiet_disk_full_logs

    quiet_disk_full_logs()  # a full disk: pflbench's one line, not MLflow's SQL and traceback before it
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["pflbench", *(sys.argv[1:] if argv is None else argv)])
    if getattr(args, "data_dir", None):
        os.environ["PFL_DATA_DIR"] = args.data_dir
    if getattr(args, "deterministic", False):  # before any CUDA call here, inherited by every worker process
        from pfl_core.seeding import CUBLAS_WORKSPACE

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    try:
        return args.func(args)
    except (SuiteError, StoreError) as err:
        print(f"pflbench: error: {mask_uri(str(err))}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a full disk is answered in one line, anything else re-raised
        from benchmarks.store.faults import disk_full, disk_full_message

        if not disk_full(err):
            raise
        print(f"pflbench: error: {mask_uri(disk_full_message(err))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
