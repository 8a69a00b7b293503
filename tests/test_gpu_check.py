"""``make gpu-check`` / ``pflbench gpu-check`` (issue 26, item 6): its dry mode on a CPU."""
from __future__ import annotations

import sys

import pytest

from benchmarks.running import gpu_check
from benchmarks.cli import main
from conftest import make_dry_run


def test_make_gpu_check_calls_the_subcommand():
    assert "pflbench gpu-check" in make_dry_run("gpu-check")


def test_the_plan_runs_the_gpu_tests_the_guard_and_both_speed_paths():
    on_gpu = {name: argv for name, argv, _ in gpu_check.plan(cuda=True)}
    assert on_gpu["gpu tests"][-4:] == ["-m", "gpu", "-rs", "tests"]
    assert "tests/test_gpu_guard.py" in on_gpu["guard"]
    assert on_gpu["speed cuda"][-3:] == ["--devices", "cuda", "--capture"] and "cpu" in on_gpu["speed cpu"]
    assert not gpu_check.NOT_BUILT  # every step of the check is built
    on_cpu = {name: argv for name, argv, _ in gpu_check.plan(cuda=False)}
    assert on_cpu["speed cuda"] is None and all(on_cpu[k] for k in ("gpu tests", "guard", "speed cpu"))
    assert on_cpu["packing cuda"] is None and on_cpu["rmnist slice"] is None and on_cpu["packing cpu"]
    assert on_gpu["packing cuda"][-5:] == ["8", "--runs", "16", "--device", "cuda"]
    sliced = gpu_check.plan(cuda=True, data_dir="/data")
    rmnist = dict((name, argv) for name, argv, _ in sliced)["rmnist slice"]
    assert rmnist[-2:] == ["--data-dir", "/data"] and "dataset=rmnist" in rmnist and "paper" in rmnist


def test_the_rmnist_slice_names_real_cells_of_the_paper_profile():
    """The slice's suite, profile and --only labels exist (a renamed label would fail on the GPU)."""
    from benchmarks.suite.spec import load_suite, parse_only

    argv = dict((name, argv) for name, argv, _ in gpu_check.plan(cuda=True))["rmnist slice"]
    only = parse_only([argv[i + 1] for i, a in enumerate(argv) if a == "--only"])
    specs = load_suite(argv[argv.index("benchmarks.timing.round_timing") + 1]).expand(
        argv[argv.index("--profile") + 1], seeds=[0], only=only)
    assert {s.cell["method"] for s in specs} == {"fedavg", "cafeme"} and {s.cell["dataset"] for s in specs} == {"rmnist"}


@pytest.mark.slow
def test_the_dry_mode_runs_what_a_cpu_can_and_names_what_needs_a_gpu(tmp_path, monkeypatch, capsys):
    """The real gpu-marked tests (they skip here); the guard and the CPU speed run stand in for
    quick commands (their own tests cover them); one planted failure fails the command."""
    real = gpu_check.plan

    def quick(cuda, tests="tests", data_dir=None):
        steps = real(cuda, "tests/test_gpu_paths.py", data_dir)
        stand_in = {"guard": [sys.executable, "-c", "print('guard ok')"],
                    "speed cpu": [sys.executable, "-c", "print('fedavg-rmnist cpu sequential 1.0')"],
                    "packing cpu": [sys.executable, "-c", "print('| 1 | 2 | 0 | 1.0 | 7200 |')"]}
        return [(name, stand_in.get(name, argv), why) for name, argv, why in steps]

    monkeypatch.setattr(gpu_check, "plan", quick)
    assert main(["gpu-check", "--dry-run", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "cpu-dry-run.md").read_text()
    assert "DRY MODE" in report and "torch " in report and "TF32 off" in report
    assert "| gpu tests | passed (skipped: need CUDA) |" in report
    assert "| speed cuda | needs a GPU |" in report and "| guard | passed |" in report
    assert "| packing cuda | needs a GPU |" in report and "| rmnist slice | needs a GPU |" in report
    assert "| packing cpu | passed |" in report and "step capture" in report
    assert "needs a GPU: speed cuda, packing cuda, rmnist slice" in capsys.readouterr().out

    def failing(cuda, tests="tests", data_dir=None):
        return [(name, [sys.executable, "-c", "raise SystemExit(1)"] if name == "guard" else argv, why)
                for name, argv, why in quick(cuda, tests, data_dir)]

    monkeypatch.setattr(gpu_check, "plan", failing)
    assert main(["gpu-check", "--dry-run", "--out", str(tmp_path)]) == 1
    assert "| guard | failed |" in (tmp_path / "cpu-dry-run.md").read_text()


@pytest.mark.slow
def test_the_real_dry_run_speed_step_runs_on_the_cpu(tmp_path):
    """The CPU speed step as gpu-check runs it (one workload, one timed round)."""
    (argv,) = [argv for name, argv, _ in gpu_check.plan(cuda=False) if name == "speed cpu"]
    step = gpu_check._run("speed cpu", argv + ["--csv", str(tmp_path / "speed.csv")], timeout=600)
    assert step.status == "passed", step.output
    assert "cafeme-rmnist" in (tmp_path / "speed.csv").read_text()


@pytest.mark.slow
def test_the_packing_sweep_runs_each_jobs_value_into_a_fresh_store(capsys):
    """The CPU packing step as gpu-check runs it: two smoke runs swept with --jobs 1 and 2, every
    run finished in each (a fresh store each time: nothing skipped as FINISHED)."""
    from benchmarks.timing import packing

    (argv,) = [argv for name, argv, _ in gpu_check.plan(cuda=False) if name == "packing cpu"]
    assert packing.main(argv[argv.index("benchmarks.timing.packing") + 1:]) == 0
    out = capsys.readouterr().out
    assert "| 1 | 2 | 0 |" in out and "| 2 | 2 | 0 |" in out and "most runs per hour: --jobs" in out


def test_the_dry_mode_writes_its_report_outside_the_tracked_tree(tmp_path, monkeypatch):
    """A dry run's report is not a measurement: by default it goes to the results folder (ignored by
    git), never into reports/gpu/ of the checkout; on CUDA the default is reports/gpu."""
    monkeypatch.setenv("PFLBENCH_RESULTS_DIR", str(tmp_path / "results"))
    assert gpu_check.default_out(dry_run=True) == tmp_path / "results" / "gpu"
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert str(gpu_check.default_out(dry_run=False)) == "reports/gpu"
    assert gpu_check.default_out(dry_run=True) == tmp_path / "results" / "gpu"
