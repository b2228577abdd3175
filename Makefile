# T-Rex: `make run` (set up + lifecycle on the tiny default) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip
STAMP   = $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
SET    ?=
STATE  ?= .trex

.PHONY: setup run test ui clean

setup: $(STAMP)

# Re-installs only when pyproject.toml changed (idempotent). torch goes first, pinned, with pip (which finds
# the CPU wheel where one is provided), so that nothing later can pull a multi-GB CUDA build. The rest goes
# through uv, which resolves and installs it in seconds where pip takes minutes (docs/operations.md); where
# uv cannot be installed or fails, pip does it. uv reads UV_INDEX_URL / UV_EXTRA_INDEX_URL, not pip's config.
# --compile-bytecode (pip's default): sandboxed programs see the venv read-only and could not cache what they
# import, so without it every sandbox would compile pyomo & co. from source (curation 3x slower).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	( $(PIP) install -q --disable-pip-version-check uv && \
	  $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e ".[test]" ) || \
	( $(PIP) install -q --disable-pip-version-check --upgrade pip && \
	  $(PIP) install -q --disable-pip-version-check -e ".[test]" )
	touch $(STAMP)

run: setup
	$(VENV)/bin/trex lifecycle --config $(CONFIG) $(SET)

# the suite runs processes side by side: idle OpenMP threads sleep instead of spinning (spinning waiters make
# torch 2-100x slower when processes share the cores). `make run` leaves the choice to the CLI (README).
# TEST_WORKERS pytest processes (pytest-xdist), each test module in one of them (its fixtures set up once), the
# longest modules first (tests/conftest.py; --no-loadscope-reorder keeps that order):
# on 2 cores the suite takes ~2/3 of the time of one process, as many tests wait on subprocesses and servers.
TEST_WORKERS ?= 2
test: export OMP_WAIT_POLICY ?= PASSIVE
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25 tests

ui: setup
	$(VENV)/bin/trex ui start --config $(CONFIG) --foreground $(SET)

clean:
	rm -rf $(STATE)
