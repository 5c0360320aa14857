# Every target creates .venv on first use; a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python

.PHONY: demo test test-all lint docs bench results clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(PY) -m pip install -q -e ".[plot]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/activate
	$(PY) -m pip install -q -e ".[dev,docs,loaders,data,distributed]"
	touch $@

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/activate
	$(PY) -m pip install -q -e ".[dev,loaders,bench,distributed]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m eqx_ensemble demo

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q -n 2 --dist loadgroup --max-worker-restart=0 --durations=15
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test-all: $(VENV)/.installed-dev
	EE_TEST_XLA_DEFAULTS=1 $(PY) -m pytest -q -n 2 --dist loadgroup --max-worker-restart=0 -m ""

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pyright

docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(VENV)/.installed-bench
	$(PY) benchmarks/run_all.py

# Every method on the same data: writes docs/results.md and its figures
# (about 20 minutes on a 2-core CPU; `--full` for longer runs).
results: $(VENV)/.installed-dev
	$(PY) benchmarks/results.py

clean:
	rm -rf $(VENV) site .pytest_cache .cache
