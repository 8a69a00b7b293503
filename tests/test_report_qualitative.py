"""MetaVers Figures 2-3 in the report: runs log their analyses' arrays to a real MLflow store, the
report draws the t-SNE panels and the DLG images with PSNR/SSIM (Markdown, PNG, and a rendered PDF
read back with pypdf), flagged qualitative."""
from __future__ import annotations

import math

import numpy as np
import pytest
from pypdf import PdfReader

from benchmarks.reporting import render_paper
from benchmarks.reporting.qualitative import dlg_panels, stored_metric, tsne_map, tsne_panels
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import Tracker, read_npz_artifact
from conftest import store, write_suite
from fake_data import write_cifar10

# its module-scoped store is filled once: one pytest-xdist worker runs the module (`make test`: --dist loadgroup)
pytestmark = [pytest.mark.xdist_group("test_report_qualitative"), pytest.mark.slow]  # analyses logged to a store: make test, not test-fast

BASE = {
    "data": {"dataset": "cifar10", "num_clients": 4, "partition": {"name": "iid"}, "client_splits": {"test": 0.25}},
    "model": {"name": "lenet"},
    "method": {"name": "fedavg", "params": {"lr": 0.01, "local_steps": 1}},
    "federation": {"rounds": 0, "clients_per_round": 2, "batch_size": 10},
    "evaluation": {"protocol": "seen", "params": {"reduction": "sample"}},
}
DLG = {"iterations": 2, "max_iter": 3}


def figure_suite(name: str, figure: str, key: str, methods: list[dict], seeds=(0, 1)) -> dict:
    return {"paper": "mvfig", "name": name, "table": f"Figure {name}", "caption": f"{name} caption.",
            "metric": {"key": key, "label": key, "scale": 1, "averaging": "one image per run.", "pm": "std",
                       "ddof": 0, "figure": figure},
            "base": BASE, "grid": [{"name": "method", "values": methods}], "seeds": list(seeds),
            "profiles": {"smoke": {"seeds": list(seeds)}}}


def dlg_method(label, model, **attack):
    return {"label": label, "set": {"model.name": model, "evaluation.analyses": [{"name": "dlg", **DLG, **attack}]}}


def tsne_method(label, rounds):
    return {"label": label, "set": {"federation.rounds": rounds,
                                    "evaluation.analyses": [{"name": "embeddings", "samples": 20}]}}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("qualitative")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setenv("PFL_DOWNLOAD", "0")
        mp.chdir(root)
        write_cifar10(root / "data", 20, mp)
        fig3 = load_suite(write_suite(root / "suites" / "mvfig" / "fig3.yaml", figure_suite("fig3", "dlg", "dlg_psnr", [
            dlg_method("FedAvg", "lenet", target="classifier"),
            dlg_method("MetaVers", "le_embedding", target="prototypes", leakage=False),
            dlg_method("MetaVers w/ leakage", "le_embedding", target="prototypes", leakage=True)])))
        fig2 = load_suite(write_suite(root / "suites" / "mvfig" / "fig2.yaml", figure_suite("fig2", "tsne", "acc", [
            tsne_method("Init", 0), tsne_method("FedAvg", 1)], seeds=(0,))))
        uri, art = store(root / "store")
        tracker = Tracker(uri, art)
        for suite in (fig3, fig2):
            summary = run_sweep(suite, suite.expand("smoke"), tracker, device="cpu",
                                data_dir=str(root / "data"), echo=lambda *a, **k: None)
            assert summary.failed == 0
        paper = render_paper("mvfig", [fig2, fig3], tracker, "smoke", root / "reports")
    return {"paper": paper, "tracker": tracker, "fig3": fig3, "fig2": fig2}


def logged(tracker, suite) -> dict[tuple[str, int], object]:
    return {(r.data.tags["cell.method"], int(r.data.tags["seed"])): r for r in tracker.runs(suite.key)}


def test_runs_log_the_analyses_arrays_and_metrics(rendered):
    runs = logged(rendered["tracker"], rendered["fig3"])
    assert len(runs) == 6
    for run in runs.values():
        arrays = read_npz_artifact(rendered["tracker"].client, run.info.run_id, "dlg")
        assert arrays["original"].shape == arrays["reconstruction"].shape == (3, 32, 32)
        assert {"dlg_psnr", "dlg_ssim", "dlg_gradient_distance"} <= set(run.data.metrics)
        assert math.isfinite(run.data.metrics["dlg_psnr"])
        assert read_npz_artifact(rendered["tracker"].client, run.info.run_id, "embeddings") is None
    tsne = logged(rendered["tracker"], rendered["fig2"])
    emb = read_npz_artifact(rendered["tracker"].client, tsne[("FedAvg", 0)].info.run_id, "embeddings")
    assert emb["embeddings"].shape == (20, 84) and tsne[("FedAvg", 0)].data.metrics["embeddings_logged"] == 20


def test_markdown_has_the_qualitative_figure_sections_with_every_psnr(rendered):
    fig2_md, fig3_md = (s.md.read_text() for s in rendered["paper"].suites)
    runs = logged(rendered["tracker"], rendered["fig3"])
    assert "## Figure: DLG reconstructions" in fig3_md and "Qualitative: the paper's figure prints no numbers" in fig3_md
    assert "![DLG reconstructions](fig3_figure.png)" in fig3_md
    for (method, seed), run in runs.items():
        m = run.data.metrics
        assert f"seed {seed}: PSNR {m['dlg_psnr']:.2f} dB, SSIM {m['dlg_ssim']:.3f}" in fig3_md
    assert "- MetaVers w/ leakage (image of seed 0 shown)" in fig3_md
    assert "## Figure: t-SNE of test embeddings" in fig2_md
    assert "- FedAvg: 20 test embeddings of" in fig2_md
    pngs = {p.name for s in rendered["paper"].suites for p in s.pngs}
    assert {"fig2_figure.png", "fig3_figure.png"} <= pngs


