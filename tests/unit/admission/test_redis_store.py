"""The Redis store against a real redis-server: the same rule as the in-memory store,
shared between replicas, leases that outlive no replica, and loud degradation.

Instants come from manual clocks (the store's injected-clock mode) except where Redis
``TIME`` itself is under test; an outage is a real server stopped, paused (SIGSTOP) or
restarted empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from collections.abc import AsyncIterator, Iterator

import pytest
import redis as redis_sync
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.admission import Admission, Demand, Lease, Outcome, Rejection
from extproc.admission.kvbudget import effective_kv_budget, kv_ceilings
from extproc.admission.slots import effective_guarantees, effective_limit
from extproc.admission.types import Budget, BucketSpec, Grant, Plan, PoolLimits, Refusal
from extproc.admission.store.memory import MemoryStore
from extproc.admission.store.fallback import (LOCAL_PREFIX, MODE_FAIL_CLOSED, MODE_LOCAL_SHARE, MODE_SHARED,
                                              StoreUnavailableError, Within, local_within)
from extproc.admission.store.redis import BEAT_S, PRESENCE_BEATS, RedisStore, beats
from extproc.admission.store.redis_commands import admit_cmd
from extproc.clock import ManualClock
from extproc.config import RedisStoreConfig
from extproc.configparse import parse_config
from kvgate_testkit.redis_server import RedisServer
from tests.unit.admission.helpers import Recorder

pytestmark = pytest.mark.redis

T0 = 1000.0
GUARANTEES = {"gold": 2, "batch": 1}
WATERMARKS = {"batch": 0.55}
TENANT_A = BucketSpec("tenant:a", 3000.0, 50.0, 3000.0)


def limits(scale: float = 1.0, base: int = 6, pool: str = "p", kv: int | None = 8000,
           tpm: float | None = 6000.0, guarantees: dict[str, int] | None = None,
           watermarks: dict[str, float] | None = None) -> PoolLimits:
    """limits builds a pool's limits at ``scale`` the way the controller does."""
    limit = effective_limit(base, scale)
    bucket = None if tpm is None else BucketSpec("pool", tpm * scale, tpm * scale / 60.0, tpm)
    kv_budget = effective_kv_budget(kv, scale)
    return PoolLimits(pool=pool, scale=scale, limit=limit, base_limit=base,
                      guarantees=effective_guarantees(GUARANTEES if guarantees is None else guarantees,
                                                      scale, limit),
                      kv_budget=kv_budget, base_kv_budget=kv,
                      kv_ceilings=kv_ceilings(WATERMARKS if watermarks is None else watermarks, kv_budget, kv),
                      bucket=bucket, retry_estimate_s=1.0)


def plan(tokens: int, lim: PoolLimits | None = None, class_name: str = "standard",
         tenant: str = "a", bucket: BucketSpec | None = None) -> Plan:
    return Plan(lim or limits(guarantees={}), tenant, class_name, tokens, bucket)


RECOVER_S = 0.5
"""RECOVER_S is the hysteresis these tests set (``store.redis.recover_s``; its default is 0):
the return to shared mode is under test here as a wait."""


def cfg(url: str, prefix: str | None = None, **kw) -> RedisStoreConfig:
    """cfg is a store config under a fresh key prefix; the timeout is 2 s unless a test
    says otherwise, so that a busy machine does not turn a rule test into an outage;
    the return to shared mode waits RECOVER_S."""
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("recover_s", RECOVER_S)
    return RedisStoreConfig(url=url, key_prefix=prefix or f"t{secrets.token_hex(6)}:", **kw)


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """own_server is a Redis server this test alone may stop, pause or restart."""
    with RedisServer() as server:
        yield server


@pytest.fixture
async def stores(redis_server: RedisServer) -> AsyncIterator[list[RedisStore]]:
    """stores collects the stores a test opens and closes them afterwards."""
    opened: list[RedisStore] = []
    yield opened
    for s in opened:
        await s.close()


def open_store(opened: list[RedisStore], config: RedisStoreConfig, clock: ManualClock | None,
               **kw) -> RedisStore:
    s = RedisStore(config, clock=clock, **kw)
    opened.append(s)
    return s


# --- the same rule as the in-memory store ---------------------------------------------

