"""A run on a copy that is not the official archive says so everywhere (issue 37, item 1): run info
(``run_info.json``), the run's tag ``data_provenance``, and every report and snapshot built from such
runs, beside the table. A sweep of one tiny CIFAR-10 cell (pickles of ``tests/fake_data.py``) is run
twice into two stores: once as the official archive (md5s patched into torchvision's lists), once as
the known reconstruction (each file mapped to the manifest's md5)."""
from __future__ import annotations

import copy
import json

import pytest
from pypdf import PdfReader

from benchmarks.reporting import render_paper
from benchmarks.reporting.snapshot import SnapshotTracker, export_snapshot, provenance_markdown, snapshot_note
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import DATA_PROVENANCE_TAG, Tracker
from pfl_core.data import cifar_files
from pfl_core.data.cifar_files import ACCEPT_ENV, CIFAR10_RECONSTRUCTION
from conftest import store, tiny_suite_dict, write_suite
from fake_data import write_cifar10

pytestmark = pytest.mark.slow  # two tiny sweeps and their reports (about 20 s)


def cifar_suite() -> dict:
    """The tiny suite on CIFAR-10: one cell (iid, fedavg), one seed, two rounds."""
    data = copy.deepcopy(tiny_suite_dict())
    data.update(paper="prov", name="cifar", table="Provenance table")
    data["base"]["data"].update(dataset="cifar10", num_clients=4, unseen_fraction=0.25)
    data["base"]["federation"].update(clients_per_round=2, batch_size=8)
    data["grid"] = [{"name": "setting", "values": [{"label": "iid", "set": {"data.partition": {"name": "iid"}}}]},
                    {"name": "method", "key": "method.name", "values": ["fedavg"]}]
    data["seeds"] = [0]
    data["profiles"] = {"smoke": {"seeds": [0], "set": {"federation.rounds": 2, "evaluation.params.steps": 1}}}
    data["published"] = [{"cell": {"setting": "iid", "method": "fedavg"}, "mean": 50.0, "source": "T"}]
    return data


def sweep(root, reconstruction: bool, monkeypatch):
    """One smoke sweep on tiny CIFAR-10 files under ``root/data``; returns (suite, tracker, report)."""
    with monkeypatch.context() as mp:
        mp.delenv(ACCEPT_ENV, raising=False)
        write_cifar10(root / "data", 24, mp)
        if reconstruction:
            real = cifar_files.file_md5
            mp.setattr(cifar_files, "file_md5", lambda p: CIFAR10_RECONSTRUCTION.md5.get(p.name)
                       if p.parent.name == "cifar-10-batches-py" else real(p))
        suite = load_suite(write_suite(root / "suites" / "prov" / "cifar.yaml", cifar_suite()))
        tracker = Tracker(*store(root / "store"))
        summary = run_sweep(suite, suite.expand("smoke"), tracker, device="cpu", data_dir=str(root / "data"),
                            echo=lambda *a, **k: None)
        assert summary.finished == 1, summary
    rendered = render_paper("prov", [suite], tracker, "smoke", root / "reports")
    return suite, tracker, rendered


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        for reconstruction in (False, True):
            root = tmp_path_factory.mktemp("recon" if reconstruction else "official")
            mp.chdir(root)
            out[reconstruction] = (root, *sweep(root, reconstruction, mp))
    return out


def run_of(tracker: Tracker, suite):
    (run,) = tracker.runs(suite.key)
    return run


def run_info(tracker: Tracker, run) -> dict:
    path = tracker.client.download_artifacts(run.info.run_id, "run_info.json")
    return json.loads(open(path).read())


def test_the_official_archive_records_nothing(both):
    _, suite, tracker, rendered = both[False]
    run = run_of(tracker, suite)
    assert DATA_PROVENANCE_TAG not in run.data.tags
    assert "data_provenance" not in run_info(tracker, run)
    assert "Data provenance" not in rendered.suites[0].md.read_text()


def test_the_reconstruction_is_in_run_info_and_the_tag(both):
    _, suite, tracker, _ = both[True]
    run = run_of(tracker, suite)
    tag = run.data.tags[DATA_PROVENANCE_TAG]
    assert tag.startswith(f"CIFAR-10 is {CIFAR10_RECONSTRUCTION.name}") and "not the official archive" in tag
    assert run_info(tracker, run)["data_provenance"] == tag


def test_every_report_says_so_beside_the_table(both):
    _, suite, tracker, rendered = both[True]
    line = f"Data provenance: CIFAR-10 is {CIFAR10_RECONSTRUCTION.name}"
    md = rendered.suites[0].md.read_text().splitlines()
    table = next(i for i, text in enumerate(md) if text.startswith("| setting |"))
    assert any(line in text and "(1 of 1 runs)" in text for text in md[table - 4:table])  # just above it
    assert line in rendered.suites[0].tex.read_text()
    pdf = " ".join(" ".join(p.extract_text().split()) for p in PdfReader(rendered.pdf).pages)
    assert line in pdf


def test_snapshots_say_so(both, monkeypatch):
    root, suite, tracker, _ = both[True]
    monkeypatch.chdir(root)
    path = root / "reports" / "reproduced" / "prov" / "cifar.snapshot.json"
    export_snapshot(suite, tracker, path, {"machine": "test"})
    snap = SnapshotTracker.load(path)
    assert f"**data provenance** (1 of 1 runs): CIFAR-10 is {CIFAR10_RECONSTRUCTION.name}" in \
        provenance_markdown(snap, path.with_suffix("").with_suffix(".md"))
    assert f"Data provenance: CIFAR-10 is {CIFAR10_RECONSTRUCTION.name}" in snapshot_note(snap, path)
    again = render_paper("prov", [suite], snap, "smoke", root / "from_snapshot")  # rendered from the snapshot
    assert f"Data provenance: CIFAR-10 is {CIFAR10_RECONSTRUCTION.name}" in again.suites[0].md.read_text()
