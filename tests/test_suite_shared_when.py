"""Shared overrides and marks name any label of the paper; in each suite they apply to the labels it
has (benchmarks/suite/shared_when.py): the suite loads as if its own overrides named only those, and
a label that is neither the suite's nor a shared grid value fails in one line naming the shared file."""
from __future__ import annotations

import textwrap

import pytest

from benchmarks.suite.file import read_suite_file
from benchmarks.suite.schema import SuiteError
from benchmarks.suite.spec import load_suite
from conftest import synthetic_suite_head

SHARED = """\
grid_values:
  small: {data.num_clients: 6}
  mid: {data.num_clients: 7}
  large: {data.num_clients: 8}
overrides:
  - {when: {size: [small, large], method: ditto}, set: {method.params.mu: 0.25}}
  - {when: {size: large}, set: {federation.rounds: 3}}
marks:
  - {when: {size: [mid, large]}, mark: "*", text: "a mid or large cell"}
profiles:
  smoke:
    overrides: [{when: {size: [small, mid]}, set: {federation.rounds: 1}}]
"""

HEAD = synthetic_suite_head(2, '  method: {params: {lr: 0.1}}\n') + """\
seeds: [0]
grid:
  - {name: size, values: [%s]}
  - {name: method, key: method.name, values: [fedavg, ditto]}
"""

# the suite with sizes small and mid, its shared entries written out as they apply to it
WRITTEN_OUT = (HEAD % "{label: small, set: {data.num_clients: 6}}, {label: mid, set: {data.num_clients: 7}}") + """\
overrides:
  - {when: {size: [small], method: ditto}, set: {method.params.mu: 0.25}}
marks:
  - {when: {size: [mid]}, mark: "*", text: "a mid or large cell"}
profiles:
  smoke:
    overrides: [{when: {size: [small, mid]}, set: {federation.rounds: 1}}]
"""


def write(folder, name, text):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def runs(suite):
    return {p: [(s.cell_id, s.seed, s.config_hash) for s in suite.expand(p)] for p in suite.profiles}


def test_shared_entries_apply_to_the_labels_a_suite_has(tmp_path):
    write(tmp_path, "_shared.yml", SHARED)
    extended = write(tmp_path, "t.yaml", "extends: _shared.yml\n" + HEAD % "small, mid")
    full = write(tmp_path, "full.yaml", WRITTEN_OUT)
    assert read_suite_file(extended) == read_suite_file(full)  # the 'large' entry left out, lists cut
    assert runs(load_suite(extended)) == runs(load_suite(full))
    suite = load_suite(extended)
    assert suite.marks({"size": "mid", "method": "fedavg"}) == [("*", "a mid or large cell")]
    every = load_suite(write(tmp_path, "all.yaml", "extends: _shared.yml\n" + HEAD % "small, mid, large"))
    large = {s.cell_id: s.config for s in every.expand()}["size=large,method=ditto"]
    assert large["federation"]["rounds"] == 3 and large["method"]["params"]["mu"] == 0.25


@pytest.mark.parametrize("entry, where", [
    ("overrides:\n  - {when: {size: [small, hug]}, set: {federation.rounds: 3}}\n", r"overrides\[0\]\.when\.size"),
    ("marks:\n  - {when: {method: fedprox}, mark: '*', text: x}\n", r"marks\[0\]\.when\.method"),
    ("profiles: {smoke: {overrides: [{when: {size: huge}, set: {federation.rounds: 1}}]}}\n",
     r"profiles\.smoke\.overrides\[0\]\.when\.size"),
])
def test_a_label_that_is_neither_the_suites_nor_a_grid_value_fails_naming_the_shared_file(tmp_path, entry, where):
    write(tmp_path, "_shared.yml", "grid_values:\n  small: {data.num_clients: 6}\n" + entry)
    with pytest.raises(SuiteError, match=where + r": '\w+' is not a label of the axis in this suite") as err:
        load_suite(write(tmp_path, "t.yaml", "extends: _shared.yml\n" + HEAD % "small"))
    assert "\n" not in str(err.value) and str(tmp_path / "_shared.yml") in str(err.value)


def test_a_suites_own_entry_must_name_its_own_labels(tmp_path):
    """Only shared entries are fitted: the suite's own override naming a grid value it lacks fails."""
    write(tmp_path, "_shared.yml", "grid_values:\n  small: {data.num_clients: 6}\n  large: {data.num_clients: 8}\n")
    own = HEAD % "small" + "overrides: [{when: {size: large}, set: {federation.rounds: 3}}]\n"
    with pytest.raises(SuiteError, match=r"t.yaml: overrides\[0\]\.when\.size: 'large' is not a label of the axis"):
        load_suite(write(tmp_path, "t.yaml", "extends: _shared.yml\n" + own))
