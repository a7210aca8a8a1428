# The README's two commands: `make demo` (main job) and `make test` (test suite).
# Both create .venv and install the project on first use. torch is pinned here to the
# CPU build this project is tested with; the package itself accepts a range.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.qkgeom-installed
TORCH ?= torch==2.13.0

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)  ## E1 + E2 at demo size on the embedded Wikipedia sample: sweep, report, claims
	$(BIN)/qkgeom reproduce e1 --preset demo --out sweeps/e1-demo

test: $(STAMP)  ## lint + the whole test suite (slow tests included)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest ran no tests" >&2; exit 1; fi; exit $$rc

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/train_throughput.py
	$(BIN)/python benchmarks/sweep_scaling.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
