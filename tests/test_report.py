"""Reports rendered from a real MLflow store: a smoke sweep of the tiny suite (one run made to
diverge) and hand-made runs logged through the Tracker (CAFeMe curves, best-validation rounds).
Tables (Markdown, CSV, LaTeX), the PDF (parsed with pypdf) and the ``report`` command."""
from __future__ import annotations

import json

import copy
import math
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from pypdf import PdfReader
from pypdf.generic import ContentStream

import benchmarks.running.sweep as runner
import benchmarks.running.worker as worker
from benchmarks.cli import main
from benchmarks.reporting import render_paper, write_report
from benchmarks.reporting.text import notice
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.spec import cell_id, load_suite
from benchmarks.store.tracking import Tracker
from pfl_core.federation import DivergenceError
from conftest import REPO_ROOT, store, tiny_suite_dict, write_suite

# its module-scoped store is filled once: one pytest-xdist worker runs the module (`make test`: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_report")

FAIL_CELL = {"setting": "iid", "method": "fedavg_ft"}
FAIL_SEED = 1
EXPECTED_COLUMNS = ["setting", "method", "n_seeds", "expected_seeds", "failed", "mean", "std", "sem", "pm",
                    "literal_mean", "literal_pm", "literal_step", "short_train_clients", "published_mean", "published_pm", "published_pm_kind", "published_runs", "published_sem",
                    "published_source", "diff", "bound", "rule", "verdict", "verdict_detail",
                    "failure_reason", "switches", "tuned", "tuned_source", "marks", "code_mean", "code_pm", "code_sem",
                    "code_seeds", "code_source", "code_diff", "code_bound", "code_rule", "code_verdict",
                    "code_verdict_detail", "label", "profile", "metric", "aggregate", "pm_kind", "ddof"]
NOTICE = "Not comparable with the paper"

# hand-made runs: fractions; the metric scale (100) makes them percent
CURVES = {0: [0.1, 0.3, 0.5, 0.6, 0.7], 1: [0.2, 0.2, 0.4, 0.8, 0.9]}
VAL_HISTORY = {  # seed -> [(round, val_acc_weighted, acc_weighted)]
    0: [(49, 0.60, 0.58), (99, 0.72, 0.69), (149, 0.71, 0.75)],
    1: [(49, 0.65, 0.61), (99, 0.64, 0.66), (149, 0.70, 0.68)],
}


def quiet(*_args, **_kwargs):
    pass


def hand_suite(name: str) -> dict:
    """Suites of paper ``hand`` whose runs are logged by hand (paper profile, seeds 0 and 1)."""
    data = copy.deepcopy(tiny_suite_dict())
    data.update(paper="hand", name=name, table=f"Hand {name}", caption=f"Caption of the {name} suite.")
    data["base"]["data"]["dataset"] = "mnist"  # not an offline stand-in (the runs are logged by hand)
    if name == "curves":
        data["metric"].update(aggregate="last3_of_seed_mean_curve", figure="curves", pm="std", ddof=0)
        data["published"] = [
            {"cell": {"setting": "dir", "method": "local"}, "mean": 60.0, "pm": 4.0, "pm_kind": "std", "runs": 5, "source": "T1"},
            {"cell": {"setting": "dir", "method": "fedavg"}, "mean": 40.0, "pm": 1.0, "pm_kind": "std", "runs": 5, "source": "T1"},
            {"cell": {"setting": "dir", "method": "fedavg_ft"}, "mean": 90.0, "pm": 1.0, "pm_kind": "std", "runs": 5, "source": "T1"},
            {"cell": {"setting": "iid", "method": "local"}, "mean": 61.0, "pm": 2.0, "pm_kind": "std", "runs": 5, "source": "T1"},
        ]
    else:
        data["metric"].update(key="round/acc_weighted", aggregate="best_val_round",
                              select_metric="round/val_acc_weighted", pm="sem", ddof=0, tolerance=1.0)
        data["published"] = [
            {"cell": {"setting": "dir", "method": "local"}, "mean": 68.0, "source": "T2"},
            {"cell": {"setting": "dir", "method": "fedavg"}, "mean": 63.0, "source": "T2"},
        ]
    return data


def log_by_hand(tracker: Tracker, suite, spec, **outcome) -> None:
    base = {"started": 1000.0, "ended": 1000.0 + outcome.pop("wall", 2.0),
            "info": {"device": "cpu", "dataset_offline": False}}
    tracker.log(spec, {"paper": suite.paper, "table": suite.raw["table"]}, {**base, **outcome}, ("c0ffee", False))


