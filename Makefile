# The two commands of the README, and the checks CI runs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: up test check host install

## Bring Orchard up on this machine's container engine and run something in a sandbox.
up: host install
	$(BIN)/orchard up --target local
	$(BIN)/orchard sandbox exec "$$($(BIN)/orchard sandbox create --label demo=readme)" -- \
		sh -c 'echo "hello from $$(hostname) on $$(. /etc/os-release; echo $$PRETTY_NAME)"; git --version'

## Run the whole test suite (lint, types, import contracts, all test tiers).
test: host install check
	$(BIN)/pytest -q -ra

check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

host:
	bash scripts/setup-host.sh

install: $(BIN)/orchard

$(BIN)/orchard: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,azure]'
	touch $@
