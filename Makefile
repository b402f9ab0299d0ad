# The two commands: `make demo` (the CPU demo) and `make test` (lint + the whole test suite).
# Both create .venv with python3 -m venv + pip when it is missing and install the project into it,
# at the versions constraints.txt pins.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.simloop-installed
BASE_STAMP := $(VENV)/.simloop-runtime-installed
# The exact versions of the runtime dependencies, shared with the Dockerfile (one lock for the CPU
# machines and the TPU image; docs/tpu-gke.md, "The image"). `make constraints` regenerates it.
CONSTRAINTS := constraints.txt

.PHONY: test demo lint format bench clean-venv browser constraints

# Python writes the bytecode of what it imports to __pycache__ (ignored by git) even where the
# environment says not to (PYTHONDONTWRITEBYTECODE=1, as on some CI images): the suite starts
# hundreds of Python processes, and without cached bytecode each one compiles every module it
# imports from source again, and each pytest worker re-does the assertion rewrite of every test
# file (collection took 17 s instead of 10 s, per worker).
unexport PYTHONDONTWRITEBYTECODE

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# `--no-compile`: pip does not compile every installed file ahead of time (torch's and
# transformers' thousands, most never imported here); Python compiles and caches each module
# when a process first imports it. A fresh install took 40 s instead of 75 s (2026-12-06).
# Reinstall whenever the packaging or the pins change. torch is pinned in the `test` extra to the
# CPU build that the machine provides; it is only a test reference (HF parity), never a runtime
# dependency, and the constraints leave test-only packages to the extra's ranges.
$(STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP) $(BASE_STAMP)

# The demo needs only the runtime dependencies (no torch / transformers test references).
$(BASE_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -c $(CONSTRAINTS) -e .
	touch $(BASE_STAMP)

# Rewrites $(CONSTRAINTS) from this venv (the CPU side) and a Python 3.12 resolution of the
# `[tpu]` extra (the image's side), which uv does: pip resolves only for the Python it runs on.
# For newer releases, first `$(BIN)/python -m pip install -U -e '.[test]'` (no constraints).
# VLLM_TPU=X moves the image's vllm-tpu. Order-only: a venv just upgraded is read as it is.
constraints: | $(BASE_STAMP)
	$(BIN)/python -m pip install -q uv
	$(BIN)/python dev/constraints.py --uv $(BIN)/uv $(if $(VLLM_TPU),--vllm-tpu $(VLLM_TPU))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The demo test renders report.html in headless Chromium (Debian's `chromium`). It is installed
# here when missing on a Debian/Ubuntu machine with root; elsewhere that one test skips.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the report test ..."; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium >/dev/null; } \
	    || echo "chromium install failed: the report's browser test will skip"; \
	  else echo "no chromium, and no root apt-get to install it: the browser test will skip"; fi; }

# Two pytest workers (pytest-xdist), each test file on one of them (its module fixtures built
# once): on 2 cores the suite is half compile and process start-up, which one worker leaves
# the second core idle for. Files are handed out in tests/conftest.py's order, longest first
# (xdist would otherwise hand out the files with the most tests first, and start the
# minutes-long single-test files last, with the other worker idle at the end).
# `make test TEST_WORKERS=0` runs it in this process.
TEST_WORKERS ?= 2

# Debian's chromium installs (when missing: ~10 s of apt on a fresh machine) while pip fills the
# venv and the linters run; pytest starts once both are done.
test:
	@$(MAKE) --no-print-directory browser & browser=$$!; \
	$(MAKE) --no-print-directory lint; lint=$$?; wait $$browser; exit $$lint
	$(BIN)/python -m pytest -q --durations=20 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

demo: $(BASE_STAMP)
	$(BIN)/simloop demo --config configs/demo_cpu.yaml --out runs/demo

bench: $(STAMP)
	$(BIN)/python bench/model_forward.py

clean-venv:
	rm -rf $(VENV)