def fill_hand_store(root, tracker):
    suites = {}
    for name in ("curves", "bestval"):
        suite = load_suite(write_suite(root / "suites" / "hand" / f"{name}.yaml", hand_suite(name)))
        suites[name] = suite
        for spec in suite.expand("paper"):
            cell = (spec.cell["setting"], spec.cell["method"])
            if name == "curves":
                if cell == ("iid", "fedavg_ft") or (cell == ("iid", "local") and spec.seed == 1):
                    continue  # not run / partial
                if cell == ("iid", "fedavg"):
                    log_by_hand(tracker, suite, spec, error="diverged: hand-made nan")
                    continue
                log_by_hand(tracker, suite, spec, curve_mean=CURVES[spec.seed],
                            metrics={"acc_last3": float(np.mean(CURVES[spec.seed][-3:])),
                                     "short_train_clients": float(spec.seed)})  # seed 1: one short client
            elif cell[0] == "dir":
                rows = [{"round": r, "train_loss": 1.0, "val_acc_weighted": v, "acc_weighted": t}
                        for r, v, t in VAL_HISTORY[spec.seed]]
                log_by_hand(tracker, suite, spec, history=rows, metrics={"acc_weighted": rows[-1]["acc_weighted"]})
    return suites


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """One store: the smoke sweep of the tiny suite (one run diverges) and the hand-made suites."""
    root = tmp_path_factory.mktemp("report")
    real = worker.run_experiment

    def one_fails(cfg, **kwargs):
        if (cfg.method.name, cfg.data.partition["name"], cfg.seed) == ("fedavg_ft", "iid", FAIL_SEED):
            raise DivergenceError("injected: non-finite training loss (nan) in round 1")
        return real(cfg, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(root)
        mp.setattr(worker, "run_experiment", one_fails)
        path = write_suite(root / "suites" / "tiny" / "mini.yaml", tiny_suite_dict())
        suite = load_suite(path)
        uri, art = store(root / "store")
        tracker = Tracker(uri, art)
        summary = run_sweep(suite, suite.expand("smoke"), tracker, device="cpu", echo=quiet)
        hand = fill_hand_store(root, tracker)
        tiny_pdf = render_paper("tiny", [suite], tracker, "smoke", root / "reports")
        hand_pdf = render_paper("hand", [hand["curves"], hand["bestval"]], tracker, "paper", root / "reports")
    assert summary.failed == 1
    md, csv = tiny_pdf.suites[0].md, tiny_pdf.suites[0].csv
    return {"root": root, "path": path, "suite": suite, "tracker": tracker, "uri": uri, "hand": hand,
            "tiny_pdf": tiny_pdf, "hand_pdf": hand_pdf, "md": md, "csv": csv,
            "text": md.read_text(), "frame": pd.read_csv(csv, keep_default_na=False, na_values=[""])}


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


def md_rows(text: str, first: str = "| setting | method |", n_axes: int = 2) -> dict[tuple, list[str]]:
    """Table rows of a Markdown report keyed by their axis labels."""
    rows = {}
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert tuple(cells[:n_axes]) not in rows, f"duplicate row {line}"
        rows[tuple(cells[:n_axes])] = cells[n_axes:]
    return rows


def mlflow_values(uri: str, suite, profile: str) -> dict[str, list[float]]:
    """metric x scale of the FINISHED runs of ``profile``, per cell, read straight from MLflow."""
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(suite.key)
    runs = client.search_runs([exp.experiment_id],
                              f"tags.profile = '{profile}' and tags.run_kind = 'cell' and attributes.status = 'FINISHED'")
    values: dict[str, list[float]] = {}
    for run in runs:
        values.setdefault(run.data.tags["cell"], []).append(
            run.data.metrics[suite.metric["key"]] * suite.metric["scale"])
    return values


def row_of(table: pd.DataFrame, setting: str, method: str):
    return table[(table["setting"] == setting) & (table["method"] == method)].iloc[0]


def pdf_pages(path) -> list[str]:
    return [page.extract_text() for page in PdfReader(path).pages]


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def page_layout(path, index: int = 0) -> tuple[list[float], list[tuple[float, str]]]:
    """Where things sit on a page of a PDF, in points from its bottom: the bottom edge of each image
    drawn (a heat map is one) and each line of text with its baseline."""
    reader = PdfReader(path)
    page = reader.pages[index]
    xobjects = page["/Resources"].get("/XObject", {})
    images, stack, ctm = [], [], [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    for args, op in ContentStream(page.get_contents(), reader).operations:
        if op == b"q":
            stack.append(ctm)
        elif op == b"Q":
            ctm = stack.pop()
        elif op == b"cm":
            a, b, c, d, e, f = (float(x) for x in args)
            A, B, C, D, E, F = ctm
            ctm = [a * A + b * C, a * B + b * D, c * A + d * C, c * B + d * D, e * A + f * C + E, e * B + f * D + F]
        elif op == b"Do" and xobjects[args[0]].get_object().get("/Subtype") == "/Image":
            images.append(ctm[5])
    pieces: dict[float, str] = {}  # baseline -> its text (a ligature such as "fl" comes as a piece of its own)

    def visit(text, cm, tm, *_):
        y = round(tm[4] * cm[1] + tm[5] * cm[3] + cm[5], 1)
        pieces[y] = pieces.get(y, "") + text
    page.extract_text(visitor_text=visit)
    return images, [(y, text) for y, text in pieces.items() if text.strip()]


def assert_shows_before_it_tells(path, line: str) -> None:
    """Page 1 of the PDF at ``path``: an image (the figure) above the verdict-count ``line``, and no
    table before it (the summary's count table is on page 2)."""
    images, texts = page_layout(path, 0)
    assert images, "page 1 holds no image: the figure is missing"
    at = [y for y, text in texts if line in squash(text)]
    assert at, f"page 1 lacks the verdict line {line!r}"
    assert min(images) > max(at), "the verdict line comes before (above) the figure"
    first = squash(pdf_pages(path)[0])
    assert "best method holds" not in first and "best method holds" in squash(pdf_pages(path)[1])


# ------------------------------------------------------------------ smoke sweep: tables

def test_report_files_written_under_out_dir(reported):
    suite, folder = reported["suite"], reported["root"] / "reports" / "tiny"
    assert reported["md"] == folder / f"{suite.name}.md" and reported["csv"] == folder / f"{suite.name}.csv"
    for name in ("mini.md", "mini.csv", "mini.tex", "mini_bars.png", "mini_diff.png"):
        assert (folder / name).is_file(), name
    assert (reported["root"] / "reports" / "tiny.pdf").is_file()


def test_markdown_header_caption_notice_and_legend(reported):
    suite, text = reported["suite"], reported["text"]
    assert text.startswith(f"# {suite.raw['table']} ({suite.key})")
    assert suite.raw["caption"].strip() in text
    notice = [line for line in text.splitlines() if NOTICE in line]
    assert len(notice) == 1
    assert "`smoke` profile (tests), not the published setup" in notice[0] and "offline data" in notice[0]  # what it cut
    assert f"`{suite.metric['key']}`" in text and suite.metric["label"] in text
    assert f"ddof={suite.metric['ddof']}" in text
    assert "Legend:" in text and "- **no reference**:" in text and "Does the paper's conclusion hold?" in text


def test_markdown_one_row_per_cell_with_seed_counts_and_verdicts(reported):
    suite = reported["suite"]
    rows = md_rows(reported["text"])
    assert set(rows) == {tuple(c.values()) for c in suite.cells()}
    n = len(tiny_suite_dict()["profiles"]["smoke"]["seeds"])
    for key, cells in rows.items():
        if key == tuple(FAIL_CELL.values()):
            assert cells[0] == f"{n - 1}/{n} (1 failed)"
            assert cells[-1].startswith(f"partial one seed of {n} (no reference)" if n == 2 else f"partial {n - 1}/{n} (no reference)")
        else:
            assert cells[0] == f"{n}/{n}"
            assert cells[-1] in ("reproduced", "above", "below", "no reference")


def test_csv_columns_and_means_match_mlflow(reported):
    suite, frame = reported["suite"], reported["frame"]
    assert list(frame.columns) == EXPECTED_COLUMNS
    assert len(frame) == len(suite.cells())
    assert set(frame["profile"]) == {"smoke"} and set(frame["metric"]) == {suite.metric["key"]}
    values = mlflow_values(reported["uri"], suite, "smoke")
    for _, row in frame.iterrows():
        mine = values[cell_id({"setting": row["setting"], "method": row["method"]})]
        assert row["n_seeds"] == len(mine)
        assert row["expected_seeds"] == len(tiny_suite_dict()["profiles"]["smoke"]["seeds"])
        assert row["mean"] == pytest.approx(np.mean(mine))
        assert 0 <= row["mean"] <= suite.metric["scale"]
        if len(mine) >= 2:
            assert row["std"] == pytest.approx(np.std(mine, ddof=1))
            assert row["sem"] == pytest.approx(np.std(mine, ddof=1) / np.sqrt(len(mine)))
            assert row["pm"] == pytest.approx(np.std(mine, ddof=suite.metric["ddof"]))


def test_spread_convention_follows_the_suite(reported, tmp_path):
    values = mlflow_values(reported["uri"], reported["suite"], "smoke")
    data = tiny_suite_dict()
    data["metric"].update(pm="sem", ddof=1)
    sem_suite = load_suite(write_suite(tmp_path / "sem.yaml", data))  # same experiment and hashes
    _, _, table = write_report(sem_suite, reported["tracker"], "smoke", out_dir=tmp_path / "sem")
    checked = 0
    for _, row in table.iterrows():
        mine = np.array(values[cell_id({"setting": row["setting"], "method": row["method"]})])
        if len(mine) >= 2:
            assert row["pm"] == pytest.approx(np.std(mine, ddof=1) / np.sqrt(len(mine)))
            checked += 1
    assert checked == len(table) - 1
    assert "mean ± sem (ddof=1)" in (tmp_path / "sem" / "tiny" / "mini.md").read_text()


def test_published_values_signed_differences_and_verdicts(reported):
    suite, frame = reported["suite"], reported["frame"]
    rows = md_rows(reported["text"])
    published = {tuple(p["cell"][a.name] for a in suite.axes): p for p in suite.published}
    assert published
    for _, row in frame.iterrows():
        key = (row["setting"], row["method"])
        ours, paper, diff, bound, verdict = rows[key][1:6]
        assert ours.startswith(f"{row['mean']:.2f}")
        if key not in published:
            assert math.isnan(row["published_mean"]) and math.isnan(row["diff"])
            assert (paper, diff, bound) == ("—", "—", "—")
            continue
        pub = published[key]
        assert (row["published_mean"], row["published_pm"], row["published_source"]) == (pub["mean"], pub["pm"], pub["source"])
        assert row["diff"] == pytest.approx(row["mean"] - pub["mean"])
        assert paper == f"{pub['mean']:.2f} ± {pub['pm']:.2f}" and diff == f"{row['mean'] - pub['mean']:+.2f}"
        se_paper = pub["pm"] * math.sqrt(pub["runs"] / (pub["runs"] - 1)) / math.sqrt(pub["runs"])  # ddof 0
        expected_bound = 2 * math.sqrt(se_paper ** 2 + row["sem"] ** 2)
        assert row["bound"] == pytest.approx(expected_bound) and bound == f"±{expected_bound:.2f} (2SE)"
        expected = "reproduced" if abs(row["diff"]) <= expected_bound else ("above" if row["diff"] > 0 else "below")
        assert verdict == row["verdict"] == expected


def test_failed_run_counted_with_reason(reported):
    frame, text = reported["frame"], reported["text"]
    failed = frame[frame["failed"] > 0]
    assert list(zip(failed["setting"], failed["method"])) == [tuple(FAIL_CELL.values())]
    assert "injected" in failed.iloc[0]["failure_reason"] and "diverged" in failed.iloc[0]["failure_reason"]
    assert (frame.loc[frame["failed"] == 0, "failure_reason"].fillna("") == "").all()
    assert f"- {FAIL_CELL['setting']}/{FAIL_CELL['method']}: diverged: injected" in text


def test_fidelity_switches_listed_per_cell(reported):
    frame, text = reported["frame"], reported["text"]
    assert set(frame["switches"]) == {"method.local_epochs=1 (default 5); method.lr=0.05 (default 0.001)"}
    assert "- dir/fedavg: method.local_epochs=1 (default 5); method.lr=0.05 (default 0.001)" in text


def test_report_of_a_profile_without_runs(reported, tmp_path):
    _, _, table = write_report(reported["suite"], reported["tracker"], "paper", out_dir=tmp_path)
    assert (table["n_seeds"] == 0).all() and table["mean"].isna().all()
    assert set(table["verdict"]) == {"not run"}
    text = (tmp_path / "tiny" / "mini.md").read_text()
    n = len(tiny_suite_dict()["seeds"])
    assert all(cells[0] == f"0/{n}" and cells[1] == "—" and cells[-1] == "not run" for cells in md_rows(text).values())
    notice = [line for line in text.splitlines() if NOTICE in line]  # digits28 is offline, known before any run
    assert len(notice) == 1 and "offline data" in notice[0] and "profile" not in notice[0]


# ------------------------------------------------------------------ hand-made store: aggregation modes

def test_cafeme_curve_statistic_from_the_store(reported):
    table = reported["hand_pdf"].suites[0].report.table
    grid = np.array([CURVES[0], CURVES[1]]) * 100
    value = grid.mean(axis=0)[-3:].mean()
    pm = np.mean([np.std(grid[:, k], ddof=0) for k in (-3, -2, -1)])
    seeds = grid[:, -3:].mean(axis=1)
    row = row_of(table, "dir", "local")
    assert row["mean"] == pytest.approx(value) and row["pm"] == pytest.approx(pm)
    assert row["sem"] == pytest.approx(np.std(seeds, ddof=1) / np.sqrt(2))
    assert (row["mean"], round(row["pm"], 4)) == (pytest.approx(65.0), 8.3333)


def test_cafeme_literal_metric_and_short_clients_beside_the_table_value(reported):
    """Issue 11 items 2 and 5: the accuracy after exactly the last step (mean and std over seeds of
    the curves' last points) and the per-run count of clients smaller than a batch."""
    report = reported["hand_pdf"].suites[0].report
    row = row_of(report.table, "dir", "local")
    last = np.array([CURVES[0][-1], CURVES[1][-1]]) * 100
    assert (row["literal_mean"], row["literal_pm"], row["literal_step"]) == (
        pytest.approx(last.mean()), pytest.approx(np.std(last, ddof=0)), 4)
    assert row["literal_mean"] != pytest.approx(row["mean"])
    assert row["short_train_clients"] == "seed 1: 1"
    text = squash(reported["hand_pdf"].suites[0].md.read_text())
    assert "dir/local: after 4 steps 80.00 ± 10.00 (table value 65.00 ± 8.33)" in text
    assert "dir/local: seed 1: 1" in text
    assert "Literal metric" not in reported["text"]  # the tiny suite's metric is not a curve
    assert any("after 4 steps 80.00" in squash(page) for page in pdf_pages(reported["hand_pdf"].pdf))


def test_every_verdict_reached_on_the_hand_made_store(reported):
    table = reported["hand_pdf"].suites[0].report.table
    verdicts = {(r["setting"], r["method"]): r["verdict"] for _, r in table.iterrows()}
    assert verdicts == {("dir", "local"): "reproduced", ("dir", "fedavg"): "above", ("dir", "fedavg_ft"): "below",
                        ("iid", "local"): "partial", ("iid", "fedavg"): "failed", ("iid", "fedavg_ft"): "not run"}
    partial = row_of(table, "iid", "local")
    assert partial["verdict_detail"] == "one seed of 2 (within the bound)" and partial["rule"] == "2SE*"  # 60 vs 61 +- 2 std
    assert "hand-made nan" in row_of(table, "iid", "fedavg")["verdict_detail"]
    text = reported["hand_pdf"].suites[0].md.read_text()
    for word in ("reproduced", "above", "below", "partial", "failed", "not run"):
        assert f"- **{word}**:" in text


def test_best_validation_round_selection_from_the_store(reported):
    report = reported["hand_pdf"].suites[1].report
    picks = [0.69, 0.68]  # seed 0: round 99 (val 0.72); seed 1: round 149 (val 0.70)
    row = row_of(report.table, "dir", "fedavg")
    assert row["mean"] == pytest.approx(100 * np.mean(picks))
    assert row["pm"] == pytest.approx(100 * np.std(picks, ddof=0) / np.sqrt(2))
    finals = [VAL_HISTORY[s][-1][2] for s in (0, 1)]
    assert row["mean"] != pytest.approx(100 * np.mean(finals))  # not the last round
    # no spread published: the suite's tolerance (1.0) decides
    assert (row["rule"], row["bound"], row["verdict"]) == ("tol", 1.0, "above")  # 68.5 vs 63.0
    local = row_of(report.table, "dir", "local")
    assert (local["rule"], local["verdict"]) == ("tol", "reproduced")  # 68.5 vs 68.0


def test_conclusions_best_method_and_kendall_tau(reported):
    report = reported["hand_pdf"].suites[0].report
    (dir_col, iid_col) = report.conclusions
    assert (dir_col.column, dir_col.methods, dir_col.best_paper) == ("dir", 3, "fedavg_ft")
    # all three equal: a tie at the top that holds the paper's best is named, and holds
    assert dir_col.best_ours == "fedavg_ft" and dir_col.tied == ("local", "fedavg") and dir_col.best_holds
    assert math.isnan(dir_col.tau)  # our three values tie: tau undefined
    assert (iid_col.methods, iid_col.best_ours, iid_col.best_paper) == (1, "local", "local")
    text = reported["hand_pdf"].suites[0].md.read_text()
    assert "- dir: best ours **fedavg_ft (tied with local, fedavg)**, best paper **fedavg_ft** (holds)" in text


# ------------------------------------------------------------------ LaTeX

def balanced(tex: str) -> bool:
    stack = []
    for kind, name in re.findall(r"\\(begin|end)\{([^}]*)\}", tex):
        if kind == "begin":
            stack.append(name)
        elif not stack or stack.pop() != name:
            return False
    depth = 0
    for ch in re.sub(r"\\[{}]", "", tex):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return not stack and depth == 0 and tex.count("$") % 2 == 0


def test_balance_checker_catches_errors():
    assert balanced(r"\begin{a}\begin{b}{x}\end{b}\end{a}")
    assert not balanced(r"\begin{a}\begin{b}\end{a}\end{b}")
    assert not balanced(r"\begin{a}{\end{a}") and not balanced(r"$x")


def test_latex_tables_are_booktabs_with_bold_best_and_balanced(reported, tmp_path):
    tiny = reported["tiny_pdf"].suites[0].tex.read_text()
    hand = reported["hand_pdf"].suites[0].tex.read_text()
    for tex in (tiny, hand):
        assert balanced(tex), tex
        assert all(rule in tex for rule in (r"\toprule", r"\midrule", r"\bottomrule"))
        assert "Ours & Paper" in tex and r"\caption{" in tex
    assert r"fedavg\_ft" in tiny and r"\textbf{" in tiny
    assert r"\textbf{90.00 $\pm$ 1.00}" in hand  # the paper's best in its column
    assert r"40.00 $\pm$ 1.00" in hand and r"$^{\uparrow}$" in hand and r"$^{\downarrow}$" in hand
    assert "failed" in hand and "not comparable" not in hand.lower()
    assert "Not comparable with the paper" in tiny
    engine = next((e for e in ("pdflatex", "lualatex", "tectonic") if shutil.which(e)), None)
    if engine is None:
        return  # no TeX engine on this machine: the balance check above is the test
    doc = tmp_path / "t.tex"
    doc.write_text("\\documentclass{article}\\usepackage{booktabs}\\begin{document}\n"
                   + tiny + hand + "\\end{document}\n")
    args = [engine, doc.name] if engine == "tectonic" else [engine, "-interaction=nonstopmode", doc.name]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]


# ------------------------------------------------------------------ PDF

def test_pdf_of_a_smoke_profile_has_the_notice_on_every_page(reported):
    done = reported["tiny_pdf"]
    pages = pdf_pages(done.pdf)
    # overview, summary, table with its legend folded under it, bars, diff, fidelity, setup
    assert len(pages) == len(done.pages) == 7
    assert done.pages[:2] == ["overview", "summary"] and not any("verdicts and conclusions" in p for p in done.pages)
    for page in pages:  # one table, not comparable: page 1's figure is of it, so its notice is beside it
        assert NOTICE in squash(page)
    title = squash(pages[1])
    for field in ("Paper: tiny", "Code commit:", "Date rendered:", "Device: cpu", "Profile: smoke",
                  "Runs: 11 finished, 1 failed, of 12 expected", "Total compute time:"):
        assert field in title, field
    body = squash(" ".join(pages[1:]))
    suite = reported["suite"]
    assert suite.raw["table"] in body and squash(suite.raw["caption"]) in body
    assert "50.00 ± 1.50" in body and "30.00 ± 2.00" in body  # published numbers
    assert "partial one seed of 2" in body and "diverged: injected" in body
    assert "ours vs paper" in body and "difference to the paper" in body
    assert "fidelity switches" in body and "method.lr=0.05 (default 0.001)" in body
    assert "exact setup" in body and "clients_per_round: 3" in body


def test_pdf_total_compute_time_is_the_sum_of_wall_s(reported):
    runs = reported["tiny_pdf"].suites[0].report.runs
    total = runs["wall_s"].sum()
    assert f"Total compute time: {total:.1f} s" in squash(pdf_pages(reported["tiny_pdf"].pdf)[1])


def test_pdf_of_the_paper_profile_has_sections_figures_and_no_notice(reported):
    done = reported["hand_pdf"]
    pages = pdf_pages(done.pdf)
    assert len(pages) == len(done.pages)
    assert not any(NOTICE in squash(p) for p in pages)
    text = squash(" ".join(pages))
    assert "Paper: hand" in text and "Code commit: c0ffee" in text and "Runs: 13 finished, 2 failed, of 24 expected" in text
    for title in ("1. Hand curves (hand/curves)", "2. Hand bestval (hand/bestval)"):
        assert title in text
    assert "1. Hand curves (hand/curves): reproduced figure" in done.pages
    assert "accuracy vs personalization steps" in text  # the CAFeMe Fig. 4 form
    assert "Kendall" in text and "best ours fedavg_ft (tied with local, fedavg), best paper fedavg_ft (holds)" in text
    assert "60.00 ± 4.00" in text and "65.00 ± 8.33" in text


def test_pdf_page_one_shows_the_figure_then_the_verdict_count(reported):
    """Page 1 shows before it tells: the first table's difference-to-paper heat map (an image), then
    its verdicts in one line; the other table gets a line naming its section; the title lines and
    the summary's tables are on page 2."""
    done = reported["hand_pdf"]
    assert_shows_before_it_tells(done.pdf, "hand/curves: 1 reproduced, 1 above, 1 below of 3 cells compared")
    first = squash(pdf_pages(done.pdf)[0])
    assert "6 in all: 1 partial, 1 failed, 1 not run" in first
    assert "Reproduction report: hand" in first
    assert ("hand/bestval: 1 reproduced, 1 above, 0 below of 2 cells compared (6 in all: 3 not run, 1 no reference)"
            " - section 2") in first
    assert "Paper: hand" not in first and "Paper: hand" in squash(pdf_pages(done.pdf)[1])
    for verdict in ("reproduced", "above", "below", "partial"):  # each cell's verdict under its value
        assert verdict in first


# ------------------------------------------------------------------ commands

@pytest.mark.slow
def test_report_command_by_paper(reported, tmp_path, capsys):
    for name in ("curves", "bestval"):
        write_suite(tmp_path / "suites" / "hand" / f"{name}.yaml", hand_suite(name))
    out = tmp_path / "out"
    assert main(["report", "--paper", "hand", "--tracking-uri", reported["uri"], "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (out / "hand.pdf").is_file() and (out / "hand" / "curves.md").is_file() and (out / "hand" / "bestval.tex").is_file()
    assert f"hand [paper]: 2 suite(s), {len(pdf_pages(out / 'hand.pdf'))} pages -> {out / 'hand.pdf'}" in printed
    assert main(["report", "--paper", "nope", "--tracking-uri", reported["uri"]]) == 2
    assert main(["report", "--tracking-uri", reported["uri"]]) == 2


def test_run_with_report_renders_the_paper_pdf(reported, tmp_path, capsys):
    path = write_suite(tmp_path / "suites" / "tiny" / "mini.yaml", tiny_suite_dict())
    out = tmp_path / "out"
    rc = main(["run", str(path), "--profile", "smoke", "--tracking-uri", reported["uri"], "--device", "cpu",
               "--only", "setting=dir", "--report", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "0 finished, 0 failed, 6 skipped" in printed  # all FINISHED in the module's store
    assert (out / "tiny.pdf").is_file() and "tiny [smoke]: 1 suite(s)" in printed


@pytest.mark.slow  # renders the committed CGPFL snapshot's 10 pages
def test_report_beside_a_committed_snapshot_says_which_is_which(reported, tmp_path, capsys):
    """``--beside-snapshot`` (make demo): the committed CGPFL Table 1 snapshot comes first in the
    PDF, page 1 counts its verdicts and says it is a snapshot that was not rerun; its pages carry no
    not-comparable banner while the smoke suite's pages do; its files go under <paper>/beside/."""
    snapshot = REPO_ROOT / "reports" / "reproduced" / "cgpfl" / "table1.snapshot.json"
    out = tmp_path / "out"
    assert main(["report", str(reported["path"]), "--profile", "smoke", "--tracking-uri", reported["uri"],
                 "--out", str(out), "--beside-snapshot", str(snapshot)]) == 0
    pages = pdf_pages(out / "tiny.pdf")
    first, summary = squash(pages[0]), squash(pages[1])
    # page 1: the snapshot's heat map, then its verdict count, then which table is which
    assert_shows_before_it_tells(out / "tiny.pdf", "cgpfl/table1: 17 reproduced, 8 above, 11 below of 36 cells compared")
    assert "cgpfl/table1: a COMMITTED SNAPSHOT of" in first and "without rerunning anything" in first
    assert "tiny/mini: " in first and "section 2" in first
    # the smoke suite's notice is not on page 1 (nor its banner): it is beside its own table
    tiny_notice = squash(notice(next(r for r in reported["tiny_pdf"].suites).report).replace("`", ""))
    assert NOTICE not in first and "NOT COMPARABLE" not in first and "offline data" not in first
    row = next(line for line in pages[1].splitlines() if line.startswith("cgpfl/table1 "))
    assert int(row.split()[2]) >= 3  # reproduced cells of the snapshot, counted on the summary page
    assert "Suites: tiny/mini" in summary and f"tiny/mini: {tiny_notice}" in summary
    cgpfl = [i for i, p in enumerate(pages) if "(cgpfl/table1)" in p]  # the section's footer names it
    tiny = [i for i, p in enumerate(pages) if "(tiny/mini)" in p]
    assert cgpfl and all("NOT COMPARABLE" not in pages[i] and NOTICE not in squash(pages[i]) for i in cgpfl)
    assert tiny and all("NOT COMPARABLE" in pages[i] and tiny_notice in squash(pages[i]) for i in tiny)
    table_page = next(i for i in tiny if "2. " in pages[i] and "50.00 ± 1.50" in pages[i])  # its table
    assert tiny_notice in squash(pages[table_page])
    assert (out / "tiny" / "beside" / "cgpfl" / "table1.md").is_file() and not (out / "cgpfl").exists()


# ------------------------------------------------------------------ run selection (real sweeps)

def renamed(suite_data: dict, name: str) -> dict:
    return {**suite_data, "name": name}


def test_rerun_after_failure_replaces_the_failed_run(reported, tmp_path, suite_data, monkeypatch):
    suite = load_suite(write_suite(tmp_path / "rerun.yaml", renamed(suite_data, "rerun")))
    specs = suite.expand("smoke", only={"setting": ["iid"], "method": ["local"]})
    tracker = reported["tracker"]
    real = worker.run_experiment

    def seed1_fails(cfg, **kwargs):
        if cfg.seed == 1:
            raise DivergenceError("injected")
        return real(cfg, **kwargs)

    monkeypatch.setattr(worker, "run_experiment", seed1_fails)
    # reuse=False: the module's store holds these configurations (tiny/mini), which would be copied
    run_sweep(suite, specs, tracker, device="cpu", echo=quiet, reuse=False)
    _, _, before = write_report(suite, tracker, "smoke", out_dir=tmp_path / "r1")
    row = row_of(before, "iid", "local")
    assert (row["n_seeds"], row["failed"], row["verdict"]) == (len(specs) - 1, 1, "partial")

    monkeypatch.setattr(worker, "run_experiment", real)
    run_sweep(suite, specs, tracker, device="cpu", echo=quiet, reuse=False)
    _, _, after = write_report(suite, tracker, "smoke", out_dir=tmp_path / "r2")
    row = row_of(after, "iid", "local")
    assert (row["n_seeds"], row["failed"], row["failure_reason"]) == (len(specs), 0, "")
    assert row["verdict"] == "reproduced" or row["verdict"] in ("above", "below")  # has a reference
    values = mlflow_values(tracker.uri, suite, "smoke")["setting=iid,method=local"]
    assert row["mean"] == pytest.approx(np.mean(values))


def test_report_ignores_runs_of_an_edited_suite(reported, tmp_path, suite_data):
    only = {"setting": ["iid"], "method": ["fedavg"]}
    tracker = reported["tracker"]
    suite_data = renamed(suite_data, "edited")
    old = load_suite(write_suite(tmp_path / "v1.yaml", suite_data))
    run_sweep(old, old.expand("smoke", only=only, seeds=[0]), tracker, device="cpu", echo=quiet)
    suite_data["base"]["method"]["params"]["lr"] = 0.2  # the suite file is edited in place
    new = load_suite(write_suite(tmp_path / "v1.yaml", suite_data))
    new_specs = new.expand("smoke", only=only)
    run_sweep(new, new_specs, tracker, device="cpu", echo=quiet)
    _, _, table = write_report(new, tracker, "smoke", out_dir=tmp_path / "rep")
    row = row_of(table, "iid", "fedavg")
    current = {s.config_hash for s in new_specs}
    values = [r.data.metrics["acc_last3"] * 100 for r in tracker.runs(new.key) if r.data.tags["config_hash"] in current]
    assert len(tracker.runs(new.key)) == len(new_specs) + 1
    assert row["n_seeds"] == len(new_specs) and row["mean"] == pytest.approx(np.mean(values))
    assert "method.lr=0.2 (default 0.001)" in row["switches"]


def test_report_counts_runs_shared_with_another_profile(reported, tmp_path, suite_data):
    suite_data = renamed(suite_data, "shared")
    suite_data["profiles"]["fewer"] = {"seeds": [0]}  # same configs as `paper`, fewer seeds
    suite = load_suite(write_suite(tmp_path / "s.yaml", suite_data))
    only = {"setting": ["iid"], "method": ["local"]}
    tracker = reported["tracker"]
    run_sweep(suite, suite.expand("fewer", only=only), tracker, device="cpu", echo=quiet)
    paper = suite.expand("paper", only=only)
    summary = run_sweep(suite, paper, tracker, device="cpu", echo=quiet)
    assert summary.skipped == 1  # seed 0 is reused: identical config
    _, _, table = write_report(suite, tracker, "paper", out_dir=tmp_path / "rep")
    assert row_of(table, "iid", "local")["n_seeds"] == len(paper)


def test_published_cell_key_order_does_not_matter(tmp_path, suite_data, reported):
    suite_data["published"] = [{"cell": {"method": "fedavg", "setting": "dir"}, "mean": 50.0, "source": "T"}]
    suite = load_suite(write_suite(tmp_path / "order.yaml", suite_data))
    _, _, table = write_report(suite, reported["tracker"], "smoke", out_dir=tmp_path / "rep")
    assert row_of(table, "dir", "fedavg")["published_mean"] == 50.0


def test_pdf_summary_page_counts_verdicts_labels_tau_and_switches(reported):
    """Page 2 (the summary) of a two-table PDF: the verdict counts per table and in all, the labels,
    Kendall tau per table and the switches in force (tiny suite: its smoke profile's non-default settings)."""
    hand = squash(pdf_pages(reported["hand_pdf"].pdf)[1])
    reports = [s.report for s in reported["hand_pdf"].suites]
    judged = [[c for c in r.conclusions if not c.provisional] for r in reports]
    apart = [len(r.conclusions) - len(j) for r, j in zip(reports, judged)]
    holds = [f"{sum(c.best_holds for c in j)}/{len(j)}" + (f" (+{a} provisional)" if a else "")
             for j, a in zip(judged, apart)]
    # cells, reproduced, above, below, partial, failed, not run, no reference, undecided, best holds
    assert f"hand/curves 6 1 1 1 1 1 1 0 0 {holds[0]}" in hand
    assert f"hand/bestval 6 1 1 0 0 0 3 1 0 {holds[1]}" in hand  # dir/fedavg_ft ran, no published number
    assert "all 12 2 2 1 1 1 4 1 0" in hand
    for line in ("4 x not run", "1 x no reference", "2 x reproduces the paper", "2 x above the paper", "1 x below the paper",
                 "1 x one seed of 2 (a spot check): within the paper's bound", "1 x failed",
                 "no table has a code reference: the labels read the paper only",
                 "hand/curves: dir n/a (3 methods); iid n/a (1 method)", "Switches in force"):
        assert line in hand, line
    tiny = squash(pdf_pages(reported["tiny_pdf"].pdf)[1])
    assert "Summary" in tiny and "Paper: tiny" in tiny and NOTICE in tiny
    n_cells = len(reported["suite"].cells())
    assert f"method.lr=0.05 (default 0.001): {n_cells} cell(s)" in tiny
    assert f"method.local_epochs=1 (default 5): {n_cells} cell(s)" in tiny


def test_a_snapshot_renders_the_same_table_as_its_store_without_the_store(reported, tmp_path, capsys):
    """``pflbench snapshot`` exports a suite's runs to one JSON file; ``report --from-snapshot`` renders
    it with the same report code and no store: the same Markdown and CSV, plus a provenance page."""
    suite = reported["hand"]["curves"]
    snap = tmp_path / "reproduced" / "hand" / "curves.snapshot.json"
    assert main(["snapshot", str(suite.path), "--tracking-uri", reported["uri"], "--out", str(snap),
                 "--note", "machine=test box", "--note", "data=hand-made"]) == 0
    out = tmp_path / "rendered"
    assert main(["report", str(suite.path), "--from-snapshot", str(snap), "--out", str(out)]) == 0
    from_store = next(r for r in reported["hand_pdf"].suites if r.report.suite.key == suite.key)
    assert (out / "hand" / "curves.md").read_text() == from_store.md.read_text()
    assert (out / "hand" / "curves.csv").read_text() == from_store.csv.read_text()
    assert (out / "hand.pdf").exists()
    provenance = (out / "hand" / "curves.provenance.md").read_text()
    assert "**machine**: test box" in provenance and "**data**: hand-made" in provenance
    assert "7 finished, 2 failed" in provenance  # the hand-made store: 7 finished runs, one cell diverged twice
    assert main(["snapshot", str(suite.path), "--tracking-uri", reported["uri"], "--out", str(snap),
                 "--note", "no-equals-sign"]) == 2


def test_several_snapshots_render_into_one_paper_pdf(reported, tmp_path, capsys):
    """``report --from-snapshot A --from-snapshot B``: a paper's two committed snapshots render into one
    PDF, each table as its store renders it, each with its own provenance page; a second snapshot of
    one suite, or a named suite without a snapshot, is refused with one line."""
    files = {}
    for name in ("curves", "bestval"):
        suite = reported["hand"][name]
        files[name] = tmp_path / f"{name}.snapshot.json"
        assert main(["snapshot", str(suite.path), "--tracking-uri", reported["uri"], "--out", str(files[name]),
                     "--note", f"machine=box {name}"]) == 0
    out = tmp_path / "both"
    paths = [str(reported["hand"][name].path) for name in files]  # by key when run from a checkout
    assert main(["report", *paths, "--from-snapshot", str(files["curves"]), "--from-snapshot", str(files["bestval"]),
                 "--out", str(out)]) == 0
    for part in reported["hand_pdf"].suites:
        name = part.report.suite.key.split("/")[1]
        assert (out / "hand" / f"{name}.md").read_text() == part.md.read_text()
        assert f"**machine**: box {name}" in (out / "hand" / f"{name}.provenance.md").read_text()
    assert len(pdf_pages(out / "hand.pdf")) == len(reported["hand_pdf"].pages)
    capsys.readouterr()
    assert main(["report", *paths, "--from-snapshot", str(files["curves"]), "--from-snapshot", str(files["curves"]),
                 "--out", str(out)]) == 2
    assert "a second snapshot of hand/curves" in capsys.readouterr().err
    assert main(["report", str(reported["hand"]["bestval"].path), "--from-snapshot", str(files["curves"]),
                 "--out", str(out)]) == 2
    assert "no snapshot of hand/bestval given" in capsys.readouterr().err


def test_a_snapshot_exports_every_profile_or_those_named(reported, tmp_path):
    """``pflbench snapshot``: every profile's runs by default; ``--profile`` (repeatable) keeps the runs
    whose ``profile`` tag it names (the tiny suite ran at smoke only: quick exports none and fails)."""
    def exported(*profiles: str) -> tuple[int, list[dict]]:
        snap = tmp_path / f"snap{'-'.join(profiles)}.json"
        rc = main(["snapshot", str(reported["path"]), "--tracking-uri", reported["uri"], "--out", str(snap),
                   *[a for p in profiles for a in ("--profile", p)]])
        return rc, json.loads(snap.read_text())["runs"]

    rc, every = exported()
    assert rc == 0 and every and {r["tags"]["profile"] for r in every} == {"smoke"}
    assert len(every) == len(reported["suite"].expand("smoke"))
    rc, smoke = exported("smoke", "quick")
    assert rc == 0 and [r["run_id"] for r in smoke] == [r["run_id"] for r in every]
    rc, quick = exported("quick")
    assert rc == 1 and quick == []


def test_snapshot_into_adds_the_runs_a_committed_snapshot_lacks_and_keeps_its_records(reported, tmp_path, capsys):
    """``pflbench snapshot --into FILE``: a snapshot exported for one setting grows by the other
    setting's runs (selected with ``--only``), its records kept byte for byte, each ``--note``
    extending its provenance entry; the result holds the same runs as one full export. A second
    call adds nothing (exit 1); a missing file, another suite's file, an unknown axis or label are
    refused with one line naming the fix."""
    path, uri = str(reported["path"]), reported["uri"]
    full, part = tmp_path / "full.json", tmp_path / "part.json"
    assert main(["snapshot", path, "--tracking-uri", uri, "--out", str(full)]) == 0
    assert main(["snapshot", path, "--tracking-uri", uri, "--out", str(part), "--only", "setting=dir",
                 "--note", "what ran=the dir setting"]) == 0
    first = json.loads(part.read_text())["runs"]
    assert first and {r["tags"]["cell.setting"] for r in first} == {"dir"}
    capsys.readouterr()
    assert main(["snapshot", path, "--tracking-uri", uri, "--into", str(part), "--only", "setting=dir,iid",
                 "--note", "what ran=then the iid setting", "--note", "machine=box"]) == 0
    out = capsys.readouterr().out
    merged = json.loads(part.read_text())
    assert f"{len(first)} already there" in out
    assert merged["provenance"] == {"what ran": "the dir setting; then the iid setting", "machine": "box"}
    assert merged["runs"] == json.loads(full.read_text())["runs"]  # same records, same order as one export
    kept = {r["run_id"]: r for r in merged["runs"]}
    assert all(kept[r["run_id"]] == r for r in first)
    assert main(["snapshot", path, "--tracking-uri", uri, "--into", str(part)]) == 1  # nothing new
    assert json.loads(part.read_text()) == merged
    capsys.readouterr()
    for args, message in ((["--into", str(tmp_path / "none.json")], "no such file; export it first with --out"),
                          (["--into", str(part), "--only", "optimizer=sgd"], "--only names axis 'optimizer'"),
                          (["--into", str(part), "--only", "setting=dirichlet"], "--only setting=dirichlet: no such label")):
        assert main(["snapshot", path, "--tracking-uri", uri, *args]) == 2
        assert message in capsys.readouterr().err
    other = reported["hand"]["curves"]
    assert main(["snapshot", str(other.path), "--tracking-uri", uri, "--into", str(part)]) == 2
    assert f"it holds {reported['suite'].key}, not {other.key}" in capsys.readouterr().err


def test_the_curves_figure_labels_its_y_axis_as_the_curve_and_says_not_run_on_an_empty_panel(reported):
    """CAFeMe Fig. 4 form: the y axis is the curve over steps, not the table metric (one point of it);
    a column without a finished run shows "not run" instead of an empty frame with an empty legend."""
    from benchmarks.reporting.figures import paper_curves

    report = copy.copy(reported["hand_pdf"].suites[0].report)
    assert report.suite.key == "hand/curves"
    fig = paper_curves(report)
    assert [ax.get_ylabel() for ax in fig.axes] == ["curve/acc (%), seed mean"] * len(fig.axes)
    assert all(ax.lines and ax.get_legend() for ax in fig.axes)
    report.runs = report.runs[~report.runs["cell"].str.startswith("setting=iid")]
    by_title = {ax.get_title(): ax for ax in paper_curves(report).axes}
    assert [t.get_text() for t in by_title["iid"].texts] == ["not run"] and not by_title["iid"].lines
    assert by_title["dir"].lines and not by_title["dir"].texts
