"""The FedL2P suites (issue 14, R): grids and run counts of the paper profiles, every published
number against ``shared/specs/published-numbers.md`` (parsed here), the spec's per-dataset
hyperparameters, the stage-1 blocks (one pretrained model per alpha and pretraining method, shared
by cells, seeds and suites) and the profiles.

Two ways of expanding a suite:

* :func:`draft` expands the raw YAML with the suite's own merge rules (base, grid, methods,
  overrides, profiles) but without validating names, so grids, cells, configs and stage-1 blocks are
  checked whatever this checkout registers;
* :func:`loaded` is the real :func:`benchmarks.suite.spec.load_suite` (every run validated, stage 1
  resolved by ``RunConfig``); it skips, naming what is missing, while a method, dataset, model,
  protocol or config key the suite names is not registered here (tests/suite_names.py: the FedL2P
  pieces land from other branches). The smoke runs are in tests/test_suites_smoke.py."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

import benchmarks.suite.spec as suite_module
from benchmarks.suite.spec import Suite, _parse_axis, cell_id, load_suite
from conftest import REPO_ROOT, make_dry_run
from suite_names import unregistered
from test_suites_smoke import md_table
from benchmarks.suite.file import read_suite_file

SUITES = REPO_ROOT / "suites" / "fedl2p"
SPECS = Path(__file__).resolve().parents[2] / "shared" / "specs"
NAMES = ("table1", "table2", "table3", "table4", "table5", "table6", "fig2", "fig3", "fig4", "fig5")
ALPHAS = ["1000", "1.0", "0.5", "0.1"]
METHODS = {"Global Accuracy": "Global", "+FT (BN C)": "FT-BN-C", "+FT (BN G)": "FT-BN-G", "+FT (BN I)": "FT-BN-I",
           "+L2P": "L2P", "+FedL2P": "FedL2P", "+FedL2P (BNNet)": "FedL2P-BNNet",
           "+FedL2P (LRNet) β=1": "FedL2P-LRNet-b1", "+FedL2P (LRNet) β=0": "FedL2P-LRNet-b0"}
PRETRAINING = {"FedAvg": "FedAvg", "PerFedAvg(HF)": "PerFedAvg-HF", "FedBABU": "FedBABU"}
DATASETS = {"CIFAR-10": "cifar10", "CIFAR-10-C": "cifar10c", "Caltech-10": "office_caltech10", "DomainNet": "domainnet"}
QUANTITIES = {"BNNet input ξ": "xi", "BNNet output β": "beta", "LRNet input x": "x", "LRNet output η": "eta"}
#: suite -> (cells of the paper grid, seeds): the spec's grid, e.g. Table 1 = 4 alpha x 3 pretrainings x 2
GRIDS = {"table1": (4 * 3 * 2, 3), "table2": (4 * 2 * 6, 3), "table3": ((4 + 1 + 4) * 5, 3),
         "table4": (2 * (6 + 5), 3), "table5": ((4 + 4 + 1 + 4) * 6, 3), "table6": (1 + 4, 3),
         "fig2": (4 + 4 + 1 + 4, 1), "fig3": (2, 1), "fig4": (2, 1), "fig5": (1 + 4, 1)}


def raw(name: str) -> dict:
    return read_suite_file(SUITES / f"{name}.yaml")


def spec_text(name: str) -> str:
    path = SPECS / name
    if not path.is_file():
        pytest.skip(f"{path} not present")
    return path.read_text(encoding="utf-8")


def spec_rows(heading: str) -> list[dict[str, str]]:
    rows = md_table(spec_text("published-numbers.md"), heading)
    assert rows, heading
    return rows


def pm_of(row: dict) -> float | None:
    value = next(v for k, v in row.items() if k.startswith("±"))
    return None if value.startswith("—") else float(value)


def published(name: str) -> dict[str, tuple[float, float | None]]:
    return {cell_id({k: str(v) for k, v in e["cell"].items()}): (e["mean"], e.get("pm")) for e in raw(name)["published"]}


def draft(name: str, profile: str = "paper") -> list:
    """The suite's runs of ``profile`` merged by :meth:`Suite.expand` without validation (names
    this checkout may not register yet); configs are the suite's own mappings."""
    data = raw(name)
    suite = Suite(SUITES / f"{name}.yaml", data, [_parse_axis(a, f"grid[{i}]") for i, a in enumerate(data["grid"])])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(suite_module, "validate_config", lambda config, where, origins=None: config)
        mp.setattr(suite_module, "SCHEMA_KEYS", suite_module.SCHEMA_KEYS | {"model.pretrained"})  # before S lands
        return suite.expand(profile)


