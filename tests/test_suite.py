"""Suite files: loading, validation (file + key in every error), profiles, grid expansion, hashes."""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from benchmarks.suite.spec import config_hash, load_suite, parse_only
from benchmarks.suite.schema import SuiteError
from pfl_core.algorithms import METHODS
from pfl_core.data import DATASETS
from pfl_core.models import MODELS
from conftest import REPO_ROOT, tiny_suite_dict, write_suite

DEMO = REPO_ROOT / "suites" / "demo" / "offline.yaml"


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


def n_cells(raw: dict) -> int:
    n = 1
    for axis in raw["grid"]:
        n *= len(axis["values"])
    return n


def test_demo_suite_loads_and_expands():
    raw = yaml.safe_load(DEMO.read_text())
    suite = load_suite(DEMO)
    assert suite.key == f"{raw['paper']}/{raw['name']}"
    assert [a.name for a in suite.axes] == [axis["name"] for axis in raw["grid"]]
    assert len(suite.cells()) == n_cells(raw)
    assert suite.profiles == ["paper", *sorted(raw["profiles"])]
    paper = suite.expand("paper")
    smoke = suite.expand("smoke")
    assert len(paper) == n_cells(raw) * len(raw["seeds"])
    assert len(smoke) == n_cells(raw) * len(raw["profiles"]["smoke"]["seeds"])
    smoke_set = raw["profiles"]["smoke"]["set"]
    settings = {v["label"]: v["set"] for v in raw["grid"][0]["values"]}
    for spec in paper:  # a setting's own round count, else the base's
        expected = settings[spec.cell["setting"]].get("federation.rounds", raw["base"]["federation"]["rounds"])
        assert spec.config["federation"]["rounds"] == expected
    for spec in smoke:
        assert spec.config["federation"]["rounds"] == smoke_set["federation.rounds"]
        assert spec.config["evaluation"]["params"]["steps"] == smoke_set["evaluation.params.steps"]
    # each cell's `set` reached its runs
    synth = [s for s in paper if s.cell["setting"] == "synthetic-seen"]
    synth_set = raw["grid"][0]["values"][1]["set"]
    assert synth and all(s.config["data"]["num_clients"] == synth_set["data.num_clients"] for s in synth)
    assert {s.method for s in paper} == set(raw["grid"][1]["values"])


@pytest.mark.parametrize("profile", ["paper", "smoke", "quick"])
def test_grid_expansion_count_per_profile(tiny_suite, profile):
    raw = tiny_suite_dict()
    seeds = raw["seeds"] if profile == "paper" else raw["profiles"][profile]["seeds"]
    specs = load_suite(tiny_suite).expand(profile)
    assert len(specs) == n_cells(raw) * len(seeds)
    assert sorted({s.seed for s in specs}) == sorted(seeds)
    assert all(s.profile == profile and s.config["seed"] == s.seed for s in specs)
    # every (cell, seed) exactly once
    assert len({(s.cell_id, s.seed) for s in specs}) == len(specs)


def test_profile_overrides_applied_and_nothing_else(tiny_suite):
    raw = tiny_suite_dict()
    suite = load_suite(tiny_suite)
    paper = {(s.cell_id, s.seed): s.config for s in suite.expand("paper")}
    smoke = {(s.cell_id, s.seed): s.config for s in suite.expand("smoke")}
    assert paper.keys() == smoke.keys()
    for key, cfg in smoke.items():
        assert cfg["federation"]["rounds"] == raw["profiles"]["smoke"]["set"]["federation.rounds"]
        assert paper[key]["federation"]["rounds"] == raw["base"]["federation"]["rounds"]
        assert cfg["evaluation"]["params"]["steps"] == raw["profiles"]["smoke"]["set"]["evaluation.params.steps"]
        # the dotted override of one sub-key keeps its siblings
        assert cfg["evaluation"]["params"]["lr"] == raw["base"]["evaluation"]["params"]["lr"]
        expected = copy.deepcopy(paper[key])
        expected["federation"]["rounds"] = cfg["federation"]["rounds"]
        expected["evaluation"]["params"]["steps"] = cfg["evaluation"]["params"]["steps"]
        assert cfg == expected


def test_seeds_argument_overrides_profile_seeds(tiny_suite):
    specs = load_suite(tiny_suite).expand("smoke", seeds=[7, 9])
    assert sorted({s.seed for s in specs}) == [7, 9]
    assert len(specs) == n_cells(tiny_suite_dict()) * 2


