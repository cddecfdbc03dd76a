"""End to end: the access-log release (deploy/envoy-access-log.yaml) with the shared Redis
store. A parked request's lease is held in Redis while its stream runs, with no ext_proc
stream open in kvgate, and the log entry's release settles it there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import http.client
import json

import pytest

from tests.e2e.options import MESSAGES, no_leak, wait_released  # noqa: F401
from kvgate_testkit.stack import Stack, released
from tests.e2e.test_replicas import PREFIX, held_in_redis
from kvgate_testkit.procs import LOOPBACK, ROOT, wait_until
from kvgate_testkit.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def stack(redis_srv: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config: dict[str, Any] = {
        "pools": {"default": {"max_concurrency": 4, "context_window": 4096, "default_max_tokens": 64,
                              "tokenizer": "cl100k_base"}},
        "store": {"redis": {"url": redis_srv.url, "key_prefix": PREFIX, "timeout_s": 0.5}},
        "server": {"drain_s": 0, "grace_s": 1},
    }
    s = Stack(tmp_path_factory.mktemp("access-log-redis"), config,
              envoy_template=ROOT / "deploy" / "envoy-access-log.yaml")
    s.start()
    yield s
    s.stop()


def test_a_parked_lease_lives_in_redis_until_its_log_entry(stack: Stack, redis_srv: RedisServer) -> None:
    """Read to the end of the body: openai-python closes on [DONE], and when that comes before
    the upstream's end of body, Envoy's entry reads as cut short (a disconnect; kvgate sees no
    body in this file to tell better)."""
    before = released(stack, "completed")
    body = {"model": "fake", "messages": MESSAGES, "stream": True, "max_tokens": 3}
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy_port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json", "x-fake-hold": "redis"})
        resp = conn.getresponse()
        assert b"tok0 " in resp.read1()
        wait_until(lambda: stack.metric("kvgate_streams_active") == 0, timeout=15,
                   what="kvgate's ext_proc stream closed")
        slots, kv = held_in_redis(redis_srv)
        assert slots == 1 and kv > 0
        stack.upstream_post("/_fake/release/redis")
        rest = resp.read()  # to the end of the body
    finally:
        conn.close()
    assert b"tok1 " in rest and b"tok2 " in rest and rest.rstrip().endswith(b"data: [DONE]")
    wait_released(stack, "completed", before + 1)
    wait_until(lambda: held_in_redis(redis_srv) == (0, 0), timeout=15, what="Redis holding nothing")
