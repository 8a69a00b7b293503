"""``extends``: a suite written over its paper's shared file loads to the same runs as the suite
written out in full (benchmarks/suite/file.py), and a wrong shared file fails in one line."""
from __future__ import annotations

import textwrap

import pytest

from benchmarks.suite.spec import load_suite
from benchmarks.suite.file import merge
from benchmarks.suite.schema import SuiteError

SHARED = """\
notes: ["shared note"]
metric: {key: acc, label: "accuracy (%)", scale: 100}
base:
  data: {dataset: synthetic, num_clients: 6, params: {alpha: 0.5, beta: 0.5}, partition: {name: natural},
         client_splits: {test: 0.2}}
  federation: {rounds: 2, clients_per_round: 3, batch_size: 8}
  model: {name: mlr}
methods:
  fedavg: {method.params: {lr: 0.1, local_epochs: 1}}
  ditto: {method.params.lr: 0.1, method.params.mu: 0.5}
seeds: [0, 1]
profiles:
  smoke:
    seeds: [0]
    set: {federation.rounds: 1}
    overrides:
      - when: {method: fedavg}
        set: {method.params.local_epochs: 1}
"""

OWN = """\
paper: demo
name: t
notes: ["own note"]
grid:
  - name: method
    key: method.name
    values: [fedavg, ditto]
methods:
  ditto: {method.params.mu: 0.25}
profiles:
  smoke:
    overrides:
      - when: {method: ditto}
        set: {method.params.mu: 0.125}
"""

FULL = """\
paper: demo
name: t
notes: ["shared note", "own note"]
metric: {key: acc, label: "accuracy (%)", scale: 100}
base:
  data: {dataset: synthetic, num_clients: 6, params: {alpha: 0.5, beta: 0.5}, partition: {name: natural},
         client_splits: {test: 0.2}}
  federation: {rounds: 2, clients_per_round: 3, batch_size: 8}
  model: {name: mlr}
grid:
  - name: method
    key: method.name
    values: [fedavg, ditto]
methods:
  fedavg: {method.params: {lr: 0.1, local_epochs: 1}}
  ditto: {method.params.lr: 0.1, method.params.mu: 0.25}
seeds: [0, 1]
profiles:
  smoke:
    seeds: [0]
    set: {federation.rounds: 1}
    overrides:
      - when: {method: fedavg}
        set: {method.params.local_epochs: 1}
      - when: {method: ditto}
        set: {method.params.mu: 0.125}
"""


def write(tmp_path, name, text):
    (tmp_path / name).write_text(textwrap.dedent(text))
    return tmp_path / name


def hashes(suite):
    return {p: [(s.cell_id, s.seed, s.config_hash) for s in suite.expand(p)] for p in suite.profiles}


def test_extended_suite_equals_the_suite_written_out(tmp_path):
    write(tmp_path, "_shared.yml", SHARED)
    extended = load_suite(write(tmp_path, "t.yaml", "extends: _shared.yml\n" + OWN))
    full = load_suite(write(tmp_path, "full.yaml", FULL))
    assert hashes(extended) == hashes(full)
    assert extended.raw["notes"] == ["shared note", "own note"]
    ditto = [s for s in extended.expand("paper") if s.method == "ditto"][0].config
    assert ditto["method"]["params"] == {"lr": 0.1, "mu": 0.25}  # the suite's key wins, the shared one stays
    smoke_ditto = [s for s in extended.expand("smoke") if s.method == "ditto"][0].config
    assert smoke_ditto["method"]["params"]["mu"] == 0.125 and smoke_ditto["federation"]["rounds"] == 1


def test_merge_rule():
    shared = {"a": {"b": 1, "c": [1]}, "notes": ["x"], "p": {"overrides": [1]}, "seeds": [0, 1]}
    own = {"a": {"c": [2]}, "notes": ["y"], "p": {"overrides": [2]}, "seeds": [3]}
    assert merge(shared, own) == {"a": {"b": 1, "c": [2]}, "notes": ["x", "y"], "p": {"overrides": [1, 2]},
                                  "seeds": [3]}
    assert shared["notes"] == ["x"]  # inputs untouched