SCALES = (1.0, 0.8, 0.6, 0.35)
OPS = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(("standard", "gold", "batch")),
              st.sampled_from((0, 1, 100, 700, 1500, 2500, 3100, 6100, 9000)) | st.integers(0, 3000),
              st.sampled_from(SCALES), st.booleans()),
    st.tuples(st.just("settle"), st.integers(0, 63), st.integers(0, 4000)),
    st.tuples(st.just("advance"), st.sampled_from((0.0, 0.01, 0.5, 1.0, 7.25, 30.0, 61.0))),
), min_size=1, max_size=40)


def same_decision(a: Grant | Refusal, b: Grant | Refusal) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, Grant):
        assert a.inflight == b.inflight
        for x, y in ((a.bucket_tokens, b.bucket_tokens), (a.bucket_capacity, b.bucket_capacity),
                     (a.bucket_rate, b.bucket_rate)):
            assert (x is None) == (y is None) and (x is None or x == pytest.approx(y, rel=1e-9, abs=1e-6))
    else:
        assert (a.budget, a.retryable) == (b.budget, b.retryable), (a, b)
        assert (a.retry_after_s, a.needed, a.used, a.limit) == pytest.approx(
            (b.retry_after_s, b.needed, b.used, b.limit), rel=1e-9, abs=1e-6)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_redis_decides_like_memory(redis_server: RedisServer, ops: list[tuple]) -> None:
    """Any sequence of admissions, settles and clock moves gets the same answers from both stores."""

    async def run() -> None:
        clock = ManualClock(T0)
        # Leases outlive the test (the in-memory store has none): the rule is under test here.
        rs = RedisStore(cfg(redis_server.url, timeout_s=2.0, lease_ttl_s=3600.0), clock=clock)
        ms = MemoryStore()
        live: list[tuple[Grant, Grant]] = []
        try:
            for op in ops:
                now = clock.now()
                if op[0] == "admit":
                    _, cls, tokens, scale, with_tenant = op
                    p = Plan(limits(scale), "a", cls, tokens, TENANT_A if with_tenant else None)
                    got, want = await rs.admit(p, now), ms.admit_now(p, now)
                    same_decision(got, want)
                    if isinstance(got, Grant):
                        live.append((got, want))
                elif op[0] == "settle" and live:
                    g, m = live.pop(op[1] % len(live))
                    rs.settle(g, op[2], now)
                    ms.settle(m, op[2], now)
                elif op[0] == "advance":
                    clock.advance(op[1])
                await rs.flush()
                now = clock.now()
                u, w = rs.usage("p", now), ms.usage("p", now)
                assert (u.inflight, u.kv_inflight) == (w.inflight, w.kv_inflight)
                assert {k: v for k, v in u.by_class.items() if v} == {k: v for k, v in w.by_class.items() if v}
                assert (u.bucket_tokens is None) == (w.bucket_tokens is None)
                if u.bucket_tokens is not None:
                    assert u.bucket_tokens == pytest.approx(w.bucket_tokens, rel=1e-9, abs=1e-6)
        finally:
            await rs.close()

    asyncio.run(run())


async def test_a_plan_above_the_shrunken_bucket_waits_at_least_for_the_refill(stores, redis_server):
    """Above the scaled capacity the exact wait does not exist; both stores give the refill's lower bound."""
    clock = ManualClock(T0)
    rs = open_store(stores, cfg(redis_server.url), clock)
    ms = MemoryStore()
    p = plan(3100, limits(0.35, kv=None, guarantees={}))  # capacity 2100 at 35 tokens/s
    got, want = await rs.admit(p, T0), ms.admit_now(p, T0)
    same_decision(got, want)
    assert isinstance(got, Refusal) and got.budget is Budget.POOL_TPM and got.retryable
    assert got.retry_after_s == pytest.approx(1000 / 35)


async def test_a_settle_shows_in_usage_at_once_and_in_redis_after_flush(stores, redis_server):
    clock = ManualClock(T0)
    rs = open_store(stores, cfg(redis_server.url), clock)
    g = await rs.admit(plan(1000, bucket=TENANT_A), T0)
    assert isinstance(g, Grant)
    rs.settle(g, 400, T0)
    u = rs.usage("p", T0)
    assert (u.inflight, u.kv_inflight, u.bucket_tokens) == (0, 0, 5600)
    assert rs.pending_settles == 1
    await rs.flush()
    assert rs.pending_settles == 0
    other = open_store(stores, rs.config, clock)  # another replica reads Redis itself
    await other.refresh()
    await other.admit(plan(0), T0)  # learns the pool's state through a round trip
    assert other.usage("p", T0).bucket_tokens == 5600 and other.usage("p", T0).inflight == 1


