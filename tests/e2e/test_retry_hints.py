"""End to end: the real openai client, with its default retries, behind long generations.

Issue 30: after many short requests a pool's median hold is ~50 ms, and a request refused
behind 2 s generations was told ``retry-after-ms: 50``: with openai-python's default 2
retries, 4 of 6 concurrent calls on 2 slots failed. Here the pool (2 slots, no wait
queue) first serves 20 short chats and 2 generations of 4 s (its median hold: a chat's);
then 2 new generations hold both slots while 4 calls come in through the real Envoy
(deploy/envoy.yaml) and kvgate. Each is refused, told when a generation is expected to end
(spread upward), and gets in on one of its retries: every call succeeds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kvgate_testkit.stack import Stack

pytestmark = pytest.mark.e2e

CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 2, "context_window": 4096, "default_max_tokens": 64,
                          "tokenizer": "cl100k_base"}},
    "tenants": {"default_class": "standard", "classes": {"standard": {"max_wait_s": 0}}},
    "server": {"drain_s": 0, "grace_s": 1},
}
MESSAGES = [{"role": "user", "content": "Say hello"}]
# A generation of 4 s (20 chunks, 200 ms apart): long enough that both still hold their slots
# when the calls arrive on a loaded machine.
LONG_TOKENS, LONG_DELAY_MS = 20, 200
SHORTS = 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("retry-hints"), CONFIG)
    s.start()
    yield s
    s.stop()


def client(stack: Stack, hints: list[tuple[int, str | None]] | None = None) -> openai.OpenAI:
    """client is the openai client with its default retries; ``hints`` collects each answer's
    (status, retry-after-ms)."""
    http = None
    if hints is not None:
        def record(response: Any) -> None:
            hints.append((response.status_code, response.headers.get("retry-after-ms")))
        http = openai.DefaultHttpxClient(event_hooks={"response": [record]})
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", timeout=30, http_client=http)


def generate(stack: Stack) -> None:
    """generate streams one 4 s generation to its end."""
    chunks = list(openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0).chat.completions.create(
        model="fake", messages=MESSAGES, stream=True, max_tokens=LONG_TOKENS,
        extra_headers={"x-fake-delay-ms": str(LONG_DELAY_MS)}))
    assert len(chunks) >= LONG_TOKENS


def test_calls_behind_long_generations_succeed_with_the_clients_default_retries(stack: Stack) -> None:
    assert client(stack).max_retries == 2              # openai-python's default
    once = client(stack)   # retried like any client: a loaded machine may answer one 503
    for _ in range(SHORTS):                            # the median hold: a chat's, a few ms
        once.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=3)
    history = [threading.Thread(target=generate, args=(stack,)) for _ in range(2)]
    for t in history:
        t.start()
    for t in history:
        t.join()
    stack.wait_inflight(0)

    refused = stack.metric("kvgate_requests_total", outcome="rejected_concurrency")
    longs = [threading.Thread(target=generate, args=(stack,)) for _ in range(2)]
    for t in longs:
        t.start()
    stack.wait_inflight(2)                             # both slots held for ~4 s
    hints: list[tuple[int, str | None]] = []
    results: list[object] = []

    def call() -> None:
        try:
            reply = client(stack, hints).chat.completions.create(
                model="fake", messages=MESSAGES, max_tokens=3)
            results.append(reply.usage.completion_tokens if reply.usage else None)
        except openai.APIError as err:
            results.append(err)
    t0 = time.monotonic()
    calls = [threading.Thread(target=call) for _ in range(4)]
    for t in calls:
        t.start()
    for t in calls + longs:
        t.join()
    took = time.monotonic() - t0

    assert results == [3, 3, 3, 3], (results, hints)
    # Each call was refused first (the slots were held), then got in on a retry.
    assert stack.metric("kvgate_requests_total", outcome="rejected_concurrency") - refused >= 4
    # Each was told about when a generation ends (~4 s, spread), not the median's 50 ms.
    told = [int(ms) for status, ms in hints if status == 429 and ms is not None]
    assert sum(ms >= 1000 for ms in told) >= 4, hints
    assert took < 12.0, (took, hints)
    stack.wait_inflight(0)
