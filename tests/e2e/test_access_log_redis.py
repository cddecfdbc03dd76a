"""End to end: the access-log release (deploy/envoy-access-log.yaml) with the shared Redis
store. A parked request's lease is held in Redis while its stream runs, with no ext_proc
stream open in kvgate, and the log entry's release settles it there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.options import MESSAGES, no_leak, wait_released  # noqa: F401
from tests.e2e.stack import Stack, openai_client, released
from tests.e2e.test_replicas import PREFIX, held_in_redis
from tests.support.procs import ROOT, wait_until
from tests.support.redis_server import RedisServer

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
    before = released(stack, "completed")
    s = openai_client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, stream=True, max_tokens=3,
        extra_headers={"x-fake-hold": "redis"})
    assert next(iter(s)).choices[0].delta.content == "tok0 "
    wait_until(lambda: stack.metric("kvgate_streams_active") == 0, timeout=15,
               what="kvgate's ext_proc stream closed")
    slots, kv = held_in_redis(redis_srv)
    assert slots == 1 and kv > 0
    stack.upstream_post("/_fake/release/redis")
    assert "".join(c.choices[0].delta.content or "" for c in s) == "tok1 tok2 "
    wait_released(stack, "completed", before + 1)
    wait_until(lambda: held_in_redis(redis_srv) == (0, 0), timeout=15, what="Redis holding nothing")