async def test_a_double_or_foreign_settle_changes_nothing(stores, redis_server):
    rs = open_store(stores, cfg(redis_server.url), ManualClock(T0))
    other = open_store(stores, rs.config, ManualClock(T0))
    g = await rs.admit(plan(500), T0)
    rs.settle(g, 100, T0)
    rs.settle(g, 0, T0)        # a second settle: ignored
    other.settle(g, 0, T0)     # a replica that did not grant it: ignored
    await rs.flush()
    await other.flush()
    assert rs.usage("p", T0).bucket_tokens == 5900  # refunded 400 once
    assert rs.usage("p", T0).inflight == 0


# --- shared between replicas -----------------------------------------------------------

async def test_the_concurrency_limit_holds_across_replicas(stores, redis_server):
    clock = ManualClock(T0)
    config = cfg(redis_server.url)
    replicas = [open_store(stores, config, clock) for _ in range(3)]
    lim = limits(base=5, kv=None, tpm=None, guarantees={})
    results = await asyncio.gather(*(replicas[i % 3].admit(plan(10, lim), T0) for i in range(12)))
    grants = [r for r in results if isinstance(r, Grant)]
    refusals = [r for r in results if isinstance(r, Refusal)]
    assert len(grants) == 5 and len(set(g.id for g in grants)) == 5
    assert all(r.budget is Budget.SLOTS for r in refusals) and len(refusals) == 7


async def test_replicas_count_each_other_by_heartbeat(stores, redis_server):
    config = cfg(redis_server.url)
    a, b = open_store(stores, config, None), open_store(stores, config, None)
    await a.start()
    await b.start()
    await a.refresh()
    assert (a.replicas, b.replicas) == (2, 2)
    await b.close()
    await a.refresh()
    assert a.replicas == 1


async def test_a_shorter_refresh_keeps_a_stalled_replicas_heartbeat_as_long(stores, redis_server):
    """refresh_s freshens what the replicas read of each other; it does not declare a
    replica that stalls gone sooner: a heartbeat lives PRESENCE_BEATS of the default
    interval plus the timeout (``beats``), whatever the refresh."""
    clock = ManualClock(T0)
    config = cfg(redis_server.url, refresh_s=0.1)
    fast, stalled = open_store(stores, config, clock), open_store(stores, config, clock)
    assert beats(config) == (0.1, PRESENCE_BEATS * BEAT_S + config.timeout_s)
    await stalled.start()
    await fast.start()
    clock.advance(PRESENCE_BEATS * 0.1 + config.timeout_s + 0.5)  # past three of its own refreshes
    await fast.refresh()
    assert fast.replicas == 2
    clock.advance(PRESENCE_BEATS * BEAT_S - PRESENCE_BEATS * 0.1)  # past the heartbeat's life
    await fast.refresh()
    assert fast.replicas == 1


# --- leases ------------------------------------------------------------------------

async def test_a_dead_replicas_leases_come_back_after_the_ttl(stores, redis_server):
    clock = ManualClock(T0)
    config = cfg(redis_server.url, lease_ttl_s=30.0)
    lim = limits(base=3, kv=3000, tpm=None, guarantees={})
    dead = open_store(stores, config, clock)
    for _ in range(3):
        assert isinstance(await dead.admit(plan(1000, lim), T0), Grant)
    await dead.close()  # it never refreshes nor settles again: a SIGKILL, as Redis sees it
    alive = open_store(stores, config, clock)
    clock.advance(29.9)
    r = await alive.admit(plan(1000, lim), clock.now())
    assert isinstance(r, Refusal) and r.budget is Budget.SLOTS
    clock.advance(0.1)  # lease_ttl_s after the admissions
    g = await alive.admit(plan(1000, lim), clock.now())
    assert isinstance(g, Grant) and g.inflight == 1
    assert alive.usage("p", clock.now()).kv_inflight == 1000


