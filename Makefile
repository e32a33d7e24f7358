# recsys_runner — `make help` lists the targets. `make run` and `make test` set up .venv themselves.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
INSTALL_LOG := $(VENV)/install.log

# The pinned stack (see README "Installing"). GPU users override TORCH_INDEX and FBGEMM, e.g.
#   make test TORCH_INDEX=<PyTorch CUDA wheel index URL> FBGEMM=fbgemm-gpu==1.8.0
TORCH ?= torch==2.13.0
FBGEMM ?= fbgemm-gpu-cpu==1.8.0
TORCHREC ?= torchrec==1.8.0
TORCH_INDEX ?=
TORCH_INDEX_ARGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple,)

RUN_ARGS ?=
PORT ?= 5000

.PHONY: help install run test test-fast bench lint ui clean

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-10s %s\n", $$1, $$2}'

# Quiet unless it fails: pip's and setuptools' output (the editable-install warnings included) goes to
# $(INSTALL_LOG), printed in full only when a step fails. torchrec is installed without its dependencies:
# its metadata asks for the CUDA fbgemm-gpu, which would replace the build above it. The editable install
# is in compat mode (a path in a .pth): Hydra finds hydra_plugins/recsys_runner_detached only by scanning directories.
$(STAMP): pyproject.toml Makefile
	@mkdir -p $(VENV) && : > $(INSTALL_LOG)
	@echo "Installing the pinned stack into $(VENV) (a few minutes the first time; log: $(INSTALL_LOG))"
	@# && and not set -e: bash ignores -e inside a command whose status || tests.
	@( set -x; \
	  { test -x $(PY) || $(PYTHON) -m venv $(VENV); } && \
	  $(PIP) install --quiet --upgrade pip && \
	  $(PIP) install --quiet $(TORCH_INDEX_ARGS) "$(TORCH)" "$(FBGEMM)" && \
	  $(PIP) install --quiet --no-deps "$(TORCHREC)" && \
	  $(PIP) install --quiet -e ".[dev]" --config-settings editable_mode=compat \
	) >> $(INSTALL_LOG) 2>&1 || { cat $(INSTALL_LOG) >&2; echo "Installing into $(VENV) failed (output above, also in $(INSTALL_LOG))" >&2; exit 1; }
	@$(PY) -c "import torch, fbgemm_gpu, torchrec, hydra, mlflow; print('stack ok: torch', torch.__version__, 'hydra', hydra.__version__)"
	@touch $(STAMP)

install: $(STAMP) ## Create .venv and install the pinned stack (once; again only if pyproject.toml changes)

run: $(STAMP) ## Train DeepFM on synthetic data, evaluate, log to ./mlflow.db (RUN_ARGS="model=dlrm ...")
	$(PY) -m recsys_runner $(RUN_ARGS)

# Two pytest workers (pytest-xdist): most tests wait on a subprocess's imports or a server, so two share 2 cores well.
# --dist loadgroup keeps each test module on one worker (its module fixtures are built once) and the SLURM modules
# together (tests/conftest.py). TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 2
TEST_PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)
test: $(STAMP) ## Run the whole test suite, slow multi-process, SLURM and browser tests included (installs SLURM, chromium and Triton when it can)
	@.ci/install-slurm && .ci/install-chromium && .ci/install-triton
	$(PY) -m pytest -q $(TEST_PARALLEL) --durations=30

test-fast: $(STAMP) ## Run the tests except those marked slow
	$(PY) -m pytest -q $(TEST_PARALLEL) -m "not slow"

BENCH_ARGS ?=
bench: $(STAMP) ## Runner vs hand loop (synthetic, Parquet, sequences, managed collision), start-up; negatives; object store; corpus eval; eval metrics at 2M rows; serving, export's peak memory, encoders, Criteo transforms; jagged attention; every model's samples/s (docs/performance.md)
	$(PY) -m recsys_runner.bench $(BENCH_ARGS)
	$(PY) -m recsys_runner.bench.retrieval
	$(PY) -m recsys_runner.bench.storage
	$(PY) -m recsys_runner.bench.multitask
	$(PY) -m recsys_runner.bench --corpus
	$(PY) -m recsys_runner.bench.eval_scale
	$(PY) -m recsys_runner.bench.serving
	$(PY) -m recsys_runner.bench.serving --compiled
	$(PY) -m recsys_runner.bench.export_memory
	$(PY) -m recsys_runner.bench.encoding
	$(PY) -m recsys_runner.bench.transforms
	$(PY) -m recsys_runner.bench.sequences_rows
	$(PY) -m recsys_runner.bench.sequences_rows --out bench_results/sequences_rows_hstu.json model.block=hstu
	$(PY) -m recsys_runner.bench.topk
	$(PY) -m recsys_runner.bench.jagged
	$(PY) -m recsys_runner.bench.hstu_kernels
	$(PY) -m recsys_runner.bench.zoo

lint: $(STAMP) ## ruff, mypy, and import-linter (what each room may import: docs/architecture.md)
	$(VENV)/bin/ruff check recsys_runner tests hydra_plugins
	$(VENV)/bin/mypy recsys_runner hydra_plugins
	$(VENV)/bin/lint-imports

# The last experiment's page first (with ?workflowType=machine_learning: MLflow 3's UI otherwise opens an empty GenAI view).
# Without MLflow 3's server-side job runner (its huey consumers serve GenAI jobs: prompt optimization, scorers), which a
# training-runs UI never uses and which costs ~2.5 s of start-up; MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true brings it back.
# MLflow's own import of starlette.middleware.wsgi warns in each of its 4 server processes: not ours, nothing to do.
ui: $(STAMP) ## MLflow UI on ./mlflow.db at http://127.0.0.1:5000 (PORT=5001: another port); prints the last experiment's page once it answers
	@MLFLOW_SERVER_ENABLE_JOB_EXECUTION=$${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false} \
	  PYTHONWARNINGS="ignore:starlette.middleware.wsgi is deprecated$${PYTHONWARNINGS:+,$$PYTHONWARNINGS}" \
	  $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port $(PORT) & server=$$!; \
	trap 'kill $$server 2>/dev/null; wait $$server' INT TERM; \
	$(PY) -m recsys_runner.compare --ui-url --uri sqlite:///$(CURDIR)/mlflow.db --port $(PORT) --wait-for-ui $$server || true; \
	wait $$server

clean: ## Remove run outputs and compare's plots (keeps .venv and mlflow.db)
	rm -rf outputs multirun compare .pytest_cache
