"""FedL2P's Table 6 (ARI) and Figures 2-5 in the report (benchmarks/reporting/personalization.py):
tiny real runs in a real MLflow store, each given a fabricated ``personalization.npz`` in the
``finetune_pretrained`` protocol's format (``beta`` [clients, 20], ``eta`` [clients, 62], ``xi``
[clients, 20], ``x`` [clients, 82], ``group``), rendered to Markdown, PNG and a PDF read back with
pypdf. The arrays are built so that every drawn or tabulated number is known in advance."""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
from pypdf import PdfReader
from sklearn.metrics import adjusted_rand_score

from benchmarks.reporting import render_paper
from benchmarks.reporting.personalization import ARTIFACT, cluster_distance_map
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import Tracker, read_npz_artifact
from conftest import store, tiny_suite_dict, write_suite

# its module-scoped store is filled once: one pytest-xdist worker runs the module (`make test`: --dist loadgroup)
pytestmark = [pytest.mark.xdist_group("test_report_fedl2p"), pytest.mark.slow]  # store fixtures of FedL2P-shaped runs: make test, not test-fast

DOMAINS = np.array(["art", "art", "clip", "clip", "real", "real"])
#: a partition of the 6 clients that is not the domains' (LRNet input x in seed 2's arrays)
OTHER = np.array([0, 0, 0, 1, 1, 2])
PAPER = {"xi": 0.65, "beta": 0.64, "x": 0.76, "eta": 0.77}


def blobs(labels: np.ndarray, dim: int, scale: float = 50.0, seed: int = 0) -> np.ndarray:
    """One tight, far-apart cloud per label: any sane spectral clustering recovers ``labels``."""
    rng = np.random.default_rng(seed)
    codes = np.unique(labels, return_inverse=True)[1]
    centres = rng.normal(size=(codes.max() + 1, dim)) * scale
    return centres[codes] + rng.normal(size=(len(labels), dim)) * 0.01


def arrays_for(seed: int, zero_tensors: int) -> dict[str, np.ndarray]:
    """Seed 1: every quantity clustered by domain. Seed 2: x clustered by OTHER. eta has its first
    ``zero_tensors`` of 62 learning rates exactly 0 on every client (sparsity zero_tensors / 62)."""
    eta = np.abs(blobs(DOMAINS, 62, 1.0, seed)) + 0.1
    eta[:, :zero_tensors] = 0.0
    beta = np.clip(np.linspace(0.0, 1.0, 20)[None, :] + 0.01 * np.arange(6)[:, None], 0, 1)
    return {"beta": beta, "eta": eta, "xi": blobs(DOMAINS, 20, seed=seed),
            "x": blobs(OTHER if seed == 2 else DOMAINS, 82, seed=seed), "group": DOMAINS}


def fedl2p_like_suite(name: str, figure: str, sample_sd: bool = False, **extra) -> dict:
    data = tiny_suite_dict()
    data.update(paper="l2pfig", name=name, table=f"FedL2P {name}", seeds=[1, 2])
    data["grid"][1]["values"] = ["fedavg"]
    data["metric"]["figure"] = figure
    if sample_sd:
        data["metric"]["sample_sd"] = True
    data.pop("published")
    data["profiles"] = {"smoke": {"seeds": [1, 2], "set": {"federation.rounds": 1, "evaluation.params.steps": 1}}}
    data.update(extra)
    return data


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("fedl2p_report")
    quantities = [{"cell": {"setting": "dir", "method": "fedavg"}, "quantity": q, "mean": v, "source": "Table 6"}
                  for q, v in PAPER.items()]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(root)
        suites = {
            "table6": load_suite(write_suite(root / "suites" / "l2pfig" / "table6.yaml",
                                             fedl2p_like_suite("table6", "ari", published_quantities=quantities,
                                                               sample_sd=True))),
            "fig2": load_suite(write_suite(root / "suites" / "l2pfig" / "fig2.yaml",
                                           fedl2p_like_suite("fig2", "hyperparameters"))),
            "fig5": load_suite(write_suite(root / "suites" / "l2pfig" / "fig5.yaml",
                                           fedl2p_like_suite("fig5", "cluster_map_all"))),
        }
        uri, art = store(root / "store")
        tracker = Tracker(uri, art)
        logged = {}
        for key, suite in suites.items():
            summary = run_sweep(suite, suite.expand("smoke"), tracker, device="cpu", echo=lambda *a, **k: None,
                                reuse=False)  # the three suites share their runs: each computes its own arrays
            assert summary.failed == 0 and summary.finished == 4
            for run in tracker.runs(suite.key):
                seed, cell = int(run.data.tags["seed"]), run.data.tags["cell.setting"]
                arrays = arrays_for(seed, zero_tensors=31 if cell == "dir" else 0)
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / f"{ARTIFACT}.npz"
                    np.savez_compressed(path, **arrays)
                    tracker.client.log_artifact(run.info.run_id, str(path))
                logged[(key, cell, seed)] = arrays
        paper = render_paper("l2pfig", list(suites.values()), tracker, "smoke", root / "reports")
    return {"paper": paper, "tracker": tracker, "suites": suites, "arrays": logged,
            "md": {s.report.suite.name: s.md.read_text() for s in paper.suites},
            "reports": {s.report.suite.name: s for s in paper.suites}}