async def test_an_expired_lease_is_never_refunded_and_a_paused_replica_takes_its_own_back(stores, redis_server):
    clock = ManualClock(T0)
    config = cfg(redis_server.url, lease_ttl_s=10.0)
    lim = limits(base=4, kv=None, guarantees={})
    paused = open_store(stores, config, clock)
    g1 = await paused.admit(plan(1000, lim), T0)
    g2 = await paused.admit(plan(1000, lim), T0)
    clock.advance(11)  # the replica stalled past its TTL: another purges its leases
    other = open_store(stores, config, clock)
    seen = await other.admit(plan(0, lim), clock.now())
    assert isinstance(seen, Grant) and seen.inflight == 1
    before = other.usage("p", clock.now()).bucket_tokens
    paused.settle(g1, 0, clock.now())  # expired: no slot to free, no refund
    await paused.flush()
    await other.admit(plan(0, lim), clock.now())
    assert other.usage("p", clock.now()).bucket_tokens == pytest.approx(before)
    assert other.usage("p", clock.now()).inflight == 2
    # g2's stream is still alive: the next refresh takes its slot again, once.
    assert await paused.refresh()
    assert await paused.refresh()
    await other.admit(plan(0, lim), clock.now())
    assert other.usage("p", clock.now()).inflight == 4
    paused.settle(g2, 1000, clock.now())
    await paused.flush()
    await other.admit(plan(0, lim), clock.now())
    assert other.usage("p", clock.now()).inflight == 4  # g2 released, one more admitted


async def test_refresh_keeps_live_leases_past_the_ttl(stores, redis_server):
    clock = ManualClock(T0)
    config = cfg(redis_server.url, lease_ttl_s=10.0)
    lim = limits(base=1, kv=None, tpm=None, guarantees={})
    rs = open_store(stores, config, clock)
    other = open_store(stores, config, clock)
    assert isinstance(await rs.admit(plan(1, lim), T0), Grant)
    for _ in range(5):
        clock.advance(3.3)  # the refresher's period is lease_ttl_s / 3
        assert await rs.refresh()
    assert isinstance(await other.admit(plan(1, lim), clock.now()), Refusal)


async def test_a_restarted_redis_gets_the_live_leases_again_and_no_settled_one(stores, own_server):
    clock = ManualClock(T0)
    rs = open_store(stores, cfg(own_server.url, timeout_s=2.0), clock)
    lim = limits(base=4, kv=10_000, tpm=None, guarantees={})
    grants = [await rs.admit(plan(100, lim), T0) for _ in range(3)]
    own_server.restart()  # empty: no keys, no scripts
    rs.settle(grants[0], 100, T0)
    await rs.flush()     # finds nothing to release (Redis forgot it): no negative counts
    assert await rs.refresh()  # the two live ones are taken again
    u = rs.usage("p", T0)
    assert (u.inflight, u.kv_inflight) == (2, 200)
    assert await rs.refresh()
    assert rs.usage("p", T0).inflight == 2
    for g in grants[1:]:
        rs.settle(g, 100, T0)
    await rs.flush()
    assert await rs.refresh()
    assert (rs.usage("p", T0).inflight, rs.usage("p", T0).kv_inflight) == (0, 0)


async def test_round_trips_still_on_the_wire_cannot_bring_a_settled_lease_back(stores, redis_server):
    """A refresh sent before a settle, or an admission whose answer was lost and then
    cancelled, may reach Redis after the settle: the tombstone stops both."""
    clock = ManualClock(T0)
    rs = open_store(stores, cfg(redis_server.url), clock)
    lim = limits(base=2, kv=None, tpm=None, guarantees={})
    g = await rs.admit(plan(10, lim), T0)
    keys = rs._keys_of("p")
    r = redis_sync.Redis.from_url(redis_server.url)
    _heartbeat, late_refresh = rs._refresh_cmds(T0)[0]  # built while the lease is live
    assert g.id in late_refresh
    rs.settle(g, 10, T0)
    await rs.flush()
    restored = r.execute_command(*late_refresh).partition(b"|")[0]
    assert restored == b"0" and int(r.hget(keys.st, "n")) == 0
    # The admission: cancelled first (as after a timeout), then it arrives.
    p = plan(10, lim)
    r.execute_command(*rs._settle_cmd(p, keys, "lost.1", 0, T0))
    reply = r.execute_command(*admit_cmd(p, keys, "lost.1", T0, rs.config.lease_ttl_s, -1.0))
    assert reply.startswith(b"2|") and int(r.hget(keys.st, "n")) == 0 and r.hlen(keys.lh) == 0


