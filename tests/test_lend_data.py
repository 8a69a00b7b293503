"""Datasets carried to a GPU lend in parts (benchmarks/running/lend_data.py): packed on small
CIFAR-10 pickles in the real layout with a part size that cuts files across parts, then unpacked
byte-identical; a missing part, a damaged piece and a wrong folder each refused in one line."""
from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.running import lend_data
from fake_data import write_cifar10, write_mnist


@pytest.fixture
def packed(tmp_path):
    data = tmp_path / "data"
    write_cifar10(data, n_per_batch=40)
    write_mnist(data, n_train=60, n_test=10)
    out = tmp_path / "parts"
    manifest = lend_data.pack(data, ["cifar-10-batches-py", "MNIST/raw"], out, part_mib=40_000 / 2**20)
    return data, out, manifest


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_roundtrip_is_byte_identical_across_parts(packed, tmp_path):
    data, out, manifest = packed
    assert manifest["parts"] >= 3
    assert any(len({p["part"] for p in e["pieces"]}) > 1 for e in manifest["files"])  # a file cut across parts
    for k in range(1, manifest["parts"] + 1):  # no part over its size (the manifest aside)
        size = sum(f.stat().st_size for f in (out / f"part{k}").rglob("*") if f.is_file() and f.name != lend_data.MANIFEST)
        assert 0 < size <= 40_000
    back = tmp_path / "back"
    lend_data.unpack(out, back)
    assert _tree(back) == _tree(data)


def test_a_missing_part_is_named(packed, tmp_path, capsys):
    _, out, manifest = packed
    shutil.rmtree(out / "part2")
    assert lend_data.main(["unpack", str(out), "--data-dir", str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"part 2 of {manifest['parts']} is not here" in err


def test_a_damaged_piece_is_refused(packed, tmp_path):
    _, out, manifest = packed
    piece = manifest["files"][0]["pieces"][-1]
    path = out / f"part{piece['part']}" / piece["name"]
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(lend_data.LendDataError, match=manifest["files"][0]["path"]):
        lend_data.unpack(out, tmp_path / "back")


def test_every_part_holds_the_whole_manifest(packed):
    _, out, manifest = packed
    for k in range(1, manifest["parts"] + 1):
        assert json.loads((out / f"part{k}" / lend_data.MANIFEST).read_text()) == manifest


def test_a_wrong_folder_is_one_line(tmp_path, capsys):
    assert lend_data.main(["pack", "cifar-10-batches-py", "--data-dir", str(tmp_path), "--out", str(tmp_path / "p")]) == 2
    assert "name dataset folders relative to --data-dir" in capsys.readouterr().err