def loaded(name: str):
    missing = unregistered(SUITES / f"{name}.yaml")
    if missing:
        pytest.skip(f"fedl2p/{name} names what is not registered here yet: {', '.join(missing)}")
    return load_suite(SUITES / f"{name}.yaml")


def stage1_key(config: dict) -> str:
    """Identity of a draft run's stage-1 block (its mapping, canonically serialised)."""
    return json.dumps(config["model"]["pretrained"], sort_keys=True)


def setting(dataset: str, alpha: str) -> str:
    return f"{DATASETS.get(dataset, dataset)}-a{alpha}"


# ------------------------------------------------------------------------------------ grids and counts


def test_every_fedl2p_suite_exists_with_its_paper_and_name():
    assert sorted(p.stem for p in SUITES.glob("*.yaml")) == sorted(NAMES)
    for name in NAMES:
        data = raw(name)
        assert (data["paper"], data["name"]) == ("fedl2p", name)
        assert set(data["profiles"]) == {"quick", "smoke"}
        assert data["profiles"]["quick"]["seeds"] == data["profiles"]["smoke"]["seeds"] == [1]


@pytest.mark.parametrize("name", NAMES)
def test_paper_profile_expands_to_the_specs_grid(name):
    cells, seeds = GRIDS[name]
    data = raw(name)
    assert math.prod(len(a["values"]) for a in data["grid"]) == cells
    assert data["seeds"] == ([1, 2, 3] if seeds == 3 else [1])
    runs = draft(name)
    assert len(runs) == cells * seeds
    assert len({(r.cell_id, r.seed) for r in runs}) == len(runs)
    assert len({r.config_hash for r in runs}) == len(runs)  # no two cells compute the same thing


@pytest.mark.parametrize("name", NAMES)
def test_cut_down_profiles_keep_the_grid_with_one_seed(name):
    cells, _ = GRIDS[name]
    for profile in ("quick", "smoke"):
        runs = draft(name, profile)
        assert len(runs) == cells and {r.seed for r in runs} == {1}
        for r in runs:
            width = r.config["model"]["params"]["width"]
            assert width == (8 if profile == "quick" else 4)
            pretrained = r.config["model"]["pretrained"]
            if "source" not in pretrained:  # stage 1 is cut down with stage 2 and loads into it
                assert pretrained["model"]["params"]["width"] == width
                assert pretrained["federation"]["rounds"] <= 10
            assert r.config["federation"]["rounds"] <= (5 if profile == "quick" else 1)


@pytest.mark.parametrize("name", NAMES)
def test_every_profile_loads_and_validates(name):
    suite = loaded(name)
    assert suite.profiles == ["paper", "quick", "smoke"]
    for profile in suite.profiles:
        assert suite.expand(profile)


# ------------------------------------------------------------------------------------ published numbers


def test_table1_published_numbers_equal_the_papers_table():
    expected = {cell_id({"alpha": r["α"], "pretraining": PRETRAINING[r["pretraining"]],
                         "method": METHODS[r["personalization"]]}): (float(r["mean (%)"]), pm_of(r))
                for r in spec_rows("FedL2P Table 1")}
    assert len(expected) == 24 and published("table1") == expected


def test_table2_published_numbers_equal_the_papers_table():
    expected = {cell_id({"alpha": r["α"], "e": r["e"], "method": METHODS[r["method"]]}): (float(r["mean (%)"]), pm_of(r))
                for r in spec_rows("FedL2P Table 2")}
    assert len(expected) == 48 and published("table2") == expected
    assert all(pm is None for (_, pm), c in zip(expected.values(), expected) if "Global" in c)  # printed without ±


