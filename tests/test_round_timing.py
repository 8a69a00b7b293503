from benchmarks.round_timing import main


def test_round_timing_prints_every_cell_and_a_projection(capsys):
    assert main(["suites/demo/offline.yaml", "--profile", "smoke", "--only", "setting=digits28-unseen",
                 "--rounds", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for method in ("local", "fedavg", "fedavg_ft"):
        assert f"setting=digits28-unseen,method={method} " in out
    assert "projected wall-clock of 3 runs (smoke profile" in out
