# Two commands do all set-up on a fresh machine: `make train` and `make test`.
# Both create .venv on first use and reinstall when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
# libtpu is installed for ahead-of-time TPU compiles; the embedded default runs on CPU.
export JAX_PLATFORMS ?= cpu

.PHONY: train test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[test,tpu]'
	touch $(STAMP)

# A fresh run each time (the same --workdir would resume from its last checkpoint).
train: $(STAMP)
	rm -rf runs/tiny_cpu
	$(PY) -m gagar_jax --config configs/tiny_cpu.py --workdir runs/tiny_cpu

# Two pytest workers (pytest-xdist), a test file per worker: module fixtures are built once.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20 tests

# ruff (configured in pyproject.toml); CI runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	for b in scripts/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf runs .cache .pytest_cache .hypothesis