def test_table3_published_numbers_equal_the_papers_table():
    expected = {cell_id({"setting": setting(r["dataset"], r["α"]), "method": METHODS[r["method"]]}):
                (float(r["mean (%)"]), pm_of(r)) for r in spec_rows("FedL2P Table 3")}
    assert len(expected) == 45 and published("table3") == expected


def test_table4_published_numbers_equal_the_papers_table_without_unseen_l2p():
    rows = spec_rows("FedL2P Table 4")
    expected = {cell_id({"e": r["e"], "method": f"{r['client pool'].lower()}:{METHODS[r['method']]}"}):
                (float(r["mean (%)"]), pm_of(r)) for r in rows if r["mean (%)"] != "-"}
    assert len(rows) == 24 and len(expected) == 22 and published("table4") == expected
    labels = [v["label"] for v in next(a for a in raw("table4")["grid"] if a["name"] == "method")["values"]]
    assert "unseen:L2P" not in labels and "seen:L2P" in labels  # the paper's '-': not evaluated


def test_table5_published_numbers_equal_the_papers_table_and_diverged_cells_are_marked():
    rows = spec_rows("FedL2P Table 5")
    expected = {cell_id({"setting": setting(r["dataset"], r["α"]), "method": METHODS[r["variant"]]}):
                (float(r["mean (%)"]), pm_of(r)) for r in rows if r["mean (%)"] != "diverge"}
    diverged = sorted(setting(r["dataset"], r["α"]) for r in rows if r["mean (%)"] == "diverge")
    assert len(rows) == 78 and len(expected) == 75 and published("table5") == expected
    assert diverged == ["domainnet-a0.1", "domainnet-a0.5", "domainnet-a1.0"]
    marks = raw("table5")["marks"]
    assert len(marks) == 1 and marks[0]["mark"] == "†" and "diverge" in marks[0]["text"]
    assert sorted(marks[0]["when"]["setting"]) == diverged and marks[0]["when"]["method"] == "FedL2P-LRNet-b0"


def test_the_papers_two_values_of_one_cell_are_both_kept_spec_diff_15():
    """CIFAR-10-C alpha = 0.5 +FedL2P: 76.78 ± 0.22 in Table 3, 76.82 ± 0.19 in Table 5."""
    cell = cell_id({"setting": "cifar10c-a0.5", "method": "FedL2P"})
    assert published("table3")[cell] == (76.78, 0.22)
    assert published("table5")[cell] == (76.82, 0.19)
    for name, other in (("table3", "76.82"), ("table5", "76.78")):
        entry = next(e for e in raw(name)["published"] if cell_id(e["cell"]) == cell)
        assert other in entry["source"] and "spec diff 15" in entry["source"]
        assert any("two values" in note and other in note for note in raw(name)["notes"])


def test_table6_published_aris_equal_the_papers_table():
    expected = {(cell_id({"setting": setting(r["dataset"], r["α"]), "method": "FedL2P"}), QUANTITIES[r["quantity clustered"]]):
                float(r["ARI"]) for r in spec_rows("FedL2P Table 6")}
    got = {(cell_id(e["cell"]), e["quantity"]): e["mean"] for e in raw("table6")["published_quantities"]}
    assert len(expected) == 20 and got == expected
    assert not raw("table6").get("published")  # the paper prints no accuracy in Table 6


def test_every_published_entry_names_its_source_and_the_papers_sd():
    for name in ("table1", "table2", "table3", "table4", "table5"):
        for entry in raw(name)["published"]:
            assert entry["source"].startswith(f"Table {name[-1]}")
            assert entry["runs"] == 3
            assert ("pm" in entry) == (entry.get("pm_kind") == "std")  # ±: SD of 3 runs; Global: none


def test_figures_have_no_published_numbers():
    for name in ("fig2", "fig3", "fig4", "fig5"):
        assert not raw(name).get("published") and not raw(name).get("published_quantities")


# ------------------------------------------------------------------------------ metric, hyperparameters


def test_the_reported_metric_is_pooled_accuracy_mean_and_population_sd():
    for name in NAMES:
        metric = Suite(Path(name), raw(name)).metric  # as the report reads it: defaults filled in
        assert metric["key"] == "acc_pooled" and metric["scale"] == 1  # already 100 x correct / total
        assert (metric["pm"], metric["ddof"], metric["sample_sd"]) == ("std", 0, True)  # and the sample SD beside
    figures = {name: raw(name)["metric"].get("figure") for name in NAMES}
    assert figures == {"table1": None, "table2": None, "table3": None, "table4": None, "table5": None,
                       "table6": "ari", "fig2": "hyperparameters", "fig3": "cluster_map", "fig4": "hyperparameters",
                       "fig5": "cluster_map_all"}


