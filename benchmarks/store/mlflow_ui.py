"""What MLflow's web UI reads from the harness's tags, so a suite opens as a model-training dashboard.

Checked against the UI bundled with mlflow 3.17.2 (``mlflow/server/js/build/static/js``):

* ``mlflow.experimentKind`` (experiment tag): ``custom_model_development`` is the training kind
  (the UI's ``ExperimentKind.CUSTOM_MODEL_DEVELOPMENT``; ``genai_development`` the GenAI one). The
  harness sets it on every experiment it creates or reuses. MLflow 3.17's UI, however, picks the
  view from its sidebar switch "GenAI | Model training" (local storage ``mlflow.workflowType``, or
  the URL parameter ``workflowType``), which defaults to GenAI and overrides the tag; hence
  :func:`experiment_url` carries ``workflowType=machine_learning``.
* ``mlflow.sharedViewState.<id>`` (experiment tag): a saved runs-table view (the "Views" menu),
  a JSON envelope ``{name, createdAt, updatedAt, state}`` whose ``state`` is the JSON of the
  runs-table state (``selectedColumns``, ``orderByKey``, ...; the UI ignores ``runsExpanded`` there);
  the URL parameter ``viewStateShareKey=<id>`` opens it. The table nests a run under its parent
  only when it is sorted by creation time (``attributes.start_time``, the UI's "Created") or not
  sorted, with no search filter; sorted by a tag it lists every run flat, the parent as one more row.
  Parents open collapsed, with an expander (the view cannot open them: the UI drops ``runsExpanded``
  from a saved view). The UI loads runs 100 at a time and nests a run only under a loaded parent;
  a parent run is created before its children, so the view sorts oldest first
  (:data:`ORDER_BY`) and a parent is loaded before its children, however many a paper sweep has.
* ``mlflow.note.content``: the description of an experiment (Markdown, shown above its runs) or of
  a run (the run page's "Description", the runs table's "Description" column).
* ``mlflow.source.name`` / ``mlflow.source.type``: a run's "Source" (the command that produced it).
  Type ``JOB``: the UI shows the whole name of a JOB source (without Databricks job ids) but cuts
  any other type's name at its last ``/``, which would leave ``mlflow.db --device cpu`` of a command.
* ``mlflow.parentRunId``: nests a run under its parent (one parent run per sweep, one per tuning study).
* ``mlflow.runName``: the runs table's first column, cut at about 30 characters: short names
  (:func:`run_name`: method, the other cell labels, seed), the whole cell in tag ``cell``.
"""
from __future__ import annotations

import json
import time

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"
SOURCE_NAME_TAG = "mlflow.source.name"
SOURCE_TYPE_TAG = "mlflow.source.type"
PARENT_TAG = "mlflow.parentRunId"
SAVED_VIEW_PREFIX = "mlflow.sharedViewState."
VIEW_ID = "pflbench"
"""Id of the harness's saved view of each experiment (tag ``mlflow.sharedViewState.pflbench``)."""
RUN_KIND_TAG = "run_kind"
"""``sweep`` on the parent run of a ``pflbench run`` invocation, ``cell`` on a (cell, seed) run;
``study`` on the parent run of a tuning study, ``trial`` on its trials."""
SWEEP, CELL, STUDY, TRIAL = "sweep", "cell", "study", "trial"
PARENT_KINDS = (SWEEP, STUDY)
"""Run kinds that hold other runs; they have no metric of their own and are never results."""
ORDER_BY = "attributes.start_time"
"""The saved view's sort: creation time, oldest first, the only order in which the UI nests runs."""

SUITE_COLUMNS = ("method", "seed", "profile", "tuned", "cell")
"""Tag columns of a suite experiment's saved view, after the suite's metric (the run name says the
cell in short; the ``cell`` column, last, says it whole)."""
TUNING_COLUMNS = ("method", "cell", "study", "trial", "state", "profile")
"""Tag columns of a ``<suite>/tuning`` experiment's saved view, followed by the trial's ``value``."""


def _column(kind: str, key: str) -> str:
    """A runs-table column id as the UI writes it: ``tags.`method```, ``metrics.`acc```."""
    return f"{kind}.`{key}`"


