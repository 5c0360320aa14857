# Every target creates .venv on first use; a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python

.PHONY: demo test test-all test-floor lint docs bench results clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(PY) -m pip install -q -e ".[plot]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/activate
	$(PY) -m pip install -q -e ".[dev,docs,loaders,data,distributed]"
	touch $@

# The results page's peers. torchvision (which laplace-torch and
# TorchUncertainty declare) goes again: the index has it only built for CUDA
# torch, and with the CPU wheel its operators fail to register, which breaks
# every import of torchmetrics; the peers' code paths used here need none of it.
$(VENV)/.installed-peers: pyproject.toml | $(BIN)/activate
	$(PY) -m pip install -q -e ".[dev,docs,loaders,data,distributed,bench,peers]"
	$(PY) -m pip uninstall -y -q torchvision
	touch $@ $(VENV)/.installed-dev

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

# The declared dependency floor (tests/floor.txt) in a virtual environment of
# its own, on the tests of the core: ensembles, training, checkpoints, metrics,
# sharding. Third-party deprecation warnings of those old releases are not
# errors there (equinox 0.13.0 warns on import under JAX 0.8).
FLOOR := .venv-floor
FLOOR_TESTS := tests/test_demo.py tests/test_ensemble.py tests/test_stack.py \
	tests/test_map.py tests/test_predict.py tests/test_fit.py tests/test_step.py \
	tests/test_optim.py tests/test_sampling.py tests/test_checkpoint.py \
	tests/test_resume.py tests/test_compile_once.py tests/test_convolution.py \
	tests/test_guard.py tests/test_optimistic_guard.py tests/test_sharding.py \
	tests/test_shared_parts.py tests/test_heterogeneous.py tests/test_metrics.py \
	tests/test_conformal.py tests/test_laplace.py tests/test_sgmcmc.py

$(FLOOR)/.installed: pyproject.toml tests/floor.txt
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -q --upgrade pip
	$(FLOOR)/bin/python -m pip install -q -c tests/floor.txt -e ".[plot]" \
		"pytest>=8" "pytest-xdist>=3.5" "pytest-timeout>=2.3" "hypothesis>=6.100" \
		"scikit-learn>=1.4" scipy
	touch $@

test-floor: $(FLOOR)/.installed
	$(FLOOR)/bin/python -m pytest -q -n 2 --dist loadgroup --max-worker-restart=0 \
		-W "ignore::DeprecationWarning" -p no:cacheprovider $(FLOOR_TESTS)

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
results: $(VENV)/.installed-peers
	$(PY) benchmarks/results.py

clean:
	rm -rf $(VENV) $(FLOOR) site .pytest_cache .cache
