# Two commands set everything up: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
HOST   ?= 0.0.0.0
PORT   ?= 8000

.PHONY: install serve serve-workers test test-fast lint format docs bench gpu-check gpu-wheels clean \
	image image-test

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

## Start the server at http://$(HOST):$(PORT): resnet50 pretrained, or offline the embedded EfficientNet-Lite0
serve: $(STAMP)
	@# A first try with right answers: MODEL=auto unless MODEL or WEIGHTS is set in the
	@# environment or .env; a MODEL set alone gets WEIGHTS=auto (random weights, said loudly,
	@# when its pretrained ones cannot be had).
	@set_in() { [ -n "$$(printenv BATCHSERVE_$$1)" ] || grep -qs "^BATCHSERVE_$$1=" .env; }; \
	if ! set_in MODEL && ! set_in WEIGHTS; then export BATCHSERVE_MODEL=auto; \
	elif ! set_in WEIGHTS; then export BATCHSERVE_WEIGHTS=auto; fi; \
	exec $(BIN)/python -m uvicorn app.main:app --host $(HOST) --port $(PORT)

## One worker per device (or per share of the CPUs) on ports 8000, 8001, ... (gRPC 9000, 9001, ...) under supervisord
WORKERS ?= 2
serve-workers: $(STAMP)
	mkdir -p .run
	BATCHSERVE_WORKERS=$(WORKERS) BATCHSERVE_RUN_DIR=$(CURDIR)/.run \
	BATCHSERVE_PYTHON=$(CURDIR)/$(BIN)/python BATCHSERVE_HOST=$(HOST) \
	$(BIN)/supervisord -c deploy/host/supervisord.conf

## Build the documentation strictly (a broken link or a missing page fails), then run the whole test suite
test: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(VENV)/site
	$(BIN)/python -m pytest -q

## The CPU container image (with a base built from Debian's packages where no registry answers)
IMAGE ?= batchserve:cpu
image:
	deploy/docker/build-image.sh $(IMAGE)

## Build the image, then run it as users will (tests/test_image.py): size and cold start reported
image-test: image $(STAMP)
	BATCHSERVE_IMAGE=$(IMAGE) BATCHSERVE_IMAGE_REPORT=$(CURDIR)/$(VENV)/image-report.txt \
		$(BIN)/python -m pytest -q tests/test_image.py
	@cat $(VENV)/image-report.txt

## Serve the documentation at http://127.0.0.1:$(DOCS_PORT), rebuilt as its pages change
DOCS_PORT ?= 8080
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:$(DOCS_PORT)

## Skip the slow and end-to-end tests
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not e2e"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e ".[dev,bench]"
	touch $(BENCH_STAMP)

## A short run of the whole benchmark suite (a few minutes); writes benchmarks/results/bench-*
bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.batcher_overhead --requests 20000 --runs 2 --no-write
	$(BIN)/python -m benchmarks.offline --model resnet18 --precision fp32 --batch-sizes 1 8 \
		--seconds 2 --runs 1 --name bench-offline
	$(BIN)/python -m benchmarks.compare --model resnet18 --batch-size 8 --rounds 1 --duration 6 \
		--name bench-compare
	$(BIN)/python -m benchmarks.sweep --model resnet18 --rates 20 50 --rounds 1 \
		--configs "batching off:max_batch_size=1" "batch 8:max_batch_size=8" \
		--duration 5 --warmup 2 --name bench-sweep
	$(BIN)/python -m benchmarks.profile --model resnet18 --batches 4 --requests 15 \
		--name bench-profile
	$(BIN)/python -m benchmarks.accuracy --model resnet18 --count 64 --name bench-accuracy

## The one-call GPU check (degraded, and quick, without CUDA); writes benchmarks/results/gpu_check.*
gpu-check: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_check

## Wheels for the GPU machine's image, into .whl/ (see the README)
gpu-wheels: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_wheels

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