SOURCE_TYPE = "JOB"
RUN_NAME_COLUMN = "attributes.`Run Name`"
"""The runs table's column ids (ag-grid ``col-id``) of the run name, then creation time and duration."""
FIXED_COLUMNS = ("runDateAndNestInfo", "duration")
RUN_NAME_WIDTH = 300
"""Pixels (the UI's default, 190, cuts ``fedavg_ft · digits28-unseen · s0``)."""
WIDE_TAGS, WIDE_TAG_WIDTH = (_column("tags", "cell"), _column("tags", "study")), 240


def saved_view(tags: tuple[str, ...], metric: str, name: str = "pflbench: results") -> str:
    """The JSON of the experiment tag ``mlflow.sharedViewState.<VIEW_ID>``: the runs table with the
    metric and the tag columns ``tags``, sorted by creation time, oldest first (:data:`ORDER_BY`),
    so that runs nest under their parent. Run name, creation time and duration always show; the
    description and source columns are left out (the UI renders only the columns that fit the
    window, and a run's page shows both)."""
    columns = [_column("metrics", metric), *(_column("tags", t) for t in tags)]
    state = {
        "searchFilter": "", "orderByKey": ORDER_BY, "orderByAsc": True,
        "startTime": "ALL", "lifecycleFilter": "Active",
        "selectedColumns": columns,
        # the order as listed (else the UI orders tags as it meets them), the run name wide enough to read
        "columnOrder": [RUN_NAME_COLUMN, *FIXED_COLUMNS, *columns],
        "columnWidths": {RUN_NAME_COLUMN: RUN_NAME_WIDTH, **{c: WIDE_TAG_WIDTH for c in columns if c in WIDE_TAGS}},
    }
    now = int(time.time() * 1000)
    return json.dumps({"name": name, "createdAt": now, "updatedAt": now, "state": json.dumps(state)})


LOCAL_UI = "http://127.0.0.1:5000"
"""Where ``make mlflow-ui`` serves a local store."""


def ui_base(tracking_uri: str) -> str:
    """The UI address of a store: a tracking server's own URI, else ``make mlflow-ui``'s."""
    return tracking_uri if tracking_uri.startswith(("http://", "https://")) else LOCAL_UI


def experiment_url(base: str, experiment_id: str) -> str:
    """The link that opens an experiment's runs table in the model-training view with the saved view."""
    return (f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs"
            f"?workflowType=machine_learning&viewStateShareKey={VIEW_ID}")


def run_url(base: str, experiment_id: str, run_id: str, tab: str | None = "model-metrics") -> str:
    """A run's page on ``tab`` (``model-metrics``: the per-step charts of ``round/*`` and ``curve/*``;
    None: the overview, with the description, source, metrics and parameters)."""
    path = f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}" + (f"/{tab}" if tab else "")
    return f"{path}?workflowType=machine_learning"


def suite_description(suite_key: str, title: str, metric: str, metric_label: str) -> str:
    """Markdown shown above a suite experiment's runs."""
    return (f"**{suite_key}**: {title}; metric `{metric}` ({metric_label}). One run per (cell, seed, "
            f"profile), named *method · other cell labels · seed*, a child of its *sweep* run (one per "
            f"`pflbench run`: suite, command, counts, report); click **+** on a sweep to list its runs. "
            f"A run's *Model metrics* tab plots `round/*` by round and `curve/*` by fine-tuning step. "
            f"Filter with e.g. `tags.method = 'fedavg'`, `tags.profile = 'paper'`, `tags.tuned = 'true'`, "
            f"`tags.run_kind = 'cell'` (a filter, or a sort other than *Created*, lists runs flat); the "
            f"view *pflbench: results* (Views menu) shows `{metric}`, method, seed, profile, tuned and cell.")


def tuning_description(suite_key: str) -> str:
    """Markdown shown above a ``<suite>/tuning`` experiment's runs."""
    return (f"**{suite_key}/tuning**: one *study* run per Optuna study of `pflbench tune` (validation "
            f"data only), holding one run per trial (click **+**), tagged `study`, `trial`, `state`, "
            f"`value`, `method`, `cell`, `profile`, with the trial's parameters in its description; "
            f"`objective` is plotted per evaluation step. The view *pflbench: results* (Views menu) "
            f"shows them.")


