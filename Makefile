# One entry point per job. Every target sets up .venv first (idempotent: a stamp file records the install).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
CONSTRAINTS := requirements/constraints.txt
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: setup demo dashboard test lint bench soak grafana clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[test,sglang-compat]'
	$(PIP) install --quiet --no-deps -c $(CONSTRAINTS) sglang==0.5.23
	touch $(STAMP)

setup: $(STAMP)

# The main job: the demo engine until Ctrl-C, serving metrics, recording, with the seed's bug injected.
DEMO_ARGS ?= --preset swa-128 --inject swa-misaligned --inject leak
DEMO_RECORDING ?= recordings/demo.sqlite
demo: $(STAMP)
	@mkdir -p $(dir $(DEMO_RECORDING))
	$(BIN)/instrumented-alloc demo $(DEMO_ARGS) --metrics-port 9464 --record $(DEMO_RECORDING) --overwrite --dashboard

# The Streamlit app alone on 127.0.0.1:8501, on the demo's recording (RECORDING=path for another; its directory
# is the one served).
RECORDING ?= $(DEMO_RECORDING)
dashboard: $(STAMP)
	@mkdir -p $(dir $(RECORDING))
	$(BIN)/instrumented-alloc dashboard $(RECORDING)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# 1,000,000 demo steps with every exporter on; SOAK_ARGS="--steps 100000" for a shorter one.
SOAK_ARGS ?=
soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak $(SOAK_ARGS)

# Rewrites grafana/dashboards/kvalloc.json from grafana/generate.py (tests/grafana fails while it is stale).
grafana: $(STAMP)
	$(BIN)/python -m grafana.generate

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
