# Two commands set everything up: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
HOST   ?= 0.0.0.0
PORT   ?= 8000

.PHONY: install serve test test-fast lint format bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

## Start the server on the default model (resnet50) at http://$(HOST):$(PORT)
serve: $(STAMP)
	$(BIN)/python -m uvicorn app.main:app --host $(HOST) --port $(PORT)

## Run the whole test suite
test: $(STAMP)
	$(BIN)/python -m pytest -q

## Skip the slow and end-to-end tests
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not e2e"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