NAME_SEPARATOR = " · "
METHOD_AXIS = "method"


def short_cell(cell: dict[str, str], method: str) -> str:
    """A cell as a researcher reads it: the method (the label of the ``method`` axis, else the
    method's name) first, then the other axes' labels joined by ", ", e.g. ``fedavg · digits28-unseen``."""
    first = cell.get(METHOD_AXIS, method)
    others = ", ".join(str(v) for k, v in cell.items() if k != METHOD_AXIS)
    return NAME_SEPARATOR.join(part for part in (str(first), others) if part)


def run_name(cell: dict[str, str], method: str, seed: int) -> str:
    """A (cell, seed) run's name: ``fedavg · digits28-unseen · s1``. Names are for reading only:
    the harness finds runs by their tags (``config_hash``, ``cell``, ``cell.<axis>``, ``seed``)."""
    return f"{short_cell(cell, method)}{NAME_SEPARATOR}s{seed}"


def study_run_name(cell: dict[str, str], method: str) -> str:
    """A tuning study's parent run: ``study fedavg · digits28-unseen``."""
    return f"study {short_cell(cell, method)}"


def trial_run_name(cell: dict[str, str], method: str, number: int) -> str:
    """A tuning trial's run: ``fedavg · digits28-unseen · trial 3``."""
    return f"{short_cell(cell, method)}{NAME_SEPARATOR}trial {number}"


def trial_description(method: str, cell: str, number: int, params: dict, objective: dict,
                      state: str, value: float | None) -> str:
    """A trial's description (Markdown): method, cell, trial number, state and value, its parameters
    and what the study maximises."""
    shown = ", ".join(f"`{k}` = {v:.6g}" if isinstance(v, float) else f"`{k}` = {v}" for k, v in sorted(params.items()))
    result = f"{state}" + ("" if value is None else f", value {value:.6g}")
    seeds = ", ".join(str(s) for s in objective.get("seeds", []))
    return (f"{method} | {cell} | trial {number}: {result}\n\n"
            f"parameters: {shown or 'none'}\n\n"
            f"objective: maximise `{objective.get('metric', '?')}` on {objective.get('target', 'validation')} "
            f"data, mean over tuning seeds {seeds}, {objective.get('rounds', '?')} rounds per seed; "
            f"search space `{objective.get('search_space', '?')}`")


def study_description(method: str, cell: str, study: str, objective: dict) -> str:
    """A tuning study's parent run description (Markdown)."""
    seeds = ", ".join(str(s) for s in objective.get("seeds", []))
    return (f"Optuna study `{study}`: {method} | {cell}; its trials are the runs below it. Objective: "
            f"maximise `{objective.get('metric', '?')}` on {objective.get('target', 'validation')} data, "
            f"mean over tuning seeds {seeds}; search space `{objective.get('search_space', '?')}`.")


def run_description(paper: str, table: str, cell: str, seed: int, profile: str) -> str:
    """One line: paper, table, cell, seed, profile."""
    where = f"{paper}, {table}" if table else paper
    return f"{where} | {cell} | seed {seed} | profile {profile}"


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.store.mlflow_ui --store URI --base URL``: print the link of every experiment
    of a store (``make mlflow-ui`` runs it before serving the UI)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.store.mlflow_ui", description=main.__doc__)
    parser.add_argument("--store", required=True, help="tracking URI, e.g. sqlite:///results/mlflow.db")
    parser.add_argument("--base", default=LOCAL_UI, help=f"UI address (default {LOCAL_UI})")
    args = parser.parse_args(argv)
    from mlflow.tracking import MlflowClient

    experiments = [e for e in MlflowClient(tracking_uri=args.store).search_experiments() if e.name != "Default"]
    print("MLflow experiments (runs table, model-training view):" if experiments else
          f"no experiment in {args.store} yet: run `make demo` or `pflbench run SUITE`")
    for exp in sorted(experiments, key=lambda e: e.name):
        print(f"  {exp.name:32s} {experiment_url(args.base, exp.experiment_id)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
