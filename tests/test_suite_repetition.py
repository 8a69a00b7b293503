"""The repetition measure of the suite files (``python -m benchmarks.suite.repetition``): which lines
count, which recur, and the split into bare section keys and content."""
from __future__ import annotations

from benchmarks.suite.repetition import main, measure


def test_the_measure_counts_recurring_lines_and_splits_bare_keys(tmp_path, capsys):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.yaml").write_text("# a comment\nname: a\ncaption: >\n  text\nprofiles:\n  smoke:\n"
                                           "    seeds: [0]  # kept\nmetric: {tolerance: 1.0}\n\n")
    (tmp_path / "p" / "_shared.yml").write_text("profiles:\n  smoke:\n    seeds: [0]\ncaption: >\n  other\nmetric: {tolerance: 1.0}\n")
    (tmp_path / "p" / "notes.txt").write_text("profiles:\n")  # not a YAML file: not counted
    rep = measure(tmp_path)
    # lines: a.yaml 6 (comment and blank left out), _shared.yml 5; "seeds: [0]  # kept" differs from "seeds: [0]"
    assert (rep.files, rep.lines) == (2, 13)
    assert rep.recurring == 8 and rep.bare_keys == 6 and rep.content == 2  # profiles:, smoke:, caption: >; metric
    assert rep.counts["caption: >"] == 2
    main([str(tmp_path)])
    assert "recurring elsewhere: 8 (61.5%)" in capsys.readouterr().out


def test_a_tuned_values_file_is_named_but_not_measured(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("profiles:\n  smoke:\n    seeds: [0]\n")
    (tmp_path / "b.yaml").write_text("profiles:\n  quick:\n    seeds: [1]\n")
    (tmp_path / "a.tuned.yml").write_text("# Written by `pflbench tune`\ncells:\n  x:\n    profiles:\n"
                                          "      seeds: [0]\n      seeds: [1]\n")
    rep = measure(tmp_path)
    # only a.yaml and b.yaml: "profiles:" recurs (2 of 6); the tuned file's copies of the other lines do not count
    assert (rep.files, rep.lines, rep.recurring) == (2, 6, 2)
    assert (rep.tuned_files, rep.tuned_lines) == (1, 5)
    main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "recurring elsewhere: 2 (33.3%)" in out
    assert "not counted: 5 lines in 1 tuned-values file(s) (*.tuned.yml, written by pflbench tune)" in out
