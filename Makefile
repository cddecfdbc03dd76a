# kvgate: `make run` starts the local stack (simulator + kvgate + Envoy); `make test` runs every test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-unit test-e2e bench bench-admission bench-overhead bench-protection bench-redis bench-scrape bench-tokens bench-loop-lag check-config clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,hf,fast]' --config-settings editable_mode=compat
	touch $(STAMP)

run: install
	$(PY) -m extproc.localstack

test: install
	$(PY) -m pytest -q

test-unit: install
	$(PY) -m pytest -q tests/unit

test-e2e: install
	$(PY) -m pytest -q tests/e2e

check-config: install
	$(PY) -m extproc check-config deploy/kvgate.yaml

bench-admission: install
	$(PY) bench/bench_admission.py

bench-overhead: install
	$(PY) bench/bench_overhead.py

bench-protection: install
	$(PY) bench/bench_protection.py

bench-redis: install
	$(PY) bench/bench_redis.py

bench-scrape: install
	$(PY) bench/bench_scrape.py

bench-tokens: install
	$(PY) bench/bench_tokens.py

bench-loop-lag: install
	$(PY) bench/bench_loop_lag.py

bench: bench-admission bench-scrape bench-tokens bench-overhead bench-protection bench-redis

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