async def test_scripts_flushed_from_redis_are_loaded_again(stores, redis_server):
    rs = open_store(stores, cfg(redis_server.url), ManualClock(T0))
    redis_sync.Redis.from_url(redis_server.url).script_flush()
    assert isinstance(await rs.admit(plan(1), T0), Grant)
    assert rs.mode == MODE_SHARED


# --- Redis time ------------------------------------------------------------------------

async def test_redis_time_drives_leases_and_tenant_buckets_expire_once_full(stores, redis_server):
    config = cfg(redis_server.url, lease_ttl_s=30.0)
    rs = open_store(stores, config, None)
    g = await rs.admit(plan(600, bucket=TENANT_A), 0.0)  # the caller's instant is not used
    assert isinstance(g, Grant)
    r = redis_sync.Redis.from_url(redis_server.url)
    secs, micros = r.time()
    expiry = r.zscore(f"{config.key_prefix}{{p}}:lz", g.id)
    assert expiry == pytest.approx(secs + micros / 1e6 + 30.0, abs=5.0)
    # 600 tokens are back in 12 s at 50 tokens/s; the key outlives that by a minute.
    pttl = r.pttl(f"{config.key_prefix}{{p}}:b:tenant:a")
    assert 60_000 < pttl <= 72_000
    assert r.pttl(f"{config.key_prefix}{{p}}:b:pool") == -1  # the pool's bucket stays


# --- degraded modes ------------------------------------------------------------------

def test_local_within_holds_the_limits_to_what_the_leases_hold():
    p = Plan(limits(1.0, base=10, kv=9000, tpm=6000.0, guarantees={"gold": 4, "batch": 1}),
             "a", "standard", 10, TENANT_A)
    within = local_within(p, 3, Within(slots=2, kv=1500), (1, 100))
    lim = within.limits
    # one local grant (100 tokens) and the room of 2 more slots and 1500 tokens the leases hold
    assert (lim.limit, dict(lim.guarantees), lim.kv_budget) == (3, {"gold": 1}, 1600)
    assert dict(lim.kv_ceilings) == {"batch": (1600, 4950)}
    # tokens are spent, not held: the buckets are shared by the replicas seen
    assert (lim.bucket.capacity, lim.bucket.rate) == pytest.approx((2000.0, 2000.0 / 60))
    assert within.tenant_bucket.capacity == pytest.approx(1000.0)
    # what never fits stays what never fits in the whole budget
    assert (lim.base_kv_budget, lim.bucket.base_capacity, within.tenant_bucket.base_capacity) == (9000, 6000, 3000)
    # never more than the pool's own limits, never less than nothing
    wide = local_within(p, 3, Within(slots=50, kv=10**6)).limits
    assert (wide.limit, wide.kv_budget) == (10, 9000)
    grown = local_within(p, 3, Within(slots=-2, kv=-5)).limits
    assert (grown.limit, grown.kv_budget) == (0, 0)


async def test_redis_down_admits_locally_within_its_leases_then_recovers(stores, own_server, caplog):
    caplog.set_level(logging.WARNING, logger="kvgate.store")
    clock = ManualClock(T0)
    config = cfg(own_server.url, timeout_s=1.0)
    seen = Recorder()
    rs = open_store(stores, config, clock, observer=seen)
    peer = open_store(stores, config, clock)
    await rs.start()
    await peer.start()
    await rs.refresh()
    assert rs.replicas == 2 and seen.modes == [MODE_SHARED]
    lim = limits(base=4, kv=None, tpm=None, guarantees={})
    shared = [await rs.admit(plan(10, lim), T0) for _ in range(2)]
    assert all(isinstance(g, Grant) and not g.id.startswith(LOCAL_PREFIX) for g in shared)
    own_server.stop()
    refused = await rs.admit(plan(10, lim), T0)
    assert rs.mode == MODE_LOCAL_SHARE and seen.modes == [MODE_SHARED, MODE_LOCAL_SHARE]
    assert seen.errors and set(seen.errors) <= {"connection", "timeout"}
    assert "unavailable" in caplog.text and "within this replica's leases" in caplog.text
    # both slots its leases hold are taken by its live requests: nothing more alone
    assert isinstance(refused, Refusal) and refused.budget is Budget.SLOTS and refused.limit == 0
    rs.settle(shared[0], 10, T0)  # its settle waits for Redis: the lease still holds the slot there
    a = await rs.admit(plan(10, lim), T0)
    assert isinstance(a, Grant) and a.id.startswith(LOCAL_PREFIX)
    assert isinstance(await rs.admit(plan(10, lim), T0), Refusal)
    assert rs.usage("p", T0).inflight == 1 and rs.live_leases("p") == 2
    assert not await rs.probe()  # still down
    own_server.start()  # empty: the ledger is rebuilt from the replicas' live leases
    assert not await rs.probe()  # answers, but not yet for RECOVER_S
    clock.advance(RECOVER_S)
    assert await rs.probe()
    assert rs.mode == MODE_SHARED and seen.modes[-1] == MODE_SHARED
    assert "answers again" in caplog.text
    # in Redis: the live shared lease and the local grant, taken there by the probes
    u = rs.usage("p", T0)
    assert (u.inflight, rs.pending_settles) == (2, 0)
    rs.settle(a, 10, T0)
    rs.settle(shared[1], 10, T0)
    await rs.flush()
    assert await rs.refresh() and rs.usage("p", T0).inflight == 0


