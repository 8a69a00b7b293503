"""The pflbench command line, called in-process through benchmarks.cli.main."""
from __future__ import annotations

import re

import pytest
from mlflow.tracking import MlflowClient

from benchmarks.cli import main
from benchmarks.suite.spec import load_suite
from pfl_core.algorithms import METHODS
from pfl_core.data import DATASETS, PARTITIONERS
from pfl_core.evaluation import PROTOCOLS
from pfl_core.models import MODELS
from conftest import REPO_ROOT, tiny_suite_dict, write_suite

REGISTRIES = {"methods": METHODS, "datasets": DATASETS, "models": MODELS,
              "partitioners": PARTITIONERS, "protocols": PROTOCOLS}


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


@pytest.fixture
def uri(tmp_path):
    return f"sqlite:///{tmp_path}/store/mlflow.db"


def count_runs(uri: str, kind: str = "cell") -> int:
    """Runs of the store: (cell, seed) runs, or with ``kind="sweep"`` the parent run of each sweep."""
    client = MlflowClient(tracking_uri=uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps) if exps else []
    return sum((r.data.tags.get("run_kind") == "sweep") == (kind == "sweep") for r in runs)


def spec_lines(out: str, specs) -> dict[str, str]:
    lines = {}
    for spec in specs:
        found = [line for line in out.splitlines() if f"hash={spec.config_hash}" in line]
        assert len(found) == 1, f"{spec.config_hash}: {found}"
        lines[spec.config_hash] = found[0]
    return lines