def spec_hyperparameters() -> dict[str, dict[str, float]]:
    """dataset -> {clients, per_round, rounds, patience, inner, eta, ft_lr} from the spec's table."""
    rows = md_table(spec_text("fedl2p.md"), "Hyperparameters per dataset")
    columns = {"CIFAR-10": "cifar10", "CIFAR-10-C": "cifar10c", "Office-Caltech-10": "office_caltech10",
               "DomainNet": "domainnet", "Speech Commands": "speech_commands"}
    keys = {"clients C": "clients", "clients/round": "per_round", "max rounds": "rounds",
            "early-stop patience (code only)": "patience", "e (inner epochs, meta-training)": "inner"}
    out: dict[str, dict] = {ds: {} for ds in columns.values()}
    for row in rows:
        name = row[""]
        for column, ds in columns.items():
            if name in keys:
                out[ds][keys[name]] = int(re.match(r"\d+", row[column]).group())
            elif name.startswith("η̃ init"):
                eta, ft = (float(v) for v in row[column].split("/"))
                out[ds].update(eta=eta, ft_lr=ft)
    return out


def test_stage2_runs_take_the_specs_per_dataset_hyperparameters():
    spec = spec_hyperparameters()
    assert spec["cifar10"] == {"clients": 1000, "per_round": 100, "rounds": 500, "patience": 50, "inner": 15,
                               "eta": 1e-3, "ft_lr": 1e-3}
    seen = set()
    for name in NAMES:
        for run in draft(name):
            c = run.config
            ds = c["data"]["dataset"]
            want = spec[ds]
            seen.add(ds)
            assert c["evaluation"]["protocol"] == "finetune_pretrained"
            params = c["evaluation"]["params"]
            assert (params["lr"], params["batch_size"], params["test_batch_size"]) == (want["ft_lr"], 32, 50)
            assert params["finetune_splits"] == (["train", "val"] if ds == "cifar10" else ["train"])  # spec diff 7
            assert c["federation"]["batch_size"] == 32
            assert c["data"]["num_clients"] == want["clients"] + (50 if ds == "speech_commands" else 0)  # + unseen
            if ds == "cifar10":  # 40 train / 10 val per client, the code's random_split (D1 `l2p-data`)
                assert c["data"]["client_val_fraction"] == 0.2
            method = c["method"]
            if method["name"] in ("global_model", "ft_bn_c", "ft_bn_g", "ft_bn_i"):
                assert c["federation"]["rounds"] == 0  # nothing to train: stage 2 only evaluates
                continue
            p = method["params"]
            if method["name"] == "l2p":  # every client learns its own lambda once: one round of all clients
                assert (c["federation"]["rounds"], c["federation"]["clients_per_round"]) == (1, 0)
            else:
                assert c["federation"]["rounds"] == want["rounds"]
                assert c["federation"]["clients_per_round"] == want["per_round"]
            assert p["eta_init"] == want["eta"]
            e = int(run.cell.get("e", 15))
            assert p["inner_epochs"] == (want["inner"] if ds == "speech_commands" else e)
            if method["name"] == "fedl2p":
                assert p["patience"] == want["patience"]
            else:  # L2P: ceil(T_max x clients per round x 3 / C) outer epochs (spec 'Baselines: L2P')
                assert method["name"] == "l2p"
                assert p["outer_epochs"] == math.ceil(want["rounds"] * want["per_round"] * 3 / want["clients"])
    assert seen == set(spec)