async def test_a_replica_that_starts_with_redis_down_admits_alone_only_when_it_is_the_only_one(stores, own_server,
                                                                                               caplog):
    """It holds no lease: with other replicas it has no room of its own (they may be sharing
    the whole limit); the only replica there is (expected_replicas: 1) has the whole limit;
    without expected_replicas it does not know and fails closed."""
    caplog.set_level(logging.WARNING, logger="kvgate.store")
    own_server.stop()
    lim = limits(base=6, kv=None, tpm=None, guarantees={})
    unknown = open_store(stores, cfg(own_server.url, timeout_s=0.2), ManualClock(T0))
    alone = open_store(stores, cfg(own_server.url, timeout_s=0.2, expected_replicas=1), ManualClock(T0))
    expecting = open_store(stores, cfg(own_server.url, timeout_s=0.2, expected_replicas=3), ManualClock(T0))
    assert alone.share_replicas == 1 and expecting.share_replicas == 3
    with pytest.raises(StoreUnavailableError, match="number of replicas is unknown"):
        await unknown.admit(plan(10, lim), T0)
    assert unknown.mode == MODE_LOCAL_SHARE
    granted = {}
    for name, rs in (("alone", alone), ("expecting", expecting)):
        got = [await rs.admit(plan(10, lim), T0) for _ in range(7)]
        assert rs.mode == MODE_LOCAL_SHARE
        granted[name] = sum(isinstance(g, Grant) for g in got)
    assert granted == {"alone": 6, "expecting": 0}
    assert "1/3 of each token bucket" in caplog.text


async def test_fail_closed_refuses_while_redis_is_down(stores, own_server):
    rs = open_store(stores, cfg(own_server.url, timeout_s=0.5, lease_ttl_s=0.6, on_unavailable="fail_closed"),
                    ManualClock(T0))
    assert isinstance(await rs.admit(plan(1), T0), Grant)
    own_server.stop()
    with pytest.raises(StoreUnavailableError, match="shared budget store unavailable"):
        await rs.admit(plan(1), T0)
    assert rs.mode == MODE_FAIL_CLOSED
    with pytest.raises(StoreUnavailableError):
        await rs.admit(plan(1), T0)
    own_server.start()  # empty: no admission until the replicas had a refresh to take their leases again
    assert not await rs.probe()
    rs._clock.advance(RECOVER_S)
    assert await rs.probe()
    with pytest.raises(StoreUnavailableError, match="lost its state"):
        await rs.admit(plan(1), T0)
    got = None
    while not isinstance(got, Grant):
        with contextlib.suppress(StoreUnavailableError):
            got = await rs.admit(plan(1), T0)
        await asyncio.sleep(0.05)  # the rebuild window runs on Redis's clock


