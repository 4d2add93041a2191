# The two commands of the README, and the checks CI runs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: up test check host install cluster cluster-down k8s-bins

## Bring Orchard up on this machine's container engine and run something in a sandbox.
up: host install
	$(BIN)/orchard up --target local
	$(BIN)/orchard sandbox exec "$$($(BIN)/orchard sandbox create --label demo=readme)" -- \
		sh -c 'echo "hello from $$(hostname) on $$(. /etc/os-release; echo $$PRETTY_NAME)"; git --version'

## Run the whole test suite (lint, types, import contracts, all test tiers). The kube_real
## tier needs the cluster's binaries (built once, cached outside the checkout) and starts the
## local cluster, with its real node, itself.
test: host install check
	bash scripts/k8s/ensure-bins.sh all
	ORCHARD_KUBE_REAL=require $(BIN)/pytest -q -ra

check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

host:
	bash scripts/setup-host.sh

## A real local Kubernetes cluster (control plane and one node) in its own network namespace
## (scripts/k8s/up.sh); the last line printed is `export KUBECONFIG=...`. `make cluster-down`
## removes it.
cluster:
	bash scripts/k8s/up.sh

cluster-down:
	bash scripts/k8s/down.sh

## Build (or find cached) the cluster's binaries from tools/k8s and tools/etcd.
k8s-bins:
	bash scripts/k8s/ensure-bins.sh all

install: $(BIN)/orchard

$(BIN)/orchard: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,azure]'
	touch $@
