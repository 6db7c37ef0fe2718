# taskpoint: two commands on a fresh machine.
#   make demo   set up .venv with the core only (no extras), then run the quick-start example on the local default root
#   make check  the fast door: set up .venv (no servers), then run every test that starts no server and no process
#               (tests/ but tests/e2e/, on local disk and memory:// only: pytest --fast) in under two minutes; a test
#               of it that asks for a server or starts a process fails, naming it
#   make test   set up .venv and the object-store servers, check the import layers, then run the whole suite
#   make reliability  the reliability campaign of issue 11 (RELIABILITY_ARGS="--quick" for the bounded run)
#   make docs   set up .venv with the docs extra only, build the documentation site into site/ (mkdocs --strict:
#               a broken link or API reference fails)
#   make bench  the speed benchmark of issues 3 and 5, and its sections: preemption (12), dcp (13), dedup (15),
#               lightning (23), agreement (28), subset (26: one file out of a step), fast (26: steps against
#               Orbax, torch.save and a raw copy), tiers (24: the local tier), format (42: verification against a
#               raw copy and DCP's reader), broadcast (44: ranks reading a step once), latency (44: requests through
#               a 10 ms proxy against the store's client), async (43: background saves against DCP, Orbax and a copy)
#               (BENCH_ARGS="--size 0.0625 --runs 1" for a quick run; "--methods dedup" for one section alone)
#   make dist   build the sdist and the wheel into dist/ (python -m build); then install the wheel with its extras:
#               pip install "dist/taskpoint-<version>-py3-none-any.whl[s3]"
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Installs go through uv with pip's own configuration (.ci/uvpip.py): the test stack in about 20 s instead of 3 min.
# make test UV_INSTALL=".venv/bin/python -m pip install": the test venv with pip alone, as before.
UV_INSTALL ?= $(PYTHON) .ci/uvpip.py $(VENV)/bin/uv $(PY)
STAMP  := $(VENV)/.installed
# The demo needs only the core: its own stamp, so a fresh clone installs a few MB, not the test stack.
DEMO_STAMP := $(VENV)/.installed-core
# ...plus the one extra a remote ROOT needs (make demo ROOT=s3://bucket/prefix).
DEMO_EXTRA = $(if $(filter s3://%,$(ROOT)),s3,$(if $(filter gs://% gcs://%,$(ROOT)),gcs,$(if $(filter az://% abfs://% abfss://%,$(ROOT)),azure,)))
NPM_DIR := tests/servers
NPM_STAMP := $(NPM_DIR)/node_modules/.installed
NPM_LOG := $(NPM_DIR)/install.log
NPM_FAILED := $(NPM_DIR)/install.failed
# The real flyte package, for the format-compatibility tests and the Flyte bridge (tests/e2e/test_flyte_bridge.py, tasks
# that use taskpoint inside flyte); its pins clash with ours, so it has its own venv, with taskpoint installed there
# too (editable, after flyte, so that flyte's pins win; taskpoint's own needs are loose enough to fit them).
FLYTE_VENV := .venv-flyte
FLYTE_STAMP := $(FLYTE_VENV)/.installed
FLYTE_BASE_STAMP := $(FLYTE_VENV)/.installed-flyte
FLYTE_VERSION ?= 2.12.1
ROOT ?=
BENCH_ARGS ?=
RELIABILITY_ARGS ?=
PYTEST_ARGS ?=
TEST_WORKERS ?= 4
# The fast tests keep a core busy each (no server or process to wait on): one worker per core.
CHECK_WORKERS ?= 2
BENCH_STAMP := $(VENV)/.installed-bench
# The site needs only the docs extra (mkdocs and the API reference read the source, importing no extra).
DOCS_STAMP := $(VENV)/.installed-docs
# make dist needs only the build frontend (it builds in an isolated environment of its own).
DIST_STAMP := $(VENV)/.installed-build

.PHONY: demo check test dist docs bench reliability lint typecheck clean venv servers

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip uv

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(UV_INSTALL) --quiet -e ".[test]"
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml | $(VENV)/bin/python
	$(UV_INSTALL) --quiet -e .
	touch $(DEMO_STAMP)

$(NPM_STAMP): $(NPM_DIR)/package.json
	cd $(NPM_DIR) && npm install --no-audit --no-fund --loglevel=error
	touch $(NPM_STAMP)

$(FLYTE_BASE_STAMP): | $(VENV)/bin/python
	$(PYTHON) -m venv $(FLYTE_VENV)
	$(PYTHON) .ci/uvpip.py $(VENV)/bin/uv $(FLYTE_VENV)/bin/python --quiet "flyte==$(FLYTE_VERSION)"
	touch $(FLYTE_BASE_STAMP)

# taskpoint itself goes in after the test venv's editable install: two editable builds at once would share
# src/taskpoint.egg-info.
$(FLYTE_STAMP): pyproject.toml $(FLYTE_BASE_STAMP) $(STAMP)
	$(PYTHON) .ci/uvpip.py $(VENV)/bin/uv $(FLYTE_VENV)/bin/python --quiet -e .
	$(FLYTE_VENV)/bin/python -m pip check
	touch $(FLYTE_STAMP)

venv: $(STAMP)

servers: $(NPM_STAMP)

demo: $(DEMO_STAMP)
	$(if $(DEMO_EXTRA),$(UV_INSTALL) --quiet -e ".[$(DEMO_EXTRA)]")
	TASKPOINT_ROOT="$(ROOT)" $(PY) examples/quickstart.py

$(DIST_STAMP): | $(VENV)/bin/python
	$(UV_INSTALL) --quiet build
	touch $(DIST_STAMP)

# dist/ is emptied first, so that it holds this version's two files only.
dist: $(DIST_STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist

$(DOCS_STAMP): pyproject.toml | $(VENV)/bin/python
	$(UV_INSTALL) --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR)/src $(VENV)/bin/mkdocs build --strict

# The environments install side by side (pip and npm wait mostly on the disk and the package index): a minute
# less from a fresh clone than one after the other. The site is built (strictly) by tests/e2e/test_docs.py, not a
# second time here.
# The suite runs on TEST_WORKERS pytest-xdist workers: most tests wait on servers, subprocesses and signals, so
# more workers than cores keep the two cores busy; one set of object-store servers serves them all (tests/conftest.py).
# Four, not three: a quiet fresh-clone CI ran pytest in 706 s with four (the whole run 12 min 23 s) against 731-759 s
# with three (12 min 53 s - 13 min 18 s), every test passing; the suite needs about 1,200 CPU-seconds, 600 s of two
# cores, so the workers' waits are what a fifth worker could still fill.
# What each test costs in CPU-seconds (the suite is CPU-bound, so that, not wall time, is what a change to the
# tests saves): make test PYTEST_ARGS="-p _cpu_report --cpu-report=/tmp/cpu", then python tests/_cpu_report.py
# '/tmp/cpu-*.jsonl' prints it by module.
# azurite's npm install (1-2 min, most of it writing 20,000 small files) goes on in the background while the tests
# run: only the Azure tests need it, and the first of them waits for it (tests/_servers.py, through
# TASKPOINT_NPM_INSTALL_LOG; a failed install fails them with the log's tail).
test:
	rm -f $(NPM_FAILED)
	($(MAKE) --no-print-directory $(NPM_STAMP) >$(NPM_LOG) 2>&1 || touch $(NPM_FAILED)) &
	$(MAKE) --no-print-directory -j2 $(STAMP) $(FLYTE_STAMP)
	$(VENV)/bin/lint-imports --no-cache
	TASKPOINT_NPM_INSTALL_LOG=$(NPM_LOG) TASKPOINT_FLYTE_PYTHON=$(FLYTE_VENV)/bin/python \
		$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=25 $(PYTEST_ARGS)

check: $(STAMP)
	$(PY) -m pytest --fast -n $(CHECK_WORKERS) --durations=10

reliability: $(STAMP) $(NPM_STAMP)
	$(PY) -m tests.reliability $(RELIABILITY_ARGS)

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(UV_INSTALL) --quiet -e ".[bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

lint: $(STAMP)
	$(UV_INSTALL) --quiet -e ".[dev]"
	$(PY) -m ruff check src tests examples benchmarks docs
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV) $(FLYTE_VENV) $(NPM_DIR)/node_modules .taskpoint site dist build
