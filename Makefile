# pflbench: reproducibility harness for personalized federated learning.
# `make help` lists the targets. Every target installs what it needs first (`make setup`).

PYTHON   ?= python3
VENV     ?= .venv
BIN      := $(VENV)/bin
PROFILE  ?= paper
JOBS     ?= 1
DEMO_JOBS ?= 2
DEVICE   ?= auto
PORT     ?= 5000
OUT      ?= reports
# the default stores' folder, as benchmarks/store/location.py resolves it (never the current directory)
RESULTS  ?= $(or $(PFLBENCH_RESULTS_DIR),$(CURDIR)/results)
MASK_URI := sed -E 's\#(://[^:/@]*):[^@/]*@\#\1:***@\#'
PFLBENCH := $(BIN)/pflbench
STAMP    := $(VENV)/.installed
SUITES   := $(sort $(wildcard suites/*/*.yaml))
RUN      = $(PFLBENCH) run $(1) --profile $(PROFILE) --jobs $(JOBS) --device $(DEVICE) --report --out $(OUT)

.DEFAULT_GOAL := help
.PHONY: help setup demo test test-fast docs mlflow-ui list clean-results browser gpu-check gpu-lend device-rehearsal committed-reports

help: ## List every target with one line
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_%-]+:.*## / {printf "  \033[36m%-26s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@for f in $(SUITES); do p=$$(basename $$(dirname $$f)); n=$$(basename $$f .yaml); \
		printf "  \033[36m%-26s\033[0m run %s, then render its report\n" "reproduce-$$p-$$n" "$$f"; done
	@echo "  Variables: PROFILE=paper|quick|smoke  JOBS=N  DEMO_JOBS=N (make demo, default 2)  DEVICE=auto|cpu|cuda  PFL_DATA_DIR=<datasets>"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP) ## Create .venv and install the project with its dev extra
	@echo "environment ready: $(VENV)"

# the demo's report shows, first, the committed paper-scale CGPFL Table 1 (a snapshot, not rerun) beside its own offline numbers
DEMO_BESIDE ?= reports/reproduced/cgpfl/table1.snapshot.json

demo: $(STAMP) ## Run the offline demo suite (no download); its report shows the committed CGPFL Table 1 snapshot first
	$(PFLBENCH) run suites/demo/offline.yaml --jobs $(DEMO_JOBS) --device $(DEVICE) --report \
		$(foreach f,$(DEMO_BESIDE),--beside-snapshot $(f))

reproduce-%: $(STAMP) ## reproduce-<paper>-<suite>: one suite; reproduce-<paper>: all of a paper
	@suites="$(filter suites/$(subst -,/,$*).yaml,$(SUITES))"; \
	[ -n "$$suites" ] || suites="$(filter suites/$*/%,$(SUITES))"; \
	[ -n "$$suites" ] || { echo "no suite for '$*'; see 'make help'"; exit 2; }; \
	rc=0; for f in $$suites; do $(call RUN,$$f) || { rc=$$?; [ $$rc -lt 128 ] || exit $$rc; }; done; exit $$rc

# Chromium for tests/test_mlflow_browser.py (driven by the `playwright` package of the dev extra; Playwright's
# own browser download is not used). Debian/Ubuntu: installed with apt-get when missing.
CHROMIUM ?= /usr/bin/chromium
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

browser: ## Install Chromium for the MLflow browser test when it is missing (apt-get; CI runs it before `make test`)
	@if [ -x $(CHROMIUM) ]; then echo "chromium: $(CHROMIUM)"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else echo "no $(CHROMIUM) and no apt-get: install Chromium and pass CHROMIUM=/path (PFL_CHROMIUM for pytest);" \
		"tests/test_mlflow_browser.py skips without it"; fi

# PostgreSQL's server for tests/test_postgres_store.py (a lab's shared store: `mlflow server` on PostgreSQL; the test
# starts and stops its own throw-away cluster). Debian/Ubuntu: installed with apt-get when missing.
PG_INITDB = $(lastword $(sort $(wildcard /usr/lib/postgresql/*/bin/initdb)))

.PHONY: postgres
postgres: ## Install PostgreSQL's server for the shared-store test when it is missing (apt-get; CI runs it before `make test`)
	@if [ -n "$(PG_INITDB)" ]; then echo "postgresql: $(PG_INITDB)"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; \
	else echo "no PostgreSQL server and no apt-get: install one and pass PFL_PG_BIN=<its bin folder> to pytest;" \
		"tests/test_postgres_store.py skips without it"; fi

# pytest-xdist workers (one torch thread each, tests/conftest.py); TEST_WORKERS=0 runs in this process
TEST_WORKERS ?= auto
PYTEST       = $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test: $(STAMP) ## Run the whole test suite on every core (TEST_WORKERS=auto); prints the 25 slowest tests
	$(PYTEST) --durations=25

test-fast: $(STAMP) ## The inner loop: the tests not marked slow, on every core
	$(PYTEST) -m "not slow"

gpu-check: $(STAMP) ## Check the GPU path (gpu tests, CUDA vs CPU, speed) into reports/gpu/<device>.md; dry mode without CUDA (into results/gpu/)
	$(PFLBENCH) gpu-check

# A GPU lend (docs/gpu-and-cluster.md): the one prepared command, run on the lent machine from the checkout
# (no install there: PYTHONPATH=.); LEND_ARGS adds to it (e.g. --data-dir, --budget-s, --git-commit).
LEND_ARGS ?=
gpu-lend: ## On a lent GPU: gpu-check's core, then CAFeMe Table 1's RMNIST cells until the deadline; records into $$OUT
	PYTHONPATH=. $(PYTHON) -m benchmarks.running.gpu_lend --suite cafeme/table1 --profile paper --only dataset=rmnist $(LEND_ARGS)

committed-reports: $(STAMP) ## Re-render the committed reports (reports/{reproduced,quick}/<paper>.pdf, tables) from their snapshots
	$(BIN)/python -m benchmarks.reporting.committed --root reports

device-rehearsal: $(STAMP) ## The gpu-lend command on the CPU in a venv with the lent image's versions (torch 2.11.0, no MLflow); tiny budget
	.ci/device-rehearsal $(BIN)/python

docs: $(STAMP) ## Build the documentation site into site/ (mkdocs build --strict: warnings are errors)
	$(BIN)/mkdocs build --strict --site-dir site

# The fresh environment borrows the third-party packages of $(VENV) (torch alone is gigabytes from PyPI);
# it holds the wheel only, and the script checks that nothing is imported from the checkout (.ci/wheel-smoke).
.PHONY: wheel-smoke
wheel-smoke: $(STAMP) ## Build the sdist and wheel, install the wheel in a fresh venv, run demo/offline (smoke) outside the checkout
	.ci/wheel-smoke $(BIN)/python

list: $(STAMP) ## List registered methods, datasets, models, partitioners and suites
	@for what in methods datasets models partitioners protocols suites; do \
		echo "== $$what"; $(PFLBENCH) list $$what; done

mlflow-ui: $(STAMP) ## Serve the MLflow UI of MLFLOW_TRACKING_URI, else of the local store (http://127.0.0.1:$(PORT)); prints each suite's link
	@uri="$${MLFLOW_TRACKING_URI:-sqlite:///$(RESULTS)/mlflow.db}"; shown=$$(echo "$$uri" | $(MASK_URI)); \
	case "$$uri" in http://*|https://*) \
		echo "MLFLOW_TRACKING_URI is a tracking server, which serves its own UI: open $$shown"; exit 0;; esac; \
	echo "MLflow UI of $$shown on http://127.0.0.1:$(PORT)"; \
	$(BIN)/python -m benchmarks.store.mlflow_ui --store "$$uri" --base http://127.0.0.1:$(PORT); \
	exec $(BIN)/mlflow ui --backend-store-uri "$$uri" --default-artifact-root $(RESULTS)/mlartifacts \
		--host 127.0.0.1 --port $(PORT)

clean-results: ## Delete the local MLflow store and the reports rendered from it (asks no question; the committed reports stay)
	rm -rf $(RESULTS)/mlflow.db $(RESULTS)/mlartifacts $(addprefix reports/,$(PAPERS)) $(addsuffix .pdf,$(addprefix reports/,$(PAPERS)))

.PHONY: reports
PAPERS := $(sort $(notdir $(patsubst %/,%,$(dir $(SUITES)))))

report-%: $(STAMP) ## report-<paper>: tables, figures and reports/<paper>.pdf from the MLflow store
	$(PFLBENCH) report --paper $* --profile $(PROFILE)

reports: $(STAMP) ## Render the report of every paper that has suites (PROFILE=... as for reproduce)
	@for p in $(PAPERS); do $(PFLBENCH) report --paper $$p --profile $(PROFILE) || exit $$?; done

# -- tuning (benchmarks/tuning/tune.py) --------------------------------------------------------------------
TRIALS       ?= 20
TUNE_PROFILE ?= $(PROFILE)
OPTUNA_DB    ?= $(RESULTS)/optuna.db

tune-%: $(STAMP) ## tune-<paper>-<suite>: Optuna study (TRIALS=20, validation data) per cell of every method the suite tunes
	@suite="$(filter suites/$(subst -,/,$*).yaml,$(SUITES))"; \
	[ -n "$$suite" ] || { echo "no suite for '$*'; see 'make help'"; exit 2; }; \
	$(PFLBENCH) tune $$suite --profile $(TUNE_PROFILE) --trials $(TRIALS) --jobs $(JOBS) --device $(DEVICE) \
		--storage sqlite:///$(OPTUNA_DB) $(if $(METHOD),$(foreach m,$(METHOD),--method $(m)))

optuna-dashboard: $(STAMP) ## Serve the Optuna dashboard on the local study store (http://127.0.0.1:$(PORT))
	@[ -x $(BIN)/optuna-dashboard ] || $(BIN)/pip install --quiet -e '.[dashboard]'
	@mkdir -p $(dir $(OPTUNA_DB))
	@# a fresh machine has no study store yet: create its tables (optuna-dashboard fails on an empty file)
	@$(BIN)/python -c "import optuna, sys; optuna.storages.RDBStorage(sys.argv[1])" sqlite:///$(OPTUNA_DB)
	$(BIN)/optuna-dashboard sqlite:///$(OPTUNA_DB) --host 127.0.0.1 --port $(PORT)
