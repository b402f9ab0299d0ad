# The two commands: `make demo` (the CPU demo) and `make test` (lint + the whole test suite).
# Both create .venv with python3 -m venv + pip when it is missing and install the project into it.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.simloop-installed

.PHONY: test demo lint format bench clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall whenever the packaging changes. torch is pinned in the `test` extra to the CPU build
# that the machine provides; it is only a test reference (HF parity), never a runtime dependency.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/simloop demo --config configs/demo_cpu.yaml --out runs/demo

bench: $(STAMP)
	$(BIN)/python bench/model_forward.py

clean-venv:
	rm -rf $(VENV)