def test_method_overrides_apply_only_to_their_method(tmp_path, suite_data):
    suite_data["methods"] = {"fedavg": {"method.params.lr": 0.5}}
    suite = load_suite(write_suite(tmp_path / "m.yaml", suite_data))
    for spec in suite.expand("paper"):
        want = 0.5 if spec.method == "fedavg" else suite_data["base"]["method"]["params"]["lr"]
        assert spec.config["method"]["params"]["lr"] == want


def test_parse_only():
    assert parse_only(["method=fedavg,local", "setting=iid", "method=fedavg_ft"]) == {
        "method": ["fedavg", "local", "fedavg_ft"], "setting": ["iid"]}
    assert parse_only(None) == {}
    with pytest.raises(SuiteError, match="KEY=VALUE"):
        parse_only(["fedavg"])


def test_expand_only_filters_cells(tiny_suite):
    suite = load_suite(tiny_suite)
    only = parse_only(["method=fedavg,local", "setting=iid"])
    specs = suite.expand("smoke", only=only)
    assert len(specs) == 2 * 1 * len(tiny_suite_dict()["profiles"]["smoke"]["seeds"])
    assert {s.cell["method"] for s in specs} == {"fedavg", "local"}
    assert {s.cell["setting"] for s in specs} == {"iid"}
    # the filtered specs are exactly the matching ones of the full expansion
    full = [s for s in suite.expand("smoke") if s.cell["method"] in ("fedavg", "local") and s.cell["setting"] == "iid"]
    assert specs == full


def test_expand_only_unknown_axis_is_an_error(tiny_suite):
    suite = load_suite(tiny_suite)
    with pytest.raises(SuiteError) as err:
        suite.expand("smoke", only=parse_only(["dataset=mnist"]))
    msg = str(err.value)
    assert str(tiny_suite) in msg and "'dataset'" in msg and "setting" in msg and "method" in msg


def test_config_hash_stable_across_loads_and_paths(tmp_path, tiny_suite):
    first = [(s.cell_id, s.seed, s.config_hash) for s in load_suite(tiny_suite).expand("smoke")]
    second = [(s.cell_id, s.seed, s.config_hash) for s in load_suite(tiny_suite).expand("smoke")]
    assert first == second
    copy_path = write_suite(tmp_path / "elsewhere" / "copy.yaml", tiny_suite_dict())
    assert [(s.cell_id, s.seed, s.config_hash) for s in load_suite(copy_path).expand("smoke")] == first


def test_config_hash_differs_across_seeds_methods_and_profiles(tiny_suite):
    suite = load_suite(tiny_suite)
    smoke = suite.expand("smoke")
    assert len({s.config_hash for s in smoke}) == len(smoke)
    paper = suite.expand("paper")
    assert not {s.config_hash for s in smoke} & {s.config_hash for s in paper}
    for spec in smoke:
        assert spec.config_hash == config_hash(spec.config)


def test_config_hash_equal_for_same_config(tmp_path, suite_data):
    """A differently written suite (other labels, other names, key order, values moved from the
    grid into base) that resolves to the same configs gets the same hashes."""
    other = copy.deepcopy(suite_data)
    other["paper"], other["name"] = "other", "suite"
    other["grid"] = [
        {"name": "algo", "values": [{"label": f"M{i}", "set": {"method.name": m}}
                                    for i, m in enumerate(["fedavg_ft", "local", "fedavg"])]},
    ]
    other["base"]["data"]["partition"] = {"min_size": 20, "name": "dirichlet", "alpha": 0.5}
    other["base"] = dict(reversed(list(other["base"].items())))
    other.pop("published")
    a = load_suite(write_suite(tmp_path / "a.yaml", suite_data)).expand("smoke", only={"setting": ["dir"]})
    b = load_suite(write_suite(tmp_path / "b.yaml", other)).expand("smoke")
    by_config = {(s.method, s.seed): s.config_hash for s in a}
    assert len(b) == len(by_config)
    for spec in b:
        assert spec.config_hash == by_config[(spec.method, spec.seed)]
    # key order of the dict itself never matters
    cfg = b[0].config
    assert config_hash(json.loads(json.dumps(cfg, sort_keys=True))) == config_hash(dict(reversed(list(cfg.items()))))


