"""A profile ``like`` another (benchmarks/suite/profile_like.py) loads to the same suite, runs and
hashes as the profile written out in full, also across shared files; a wrong ``like`` fails in one
line naming the file that states it."""
from __future__ import annotations


import pytest

from benchmarks.suite.file import read_suite_file
from benchmarks.suite.schema import SuiteError
from benchmarks.suite.spec import load_suite
from conftest import expanded_runs, synthetic_suite_head, write_dedented

HEAD = synthetic_suite_head(4) + """\
seeds: [0, 1]
grid:
  - {name: method, key: method.name, values: [fedavg, ditto]}
"""

QUICK = """\
  quick:
    description: two rounds
    seeds: [0]
    set: {federation.rounds: 2}
    methods: {fedavg: {method.params.local_epochs: 1}, ditto: {method.params.mu: 0.5}}
    overrides: [{when: {method: ditto}, set: {method.params.lr: 0.05}}]
"""

LIKE = """\
  short:
    like: quick
    set: {federation.clients_per_round: 2}
    methods: {ditto: {method.params.mu: 0.25}}
    overrides: [{when: {method: fedavg}, set: {method.params.lr: 0.2}}]
"""

WRITTEN_OUT = """\
  short:
    description: two rounds
    seeds: [0]
    set: {federation.rounds: 2, federation.clients_per_round: 2}
    methods: {fedavg: {method.params.local_epochs: 1}, ditto: {method.params.mu: 0.25}}
    overrides: [{when: {method: ditto}, set: {method.params.lr: 0.05}}, {when: {method: fedavg}, set: {method.params.lr: 0.2}}]
"""


write, runs = write_dedented, expanded_runs


def test_a_profile_like_another_loads_as_written_out(tmp_path):
    """The other profile's keys, this one's merged over them (mappings key by key, overrides appended)."""
    like = write(tmp_path, "like.yaml", HEAD + "profiles:\n" + QUICK + LIKE)
    full = write(tmp_path, "full.yaml", HEAD + "profiles:\n" + QUICK + WRITTEN_OUT)
    assert read_suite_file(like) == read_suite_file(full)
    assert runs(load_suite(like)) == runs(load_suite(full))
    short = {s.cell_id: s.config for s in load_suite(like).expand("short")}
    assert short["method=ditto"]["method"]["params"]["mu"] == 0.25 and short["method=ditto"]["federation"]["rounds"] == 2


def test_like_across_shared_files_and_chains(tmp_path):
    """``like`` names a profile of another shared file (the suite's merged one); a chain resolves."""
    write(tmp_path, "_a.yml", "profiles:\n" + QUICK)
    write(tmp_path, "_b.yml", "profiles:\n" + LIKE)
    own = "profiles:\n  shorter: {like: short, seeds: [1]}\n"
    extended = write(tmp_path, "t.yaml", "extends: [_a.yml, _b.yml]\n" + HEAD + own)
    shorter = WRITTEN_OUT.replace("short:", "shorter:").replace("seeds: [0]", "seeds: [1]")
    full = write(tmp_path, "full.yaml", HEAD + "profiles:\n" + QUICK + WRITTEN_OUT + shorter)
    assert read_suite_file(extended) == read_suite_file(full)
    assert runs(load_suite(extended)) == runs(load_suite(full))


@pytest.mark.parametrize("like, message", [
    ("quik", r"_b.yml: profiles.short.like: 'quik' is not a profile of the suite \(\['quick', 'short'\]\); name one"),
    ("short", "short -> short goes round in a circle"),
    ("[quick]", r"\['quick'\] is not a profile of the suite"),
    ("paper", "'paper' is not a profile of the suite"),
])
def test_a_wrong_like_fails_in_one_line_naming_the_file(tmp_path, like, message):
    write(tmp_path, "_a.yml", "profiles:\n" + QUICK)
    write(tmp_path, "_b.yml", "profiles:\n" + LIKE.replace("like: quick", f"like: {like}"))
    with pytest.raises(SuiteError, match=message) as err:
        load_suite(write(tmp_path, "t.yaml", "extends: [_a.yml, _b.yml]\n" + HEAD))
    assert "\n" not in str(err.value) and str(tmp_path / "_b.yml") in str(err.value)


def test_a_circle_through_two_profiles_names_the_suite_file(tmp_path):
    path = write(tmp_path, "t.yaml", HEAD + "profiles:\n  a: {like: b}\n  b: {like: a, seeds: [0]}\n")
    with pytest.raises(SuiteError, match=r"t.yaml: profiles.b.like: a -> b -> a goes round in a circle"):
        load_suite(path)
