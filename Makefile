# Every target does its own set-up: a fresh clone needs nothing but python3 and make.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PIPELINE_HOME ?= $(CURDIR)/.pipeline
export DAGSTER_HOME ?= $(PIPELINE_HOME)/dagster
export MLFLOW_TRACKING_URI ?= sqlite:///$(PIPELINE_HOME)/mlflow.db
SAMPLE_RECORDS ?= 20000
SAMPLE_PAIRS ?= 2000
SAMPLE_CONVERSATIONS ?= 2000
DAGSTER_PORT ?= 3000
MLFLOW_PORT ?= 5000
PIP := $(BIN)/python -m pip --disable-pip-version-check
# Processes keep the bytecode they compile (the install runs with --no-compile). Where the
# environment sets PYTHONDONTWRITEBYTECODE, as many images do, every process would compile every
# module it imports again: the suite took 25 min 37 s that way here, against 16 min 39 s.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install chromium demo test lint dev bench clean

# torch first, pinned, by pip: the local CPU wheel. An unpinned torch would pull GBs of CUDA packages.
# --no-compile: Python compiles the modules a process imports on first use; compiling every file of
# every package at install is most of the install's time here (torch alone: 39 s against 12 s).
# The rest by uv, which downloads and installs in parallel: on an empty cache it took 13 s (uv's
# own install included) where pip took 75 s, for the same 209 packages at the same versions. uv
# keeps the installed torch, and compiles no bytecode unless asked. Where uv cannot install, pip
# does.
comma := ,
install_project = ($(PIP) install -q uv==0.13.9 && $(BIN)/python -m uv pip install -q \
	--python $(BIN)/python -e "$(1)") || $(PIP) install -q --no-compile -e "$(1)"
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install -q --no-compile torch==2.13.0
	$(call install_project,.[dev])
	$(BIN)/python -c "import pipeline_assets, dagster, deltalake, polars, pandera, mlflow"
	touch $@

install: $(VENV)/.installed

$(DAGSTER_HOME)/dagster.yaml: pipeline_assets/instance.yaml
	mkdir -p $(DAGSTER_HOME)
	cp pipeline_assets/instance.yaml $@

# The sample corpus's added sources: prefs is read as preference pairs, chats as conversations, by
# the demo and by make dev.
demo dev: export PIPELINE_SOURCE_FORMATS ?= {"prefs": "preference", "chats": "conversation"}
demo: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/pipeline-assets sample-data --records $(SAMPLE_RECORDS) --preference-pairs $(SAMPLE_PAIRS) \
		--conversations $(SAMPLE_CONVERSATIONS)
	time $(BIN)/pipeline-assets run
	$(BIN)/pipeline-assets summary
	$(BIN)/pipeline-assets lineage $${PIPELINE_MODEL_NAME:-sft-model}@champion
	rm -rf $(PIPELINE_HOME)/export/champion
	$(BIN)/pipeline-assets export $${PIPELINE_MODEL_NAME:-sft-model}@champion \
		--out $(PIPELINE_HOME)/export/champion --generate "How do I reset my password?"

# The browser test of the Dagster UI drives Debian's chromium (Playwright's own download needs the
# internet): installed here when missing, with sudo unless we are root.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
chromium:
	command -v chromium >/dev/null || ($(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

# Three workers on two cores, one test file each at a time: much of the suite waits (on
# subprocesses, Ray, servers, a daemon's ticks, a browser) rather than computes, and a third worker
# fills those waits (1,055 s against 1,247 s with two). The GRPO learning test's learner and
# rollout worker follow a fixed schedule (off_policy_steps): the load cannot change what it learns.
# The longest files go first (conftest.LONGEST_FIRST; xdist would otherwise start the files with
# the most tests first); the 15 slowest tests are listed.
# The tests' files (Delta tables, SQLite instances, checkpoints) live in /dev/shm when it has 4 GB
# free, else in the system's temporary folder; they are removed when the suite passes.
TEST_TMP = $$(if [ -w /dev/shm ] && [ "$$(df -Pk /dev/shm | awk 'NR == 2 {print $$4}')" -gt 4000000 ]; \
	then mktemp -d /dev/shm/pt.XXXXXX; else mktemp -d; fi)
# ruff: imports sorted, pyflakes, and the code formatted at 100 columns (pyproject.toml, [tool.ruff]).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

test: install chromium lint
	tmp=$(TEST_TMP); echo "test files under $$tmp"; \
	TMPDIR=$$tmp $(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=15 \
		--basetemp=$$tmp/pytest pipeline_assets_tests && rm -rf $$tmp

# The MLflow UI without its GenAI job runners (a consumer a core and a scheduler, for judges and
# prompt optimization, which nothing here submits).
dev: install $(DAGSTER_HOME)/dagster.yaml
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --workers 1 --host 127.0.0.1 --port $(MLFLOW_PORT) --backend-store-uri $(MLFLOW_TRACKING_URI) & \
	mlflow_pid=$$!; trap "kill $$mlflow_pid" EXIT; \
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p $(DAGSTER_PORT)

# bench.scale lands 1 and 4 million records from landing to a snapshot: about 35 minutes on 2 cores.
bench: install
	$(call install_project,.[dev$(comma)bench])
	$(BIN)/python -m bench.run --out bench/results
	$(BIN)/python -m bench.scale --out bench/results/scale.json

clean:
	rm -rf $(VENV) $(PIPELINE_HOME)