def test_misspelled_method_in_grid(tmp_path, suite_data):
    suite_data["grid"][1]["values"] = ["local", "fedvag"]
    suite_data.pop("published")
    path = write_suite(tmp_path / "typo.yaml", suite_data)
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    msg = str(err.value)
    assert str(path) in msg
    assert "fedvag" in msg
    for name in METHODS.names():
        assert name in msg


def _set(d, dotted, value):
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value


REJECTIONS = {
    "unknown top-level key": (lambda d: d.__setitem__("seedz", [0]), ["seedz"]),
    "missing required key": (lambda d: d.pop("metric"), ["metric"]),
    "unknown metric key": (lambda d: _set(d, "metric.scal", 100), ["metric", "scal"]),
    "bad metric pm": (lambda d: _set(d, "metric.pm", "iqr"), ["metric.pm"]),
    "unknown dotted key in grid set": (
        lambda d: d["grid"][0]["values"][0]["set"].__setitem__("federation.roundz", 2),
        ["grid.setting=dir", "federation.roundz"]),
    "unknown nested key in base": (lambda d: _set(d, "base.federation.roundz", 2), ["federation.roundz"]),
    "unknown dotted key in profile": (
        lambda d: d["profiles"]["smoke"]["set"].__setitem__("federation.rouns", 1),
        ["profiles.smoke.set", "federation.rouns"]),
    "unknown profile key": (lambda d: d["profiles"]["smoke"].__setitem__("seed", [0]), ["profiles.smoke", "seed"]),
    "unknown dataset": (lambda d: _set(d, "base.data.dataset", "digits29"), ["digits29", "dataset"]),
    "unknown model": (lambda d: _set(d, "base.model.name", "mlrr"), ["mlrr", "model"]),
    "unknown partitioner": (
        lambda d: d["grid"][0]["values"][1]["set"].__setitem__("data.partition", {"name": "iidd"}),
        ["iidd", "partitioner"]),
    "unknown partitioner parameter": (
        lambda d: d["grid"][0]["values"][0]["set"].__setitem__(
            "data.partition", {"name": "dirichlet", "alpah": 0.5}),
        ["alpah", "data.partition", "alpha"]),
    "unknown method hyperparameter": (
        lambda d: _set(d, "base.method.params", {"lr": 0.1, "lrr": 0.1}), ["lrr", "method.params", "local_epochs"]),
    "unknown evaluation parameter": (
        lambda d: _set(d, "base.evaluation.params", {"stepz": 1}), ["stepz", "evaluation.params"]),
    "unknown protocol": (lambda d: _set(d, "base.evaluation.protocol", "unsen"), ["unsen", "protocol"]),
    "unknown method in methods section": (
        lambda d: d.__setitem__("methods", {"fedprox": {"method.params.lr": 0.1}}), ["methods.fedprox", "fedavg"]),
    "published cell not in the grid": (
        lambda d: d["published"].append({"cell": {"setting": "dir", "method": "fedprox"}, "mean": 1.0, "source": "T"}),
        ["published[2]", "fedprox"]),
    "published entry without source": (
        lambda d: d["published"].append({"cell": {"setting": "dir", "method": "local"}, "mean": 1.0}),
        ["published[2]", "source"]),
    "published entry with an empty source": (
        lambda d: d["published"].append({"cell": {"setting": "dir", "method": "local"}, "mean": 1.0, "source": ""}),
        ["published[2].source"]),
    "published entry without mean": (
        lambda d: d["published"].append({"cell": {"setting": "dir", "method": "local"}}), ["published[2]", "mean"]),
    "scalar axis without key": (lambda d: d["grid"][1].pop("key"), ["grid[1]", "key"]),
    "duplicate labels": (lambda d: d["grid"][1].__setitem__("values", ["local", "local"]), ["grid[1]", "duplicate"]),
}


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_bad_suite_rejected_naming_file_and_key(tmp_path, suite_data, case):
    mutate, fragments = REJECTIONS[case]
    mutate(suite_data)
    path = write_suite(tmp_path / "bad.yaml", suite_data)
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    msg = str(err.value)
    assert str(path) in msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


def test_unknown_profile_in_expand(tiny_suite):
    suite = load_suite(tiny_suite)
    with pytest.raises(SuiteError) as err:
        suite.expand("quik")
    msg = str(err.value)
    assert str(tiny_suite) in msg and "quik" in msg and "quick" in msg and "smoke" in msg