@pytest.mark.parametrize("shared, extends, message", [
    ("grid: []\n", "_shared.yml", "cannot be shared"),
    ("colour: red\n", "_shared.yml", "unknown key"),
    (SHARED, "_missing.yml", "does not exist"),
    (SHARED, "shared.yaml", "starts with '_' and ends in '.yml'"),
    (SHARED, "../_shared.yml", "starts with '_' and ends in '.yml'"),
    ("- a list\n", "_shared.yml", "expected a mapping"),
])
def test_a_wrong_shared_file_fails_in_one_line(tmp_path, shared, extends, message):
    write(tmp_path, "_shared.yml", shared)
    with pytest.raises(SuiteError, match=message) as err:
        load_suite(write(tmp_path, "t.yaml", f"extends: {extends}\n" + OWN))
    assert "\n" not in str(err.value)


def test_a_shared_override_naming_a_missing_label_fails_with_the_suite(tmp_path):
    write(tmp_path, "_shared.yml", SHARED + "overrides:\n  - when: {method: cafeme}\n    set: {federation.rounds: 3}\n")
    with pytest.raises(SuiteError, match="'cafeme' is not a label"):
        load_suite(write(tmp_path, "t.yaml", "extends: _shared.yml\n" + OWN))


def test_named_grid_values_read_as_written_out(tmp_path):
    """An axis without a key lists shared grid values by label; the suite loads as the inline grid."""
    write(tmp_path, "_shared.yml", SHARED + "grid_values:\n  small: {data.num_clients: 6}\n  large: {data.num_clients: 8}\n")
    axis = "  - name: size\n    values: [%s]\nmethods:\n"
    named = OWN.replace("methods:\n", axis % "small, {label: mid, set: {data.num_clients: 7}}, large", 1)
    inline = FULL.replace("methods:\n", axis % ("{label: small, set: {data.num_clients: 6}}, {label: mid, set: "
                                                "{data.num_clients: 7}}, {label: large, set: {data.num_clients: 8}}"), 1)
    extended = load_suite(write(tmp_path, "t.yaml", "extends: _shared.yml\n" + named))
    full = load_suite(write(tmp_path, "full.yaml", inline))
    assert hashes(extended) == hashes(full) and len(extended.cells()) == 6 and "grid_values" not in extended.raw
    with pytest.raises(SuiteError, match="'huge' is not a grid value of the shared files"):
        load_suite(write(tmp_path, "t.yaml", "extends: _shared.yml\n" + named.replace(", large]", ", huge]")))


def test_a_grid_value_defined_twice_differently_fails(tmp_path):
    write(tmp_path, "_shared.yml", SHARED + "grid_values:\n  small: {data.num_clients: 6}\n")
    write(tmp_path, "_more.yml", "grid_values:\n  small: {data.num_clients: 5}\n")
    named = OWN.replace("methods:\n", "  - name: size\n    values: [small]\nmethods:\n", 1)
    with pytest.raises(SuiteError, match="'small' is defined differently in _shared.yml and _more.yml"):
        load_suite(write(tmp_path, "t.yaml", "extends: [_shared.yml, _more.yml]\n" + named))


def test_pflbench_show_prints_the_merged_suite_and_one_runs_config(tmp_path, capsys):
    import yaml

    from benchmarks.cli import main

    write(tmp_path, "_shared.yml", SHARED)
    path = write(tmp_path, "t.yaml", "extends: _shared.yml\n" + OWN)
    assert main(["show", str(path)]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["notes"] == ["shared note", "own note"] and "extends" not in shown
    assert main(["show", str(path), "--only", "method=ditto", "--profile", "smoke"]) == 0
    out = capsys.readouterr().out
    spec = next(s for s in load_suite(path).expand("smoke") if s.method == "ditto")
    assert f"config hash {spec.config_hash}" in out and yaml.safe_load(out)["method"]["params"]["mu"] == 0.125
    assert main(["show", str(path)] + ["--only", "method=ditto,fedavg"]) == 2
    assert "selects 2 cells" in capsys.readouterr().err


def test_a_suites_name_is_its_files_stem_unless_stated(tmp_path):
    write(tmp_path, "_shared.yml", SHARED)
    assert load_suite(write(tmp_path, "table9.yaml", "extends: _shared.yml\n" + OWN.replace("name: t\n", ""))).key == "demo/table9"
    assert load_suite(write(tmp_path, "other.yaml", "extends: _shared.yml\n" + OWN)).key == "demo/t"
