"""``like``: a grid value that states only how it differs from another (benchmarks/suite/file.py)
loads to the same runs, hashes and suite as the value written out in full; a wrong ``like`` fails
in one line naming the file and the fix."""
from __future__ import annotations


import pytest

from benchmarks.suite.spec import load_suite
from benchmarks.suite.file import overlay, read_suite_file
from benchmarks.suite.schema import SuiteError
from conftest import expanded_runs, synthetic_suite_head, write_dedented

HEAD = synthetic_suite_head(2) + """\
seeds: [0, 1]
profiles: {smoke: {seeds: [0], set: {federation.rounds: 1}}}
grid:
  - name: method
    values:
"""

WRITTEN_OUT = HEAD + """\
      - {label: ditto-mu0.5, set: {method.name: ditto, method.params: {lr: 0.1, mu: 0.5, personal_steps: 2}}}
      - {label: ditto-mu1, set: {method.name: ditto, method.params: {lr: 0.1, mu: 1.0, personal_steps: 2}}}
      - {label: ditto-mu1-lr, set: {method.name: ditto, method.params: {lr: 0.05, mu: 1.0, personal_steps: 2}}}
      - {label: fedavg, set: {method.name: fedavg, method.params: {lr: 0.1, local_epochs: 1}}}
"""

LIKE = HEAD + """\
      - {label: ditto-mu0.5, set: {method.name: ditto, method.params: {lr: 0.1, mu: 0.5, personal_steps: 2}}}
      - {label: ditto-mu1, like: ditto-mu0.5, set: {method.params.mu: 1.0}}
      - {label: ditto-mu1-lr, like: ditto-mu1, set: {method.params.lr: 0.05}}
      - {label: fedavg, set: {method.name: fedavg, method.params: {lr: 0.1, local_epochs: 1}}}
"""


write, runs = write_dedented, expanded_runs


def test_a_value_like_another_loads_as_written_out(tmp_path):
    """Same grid (as ``pflbench show`` prints it), same runs, same hashes; ``like`` chains resolve."""
    like, full = write(tmp_path, "like.yaml", LIKE), write(tmp_path, "full.yaml", WRITTEN_OUT)
    assert read_suite_file(like) == read_suite_file(full)
    assert runs(load_suite(like)) == runs(load_suite(full))
    mu1 = next(s for s in load_suite(like).expand() if s.cell_id == "method=ditto-mu1").config
    assert mu1["method"]["params"] == {"lr": 0.1, "mu": 1.0, "personal_steps": 2}


def test_like_in_a_shared_files_grid_values(tmp_path):
    """A shared grid value ``{like: <grid value>, set: {...}}`` is the named one with its keys changed,
    also when the two stand in different shared files and a suite value is ``like`` it in turn."""
    write(tmp_path, "_a.yml", "grid_values:\n  fedavg-lr1: {method.name: fedavg, method.params: {lr: 0.1, local_epochs: 1}}\n")
    write(tmp_path, "_b.yml", "grid_values:\n  fedavg-lr2: {like: fedavg-lr1, set: {method.params.lr: 0.2}}\n")
    own = HEAD + "      - fedavg-lr1\n      - fedavg-lr2\n      - {label: fedavg-lr3, like: fedavg-lr2, set: {method.params.lr: 0.3}}\n"
    full = HEAD + "".join(f"      - {{label: fedavg-lr{i}, set: {{method.name: fedavg, method.params: {{lr: 0.{i}, "
                          f"local_epochs: 1}}}}}}\n" for i in (1, 2, 3))
    extended = write(tmp_path, "t.yaml", "extends: [_a.yml, _b.yml]\n" + own)
    assert read_suite_file(extended) == read_suite_file(write(tmp_path, "full.yaml", full))
    assert runs(load_suite(extended)) == runs(load_suite(tmp_path / "full.yaml"))