def test_pdf_shows_the_figures_and_their_psnr_values(rendered):
    pdf = rendered["paper"].pdf
    pages = [p.extract_text() for p in PdfReader(pdf).pages]
    titles = rendered["paper"].pages
    assert any(t.endswith("t-SNE of test embeddings (qualitative)") for t in titles)
    assert any(t.endswith("DLG reconstructions (qualitative)") for t in titles)
    text = "\n".join(pages)
    runs = logged(rendered["tracker"], rendered["fig3"])
    shown = {method: run.data.metrics for (method, seed), run in runs.items() if seed == 0}
    figure_page = next(p for p in pages if "DLG reconstructions (qualitative)" in p)
    for method, m in shown.items():  # the panel titles of the figure page
        assert f"PSNR {m['dlg_psnr']:.2f} dB, SSIM {m['dlg_ssim']:.3f}" in figure_page
    for (method, seed), run in runs.items():  # every seed on the notes page
        assert f"seed {seed}: PSNR {run.data.metrics['dlg_psnr']:.2f} dB" in text
    assert "Qualitative: the paper's figure prints no numbers" in text
    tsne_page = next(p for p in pages if "t-SNE of test embeddings (qualitative)" in p)
    assert "(a) Init" in tsne_page and "(b) FedAvg" in tsne_page


def test_tsne_panels_one_per_method_with_centroids():
    rng = np.random.default_rng(0)
    centres = np.eye(3, 8) * 20
    labels = np.repeat(np.arange(3), 15)
    emb = centres[labels] + rng.normal(size=(45, 8))
    fig = tsne_panels({"Local": (emb, labels), "MetaVers": (emb * 2, labels)})
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["(a) Local", "(b) MetaVers"]
    assert len(axes[0].collections) == 6  # per class: its dots and its centroid
    xy = tsne_map(emb)
    assert xy.shape == (45, 2)
    means = np.array([xy[labels == c].mean(0) for c in range(3)])
    within = max(np.linalg.norm(xy[labels == c] - means[c], axis=1).mean() for c in range(3))
    between = min(np.linalg.norm(means[i] - means[j]) for i in range(3) for j in range(i + 1, 3))
    assert between > 2 * within  # well-separated clusters stay separated
    with pytest.raises(ValueError, match="at least 3"):
        tsne_map(emb[:2])


def test_dlg_panels_show_original_and_reconstruction_with_their_scores():
    image = np.random.default_rng(1).random((3, 8, 8))
    fig = dlg_panels({"FedAvg": {"original": image, "reconstruction": image, "psnr": math.inf, "ssim": 1.0}})
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["FedAvg\noriginal", "reconstruction\nPSNR inf dB, SSIM 1.000"]
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), np.moveaxis(image, 0, -1))


def test_an_infinite_psnr_reads_back_as_inf(tmp_path):
    """MLflow stores inf as the largest float; the report shows it as inf again."""
    from mlflow.entities import Metric

    uri, art = store(tmp_path / "store")
    tracker = Tracker(uri, art)
    run = tracker.client.create_run(tracker.experiment_id("x/y")).info.run_id
    tracker.client.log_batch(run, metrics=[Metric("dlg_psnr", math.inf, 0, 0), Metric("dlg_ssim", 1.0, 0, 0)])
    logged = tracker.client.get_run(run).data.metrics
    assert stored_metric(logged["dlg_psnr"]) == math.inf and stored_metric(logged["dlg_ssim"]) == 1.0
    assert stored_metric(-logged["dlg_psnr"]) == -math.inf


def test_a_snapshot_carries_the_figures_artifacts_and_renders_them_without_the_store(rendered, tmp_path):
    """``pflbench snapshot`` of a qualitative suite carries each run's figure artifact (``dlg.npz``, a few
    KB) so ``report --from-snapshot`` draws the same panels as the store: the same Markdown (every PSNR),
    the arrays byte for byte, and a PDF whose figure page shows them."""
    import json

    from benchmarks.reporting.snapshot import SnapshotSet, export_snapshot

    suite, tracker = rendered["fig3"], rendered["tracker"]
    snap = tmp_path / "fig3.snapshot.json"
    assert export_snapshot(suite, tracker, snap) == len(suite.expand("smoke"))
    records = json.loads(snap.read_text())["runs"]
    assert all(set(r["artifacts"]) == {"dlg.npz"} for r in records)
    again = SnapshotSet.load([snap])
    for record in records:
        carried = read_npz_artifact(again.client, record["run_id"], "dlg")
        stored = read_npz_artifact(tracker.client, record["run_id"], "dlg")
        assert carried.keys() == stored.keys() and all(np.array_equal(carried[k], stored[k]) for k in stored)
    paper = render_paper("mvfig", [suite], again, "smoke", tmp_path / "reports")
    from_store = next(p for p in rendered["paper"].suites if p.report.suite.key == suite.key)
    from_snapshot = next(p for p in paper.suites if p.report.suite.key == suite.key)
    assert from_snapshot.md.read_text() == from_store.md.read_text()
    assert "## Figure: DLG reconstructions" in from_snapshot.md.read_text()
