"""Replicas learn completion lengths together through the Redis store (``redis_lengths``):
what one replica's requests completed reaches every replica's growth rule, against a real
Redis-protocol server at fixed instants."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import redis as redis_sync

from extproc.admission import Admission, Demand, Lease, Outcome
from extproc.admission.lengths import LENGTH_SAMPLES
from extproc.admission.store.redis import RedisStore
from extproc.admission.store.redis_lengths import READ_EVERY
from extproc.admission.types import NodeReport
from extproc.clock import ManualClock
from extproc.configparse import parse_config
from kvgate_testkit.redis_server import RedisServer
from tests.unit.admission.test_shared_nodes import CAP, T0, cfg

pytestmark = pytest.mark.redis


async def refreshed(store: RedisStore, rounds: int = READ_EVERY + 1) -> None:
    """refreshed runs ``rounds`` refreshes: enough for one to read the classes and a later one
    their lists."""
    for _ in range(rounds):
        assert await store.refresh()


@contextlib.asynccontextmanager
async def two_stores(url: str, **kw: float) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """two_stores is two replicas' stores on the Redis at ``url``, one key prefix, both
    knowing the pool ``default``; closed on leaving."""
    clock = ManualClock(T0)
    shared = cfg(url, **kw)
    a, b = RedisStore(shared, clock=clock), RedisStore(shared, clock=clock)
    try:
        for s in (a, b):
            s.know_pools(["default"])
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_what_one_replica_learned_reaches_the_other(redis_server):
    async with two_stores(redis_server.url) as (a, b):
        for n in range(1, 31):
            a.teach("default", "standard", n)
        await a.refresh()
        assert a.learned("default") is None  # its read came with its push: no list yet
        await refreshed(b)
        assert b.learned("default") == {"standard": list(range(1, 31))}  # each pushed once
        assert b.learned("default") is None  # asked once: nothing new since
        # the list keeps the latest LENGTH_SAMPLES, and b's own lengths join a's
        for n in range(LENGTH_SAMPLES):
            b.teach("default", "standard", 1000 + n)
        await refreshed(b)
        got = b.learned("default")
        assert got is not None and list(got["standard"]) == [1000 + n for n in range(LENGTH_SAMPLES)]


async def test_lengths_taught_while_redis_is_away_wait_for_it():
    with RedisServer() as own_server:  # paused here: not the module's server
        async with two_stores(own_server.url, timeout_s=0.5, recover_s=0.0) as (a, b):
            own_server.pause()
            try:
                for n in range(5):
                    a.teach("default", "batch", 7 + n)
                assert not await a.refresh()  # Redis does not answer: the lengths stay pending
            finally:
                own_server.resume()
            assert await a.probe()  # back: its first round trip pushes what waited
            await refreshed(a, 1)
            await refreshed(b)
            assert b.learned("default") == {"batch": [7, 8, 9, 10, 11]}


def learned_picking_config() -> object:
    return parse_config({"pools": {"default": {
        "max_concurrency": 1000,
        "backends": [{"name": "n0", "metrics_url": "http://127.0.0.1:9/n0", "address": "127.0.0.1:8001",
                      "kv_capacity_tokens": CAP}],
        "picking": {"growth": "learned", "min_samples": 20, "quantile": 0.9, "reserve_fraction": 0.0}}}})


def want(prompt: int, max_tokens: int) -> Demand:
    return Demand(pool="default", tenant="t", class_name="standard", prompt_tokens=prompt,
                  reserved_completion=max_tokens)


async def test_a_replica_expects_the_growth_another_replicas_requests_taught(redis_server):
    """a's 25 requests complete with 100-124 tokens; b, which completed none, expects its own
    request to use its whole reservation until its next scrape round reads what a taught:
    then its hold on the node is the prompt and the 0.9 quantile of a's lengths."""
    clock = ManualClock(T0)
    shared = cfg(redis_server.url)
    stores = [RedisStore(shared, clock=clock) for _ in range(2)]
    a, b = (Admission(learned_picking_config(), clock, s) for s in stores)
    try:
        for adm in (a, b):
            adm.report_node("default", "n0", NodeReport(kv_usage=0.0, capacity_tokens=CAP, at=T0))
        for n in range(25):
            got = await a.acquire(want(10, 1000))
            assert isinstance(got, Lease)
            got.release(Outcome.COMPLETED, 100 + n)
        await stores[0].flush()
        held = await b.acquire(want(2000, 1000))
        assert isinstance(held, Lease)
        (node,) = b.nodes("default")
        assert node.held_tokens == 3000  # nothing learned by b: the whole reservation
        await refreshed(stores[0], 1)
        await refreshed(stores[1])
        b.mark_nodes(1)
        (node,) = b.nodes("default")
        assert node.held_tokens == 2000 + 122  # the 0.9 quantile of 100..124: the 23rd of 25
        held.release(Outcome.COMPLETED, 5)
    finally:
        for adm in (a, b):
            await adm.close()


async def test_lists_written_by_something_else_leave_the_store_shared(redis_server, caplog):
    """Hostile or broken values in Redis: entries that are no lengths are passed over, and a
    key of another type makes Redis refuse the lengths' round trip: one warning, the store
    stays shared and its replicas keep what they adopted before."""
    r = redis_sync.Redis.from_url(redis_server.url)
    async with two_stores(redis_server.url) as (a, b):
        base = f"{a.config.key_prefix}{{default}}:"
        r.sadd(base + "lc", "standard", "batch")
        r.rpush(base + "ln:standard", "12", "x", "-4", "1e9", "30")
        r.set(base + "ln:batch", "not a list")
        await refreshed(b)
        assert b.mode == "shared"
        assert "refused the shared completion lengths" in caplog.text
        r.delete(base + "ln:batch")
        await refreshed(b)
        assert b.learned("default") == {"standard": [12, 30]}  # an empty list adopts nothing
        assert b.mode == "shared"