@pytest.mark.parametrize("text", ["paper: [unclosed\nname: x: y\n", "{a: 1, b: [}\n"])
def test_non_yaml_file_rejected(tmp_path, text):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    assert str(path) in str(err.value) and "YAML" in str(err.value)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_yaml_that_is_not_a_mapping_rejected(tmp_path, text):
    path = tmp_path / "notmap.yaml"
    path.write_text(text)
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    assert str(path) in str(err.value) and "mapping" in str(err.value)


def test_missing_file_rejected(tmp_path):
    path = tmp_path / "nope" / "missing.yaml"
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    assert str(path) in str(err.value) and "does not exist" in str(err.value)


def test_unknown_method_in_profile_methods_rejected(tmp_path, suite_data):
    suite_data["profiles"]["smoke"]["methods"] = {"fedvag": {"method.params.lr": 0.5}}
    path = write_suite(tmp_path / "profmeth.yaml", suite_data)
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    assert str(path) in str(err.value) and "fedvag" in str(err.value)


def test_string_valued_learning_rate_rejected_at_load(tmp_path, suite_data):
    path = tmp_path / "lrstr.yaml"
    path.write_text(yaml.safe_dump(suite_data, sort_keys=False).replace("lr: 0.05\n      local_epochs", "lr: 1e-3\n      local_epochs", 1))
    assert yaml.safe_load(path.read_text())["base"]["method"]["params"]["lr"] == "1e-3"
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    assert str(path) in str(err.value) and "lr" in str(err.value)


def test_published_cell_with_numeric_label(tmp_path, suite_data):
    suite_data["grid"].append({"name": "rounds", "key": "federation.rounds", "values": [1, 2]})
    suite_data["published"] = [{"cell": {"setting": "dir", "method": "fedavg", "rounds": 1}, "mean": 50.0, "source": "T"}]
    suite = load_suite(write_suite(tmp_path / "num.yaml", suite_data))
    assert len(suite.published) == 1


def test_seed_token_is_replaced_by_the_run_seed(tmp_path):
    text = (REPO_ROOT / "suites" / "demo" / "offline.yaml").read_text()
    text = text.replace("data.params: {alpha: 0.5, beta: 0.5}",
                        'data.params: {alpha: 0.5, beta: 0.5, seed: "${seed}"}')
    path = tmp_path / "seeded.yaml"
    path.write_text(text)
    specs = load_suite(path).expand("paper", only={"setting": ["synthetic-seen"], "method": ["fedavg"]})
    assert [s.config["data"]["params"]["seed"] for s in specs] == [s.seed for s in specs] == [0, 1]
    assert specs[0].config_hash != specs[1].config_hash


def test_conditional_overrides_apply_only_to_matching_cells(tmp_path):
    raw = tiny_suite_dict()
    axes = {a["name"]: a for a in raw["grid"]}
    setting, method = list(axes)[0], "method"
    first_setting = axes[setting]["values"][0]
    first_label = first_setting["label"] if isinstance(first_setting, dict) else str(first_setting)
    raw["overrides"] = [{"when": {setting: first_label, method: ["fedavg", "local"]},
                         "set": {"federation.batch_size": 7}}]
    suite = load_suite(write_suite(tmp_path / "suite.yaml", raw))
    for spec in suite.expand("paper"):
        hit = spec.cell[setting] == first_label and spec.method in ("fedavg", "local")
        assert (spec.config["federation"]["batch_size"] == 7) == hit


@pytest.mark.parametrize("when, message", [
    ({"nope": "x"}, "unknown key"),
    ({"method": "fedavgg"}, "not a label of the axis"),
])
def test_bad_override_conditions_are_rejected(tmp_path, when, message):
    raw = tiny_suite_dict()
    raw["overrides"] = [{"when": when, "set": {"federation.batch_size": 7}}]
    with pytest.raises(SuiteError, match=message):
        load_suite(write_suite(tmp_path / "suite.yaml", raw))


def test_config_hash_ignores_values_equal_to_the_schema_defaults():
    from pfl_core.config import RunConfig

    config = RunConfig.from_dict({"method": {"name": "fedavg", "params": {"lr": 0.1}}}).to_dict()
    trimmed = copy.deepcopy(config)
    del trimmed["data"]["subsample"], trimmed["evaluation"]["target"]  # as if these keys were new
    assert config_hash(config) == config_hash(trimmed)
    changed = copy.deepcopy(config)
    changed["data"]["subsample"] = 100
    assert config_hash(changed) != config_hash(config)
    changed = copy.deepcopy(config)
    changed["method"]["params"]["lr"] = 0.2
    assert config_hash(changed) != config_hash(config)
