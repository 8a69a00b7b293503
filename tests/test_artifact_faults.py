"""A run artifact cut short on disk (issue 38, item 5): ``pflbench report`` refuses in one line
naming the run, the file and the fix; the next ``pflbench run`` marks the run FAILED and recomputes
it; a checkpoint cut short is named and the run starts again."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from benchmarks import cli
from benchmarks.store.artifact_faults import file_fault
from conftest import store

RUN = ["--device", "cpu", "--profile", "smoke", "--seeds", "0", "--only", "setting=iid", "--only", "method=local"]


@pytest.fixture
def one_run(isolated, tiny_suite):
    """(suite, store URI, client, the FINISHED run) after one ``pflbench run``."""
    uri, _ = store(isolated / "store")
    assert cli.main(["run", str(tiny_suite), "--tracking-uri", uri, *RUN]) == 0
    client = MlflowClient(tracking_uri=uri)
    (run,) = cell_runs(client, "FINISHED")
    return tiny_suite, uri, client, run


def cell_runs(client: MlflowClient, status: str):
    exp = client.get_experiment_by_name("tiny/mini").experiment_id
    return [r for r in client.search_runs([exp], f"attributes.status = '{status}'", ViewType.ALL)
            if r.data.tags.get("run_kind") == "cell"]


def cut(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def artifact(client, run, name):
    from benchmarks.store.artifact_faults import artifact_folder

    return artifact_folder(client.get_run(run.info.run_id)) / name


@pytest.mark.slow
def test_report_refuses_a_run_whose_artifact_is_cut_short(one_run, capsys):
    suite, uri, client, run = one_run
    report = ["report", str(suite), "--tracking-uri", uri, "--profile", "smoke"]
    for name in ("run_info.json", "config.json", "clients.json"):
        path = artifact(client, run, name)
        whole = path.read_bytes()
        cut(path)
        capsys.readouterr()
        assert cli.main(report) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("pflbench: error: "), err
        for part in (run.info.run_id, name, "cut short", str(path), f"pflbench run {suite} --profile smoke"):
            assert part in err[0], err[0]
        path.write_bytes(whole)
    assert cli.main(report) == 0


@pytest.mark.slow
def test_the_next_run_marks_it_failed_and_recomputes_it(one_run, capsys):
    suite, uri, client, run = one_run
    cut(artifact(client, run, "run_info.json"), keep=0.9)
    capsys.readouterr()
    assert cli.main(["run", str(suite), "--tracking-uri", uri, *RUN]) == 0
    out = capsys.readouterr().out
    named = [line for line in out.splitlines() if run.info.run_id in line]
    assert len(named) == 1 and "run_info.json" in named[0] and "recomputing" in named[0], out
    (failed,) = cell_runs(client, "FAILED")
    assert failed.info.run_id == run.info.run_id and "run_info.json cut short" in failed.data.tags["failure_reason"]
    (again,) = cell_runs(client, "FINISHED")
    assert again.info.run_id != run.info.run_id
    assert again.data.tags["config_hash"] == run.data.tags["config_hash"]
    assert cli.main(["report", str(suite), "--tracking-uri", uri, "--profile", "smoke"]) == 0


def test_arrays_and_states_cut_short_are_found(tmp_path):
    arrays, state = tmp_path / "dlg.npz", tmp_path / "state.pt"
    np.savez_compressed(arrays, x=np.arange(1000.0))
    torch.save({"w": torch.arange(1000.0)}, state)
    assert file_fault(arrays) is None and file_fault(state) is None
    cut(arrays, 0.8)
    cut(state, 0.8)
    assert "cut short" in file_fault(arrays) and "zip archive" in file_fault(state)


def test_a_checkpoint_cut_short_is_named_and_the_run_starts_again(tmp_path, caplog):
    from test_checkpoint import ROUNDS, Stop, _config, _stop_after

    from pfl_core.checkpoint import Checkpointing
    from pfl_core.experiment import run_experiments

    cfg = _config("fedavg", 0)
    saving = Checkpointing([tmp_path / "abc123.pt"], every=2)
    with pytest.raises(Stop):
        run_experiments([cfg], device="cpu", on_round=_stop_after(3), checkpointing=saving)
    cut(saving.paths[0])
    with caplog.at_level(logging.WARNING, logger="pfl_core.checkpoint"):
        (result,) = run_experiments([cfg], device="cpu", checkpointing=saving)
    named = [r.getMessage() for r in caplog.records if "abc123.pt" in r.getMessage()]
    assert len(named) == 1 and "cut short" in named[0] and "starts again from round 0" in named[0]
    assert "resumed_from_round" not in result.info and result.info["checkpoint_discarded"] == named[0]
    assert [row["round"] for row in result.history] == list(range(1, ROUNDS + 1))  # every round ran again
