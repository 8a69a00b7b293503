"""``pflbench gpu-check`` / ``make gpu-check``: the GPU claims of the README checked by one command
(issue 26, item 6), with its report at ``reports/gpu/<device>.md``.

On a machine with CUDA it runs every step; without one (or with ``--dry-run``) it runs in a dry
mode: every step that can run on a CPU runs (the GPU guard, the collection of the ``gpu``-marked
tests, the CPU side of the speed benchmark, cut down), and the report says which steps need a GPU.
Steps:

1. ``gpu tests``: the ``gpu``-marked tests (``tests/test_gpu_paths.py``: the engine equivalence
   cases on CUDA against the CPU, in float64 and in float32 with TF32 off); they skip without CUDA.
2. ``guard``: ``tests/test_gpu_guard.py``, the stand-in device checks (mismatches, host syncs in a
   client step, float64, sync budgets); a CPU test, run in both modes.
3. ``speed``: :mod:`benchmarks.timing.speed`, sequential and batched paths, on CUDA (the batched
   ones also with CUDA-graph step capture, ``--capture``) and (cut down) on the CPU.
4. ``packing``: :mod:`benchmarks.timing.packing`, the same demo runs swept with ``--jobs`` 1, 2, 4, 8
   on the GPU (runs per hour each); on the CPU two smoke runs with ``--jobs`` 1 and 2 exercise it
   (16 runs of the demo's ``quick`` profile and the jobs values are harness choices: enough runs to
   fill 8 workers twice, in minutes).
5. ``rmnist slice``: :mod:`benchmarks.timing.round_timing` on CAFeMe Table 1's RMNIST cells at the
   ``paper`` profile (FedAvg and CAFeMe, 3 rounds each, projected to the RMNIST half of the
   table); it needs MNIST under ``--data-dir`` (or ``PFL_DATA_DIR``) on the GPU machine.

"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NOT_BUILT: list[str] = []  # steps of the check not built yet (listed in the report as such)


@dataclass
class Step:
    """One step of the check: ``status`` is ``passed``, ``failed``, ``needs a GPU`` or ``not built``."""

    name: str
    status: str
    seconds: float = 0.0
    output: str = ""
    command: str = ""


def _run(name: str, argv: list[str], timeout: int) -> Step:
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        output, ok = proc.stdout + proc.stderr, proc.returncode in (0, 5)  # 5: pytest collected nothing
    except subprocess.TimeoutExpired as err:
        partial = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        output, ok = f"timed out after {timeout} s\n{partial}", False
    return Step(name, "passed" if ok else "failed", time.perf_counter() - started,
                "\n".join(output.strip().splitlines()[-40:]), " ".join(argv[2:] if argv[1] == "-m" else argv[1:]))


def plan(cuda: bool, tests: str = "tests", data_dir: str | None = None) -> list[tuple[str, list[str] | None, str]]:
    """(step name, command or None when it needs a GPU this machine lacks, why) of every step."""
    py = [sys.executable, "-m"]
    data = ["--data-dir", data_dir] if data_dir else []
    quick_cpu = ["--devices", "cpu", "--only", "cafeme-rmnist", "--rounds", "1", "--seeds", "1", "--threads", "1"]
    steps = [("gpu tests", [*py, "pytest", "-q", "-m", "gpu", "-rs", tests], "the `gpu`-marked tests"),
             ("guard", [*py, "pytest", "-q", "-m", "not slow", "tests/test_gpu_guard.py"],
              "the GPU path on a stand-in device (CPU)"),
             ("speed cpu", [*py, "benchmarks.timing.speed", *quick_cpu], "speed benchmark, CPU side (one workload, cut down)"),
             ("speed cuda", [*py, "benchmarks.timing.speed", "--devices", "cuda", "--capture"] if cuda else None,
              "speed benchmark on CUDA, every workload, sequential / batched / lockstep seeds, each batched "
              "path also with CUDA-graph step capture"),
             ("packing cpu", [*py, "benchmarks.timing.packing", "demo/offline", "--profile", "smoke", "--jobs", "1", "2",
                              "--runs", "2", "--device", "cpu"], "--jobs packing sweep, CPU side (two smoke runs)"),
             ("packing cuda", [*py, "benchmarks.timing.packing", "demo/offline", "--profile", "quick", "--jobs", "1", "2",
                               "4", "8", "--runs", "16", "--device", "cuda"] if cuda else None,
              "--jobs packing sweep on one GPU: 16 demo runs with --jobs 1, 2, 4, 8"),
             ("rmnist slice", [*py, "benchmarks.timing.round_timing", "cafeme/table1", "--profile", "paper", "--only",
                               "dataset=rmnist", "--only", "method=fedavg,cafeme", "--rounds", "3", "--device", "cuda",
                               *data] if cuda else None,
              "CAFeMe Table 1, RMNIST cells, paper profile: 3 rounds per cell and the projection (needs MNIST)")]
    return steps


def device_slug(cuda: bool) -> str:
    """The report's file name: the GPU's name (``nvidia-h100-80gb-hbm3``), or ``cpu-dry-run``."""
    if not cuda:
        return "cpu-dry-run"
    import torch

    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def default_out(dry_run: bool) -> Path:
    """``reports/gpu`` where the check runs on CUDA (its report is committed); in dry mode the
    results folder's ``gpu/`` (:func:`benchmarks.store.location.results_dir`, ignored by git)."""
    import torch

    from benchmarks.store.location import results_dir

    return results_dir() / "gpu" if dry_run or not torch.cuda.is_available() else Path("reports/gpu")