async def test_a_stalled_redis_times_out_and_the_lost_admission_is_cancelled(stores, own_server):
    clock = ManualClock(T0)
    seen = Recorder()
    rs = open_store(stores, cfg(own_server.url, timeout_s=0.5, expected_replicas=1), clock, observer=seen)
    lim = limits(base=3, kv=None, tpm=None, guarantees={})
    held = await rs.admit(plan(1, lim), T0)
    own_server.pause()
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        lost = await rs.admit(plan(1, lim), T0)  # sent, then no answer
        assert loop.time() - started < 10.0  # timeout_s (0.5 s), not forever, on a busy machine too
        assert seen.errors[0] == "timeout" and rs.mode == MODE_LOCAL_SHARE
        assert isinstance(lost, Grant) and lost.id.startswith(LOCAL_PREFIX)
        rs.settle(held, 1, T0)
    finally:
        own_server.resume()
    # A resumed server first works through what piled up while it was stopped: on a loaded
    # machine one probe may still miss its 0.5 s. Wait for the condition, not for a time.
    deadline = loop.time() + 20.0
    while not await rs.probe():
        assert loop.time() < deadline, "the resumed Redis never answered a probe"
        clock.advance(RECOVER_S / 2)  # the next probe, half the hysteresis later
    # Whether or not Redis ran the timed-out admission, neither it nor `held` holds a slot;
    # the grant made alone meanwhile is there, taken by the probes, until it is settled.
    r = redis_sync.Redis.from_url(own_server.url)
    assert int(r.hget(f"{rs.config.key_prefix}{{p}}:st", "n") or 0) == 1
    assert r.hkeys(f"{rs.config.key_prefix}{{p}}:lh") == [lost.id.encode()]
    rs.settle(lost, 1, T0)
    await rs.flush()
    assert int(r.hget(f"{rs.config.key_prefix}{{p}}:st", "n") or 0) == 0
    assert r.hlen(f"{rs.config.key_prefix}{{p}}:lh") == 0


async def test_a_corrupted_state_degrades_loudly_and_leaks_nothing(stores, redis_server):
    seen = Recorder()
    rs = open_store(stores, cfg(redis_server.url, expected_replicas=1), ManualClock(T0), observer=seen)
    lim = limits(base=3, kv=None, tpm=None, guarantees={})
    r = redis_sync.Redis.from_url(redis_server.url)
    r.hset(f"{rs.config.key_prefix}{{p}}:st", "n", "not a number")
    g = await rs.admit(plan(1, lim), T0)
    assert seen.errors == ["response"] and rs.mode == MODE_LOCAL_SHARE
    assert isinstance(g, Grant) and g.id.startswith(LOCAL_PREFIX)
    assert r.hlen(f"{rs.config.key_prefix}{{p}}:lh") == 0
    assert not await rs.probe()  # still unreadable: stays degraded, loudly
    assert seen.errors[-1] == "response"
    rs.settle(g, 1, T0)
    assert rs.usage("p", T0).inflight == 0


async def test_settle_never_raises_and_close_is_idempotent(stores, own_server):
    rs = open_store(stores, cfg(own_server.url, timeout_s=0.5), ManualClock(T0))
    g = await rs.admit(plan(1), T0)
    own_server.stop()
    rs.settle(g, 1, T0)
    await rs.flush()  # fails, degrades, keeps the settle for later
    assert rs.mode == MODE_LOCAL_SHARE and rs.pending_settles == 1
    await rs.close()
    await rs.close()
    assert math.isfinite(rs.usage("p", T0).inflight)


async def test_a_waiter_on_a_fail_closed_store_is_refused_at_its_deadline(stores, own_server):
    """The controller's wait queue outlives a store that refuses to answer: the waiter ends
    at its deadline instead of hanging, and nothing stays held."""
    clock = ManualClock(T0)
    config = parse_config({"pools": {"default": {"max_concurrency": 1}},
                           "tenants": {"classes": {"standard": {"max_wait_s": 30}}}})
    rs = open_store(stores, cfg(own_server.url, timeout_s=1.0, on_unavailable="fail_closed"), clock)
    adm = Admission(config, clock, rs)
    d = Demand(pool="default", tenant="t", class_name="standard", prompt_tokens=10, reserved_completion=10)
    held = await adm.acquire(d)
    assert isinstance(held, Lease)
    waiter = asyncio.create_task(adm.acquire(d))
    await wait_for_event(lambda: adm.snapshot("default").waiting == 1)
    own_server.stop()
    held.release(Outcome.COMPLETED, 5)  # frees the slot, but the store now fails closed
    await wait_for_event(lambda: rs.mode == MODE_FAIL_CLOSED)
    clock.advance(30.0)
    result = await asyncio.wait_for(waiter, 10)
    assert isinstance(result, Rejection) and "waited 30.0s" in result.message
    assert adm.snapshot("default").waiting == 0


async def wait_for_event(predicate, timeout: float = 10.0) -> None:
    """wait_for_event yields to the loop until ``predicate`` holds (the store's round trips
    are real I/O), failing after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("the awaited event did not happen")
        await asyncio.sleep(0.005)
