"""CGPFL Figure 3(a)'s K sweep (benchmarks/reporting/k_sweep.py): seeds averaged per K, only FINISHED
CGPFL-K<n> runs counted, the Ks within tolerance of a published value, and the real figure written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.reporting import k_sweep

REPO = Path(__file__).resolve().parent.parent


def _run(setting, method, acc, status="FINISHED"):
    return {"status": status, "tags": {"cell.setting": setting, "cell.method": method},
            "metrics": {"acc_weighted": acc}}


def snapshot():
    runs = [_run("mnist-mlr", "CGPFL-K1", 0.90), _run("mnist-mlr", "CGPFL-K1", 0.92),
            _run("mnist-mlr", "CGPFL-K2", 0.95), _run("mnist-mlr", "CGPFL-K3", 0.97),
            _run("mnist-mlr", "CGPFL-K3", 0.10, status="FAILED"),  # not counted
            _run("mnist-mlr", "pFedMe-PM", 0.99),                   # not a K cell
            _run("mnist-mlr", "CGPFL-K10", 0.965)]
    return {"runs": runs}


def test_sweep_averages_finished_k_cells_only():
    data = k_sweep.sweep(snapshot())
    assert sorted(data["mnist-mlr"]) == [1, 2, 3, 10]
    assert data["mnist-mlr"][1] == pytest.approx([90.0, 92.0])
    assert data["mnist-mlr"][3] == pytest.approx([97.0])


def test_fits_uses_the_seed_mean_and_the_tolerance():
    curve = k_sweep.sweep(snapshot())["mnist-mlr"]
    assert k_sweep.fits(curve, 97.41, 1.0) == [3, 10]
    assert k_sweep.fits(curve, 91.0, 1.0) == [1]       # mean of 90 and 92
    assert k_sweep.fits(curve, 92.0, 0.5) == []     # 92 is one seed, not the mean


def test_published_values_come_from_the_table():
    values, tolerance = k_sweep.published(REPO / "suites/cgpfl/table1.yaml")
    assert values[("mnist-mlr", "CGPFL-Heur")] == 97.41 and values[("fmnist-dnn", "CGPFL-K4")] == 93.56
    assert tolerance == 1.0


def test_main_writes_the_table_and_the_figure(tmp_path):
    path = tmp_path / "fig3.snapshot.json"
    path.write_text(json.dumps(snapshot()))
    assert k_sweep.main([str(path), "--published", str(REPO / "suites/cgpfl/table1.yaml"), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "fig3_k_sweep.md").read_text()
    assert "| mnist-mlr | 1/2 | 91.00 | 95.00 | 97.00 | 96.50 | 3 (97.00) | 97.41: 3, 10 (nearest K=3)" in text
    assert (tmp_path / "fig3_k_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
