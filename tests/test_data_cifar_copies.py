"""CIFAR copies loaded knowingly, and the three data errors (issue 37, items 1 and 2).

Tiny pickles in the real ``cifar-10-batches-py`` layout (``tests/fake_data.py``). The official archive
is stood in for by patching torchvision's md5 lists to the written files' md5s; the known
reconstruction by mapping each written file to the manifest's md5 (the shipped table itself is
what is matched). A test on the real reconstruction (``PFL_SHARED_CIFAR10``: a data directory with
``cifar-10-batches-py/``) skips when it is absent."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from torchvision import datasets as tv

from pfl_core.data import DatasetNotFoundError, load_dataset, load_sources
from pfl_core.data import cifar_files
from pfl_core.data.cifar_files import ACCEPT_ENV, CIFAR10_RECONSTRUCTION
from pfl_core.data.errors import DatasetChecksumError, DatasetPartialError

from fake_data import write_cifar10, write_cifar_layout

SHARED_DATA = Path(os.environ.get("PFL_SHARED_CIFAR10", Path(__file__).parents[2] / "shared" / "data"))
FOLDER = "cifar-10-batches-py"


@pytest.fixture
def official(tmp_path, monkeypatch):
    """Tiny CIFAR-10 pickles that pass the (patched) official md5 check; returns the data dir."""
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    write_cifar10(tmp_path, 4, monkeypatch)
    return tmp_path


def _damage(data_dir: Path, name: str = "test_batch") -> Path:
    """Rewrite ``name`` with other labels: a sound pickle whose md5 is no longer the official one."""
    path = data_dir / FOLDER / name
    entry = pickle.loads(path.read_bytes())
    entry["labels"] = [(y + 1) % 10 for y in entry["labels"]]
    path.write_bytes(pickle.dumps(entry))
    return path


def _error(data_dir: Path, kind: type, name: str = "cifar10", download: bool = False) -> str:
    with pytest.raises(kind) as info:
        load_dataset(name, data_dir, "train", download=download)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_official_copy_loads_with_no_provenance(official):
    ds = load_dataset("cifar10", official, "all", download=False)
    assert len(ds) == 24 and ds.provenance == ""


def test_known_reconstruction_loads_and_says_so(official, monkeypatch):
    """A folder whose md5s are the reconstruction's manifest loads, and every split says what it is."""
    real = cifar_files.file_md5
    monkeypatch.setattr(cifar_files, "file_md5",
                        lambda path: CIFAR10_RECONSTRUCTION.md5.get(path.name) if path.parent.name == FOLDER else real(path))
    for split in ("train", "test", "all"):
        ds = load_dataset("cifar10", official, split, download=False)
        assert CIFAR10_RECONSTRUCTION.name in ds.provenance and "not the official archive" in ds.provenance
        assert "121 of 60,000" in ds.provenance
    joined = load_sources("cifar10", ["train", "test"], official, download=False)
    assert joined.provenance == ds.provenance  # kept when splits are joined
    assert joined.subset(np.arange(3)).provenance == ds.provenance  # and when subsampled


def test_not_found_names_the_path_and_both_fixes(tmp_path, monkeypatch):
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    message = _error(tmp_path / "empty", DatasetNotFoundError)
    assert message.startswith(f"CIFAR-10 not found under {tmp_path / 'empty'} (expected {tmp_path / 'empty' / FOLDER})")
    assert "PFL_DATA_DIR / --data-dir" in message and "PFL_DOWNLOAD=1" in message
    assert "partial" not in message and "checksum" not in message


def test_partial_names_the_missing_files(official):
    for name in ("data_batch_3", "test_batch"):
        (official / FOLDER / name).unlink()
    message = _error(official, DatasetPartialError)
    assert message.startswith(f"CIFAR-10 partial under {official / FOLDER}: 5 of 7 files there, missing "
                              "data_batch_3, test_batch;")
    assert "not found" not in message and "checksum" not in message
    with pytest.raises(DatasetNotFoundError):  # a partial copy is also "not found" to a caller that
        load_dataset("cifar10", official, "test", download=False)  # catches only that


