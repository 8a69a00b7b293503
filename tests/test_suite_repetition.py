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
