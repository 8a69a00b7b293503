"""Profiles side by side (benchmarks/reporting/profiles_side.py): a profile's cell is the runs its own
expansion hashes to, pooled from several snapshots; a cell the profile does not change is marked as
the paper profile's runs; each profile gets its own conclusion line, and a column where some
published method has no run is named, not judged."""
from __future__ import annotations

import json

from benchmarks.reporting import profiles_side
from benchmarks.suite.spec import load_suite
from conftest import tiny_suite_dict, write_suite

# profile -> (setting, method) -> accuracy of every seed
VALUES = {
    "smoke": {("dir", "local"): 0.40, ("dir", "fedavg"): 0.50, ("dir", "fedavg_ft"): 0.60,
              ("iid", "local"): 0.30, ("iid", "fedavg"): 0.55, ("iid", "fedavg_ft"): 0.65},
    "alt": {("dir", "fedavg"): 0.70, ("iid", "fedavg"): 0.58},
}


def suite_file(tmp_path):
    data = tiny_suite_dict()
    data["profiles"]["alt"] = {"like": "smoke", "description": "fedavg at another lr",
                               "methods": {"fedavg": {"method.params.lr": 0.2}}}
    data["published"] += [
        {"cell": {"setting": "dir", "method": "local"}, "mean": 40.0, "source": "Table 1"},
        {"cell": {"setting": "dir", "method": "fedavg_ft"}, "mean": 60.0, "source": "Table 1"},
        {"cell": {"setting": "iid", "method": "fedavg"}, "mean": 55.0, "source": "Table 1"}]
    return write_suite(tmp_path / "suites" / "tiny" / "side.yaml", data)


def snapshot(tmp_path, suite, profile, name, drop=()):
    """A snapshot file holding one FINISHED run per spec of ``profile`` that VALUES prices."""
    runs = []
    for spec in suite.expand(profile):
        key = (spec.cell["setting"], spec.method)
        if key not in VALUES[profile] or key in drop:
            continue
        runs.append({"run_id": f"{profile}-{spec.config_hash}", "status": "FINISHED", "end_time": 1,
                     "tags": {"config_hash": spec.config_hash, "cell": spec.cell_id, "seed": str(spec.seed),
                              "profile": profile, "git_commit": "abc"},
                     "metrics": {"acc_last3": VALUES[profile][key] + 0.01 * spec.seed, "wall_s": 60.0},
                     "histories": {}})
    path = tmp_path / name
    path.write_text(json.dumps({"format": 1, "suite": suite.key, "provenance": {}, "runs": runs}))
    return path


def test_profiles_pool_snapshots_by_hash_and_mark_the_cells_they_share(tmp_path):
    path = suite_file(tmp_path)
    suite = load_suite(path)
    files = [snapshot(tmp_path, suite, "smoke", "a.json"), snapshot(tmp_path, suite, "alt", "b.json")]
    out = tmp_path / "side.md"
    assert profiles_side.main([str(path), *map(str, files), "--profile", "smoke", "--profile", "alt",
                               "--out", str(out)]) == 0
    text = out.read_text()
    rows = {tuple(cells[:2]): cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                                  for line in text.splitlines() if line.startswith("| "))}
    # dir/local: alt does not change it, so the same runs, marked; dir/fedavg: alt's own runs
    assert rows[("dir", "local")][3].startswith("40.50") and rows[("dir", "local")][5] == "40.50 ± 0.50 ="
    assert rows[("dir", "fedavg")][3].startswith("50.50") and rows[("dir", "fedavg")][5].startswith("70.50")
    assert "=" not in rows[("dir", "fedavg")][5]
    lines = {line.split("**")[1]: line for line in text.splitlines() if line.startswith("- **") and "ranking" in line}
    assert "ranking holds (its best method is ours in 2 of 2 columns" in lines["smoke"]
    assert "dir: best fedavg (paper fedavg_ft)" in lines["alt"] and "holds in part" in lines["alt"]
    # compute: smoke's 12 runs; alt's own 4 (the fedavg cells), not the 8 it shares
    assert "**smoke**: 0.20 CPU-h of runs of its own (12 runs" in text
    assert "**alt**: 0.07 CPU-h of runs of its own (4 runs" in text


def test_a_column_missing_a_published_method_is_named_not_judged(tmp_path):
    path = suite_file(tmp_path)
    suite = load_suite(path)
    files = [snapshot(tmp_path, suite, "smoke", "a.json", drop=[("dir", "fedavg_ft")])]
    column, = profiles_side.build(suite, profiles_side.union(files), ["smoke"])
    line = profiles_side.conclusion_line(column)
    assert "Not judged: dir (missing: fedavg_ft)" in line
    assert "ours in 1 of 1 columns" in line and "dir: best" not in line


def test_a_tuned_method_without_a_study_is_shown_but_not_judged(tmp_path):
    """In a profile that takes tuned values, a cell of a tuned method with no study yet is its
    untuned run: shown as such, and its column not judged."""
    import yaml

    path = suite_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["tuned"] = {"methods": ["fedavg"]}
    write_suite(path, data)
    entry = {"params": {"method.params.lr": 0.3}, "provenance": {"trial": 2, "n_trials": 4, "value": 0.8,
                                                              "metric": "acc_last3", "trial_seconds": 360.0}}
    (path.parent / "side.tuned.yml").write_text(yaml.safe_dump(
        {"suite": "tiny/side", "cells": {"setting=dir,method=fedavg": {"fedavg": {"alt": entry}}}}))
    suite = load_suite(path)
    files = [snapshot(tmp_path, suite, "smoke", "a.json"), snapshot(tmp_path, suite, "alt", "b.json")]
    columns = profiles_side.build(suite, profiles_side.union(files), ["smoke", "alt"])
    alt = columns[1]
    assert set(alt.tuned) == {"setting=dir,method=fedavg"} and alt.untuned == {"setting=iid,method=fedavg"}
    text = profiles_side.markdown(suite, columns)
    assert "58.50 ± 0.50 (no study yet)" in text and "70.50 ± 0.50 †" in text
    line = profiles_side.conclusion_line(alt)
    assert "Not judged: iid (missing: fedavg (no study))" in line and "ours in 0 of 1 columns" in line
    assert "0.10 h of its 1 tuning studies' trials" in text
