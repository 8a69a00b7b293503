"""Atomic files (issue 29, item 4): every report file, figure, PDF and tuned-values file is written
under a temporary name in its directory and renamed, so a kill leaves no truncated file. The
tests record every file opened for writing and require that none of the final names is."""
from __future__ import annotations

import builtins
import io
import os

import pytest
from conftest import store
from test_report import fill_hand_store

from benchmarks.reporting import render_paper
from benchmarks.store.tracking import Tracker
from benchmarks.tuning.tuned_file import write_tuned
from pfl_core.atomic_file import atomic_path, write_text


@pytest.fixture
def opened_for_writing(monkeypatch):
    """The paths opened for writing (any mode with w, a, x or +) while the test runs."""
    opened, real = [], builtins.open

    def recording_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
            opened.append(os.fspath(file))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    monkeypatch.setattr(io, "open", recording_open)
    return opened


@pytest.mark.slow
def test_report_tables_figures_and_pdf_are_renamed_into_place(isolated, opened_for_writing):
    uri, art = store(isolated / "store")
    tracker = Tracker(uri, art)
    suites = fill_hand_store(isolated, tracker)
    opened_for_writing.clear()  # the store's own files are MLflow's
    done = render_paper("hand", [suites["curves"], suites["bestval"]], tracker, "paper", isolated / "reports")
    finals = [done.pdf, *(p for part in done.suites for p in (part.md, part.csv, part.tex, *part.pngs))]
    assert all(p.exists() for p in finals) and any(p.suffix == ".png" for p in finals)
    written = {os.path.realpath(p) for p in opened_for_writing}
    assert not written & {os.path.realpath(p) for p in finals}, "a report file was written in place"
    assert not [p for p in (isolated / "reports").rglob("*") if ".tmp" in p.name]


def test_tuned_file_is_renamed_into_place(tmp_path, opened_for_writing):
    path = tmp_path / "suite.tuned.yml"
    write_tuned(path, "p/s", "cell=a", "fedavg", "smoke", {"method.params.lr": 0.1}, {"trials": 3})
    write_tuned(path, "p/s", "cell=a", "local", "smoke", {"method.params.lr": 0.2}, {"trials": 3})
    assert str(path) not in opened_for_writing
    assert "local" in path.read_text() and "fedavg" in path.read_text()  # the read-modify-write kept both


def test_an_error_while_writing_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "table.md"
    write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["table.md"]


@pytest.mark.slow
def test_a_report_killed_mid_render_leaves_temporary_files_the_next_report_removes(isolated, tiny_suite,
                                                                                    dead_and_live_pids):
    """``.tiny.<pid>.tmp.pdf`` and ``tiny/.mini.<pid>.tmp.md``: a ``pflbench report`` killed before
    its renames. The next ``pflbench report`` into that folder removes them when their writer is
    gone, and keeps a live writer's."""
    from benchmarks import cli

    dead, live = dead_and_live_pids
    uri, _ = store(isolated / "store")
    out = isolated / "out"
    common = ["--tracking-uri", uri, "--profile", "smoke"]
    assert cli.main(["run", str(tiny_suite), *common, "--device", "cpu", "--seeds", "0",
                     "--only", "setting=iid", "--only", "method=local"]) == 0
    (out / "tiny").mkdir(parents=True)
    stale = [out / f".tiny.{dead}.tmp.pdf", out / "tiny" / f".mini.{dead}.tmp.md"]
    writing = out / f".tiny.{live}.tmp.pdf"
    for path in (*stale, writing):
        path.write_bytes(b"half a file")
    assert cli.main(["report", str(tiny_suite), *common, "--out", str(out)]) == 0
    assert (out / "tiny.pdf").is_file() and not any(p.exists() for p in stale) and writing.exists()
