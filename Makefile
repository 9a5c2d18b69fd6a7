# torchrig developer targets. Every target creates and reuses .venv; CI (.ci/run) calls `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TOOLS_STAMP := $(VENV)/.tools
PYTEST_ARGS ?=

.PHONY: help venv tools demo test test-fast soak lint format typecheck manifests docs bench clean images

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

venv: $(STAMP) ## Create .venv and install torchrig with its dev extras (pinned by constraints.txt)

$(TOOLS_STAMP): $(STAMP) scripts/install-tools.sh
	bash scripts/install-tools.sh $(VENV)
	touch $@

tools: $(TOOLS_STAMP) ## Install helm/kubectl into .venv/bin and Prometheus (Debian package)

images: $(STAMP) $(TOOLS_STAMP) ## Build images/cpu with podman (Debian base, local torch wheel); images/worker where its base can be pulled
	$(PY) scripts/build_images.py

demo: $(STAMP) ## Run the digits example locally: 2 ranks on CPU, checkpoints, metrics on 127.0.0.1
	$(VENV)/bin/torchrig run examples/digits-ddp.yaml

test: $(STAMP) $(TOOLS_STAMP) ## Run the whole suite (slow tests included), then lint and type-check
	bash scripts/run-tests.sh $(VENV) $(PYTEST_ARGS)

soak: $(STAMP) $(TOOLS_STAMP) ## Long soaks left out of `make test` (e.g. 20 recoveries in a row in one job)
	RAY_USAGE_STATS_ENABLED=0 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pytest -q -m soak

test-fast: $(STAMP) ## Unit tests only, no slow ones
	$(VENV)/bin/pytest -q -m 'not slow' tests/unit $(PYTEST_ARGS)

lint: $(STAMP) ## ruff (lint + format check) and mypy (strict)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP) ## Apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

manifests: $(STAMP) ## Re-render manifests/ from examples/ and docs/spec.md from the model
	$(PY) -m orchestrator.gen

bench: $(STAMP) $(TOOLS_STAMP) ## Benchmarks; results in bench/results/
	$(PY) -m bench

clean: ## Remove the venv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