def test_table5_ablations_are_the_named_switches():
    switches = {}
    for run in draft("table5"):
        m = run.config["method"]
        if m["name"] == "fedl2p":
            switches.setdefault(run.cell["method"], set()).add(
                tuple(sorted((k, v) for k, v in m["params"].items() if k in ("bn_net", "lr_net", "fixed_beta"))))
    inner = {(run.config["data"]["dataset"], run.config["method"]["params"].get("inner_lr"))
             for run in draft("table5") if run.cell["method"] == "FedL2P-BNNet"}
    assert inner == {("cifar10", 1e-3), ("cifar10c", 1e-3), ("office_caltech10", 1e-2), ("domainnet", 1e-2)}  # = FT lr
    assert switches == {"FedL2P": {()}, "FedL2P-BNNet": {(("lr_net", False),)},
                        "FedL2P-LRNet-b1": {(("bn_net", False), ("fixed_beta", 1.0))},
                        "FedL2P-LRNet-b0": {(("bn_net", False), ("fixed_beta", 0.0))}}


# ------------------------------------------------------------------------------------------- stage 1


def stage1_blocks(name: str) -> dict[str, set[str]]:
    """stage-1 block -> the cells that use it (paper profile)."""
    out: dict[str, set[str]] = {}
    for run in draft(name):
        out.setdefault(stage1_key(run.config), set()).add(run.cell_id)
    return out


def test_table1_has_one_stage1_model_per_alpha_and_pretraining_method():
    blocks = stage1_blocks("table1")
    assert len(blocks) == 4 * 3
    for key, cells in blocks.items():
        block = json.loads(key)
        assert block["seed"] == 1 and len(cells) == 2  # FT (BN C) and FedL2P share it, with all 3 seeds
        assert block["model"] == {"name": "resnet18_cifar"}
        fed = block["federation"]
        assert (fed["rounds"], fed["clients_per_round"], fed["batch_size"], fed["drop_last"]) == (500, 100, 32, False)
        assert block["data"]["num_clients"] == 1000 and block["data"]["dataset"] == "cifar10"
        assert block["data"]["augment"] == "crop_flip" and "client_val_fraction" not in block["data"]  # all 50
    methods = sorted(json.loads(k)["method"]["name"] for k in blocks)
    assert methods == ["fedavg"] * 4 + ["fedbabu"] * 4 + ["perfedavg"] * 4
    for run in draft("table1"):  # the stage-1 partition is the cell's
        assert run.config["model"]["pretrained"]["data"]["partition"] == run.config["data"]["partition"]


def test_the_fedavg_stage1_models_are_shared_across_suites():
    """One FedAvg model per alpha for Tables 1, 2, 5 and Figure 2; CIFAR-10-C reuses alpha = 1000's."""
    fedavg = {k for k in stage1_blocks("table1") if json.loads(k)["method"]["name"] == "fedavg"}
    assert set(stage1_blocks("table2")) == fedavg
    by_alpha = {json.loads(k)["data"]["partition"]["alpha"]: k for k in fedavg}
    for name in ("table3", "table5", "fig2"):
        blocks = stage1_blocks(name)
        cifar10c = {k for k, cells in blocks.items() if any("cifar10c" in c for c in cells)}
        assert cifar10c == {by_alpha[1000]}, name
        imagenet = {k for k in blocks if json.loads(k) == {"source": "imagenet"}}
        assert set(blocks) - imagenet <= fedavg, name
    assert {k for k in stage1_blocks("table5") if k != json.dumps({"source": "imagenet"})} == fedavg
    for name in ("table6", "fig3", "fig5"):
        assert set(stage1_blocks(name)) == {json.dumps({"source": "imagenet"})}
    speech = set(stage1_blocks("table4"))
    assert len(speech) == 1 and speech == set(stage1_blocks("fig4"))


def test_imagenet_cells_load_the_imagenet_weights():
    for name in ("table3", "table5", "table6"):
        for run in draft(name):
            if run.config["data"]["dataset"] in ("office_caltech10", "domainnet"):
                assert run.config["model"]["name"] == "resnet18_imagenet"
                assert run.config["model"]["params"]["weights"] == "imagenet"
            if run.config["data"]["dataset"] in ("office_caltech10", "domainnet"):  # FT configs have no normalize; *_fedl2p.yaml do
                normalize = run.config["data"].get("params", {}).get("normalize", True)
                assert normalize is (not run.config["method"]["name"].startswith("ft_bn")), run.cell_id