def run_check(out: Path = Path("reports/gpu"), dry_run: bool = False, tests: str = "tests",
              timeout: int = 3600, data_dir: str | None = None) -> tuple[Path, list[Step]]:
    """Run the steps (dry mode without CUDA or with ``dry_run``) and write the report."""
    import torch

    from pfl_core.engine.device import configure_device

    cuda = torch.cuda.is_available() and not dry_run
    configure_device("cuda" if cuda else "cpu")  # TF32 off, as in every step (the report's flags)
    steps = []
    for name, argv, why in plan(cuda, tests, data_dir):
        step = _run(name, argv, timeout) if argv else Step(name, "needs a GPU", output=why)
        if name == "gpu tests" and not cuda and step.status == "passed":
            step.status = "passed (skipped: need CUDA)" if " skipped" in step.output else step.status
        steps.append(step)
        print(f"gpu-check: {name:12s} {step.status} ({step.seconds:.0f} s)", flush=True)
    steps += [Step(name, "not built") for name in NOT_BUILT]
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{device_slug(cuda)}.md"
    path.write_text(render(steps, cuda))
    return path, steps


def render(steps: list[Step], cuda: bool) -> str:
    from pfl_core.engine.device import device_info

    info = device_info("cuda" if cuda else "cpu")
    mode = "on a GPU" if cuda else "DRY MODE (no CUDA device): the steps marked `needs a GPU` did not run"
    lines = [f"# GPU check: {info['device_name']}", "", f"Mode: {mode}.", "",
             f"torch {info['torch_version']}, CUDA {info['cuda_version'] or '-'}, cuDNN {info['cudnn_version'] or '-'}, "
             f"TF32 {'on' if info['allow_tf32'] else 'off'}; written by `pflbench gpu-check` on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
             "| step | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.0f} |" for s in steps]
    for s in steps:
        if s.output:
            lines += ["", f"## {s.name}", "", f"`{s.command}`" if s.command else "", "", "```", s.output, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="pflbench gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return cmd_gpu_check(parser.parse_args(argv))


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None,
                        help="report folder (default: reports/gpu on a GPU; in dry mode <results dir>/gpu, outside "
                             "the tracked tree, since a dry run's report is not a measurement to commit)")
    parser.add_argument("--dry-run", action="store_true", help="dry mode even with a GPU (CPU steps only)")
    parser.add_argument("--tests", default="tests", help="where the gpu-marked tests are collected (default tests)")
    parser.add_argument("--data-dir", default=None,
                        help="datasets for the RMNIST slice (MNIST in torchvision's layout; default PFL_DATA_DIR)")


def cmd_gpu_check(args) -> int:
    out = Path(args.out) if args.out else default_out(args.dry_run)
    path, steps = run_check(out, args.dry_run, args.tests, data_dir=args.data_dir)
    needs = [s.name for s in steps if s.status == "needs a GPU"]
    print(f"gpu-check: report {path}" + (f"; needs a GPU: {', '.join(needs)}" if needs else ""))
    return 1 if any(s.status == "failed" for s in steps) else 0


if __name__ == "__main__":
    raise SystemExit(main())
