# T-Rex: `make run` (set up + lifecycle on the tiny default) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip
STAMP   = $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
SET    ?=
STATE  ?= .trex
# idle OpenMP threads sleep instead of spinning: torch runs far faster when processes share the cores
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup run test ui clean

setup: $(STAMP)

# Re-installs only when pyproject.toml changed (idempotent). torch goes first, pinned, so that
# nothing later can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check --upgrade pip
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	$(PIP) install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

run: setup
	$(VENV)/bin/trex lifecycle --config $(CONFIG) $(SET)

test: setup
	$(PY) -m pytest -q tests

ui: setup
	@echo "Prefect UI: http://127.0.0.1:4200   MLflow UI: http://127.0.0.1:5000   (Ctrl-C stops both)"
	@mkdir -p $(STATE)
	PREFECT_HOME=$(abspath $(STATE))/prefect $(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200 & \
	$(VENV)/bin/mlflow ui --host 127.0.0.1 --port 5000 \
	  --backend-store-uri sqlite:///$(abspath $(STATE))/mlflow.db \
	  --default-artifact-root $(abspath $(STATE))/mlartifacts; \
	kill %1 2>/dev/null || true

clean:
	rm -rf $(STATE)