def test_the_fabricated_arrays_are_read_back_from_the_store(rendered):
    tracker, suite = rendered["tracker"], rendered["suites"]["table6"]
    runs = tracker.runs(suite.key)
    assert len(runs) == 4
    for run in runs:
        got = read_npz_artifact(tracker.client, run.info.run_id, ARTIFACT)
        want = rendered["arrays"][("table6", run.data.tags["cell.setting"], int(run.data.tags["seed"]))]
        assert set(got) == set(want) and np.array_equal(got["eta"], want["eta"])


def test_table6_ari_per_seed_mean_population_sd_and_the_paper(rendered):
    md = rendered["md"]["table6"]
    other = adjusted_rand_score(DOMAINS, OTHER)  # seed 2's x: clustered by a partition that is not the domains'
    assert 0 < other < 1
    assert "## ARI of spectral clusters vs domains" in md
    for q, paper in PAPER.items():
        if q == "x":
            mean, sd = (1 + other) / 2, abs(1 - other) / 2  # population SD (ddof 0) of {1, other}
            line = (f"| dir / fedavg | LRNet input x | {mean:.2f} ± {sd:.2f} | 1: 1.00, 2: {other:.2f} | "
                    f"{paper:.2f} | {mean - paper:+.2f} |")
        else:
            label = {"xi": "BNNet input ξ", "beta": "BNNet output β", "eta": "LRNet output η"}[q]
            line = f"| dir / fedavg | {label} | 1.00 ± 0.00 | 1: 1.00, 2: 1.00 | {paper:.2f} | {1 - paper:+.2f} |"
        if q == "beta":  # beta of the fabricated arrays is a smooth ramp over clients, not domain clouds
            continue
        assert line in md, line
    assert "| iid / fedavg | BNNet input ξ | 1.00 ± 0.00 | 1: 1.00, 2: 1.00 | — | — |" in md  # no paper value
    assert "![ARI](table6_figure.png)" in md


def test_table6_figure_draws_ours_beside_the_papers_values(rendered):
    assert "table6_figure.png" in {p.name for p in rendered["reports"]["table6"].pngs}
    from benchmarks.reporting.personalization import ari_figure

    figure = ari_figure(rendered["reports"]["table6"].report)
    panel = next(ax for ax in figure.axes if ax.get_title() == "dir / fedavg")
    from matplotlib.container import BarContainer

    bars = {c.get_label(): c for c in panel.containers if isinstance(c, BarContainer)}
    ours, paper = bars["ours"], bars["paper"]
    assert [round(p.get_height(), 6) for p in paper.patches] == [PAPER[q] for q in ("xi", "beta", "x", "eta")]
    assert ours.patches[0].get_height() == pytest.approx(1.0)
    assert ours.patches[2].get_height() == pytest.approx((1 + adjusted_rand_score(DOMAINS, OTHER)) / 2)


def test_figure2_box_plots_and_sparsity(rendered):
    md = rendered["md"]["fig2"]
    assert "## learned β and η per layer, sparsity" in md and "Qualitative" in md
    assert "- dir / fedavg (seed 1): 6 clients of 3 group(s)" in md and "mean sparsity 0.500" in md
    assert "- iid / fedavg (seed 1): 6 clients of 3 group(s)" in md and "mean sparsity 0.000" in md
    from benchmarks.reporting.personalization import figures

    figs = figures(rendered["reports"]["fig2"].report)
    axes = [ax for ax in figs["figure"].axes if ax.get_visible()]
    assert len(axes) == 6  # two cells x (beta, eta, sparsity)
    titles = [ax.get_title() for ax in axes]
    assert titles[0] == "dir / fedavg: β (seed 1)" and titles[2] == "dir / fedavg: sparsity, mean 0.50"
    assert titles[5] == "iid / fedavg: sparsity, mean 0.00"
    beta, eta = axes[0], axes[1]
    # matplotlib's bxp draws per box: box, 2 whiskers, 2 caps, median, mean, fliers (8 lines)
    assert len(beta.lines) == 8 * 20 and len(eta.lines) == 8 * 62
    medians = [beta.lines[8 * j + 5].get_ydata()[0] for j in range(20)]
    assert np.allclose(medians, np.median(rendered["arrays"][("fig2", "dir", 1)]["beta"], axis=0))
    assert beta.get_xlabel() == "BN layer" and eta.get_xlabel() == "parameter tensor"


