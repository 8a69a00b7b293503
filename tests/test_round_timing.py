from benchmarks.timing.round_timing import main


def test_round_timing_prints_every_cell_and_a_projection(capsys):
    assert main(["suites/demo/offline.yaml", "--profile", "smoke", "--only", "setting=digits28-unseen",
                 "--rounds", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for method in ("local", "fedavg", "fedavg_ft"):
        assert f"setting=digits28-unseen,method={method} " in out
    assert "projected wall-clock of 3 runs (smoke profile" in out


def test_projection_counts_the_periodic_evaluations():
    from benchmarks.timing.round_timing import projected_seconds

    assert projected_seconds({"rounds": 1000, "eval_every": 50}, 2.0, 10.0) == 1000 * 2.0 + 21 * 10.0
    assert projected_seconds({"rounds": 10}, 2.0, 10.0) == 10 * 2.0 + 10.0
