# One entry point per job. Every target sets up .venv first (idempotent: a stamp file records the install).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
CONSTRAINTS := requirements/constraints.txt
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: setup demo demo-sglang dashboard test test-fast lint bench soak grafana clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# SGLang 0.5.23 and xgrammar with --no-deps (their declared dependencies pin a CUDA torch); the CPU stubs module
# (requirements/sglang-cpu) into the environment, with the .pth file that loads it in every process SGLang spawns.
CPU_STUBS := requirements/sglang-cpu/kvalloc_sglang_cpu.py
$(STAMP): $(BIN)/python pyproject.toml $(CONSTRAINTS) $(CPU_STUBS)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[test,sglang-cpu]'
	$(PIP) install --quiet --no-deps -c $(CONSTRAINTS) sglang==0.5.23 xgrammar==0.2.7
	site=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	cp $(CPU_STUBS) "$$site/" && echo "import kvalloc_sglang_cpu" > "$$site/kvalloc_sglang_cpu.pth"
	touch $(STAMP)

setup: $(STAMP)

# The main job: the demo engine until Ctrl-C, serving metrics, recording, with the seed's bug injected.
DEMO_ARGS ?= --preset swa-128 --inject swa-misaligned --inject leak
DEMO_RECORDING ?= recordings/demo.sqlite
demo: $(STAMP)
	@mkdir -p $(dir $(DEMO_RECORDING))
	$(BIN)/instrumented-alloc demo $(DEMO_ARGS) --metrics-port 9464 --record $(DEMO_RECORDING) --overwrite --dashboard

# The main job on SGLang's real server: a tiny model on the CPU, the plugin on, seeded traffic, metrics, a
# recording per rank and the dashboard (see `instrumented-alloc demo --help`), until Ctrl-C. A leak 10 s into the
# traffic; at 60 s the seed's misaligned SWA evicted length, which SGLang's SWA tree then fails on: the server's
# end ends the demo there (exit 1), with the summary and the recording kept.
# Faults SGLang survives, so the demo runs until Ctrl-C; the seed's own (swa-misaligned) ends SGLang's scheduler
# once it stored the misaligned value: make demo-sglang SGLANG_DEMO_ARGS="--inject swa-misaligned@60".
SGLANG_DEMO_ARGS ?= --inject leak --inject no-release
SGLANG_DEMO_DIR ?= recordings/sglang
demo-sglang: $(STAMP)
	$(BIN)/instrumented-alloc demo --engine sglang $(SGLANG_DEMO_ARGS) --metrics-port 9464 --record-dir $(SGLANG_DEMO_DIR) --dashboard

# The Streamlit app alone on 127.0.0.1:8501, on the demo's recording (RECORDING=path for another; its directory
# is the one served).
RECORDING ?= $(DEMO_RECORDING)
dashboard: $(STAMP)
	@mkdir -p $(dir $(RECORDING))
	$(BIN)/instrumented-alloc dashboard $(RECORDING)

lint: $(STAMP)
	$(BIN)/ruff check .

# Two workers (pytest-xdist), a test file on one (its module fixtures, an SGLang Engine among them, set up once);
# PYTEST_WORKERS=0 runs the suite in this process.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The local loop: the same without the tests marked slow (SGLang Engines, the browser, a real Prometheus, the soak
# and differential runs; see tests/conftest.py). CI runs `make test`, everything.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

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