def test_figure5_maps_equal_the_cluster_distance_maps(rendered):
    from benchmarks.reporting.personalization import figures

    figs = figures(rendered["reports"]["fig5"].report)
    axes = [ax for ax in figs["figure"].axes if ax.get_visible() and ax.images]
    assert len(axes) == 2 * 4  # two cells x (xi, beta, x, eta)
    arrays = rendered["arrays"][("fig5", "dir", 1)]
    for ax, q in zip(axes[:4], ("xi", "beta", "x", "eta")):
        expected, names = cluster_distance_map(arrays[q], arrays["group"])
        shown = np.ma.filled(ax.images[0].get_array(), np.nan)
        assert np.allclose(shown, expected, equal_nan=True)
        assert [t.get_text() for t in ax.get_xticklabels()] == names
        assert np.allclose(np.diag(shown), 0.0)  # the map's diagonal is 0 by construction
    xi_map = np.ma.filled(axes[0].images[0].get_array(), np.nan)
    assert (xi_map[~np.eye(3, dtype=bool)] > 1).all()  # far-apart domain clouds: off-diagonal blocks > 0


def test_pdf_has_the_ari_table_and_the_figure_pages(rendered):
    pages = [p.extract_text() for p in PdfReader(rendered["paper"].pdf).pages]
    titles = rendered["paper"].pages
    assert any(t.endswith("ARI of spectral clusters vs domains") for t in titles)
    assert any(t.endswith("learned β and η per layer, sparsity") for t in titles)
    assert any(t.endswith("cluster distance maps of ξ, β, x and η") for t in titles)
    text = "\n".join(pages)
    other = adjusted_rand_score(DOMAINS, OTHER)
    assert f"1: 1.00, 2: {other:.2f}" in text  # the per-seed ARIs of x
    assert "0.76" in text and "0.65" in text  # the paper's values beside them
    sparsity_page = next(p for p in pages if "sparsity, mean 0.50" in p)
    assert "dir / fedavg" in sparsity_page


def test_no_arrays_says_so(tmp_path):
    """A suite whose runs logged no personalization.npz: the section says there is nothing to draw."""
    from benchmarks.reporting.personalization import markdown_lines
    from benchmarks.reporting.table import build_suite_report

    suite = load_suite(write_suite(tmp_path / "s" / "l2pfig" / "fig3.yaml", fedl2p_like_suite("fig3", "cluster_map")))
    uri, art = store(tmp_path / "store")
    report = build_suite_report(suite, Tracker(uri, art), "smoke")
    lines = markdown_lines(report)
    assert any("No finished run logged `personalization.npz`" in line for line in lines)
    assert math.isnan(report.table["mean"].iloc[0])


def test_the_sample_sd_is_shown_beside_the_population_sd(rendered):
    """metric.sample_sd: "ours" carries the paper's spread (std, ddof 0), the column "sample SD" ddof 1."""
    report = rendered["reports"]["table6"].report
    md = rendered["md"]["table6"]
    header = next(line for line in md.splitlines() if line.startswith("| setting"))
    assert "| ours | sample SD | paper |" in header
    assert "sample SD" not in next(line for line in rendered["md"]["fig2"].splitlines() if line.startswith("| setting"))
    for _, row in report.table.iterrows():
        values = report.runs[(report.runs["cell"] == f"setting={row['setting']},method=fedavg")]["value"].to_numpy(float)
        assert len(values) == 2
        assert row["pm"] == pytest.approx(np.std(values, ddof=0)) and row["std"] == pytest.approx(np.std(values, ddof=1))
        line = next(line for line in md.splitlines() if line.startswith(f"| {row['setting']} | fedavg"))
        assert f"| {row['std']:.2f} |" in line