@pytest.mark.parametrize("value, message", [
    ("{label: ditto-mu2, like: ditto-mu9, set: {method.params.mu: 2.0}}",
     r"grid\[0\]\.values\[4\]\.like: 'ditto-mu9' is not a label of axis 'method' \(\['ditto-mu0.5', .*\]\); name one of them"),
    ("{label: ditto-mu2, like: ditto-mu2, set: {method.params.mu: 2.0}}", "ditto-mu2 -> ditto-mu2 goes round in a circle"),
    ("{label: ditto-mu2, lik: ditto-mu1, set: {method.params.mu: 2.0}}", r"unknown key\(s\) \['lik'\]; allowed: \['label', 'like', 'set'\]"),
    ("{label: ditto-mu2, like: ditto-mu1, set: [method.params.mu]}", r"values\[4\]\.set: expected a mapping"),
    ("{like: ditto-mu1, set: {method.params.mu: 2.0}}", r"missing required key\(s\) \['label'\]"),
    ("{label: ditto-mu2, like: ditto-mu1}", "resolve to the same configuration"),  # nothing differs
    ("{label: ditto-mu2, like: ditto-mu1, set: {method.params.muu: 2.0}}", "muu"),  # checked as if written out
])
def test_a_wrong_like_fails_in_one_line_naming_the_file(tmp_path, value, message):
    path = write(tmp_path, "t.yaml", LIKE + f"      - {value}\n")
    with pytest.raises(SuiteError, match=message) as err:
        load_suite(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_cycle_through_several_values_and_a_missing_shared_value_fail(tmp_path):
    cycle = LIKE.replace("like: ditto-mu0.5,", "like: ditto-mu1-lr,")
    with pytest.raises(SuiteError, match="ditto-mu1 -> ditto-mu1-lr -> ditto-mu1 goes round in a circle"):
        load_suite(write(tmp_path, "t.yaml", cycle))
    write(tmp_path, "_a.yml", "grid_values:\n  fedavg-lr2: {like: fedavg-lr1, set: {method.params.lr: 0.2}}\n")
    with pytest.raises(SuiteError, match=r"_a.yml: grid_values.fedavg-lr2.like: 'fedavg-lr1' is not a grid value"):
        load_suite(write(tmp_path, "s.yaml", "extends: _a.yml\n" + HEAD + "      - fedavg-lr2\n"))
    write(tmp_path, "_a.yml", "grid_values:\n  fedavg-lr2: {like: fedavg-lr1, sett: {method.params.lr: 0.2}}\n")
    with pytest.raises(SuiteError, match=r"_a.yml: grid_values.fedavg-lr2: unknown key\(s\) \['sett'\]"):
        load_suite(write(tmp_path, "s.yaml", "extends: _a.yml\n" + HEAD + "      - fedavg-lr2\n"))


def test_overlay_gives_what_applying_both_would():
    base = {"method.name": "cgpfl", "method.params": {"num_clusters": 4, "lr": 0.005}, "data.partition.alpha": 1}
    assert overlay(base, {"method.params.num_clusters": 3}) == {  # set inside the mapping, in place
        "method.name": "cgpfl", "method.params": {"num_clusters": 3, "lr": 0.005}, "data.partition.alpha": 1}
    assert overlay(base, {"method.params": {"mu": 1}})["method.params"] == {"mu": 1}  # a whole mapping replaces
    assert overlay(base, {"data.partition": {"name": "lda"}}) == {  # a key covering base's keys removes them
        "method.name": "cgpfl", "method.params": {"num_clusters": 4, "lr": 0.005}, "data.partition": {"name": "lda"}}
    assert list(overlay(base, {"model.name": "mlr"}))[-1] == "model.name"  # a new key comes after base's
    assert overlay({"model": {"pretrained": {"data": {"partition": {"alpha": 1000}}}}},
                   {"model.pretrained.data.partition.alpha": 0.5}) == {
        "model": {"pretrained": {"data": {"partition": {"alpha": 0.5}}}}}
    assert overlay({"a": 5}, {"a.b": 2}) == {"a": 5, "a.b": 2}  # through a non-mapping: applied last (and fails there)
    assert base["method.params"]["num_clusters"] == 4  # inputs untouched