@pytest.mark.slow
def test_dry_run_then_run_then_dry_run(tiny_suite, uri, capsys, tmp_path):
    (tmp_path / "store").mkdir()
    specs = load_suite(tiny_suite).expand("smoke")
    args = ["run", str(tiny_suite), "--profile", "smoke", "--tracking-uri", uri, "--device", "cpu"]

    assert main(args + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    for spec, line in zip(specs, spec_lines(out, specs).values()):
        assert line.rstrip().endswith("pending")
        assert spec.cell_id in line and f"method={spec.method}" in line and f"seed={spec.seed}" in line
    assert f"{len(specs)} runs (0 already FINISHED, {len(specs)} to run); profile=smoke, store={uri}" in out
    assert count_runs(uri) == 0  # a dry run runs nothing

    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"{len(specs)} finished, 0 failed, 0 skipped of {len(specs)} runs" in out
    assert (count_runs(uri), count_runs(uri, "sweep")) == (len(specs), 1)

    assert main(args + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert all(line.rstrip().endswith("FINISHED") for line in spec_lines(out, specs).values())
    assert f"{len(specs)} runs ({len(specs)} already FINISHED, 0 to run)" in out

    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"0 finished, 0 failed, {len(specs)} skipped of {len(specs)} runs" in out
    assert (count_runs(uri), count_runs(uri, "sweep")) == (len(specs), 2)  # a dry run has no parent run


def test_only_and_seeds_in_dry_run(tiny_suite, uri, capsys, tmp_path):
    (tmp_path / "store").mkdir()
    rc = main(["run", str(tiny_suite), "--profile", "smoke", "--tracking-uri", uri, "--dry-run",
               "--only", "method=fedavg", "--seeds", "3", "4", "5"])
    assert rc == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "hash=" in line]
    n_settings = len(tiny_suite_dict()["grid"][0]["values"])
    assert len(lines) == n_settings * 3
    assert all("method=fedavg " in line for line in lines)
    assert {re.search(r"seed=(\d+)", line).group(1) for line in lines} == {"3", "4", "5"}


def test_only_matching_nothing_or_unknown_axis(tiny_suite, uri, capsys):
    assert main(["run", str(tiny_suite), "--tracking-uri", uri, "--only", "method=fedvag", "--dry-run"]) == 2
    assert "no run matches" in capsys.readouterr().err
    assert main(["run", str(tiny_suite), "--tracking-uri", uri, "--only", "dataset=mnist", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pflbench: error:") and "'dataset'" in err and str(tiny_suite) in err


@pytest.mark.parametrize("what", sorted(REGISTRIES))
def test_list_registered_names(what, capsys):
    assert main(["list", what]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert names == REGISTRIES[what].names()
    assert names


def test_list_suites_names_the_packaged_suites_wherever_it_runs(tmp_path, monkeypatch, capsys):
    """``list suites``: one line per packaged suite, its short name first, whatever the current
    directory holds (a ``suites/`` folder there is not the package's)."""
    write_suite(tmp_path / "suites" / "a" / "one.yaml", tiny_suite_dict())
    packaged = sorted(p.relative_to(REPO_ROOT / "suites").with_suffix("").as_posix()
                      for p in (REPO_ROOT / "suites").glob("*/*.yaml"))
    for cwd in (tmp_path, REPO_ROOT):  # read-only: `list suites` touches no store
        monkeypatch.chdir(cwd)
        assert main(["list", "suites"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in lines] == packaged
    demo = next(line for line in lines if line.startswith("demo/offline "))
    assert "Offline demo" in demo and "profiles: paper, smoke" in demo


def test_misspelled_method_exits_2_and_runs_nothing(tmp_path, uri, capsys):
    data = tiny_suite_dict()
    data["grid"][1]["values"] = ["local", "fedvag"]
    data.pop("published")
    path = write_suite(tmp_path / "typo.yaml", data)
    assert main(["run", str(path), "--profile", "smoke", "--tracking-uri", uri]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("pflbench: error:")
    assert str(path) in captured.err and "fedvag" in captured.err
    assert all(name in captured.err for name in METHODS.names())
    db = tmp_path / "store" / "mlflow.db"
    assert not db.exists() or count_runs(uri) == 0
    assert not (tmp_path / "results").exists()  # no default store was created either


def test_missing_suite_file_exits_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml"), "--dry-run"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_report_command_writes_md_and_csv(tiny_suite, uri, tmp_path, capsys):
    (tmp_path / "store").mkdir()
    only = ["--only", "setting=iid"]
    assert main(["run", str(tiny_suite), "--profile", "smoke", "--tracking-uri", uri, "--device", "cpu", *only]) == 0
    n_runs = len(load_suite(tiny_suite).expand("smoke", only={"setting": ["iid"]}))
    capsys.readouterr()
    out_dir = tmp_path / "out"
    assert main(["report", str(tiny_suite), "--profile", "smoke", "--tracking-uri", uri, "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    md, csv = out_dir / "tiny" / "mini.md", out_dir / "tiny" / "mini.csv"
    assert md.is_file() and csv.is_file()
    assert f"tiny/mini [smoke]: {n_runs} finished runs -> {md}, {csv}" in out
    assert "| iid | fedavg |" in md.read_text()
    assert not (tmp_path / "reports").exists()  # --out was honoured


def test_run_with_report_uses_default_store_under_cwd(tiny_suite, tmp_path, capsys):
    rc = main(["run", str(tiny_suite), "--profile", "smoke", "--device", "cpu", "--only", "setting=dir",
               "--only", "method=local", "--report"])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"sqlite:///{(tmp_path / 'results' / 'mlflow.db').resolve()}" in out
    assert count_runs(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}") == 2
    assert (tmp_path / "reports" / "tiny" / "mini.md").is_file()
    assert (tmp_path / "results" / "mlartifacts").is_dir()


def _failing_suite(tmp_path):
    data = tiny_suite_dict()
    data["methods"] = {"fedavg": {"method.params.lr": 1.0e38}}  # MLR overflows to NaN in round 1
    data.pop("published")
    return write_suite(tmp_path / "fails.yaml", data)


@pytest.mark.slow
def test_exit_code_is_1_when_a_run_failed_unless_allow_failures(tmp_path, uri, capsys):
    """Issue 15, item 9: a failed run fails the command by default; --allow-failures is the lenient
    behaviour; --strict (the old opt-in) is accepted and means the default."""
    (tmp_path / "store").mkdir()
    path = _failing_suite(tmp_path)
    base = ["run", str(path), "--profile", "smoke", "--tracking-uri", uri, "--device", "cpu",
            "--seeds", "0", "--only", "setting=iid", "--only", "method=fedavg,local"]
    assert main(base) == 1  # the default: a failed run fails the command
    assert "1 finished, 1 failed" in capsys.readouterr().out
    assert main(base + ["--allow-failures"]) == 0  # the failed run is retried, fails again, exit 0
    assert "0 finished, 1 failed, 1 skipped" in capsys.readouterr().out
    assert main(base + ["--strict"]) == 1
    assert "0 finished, 1 failed, 1 skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the two are contradictory
        main(base + ["--strict", "--allow-failures"])


def test_strict_with_report_still_fails(tmp_path, uri, capsys):
    (tmp_path / "store").mkdir()
    path = _failing_suite(tmp_path)
    rc = main(["run", str(path), "--profile", "smoke", "--tracking-uri", uri, "--device", "cpu", "--seeds", "0",
               "--only", "setting=iid", "--only", "method=fedavg", "--strict", "--report",
               "--out", str(tmp_path / "rep")])
    assert "0 finished, 1 failed" in capsys.readouterr().out
    assert rc == 1


@pytest.mark.slow
def test_a_run_another_suite_finished_is_reused_unless_no_reuse(tmp_path, uri, capsys):
    """Same cell in suites a and b: b copies a's run (printed, counted); --no-reuse computes it."""
    (tmp_path / "store").mkdir()
    one = ["--profile", "smoke", "--tracking-uri", uri, "--device", "cpu", "--only", "setting=dir",
           "--only", "method=fedavg", "--seeds", "0"]
    paths = {name: write_suite(tmp_path / f"{name}.yaml", {**tiny_suite_dict(), "name": name}) for name in "abc"}
    assert main(["run", str(paths["a"]), *one]) == 0
    assert "1 finished, 0 failed, 0 skipped of 1 runs" in capsys.readouterr().out
    assert main(["run", str(paths["b"]), *one, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "reuse: copy of tiny/a run " in out and "(0 already FINISHED, 1 to run, 1 of them copied" in out
    assert main(["run", str(paths["b"]), *one, "--dry-run", "--no-reuse"]) == 0
    assert "(0 already FINISHED, 1 to run); " in capsys.readouterr().out
    assert main(["run", str(paths["b"]), *one]) == 0
    assert "0 finished, 0 failed, 0 skipped, 1 reused from other suites of 1 runs" in capsys.readouterr().out
    assert main(["run", str(paths["c"]), *one, "--no-reuse"]) == 0
    assert "1 finished, 0 failed, 0 skipped of 1 runs" in capsys.readouterr().out
    client = MlflowClient(tracking_uri=uri)
    reused = {e.name: [r.data.tags.get("reused_from.experiment") for r in client.search_runs([e.experiment_id])
                       if r.data.tags.get("run_kind") == "cell"] for e in client.search_experiments()
              if e.name != "Default"}
    assert reused == {"tiny/a": [None], "tiny/b": ["tiny/a"], "tiny/c": [None]}


def test_step_capture_without_cuda_exits_2_naming_the_fix(tiny_suite, uri, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("PFL_CAPTURE_STEP", raising=False)
    assert main(["run", str(tiny_suite), "--profile", "smoke", "--tracking-uri", uri,
                 "--capture-step", "cuda_graphs"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pflbench: error: --capture-step cuda_graphs needs a CUDA device") and "drop --capture-step" in err
    assert "PFL_CAPTURE_STEP" not in __import__("os").environ