@pytest.mark.parametrize("name, distinct", [("table1", 12), ("table2", 4), ("table3", 2), ("table5", 5)])
def test_loaded_suites_resolve_the_stage1_hashes(name, distinct):
    """With the real config: the stage-1 config hash (the normal hash of the stage-1 RunConfig) is
    the same for the seeds and cells that share a pretrained model."""
    suite = loaded(name)
    from benchmarks.suite.spec import stage1_hash  # S `l2p-stages`

    hashes = {}
    for spec in suite.expand("paper"):
        key = stage1_hash(spec.config) or "imagenet"
        hashes.setdefault(key, set()).add(spec.seed)
    assert len(hashes) == distinct
    assert all(seeds == {1, 2, 3} for seeds in hashes.values())


# ------------------------------------------------------------------ the schema: published_quantities


def quantity_suite(tmp_path, entries) -> Path:
    from conftest import tiny_suite_dict, write_suite

    data = tiny_suite_dict()
    data["published_quantities"] = entries
    return write_suite(tmp_path / "q.yaml", data)


def test_published_quantities_are_read_per_cell_and_quantity(tmp_path):
    entries = [{"cell": {"setting": "iid", "method": "local"}, "quantity": "beta", "mean": 0.5, "source": "Table 6"},
               {"cell": {"method": "local", "setting": "iid"}, "quantity": "eta", "mean": 1, "source": "Table 6"}]
    suite = load_suite(quantity_suite(tmp_path, entries))
    got = [(cell_id(e["cell"]), e["quantity"], e["mean"]) for e in suite.published_quantities]
    assert got == [("setting=iid,method=local", "beta", 0.5), ("setting=iid,method=local", "eta", 1)]


@pytest.mark.parametrize("entry, message", [
    ({"cell": {"setting": "nope", "method": "local"}, "quantity": "beta", "mean": 0.5, "source": "T"}, "published_quantities[0].cell"),
    ({"cell": {"setting": "iid", "method": "local"}, "quantity": "beta", "mean": "0.5", "source": "T"}, "published_quantities[0].mean"),
    ({"cell": {"setting": "iid", "method": "local"}, "quantity": "", "mean": 0.5, "source": "T"}, "published_quantities[0].quantity"),
    ({"cell": {"setting": "iid", "method": "local"}, "quantity": "beta", "mean": 0.5}, "missing required key(s) ['source']"),
    ({"cell": {"setting": "iid", "method": "local"}, "quantity": "beta", "mean": 0.5, "source": " "}, "published_quantities[0].source"),
    ({"cell": {"setting": "iid", "method": "local"}, "mean": 0.5, "source": "T"}, "missing required key(s) ['quantity']"),
    ({"cell": {"setting": "iid", "method": "local"}, "quantity": "beta", "mean": 0.5, "pm": 0.1, "source": "T"}, "unknown key(s) ['pm']"),
])
def test_bad_published_quantities_are_rejected_naming_the_entry(tmp_path, entry, message):
    with pytest.raises(suite_module.SuiteError) as err:
        load_suite(quantity_suite(tmp_path, [entry]))
    assert message in str(err.value) and "q.yaml" in str(err.value)


def test_a_quantity_listed_twice_for_one_cell_is_rejected(tmp_path):
    entry = {"cell": {"setting": "iid", "method": "local"}, "quantity": "beta", "mean": 0.5, "source": "T"}
    with pytest.raises(suite_module.SuiteError, match="listed twice"):
        load_suite(quantity_suite(tmp_path, [entry, dict(entry, mean=0.6)]))


# ------------------------------------------------------------------------------------------ make targets


@pytest.mark.parametrize("name", NAMES)
def test_make_reproduce_fedl2p_target_runs_its_suite_and_renders_the_report(name):
    out = make_dry_run(f"reproduce-fedl2p-{name}")
    assert re.findall(r"suites/fedl2p/\w+\.yaml", out) == [f"suites/fedl2p/{name}.yaml"]
    assert "pflbench run $f --profile quick --jobs 2" in out and "--report" in out


def test_make_reproduce_fedl2p_runs_every_fedl2p_suite():
    out = make_dry_run("reproduce-fedl2p")
    assert sorted(set(re.findall(r"suites/fedl2p/(\w+)\.yaml", out))) == sorted(NAMES)
    assert "suites/metavers" not in out and "suites/cafeme" not in out