def test_checksum_failure_names_the_file_and_the_switch(official):
    damaged = _damage(official)
    message = _error(official, DatasetChecksumError)
    assert message.startswith(f"CIFAR-10 checksum failed for {damaged} (md5 ")
    assert "1 of 7 files differ: test_batch" in message
    assert message.endswith(f"{ACCEPT_ENV}=cifar10")
    assert "not found" not in message and "partial" not in message


def test_the_three_messages_differ(tmp_path, monkeypatch):
    """Missing, partial and checksum-failing data: three error classes, three different first words."""
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    firsts = set()
    for case, kind in (("missing", DatasetNotFoundError), ("partial", DatasetPartialError),
                       ("checksum", DatasetChecksumError)):
        root = tmp_path / case
        if case != "missing":
            write_cifar10(root, 2, monkeypatch)
        if case == "partial":
            (root / FOLDER / "batches.meta").unlink()
        if case == "checksum":
            _damage(root, "data_batch_1")
        with pytest.raises(kind) as info:
            load_dataset("cifar10", root, "test", download=False)
        assert type(info.value) is kind
        firsts.add(str(info.value).split(" under ")[0].split(" for ")[0])
    assert firsts == {"CIFAR-10 not found", "CIFAR-10 partial", "CIFAR-10 checksum failed"}


def test_the_switch_accepts_a_failing_copy_knowingly(official, monkeypatch):
    _damage(official)
    monkeypatch.setenv(ACCEPT_ENV, "cifar100")  # another dataset's switch does not accept this one
    _error(official, DatasetChecksumError)
    monkeypatch.setenv(ACCEPT_ENV, "cifar100, CIFAR10")
    ds = load_dataset("cifar10", official, "test", download=False)
    assert f"accepted by {ACCEPT_ENV}=cifar10" in ds.provenance and "(test_batch)" in ds.provenance
    assert "not the official archive" in ds.provenance
    assert ds.y.tolist() == [1, 2, 3, 4]  # the copy's own labels (the written 0..3, each + 1)


def test_cifar100_gets_the_same_checks(tmp_path, monkeypatch):
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    write_cifar_layout(tmp_path, tv.CIFAR100, monkeypatch)
    assert load_dataset("cifar100", tmp_path, "test", download=False).provenance == ""
    path = tmp_path / "cifar-100-python" / "test"
    path.write_bytes(path.read_bytes() + b"\0")  # pickle ignores trailing bytes; the md5 does not
    message = _error(tmp_path, DatasetChecksumError, "cifar100")
    assert message.startswith(f"CIFAR-100 checksum failed for {path}") and f"{ACCEPT_ENV}=cifar100" in message
    assert CIFAR10_RECONSTRUCTION.name not in message
    (tmp_path / "cifar-100-python" / "meta").unlink()
    assert "missing meta" in _error(tmp_path, DatasetPartialError, "cifar100")


def test_download_is_tried_only_when_no_file_is_there(official, monkeypatch):
    """A partial folder is reported, never downloaded over; an empty one is downloaded (the network
    call replaced: it fails as offline), and that failure is the not-found message."""
    def no_network(self):
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(tv.CIFAR10, "download", no_network)
    (official / FOLDER / "data_batch_2").unlink()
    _error(official, DatasetPartialError, download=True)
    message = _error(official / "empty", DatasetNotFoundError, download=True)
    assert "download failed: <urlopen error" in message and "PFL_DATA_DIR" in message


@pytest.mark.skipif(not (SHARED_DATA / FOLDER / "data_batch_1").is_file(),
                    reason="no real CIFAR-10 copy (PFL_SHARED_CIFAR10)")
def test_the_real_reconstruction_loads_and_says_so():
    if cifar_files.official_md5(tv.CIFAR10) == {f: cifar_files.file_md5(SHARED_DATA / FOLDER / f)
                                               for f in CIFAR10_RECONSTRUCTION.md5}:
        pytest.skip("this copy is the official archive")
    ds = load_dataset("cifar10", SHARED_DATA, "test", download=False)
    assert ds.provenance.startswith(f"CIFAR-10 is {CIFAR10_RECONSTRUCTION.name}")
    assert len(ds) == 10_000 and np.bincount(ds.y.numpy()).tolist() == [1000] * 10
