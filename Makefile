# steadyserve: `make serve` and `make test` each work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# On a CUDA machine: make serve TORCH_CONSTRAINTS=/path/to/your/constraints.txt
TORCH_CONSTRAINTS ?= constraints-cpu.txt
# Every other package, pinned to the versions CI passed with (how to refresh it: its header).
# Every pip install below takes it (pip's own upgrade too); the package installs also take
# $(TORCH_CONSTRAINTS).
LOCK_CONSTRAINTS ?= constraints-lock.txt
BIN := $(VENV)/bin
# Lines the batch client's bench pushes through one server (make bench BATCH_BENCH_LINES=20000)
BATCH_BENCH_LINES ?= 100000

.PHONY: setup setup-dev setup-bench tools serve test lint typecheck pytest bench check-config clean FORCE

# venv writes bin/python before ensurepip runs: a failed creation removes the venv, or the
# next run would find bin/python and go on without pip.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }

# The runtime stamp holds the constraints file the venv was installed with; another one
# (a file given after the venv was made may be older than the stamp, and a switch back to
# the CPU one as well) installs again, decided by the stamp's content when make reads this
# file: a stamp rewritten on a switch could share its timestamp with the install's on a
# coarse clock and look current, keeping the torch build installed before.
INSTALLED_WITH := $(shell cat $(VENV)/.runtime-installed 2>/dev/null)
ifneq ($(INSTALLED_WITH),$(abspath $(TORCH_CONSTRAINTS)))
$(VENV)/.runtime-installed: FORCE
endif

$(VENV)/.runtime-installed: pyproject.toml $(TORCH_CONSTRAINTS) $(LOCK_CONSTRAINTS) | $(BIN)/python
	$(BIN)/pip install -q --upgrade -c $(LOCK_CONSTRAINTS) pip
	$(BIN)/pip install -q -c $(TORCH_CONSTRAINTS) -c $(LOCK_CONSTRAINTS) -e .
	echo '$(abspath $(TORCH_CONSTRAINTS))' > $@

$(VENV)/.dev-installed: $(VENV)/.runtime-installed $(LOCK_CONSTRAINTS)
	$(BIN)/pip install -q -c $(TORCH_CONSTRAINTS) -c $(LOCK_CONSTRAINTS) -e '.[dev]'
	touch $@

# The benches' baselines (TorchServe, `transformers serve`): no test runs them.
$(VENV)/.bench-installed: $(VENV)/.dev-installed $(LOCK_CONSTRAINTS)
	$(BIN)/pip install -q -c $(TORCH_CONSTRAINTS) -c $(LOCK_CONSTRAINTS) -e '.[bench]'
	touch $@

setup: $(VENV)/.runtime-installed
setup-dev: $(VENV)/.dev-installed
setup-bench: $(VENV)/.bench-installed

# System tools the tests drive (promtool, hey, ...): installed when missing, see the script.
tools:
	bash tools/ensure-tools.sh

# Address and port from STEADY_HOST / STEADY_PORT (default 127.0.0.1:8000), like every other
# setting: make variables HOST/PORT would also pick up a shell's unrelated PORT.
serve: setup
	HF_HUB_OFFLINE=1 $(BIN)/steadyserve serve

lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup-dev
	$(BIN)/mypy --strict app

pytest: setup-dev tools
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -ra --durations=40

test: lint typecheck pytest

bench: setup-bench
	bash tools/ensure-tools.sh --bench
	HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest.bench
	HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest.overhead
	HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest.overload_bench
	HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest.frontend_cost
	HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest.frontend_cost --path /v1/embeddings
	HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest.batch_bench --lines $(BATCH_BENCH_LINES)
	HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest.generation_bench
	HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest.prefix_reuse_bench
	HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest.v2_bench

check-config: setup
	$(BIN)/steadyserve check-config

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

FORCE:
