# T-Rex: `make run` (set up + lifecycle on the tiny default) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip
STAMP   = $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
SET    ?=
STATE  ?= .trex

.PHONY: setup run test test-matrix ui clean

setup: $(STAMP)

# Re-installs only when pyproject.toml changed (idempotent). One uv call resolves and installs torch (pinned) and
# the rest in seconds where pip takes minutes (docs/operations.md). torch must be the CPU wheel, never a multi-GB
# CUDA build: uv takes it from pip's local wheelhouse where one is configured (PIP_FIND_LINKS or pip's
# find-links: uv does not read pip's configuration), else from the PyTorch CPU index (--torch-backend cpu).
# Where uv cannot be installed or fails, pip does it all (pip finds the CPU wheel where one is provided).
# Bytecode: sandboxed programs see the venv read-only and cannot cache what they import, so without .pyc files
# every sandbox would compile pyomo & co. from source (curation 3x slower). `make run` compiles everything but
# the packages neither the lifecycle nor its sandboxes import (BYTECODE_LATER, a third of the sources);
# `make test`, whose tests import them, compiles those once more (a second stamp). compileall fails on modules
# written for newer Pythons (never imported here, e.g. whenever/_typing_312.py): its status is not the install's.
FIND_LINKS     ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_TORCH        = $(if $(strip $(FIND_LINKS)),$(addprefix --find-links ,$(FIND_LINKS)),--torch-backend cpu)
SITE            = $(VENV)/lib/python*/site-packages
BYTECODE_LATER  = transformers sklearn dask distributed openai deepspeed networkx playwright apprise narwhals tornado
BYTECODE_ALL    = $(VENV)/.bytecode-all
SPACE          := $() $()
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	( $(PIP) install -q --disable-pip-version-check uv && \
	  $(VENV)/bin/uv pip install -q --python $(PY) $(UV_TORCH) torch==2.13.0 -e ".[test]" ) || \
	( $(PIP) install -q --disable-pip-version-check torch==2.13.0 && \
	  $(PIP) install -q --disable-pip-version-check --upgrade pip && \
	  $(PIP) install -q --disable-pip-version-check -e ".[test]" )
	$(PY) -m compileall -qq -j 0 -x '/site-packages/($(subst $(SPACE),|,$(BYTECODE_LATER)))/' $(SITE) || true
	touch $(STAMP)

$(BYTECODE_ALL): $(STAMP)
	$(PY) -m compileall -qq -j 0 $(addprefix $(SITE)/,$(BYTECODE_LATER)) || true
	touch $(BYTECODE_ALL)

run: setup
	$(VENV)/bin/trex lifecycle --config $(CONFIG) $(SET)

# the suite runs processes side by side: idle OpenMP threads sleep instead of spinning (spinning waiters make
# torch 2-100x slower when processes share the cores). `make run` leaves the choice to the CLI (README).
# TEST_WORKERS pytest processes (pytest-xdist), each test module in one of them (its fixtures set up once), the
# longest modules first (tests/conftest.py; --no-loadscope-reorder keeps that order):
# on 2 cores the suite takes ~2/3 of the time of one process, as many tests wait on subprocesses and servers.
TEST_WORKERS ?= 2
test: export OMP_WAIT_POLICY ?= PASSIVE
test: setup $(BYTECODE_ALL)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25 tests

# the whole family x category x representation x API matrix of the data engine (make test runs a representative
# share of it: every family, category, representation, API and representation x API pair at least once)
test-matrix: export OMP_WAIT_POLICY ?= PASSIVE
test-matrix: setup $(BYTECODE_ALL)
	TREX_FULL_MATRIX=1 $(PY) -m pytest -q -n $(TEST_WORKERS) tests/ordata/test_families.py

ui: setup
	$(VENV)/bin/trex ui start --config $(CONFIG) --foreground $(SET)

clean:
	rm -rf $(STATE)
