"""The Redis store's background work under faults it did not choose: exceptions a client
library raises on a connection that died under it (uvloop's RuntimeError on a write to a
reset transport), exceptions of the store's own code, and connections reset by a proxy
between a replica and Redis. The refresher never dies: it logs, counts and goes on, and
the store comes back to shared mode by itself.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import pytest
import uvloop
from redis.asyncio.connection import Connection

from extproc.admission.shared_nodes import Candidate as C, NodeAsk
from extproc.admission.store.fallback import MODE_LOCAL_SHARE, MODE_SHARED, StoreUnavailableError
from extproc.admission.store.redis import RedisStore
from extproc.admission.store.redis_client import RedisClient, RoundTripError
from extproc.admission.store.redis_lua import HEARTBEAT, HeartbeatArg, HeartbeatKeys, word
from extproc.admission.types import ERROR_CONNECTION
from extproc.admission.types import Grant, Plan, PoolLimits
from extproc.clock import ManualClock
from extproc.config import RedisStoreConfig
from kvgate_testkit.faultproxy import running
from kvgate_testkit.redis_server import RedisServer
from tests.unit.admission.helpers import Recorder

pytestmark = pytest.mark.redis

# What uvloop raises on a write to a transport the peer reset (redis-py lets it through).
UVLOOP_CLOSED = "unable to perform operation on <TCPTransport closed=True reading=False>; the handler is closed"


def config(url: str, **kw) -> RedisStoreConfig:
    kw.setdefault("timeout_s", 1.0)
    kw.setdefault("lease_ttl_s", 0.6)  # refresh every 0.2 s, probe every 0.2 s
    kw.setdefault("expected_replicas", 2)
    return RedisStoreConfig(url=url, key_prefix=f"t{secrets.token_hex(6)}:", **kw)


def one_plan(tokens: int = 10) -> Plan:
    lim = PoolLimits(pool="p", scale=1.0, limit=64, base_limit=64, guarantees={}, kv_budget=None,
                     base_kv_budget=None, kv_ceilings={}, bucket=None, retry_estimate_s=1.0)
    return Plan(lim, "a", "standard", tokens, None)


async def until(predicate, timeout: float = 15.0) -> None:
    """until yields to the loop until ``predicate`` holds (real round trips and the store's
    own timers run meanwhile), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the awaited state did not come")
        await asyncio.sleep(0.01)


@pytest.fixture
def failing_writes(monkeypatch):
    """failing_writes makes the next ``n`` writes of every redis-py connection raise what uvloop
    raises on a reset transport; set ``box[0] = n`` to arm it."""
    box = [0]
    real = Connection.send_packed_command

    async def send(self, command, check_health=True):
        if box[0] > 0:
            box[0] -= 1
            await self.disconnect(nowait=True)  # the transport is gone, as after a reset
            raise RuntimeError(UVLOOP_CLOSED)
        return await real(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", send)
    return box


async def test_a_runtime_error_on_a_dead_connection_is_a_failed_round_trip(redis_server, failing_writes):
    client = RedisClient(config(redis_server.url), "r1", lambda: None)
    try:
        failing_writes[0] = 1
        with pytest.raises(RoundTripError) as failed:
            await client.round_trip([("PING",)])
        assert failed.value.reason == ERROR_CONNECTION and "RuntimeError" in str(failed.value)
        assert await client.round_trip([("PING",)]) == [True]  # a new connection, the pool is whole
    finally:
        await client.aclose()


async def test_the_refresher_survives_a_client_error_and_the_store_shares_again(redis_server, failing_writes,
                                                                                caplog):
    caplog.set_level(logging.WARNING, logger="kvgate.store")
    seen = Recorder()
    store = RedisStore(config(redis_server.url), observer=seen)
    try:
        await store.start()
        assert store.mode == MODE_SHARED
        failing_writes[0] = 3  # the next refresh and the first probes meet dead connections
        await until(lambda: store.mode == MODE_LOCAL_SHARE)
        await until(lambda: failing_writes[0] == 0 and store.mode == MODE_SHARED)
        assert store._upkeep.task is not None and not store._upkeep.task.done()
        assert "connection" in seen.errors and seen.modes[-1] == MODE_SHARED
        granted = await store.admit(one_plan(), 0.0)
        assert isinstance(granted, Grant) and not granted.id.startswith("local:")
    finally:
        await store.close()


async def test_the_refresher_survives_its_own_bug_logs_and_counts_it(redis_server, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="kvgate.store")
    seen = Recorder()
    store = RedisStore(config(redis_server.url), observer=seen)
    real = store._refresh_cmds
    fails = [2]

    def broken(now):
        if fails[0] > 0:
            fails[0] -= 1
            raise ValueError("a bug in the store's own code")
        return real(now)

    try:
        await store.start()
        monkeypatch.setattr(store, "_refresh_cmds", broken)
        await until(lambda: fails[0] == 0 and store.mode == MODE_SHARED and "internal" in seen.errors)
        assert not store._upkeep.task.done()
        assert "survived an unexpected ValueError" in caplog.text and "a bug in the store" in caplog.text
    finally:
        await store.close()


def test_on_uvloop_connections_reset_under_load_leave_no_replica_out_of_shared_mode():
    """The deployment's event loop, a proxy that resets every connection between a replica
    and Redis while admissions and settles flow; once the path heals the store is shared
    again within a few probes, and nothing it granted is left in Redis."""

    async def scenario(server: RedisServer) -> tuple[str, float, int, bool]:
        with running(server.port) as proxy:
            store = RedisStore(config(f"redis://127.0.0.1:{proxy.port}/0", lease_ttl_s=1.5, timeout_s=0.5))
            await store.start()
            stop = asyncio.Event()

            async def traffic() -> None:
                while not stop.is_set():
                    g = await store.admit(one_plan(), time.monotonic())
                    if isinstance(g, Grant):
                        await asyncio.sleep(0.002)
                        store.settle(g, 10, time.monotonic())
                    await asyncio.sleep(0.001)

            workers = [asyncio.create_task(traffic()) for _ in range(6)]
            for _ in range(25):
                proxy.reset_open()
                await asyncio.sleep(0.04)
            proxy.set_mode("reset")
            await asyncio.sleep(0.3)
            proxy.set_mode("pass")
            healed = time.monotonic()
            stop.set()
            await asyncio.gather(*workers)
            await until(lambda: store.mode == MODE_SHARED)
            back = time.monotonic() - healed
            await store.flush()
            alive = store._upkeep.task is not None and not store._upkeep.task.done()
            mode = store.mode
            live = store.live_leases("p")
            await store.close()
            return mode, back, live, alive

    with RedisServer() as server:
        mode, back, live, alive = uvloop.run(scenario(server))
    assert mode == MODE_SHARED and alive
    assert live == 0
    assert back < 10.0  # a few probes and the recovery time, on a busy machine too


# --- a replica cut off from Redis while another shares ------------------------------------------

def slots_plan(limit: int = 4) -> Plan:
    lim = PoolLimits(pool="p", scale=1.0, limit=limit, base_limit=limit, guarantees={}, kv_budget=None,
                     base_kv_budget=None, kv_ceilings={}, bucket=None, retry_estimate_s=1.0)
    return Plan(lim, "a", "standard", 10, None)


def cut_and_direct(proxy_port: int, url: str, clock: ManualClock,
                   recover_s: float = 0.5) -> tuple[RedisStore, RedisStore]:
    """cut_and_direct is two replicas of one ledger (lease TTL 30 s, 2 expected): A reaching
    Redis through the proxy on ``proxy_port`` and sharing again after Redis answered for
    ``recover_s``, B directly at ``url``."""
    prefix = f"t{secrets.token_hex(6)}:"
    a = RedisStore(RedisStoreConfig(url=f"redis://127.0.0.1:{proxy_port}/0", key_prefix=prefix,
                                    timeout_s=0.5, lease_ttl_s=30.0, expected_replicas=2, recover_s=recover_s),
                   clock=clock)
    b = RedisStore(RedisStoreConfig(url=url, key_prefix=prefix, timeout_s=2.0,
                                    lease_ttl_s=30.0, expected_replicas=2), clock=clock)
    return a, b


def admitter(live: dict[str, list[Grant]], clock: ManualClock, limit: int = 4):
    """admitter is ``admit(name, store, n)``: ``n`` admissions of ``slots_plan`` by replica
    ``name``, its grants kept in ``live``, asserting after each that the replicas' live
    grants together stay within ``limit``; returns how many were granted."""

    async def admit(name: str, store: RedisStore, n: int) -> int:
        got = 0
        for _ in range(n):
            g = await store.admit(slots_plan(), clock.now())
            if isinstance(g, Grant):
                live[name].append(g)
                got += 1
            assert sum(map(len, live.values())) <= limit, live
        return got

    return admit


async def test_a_replica_cut_off_and_one_sharing_never_pass_the_limit_together(redis_server):
    """A reaches Redis through a proxy that stops forwarding, B directly. Whatever A admits
    alone and whatever B admits over the ledger meanwhile, and after A is back, the
    requests live at once never pass the limit of 4: A admits alone only into the room its
    own leases hold in Redis, and what it admitted alone is in Redis before it shares."""
    clock = ManualClock(1000.0)
    live: dict[str, list[Grant]] = {"a": [], "b": []}
    with running(redis_server.port) as proxy:
        a, b = cut_and_direct(proxy.port, redis_server.url, clock)
        admit = admitter(live, clock)

        def end(name: str, store: RedisStore, n: int) -> None:
            for g in live[name][:n]:
                store.settle(g, 10, clock.now())
            del live[name][:n]

        try:
            await a.start()
            await b.start()
            assert await admit("a", a, 2) == 2 and await admit("b", b, 1) == 1
            proxy.set_mode("refuse")  # A is cut off; its leases stay in Redis
            assert await admit("a", a, 1) == 0 and a.mode == MODE_LOCAL_SHARE  # its leases are all taken
            end("a", a, 2)            # ended; the settles cannot be sent
            assert await admit("a", a, 4) == 2  # into the room its two leases hold
            assert await admit("b", b, 4) == 1  # B sees A's two leases and its own
            proxy.set_mode("pass")
            while not await a.probe():
                clock.advance(0.5)
            assert a.mode == MODE_SHARED
            # A's two requests admitted alone are in Redis: nobody finds room
            assert await admit("b", b, 2) == 0 and await admit("a", a, 2) == 0
            end("a", a, 2)
            await a.flush()
            assert await admit("b", b, 3) == 2
        finally:
            await a.close()
            await b.close()


async def test_a_replica_waiting_to_share_again_keeps_the_room_of_its_ended_leases(redis_server):
    """A is cut off with 3 leases, its 3 requests end (their settles wait) and it admits 1
    alone. Redis answers again and the probe takes that grant in, but A must answer for
    recover_s before it shares: its settles wait with it, so until then it still admits
    within the room its 4 leases hold in Redis (the one it took in is no sign that Redis
    lost any), and B, sharing, finds none. Once A shares, its grants are in Redis and the
    settles go: the two together never pass the limit of 4."""
    clock = ManualClock(1000.0)
    live: dict[str, list[Grant]] = {"a": [], "b": []}
    with running(redis_server.port) as proxy:
        a, b = cut_and_direct(proxy.port, redis_server.url, clock)
        admit = admitter(live, clock)

        try:
            await a.start()
            await b.start()
            assert await admit("a", a, 3) == 3
            await a.refresh()                  # the ledger A counts on carries them
            proxy.set_mode("refuse")
            assert await admit("a", a, 1) == 0 and a.mode == MODE_LOCAL_SHARE
            for g in live["a"]:
                a.settle(g, 10, clock.now())   # ended; the settles cannot be sent
            live["a"].clear()
            assert await admit("a", a, 1) == 1
            proxy.set_mode("pass")
            assert not await a.probe()         # Redis answers; A waits recover_s before sharing
            assert a.mode == MODE_LOCAL_SHARE and a.pending_settles == 4  # and the cut admission's cancel
            assert await admit("a", a, 4) == 3   # 4 leases in Redis, 1 live request
            assert await admit("b", b, 1) == 0   # Redis still counts the 4
            clock.advance(a.recover_s)
            assert await a.probe() and a.mode == MODE_SHARED and a.pending_settles == 0
            assert await admit("b", b, 1) == 0   # A's 4 live requests are all in Redis
            a.settle(live["a"].pop(), 10, clock.now())
            await a.flush()
            assert await admit("b", b, 2) == 1
        finally:
            await a.close()
            await b.close()


@pytest.mark.parametrize("recover_s", [0.0, 0.5])
async def test_a_grant_made_alone_while_the_last_probe_is_on_the_wire_is_in_redis_before_the_settles(redis_server,
                                                                                                  monkeypatch,
                                                                                                  recover_s):
    """A's probe that brings it back carries its grants made alone; one more made while that
    round trip is on the wire, within the room of A's ended requests, is not in it. Were
    the settles of those requests sent then, A and B would admit over a ledger that lacks
    it: they wait until another refresh carried it. With no hysteresis (the default) the
    probe that brings A back is the first that Redis answers."""
    clock = ManualClock(1000.0)
    live: list[Grant] = []
    with running(redis_server.port) as proxy:
        a, b = cut_and_direct(proxy.port, redis_server.url, clock, recover_s)
        try:
            await a.start()
            await b.start()
            live.extend([await a.admit(slots_plan(), clock.now()) for _ in range(2)])
            proxy.set_mode("refuse")
            assert not isinstance(await a.admit(slots_plan(), clock.now()), Grant)
            for g in live:
                a.settle(g, 10, clock.now())   # their room is A's to admit within
            live.clear()
            live.append(await a.admit(slots_plan(), clock.now()))
            proxy.set_mode("pass")
            if recover_s:
                assert not await a.probe()     # answering since now
                clock.advance(a.recover_s)
            real = RedisClient.round_trip
            slipped: list[Grant | object] = []

            async def round_trip(client, cmds):  # a request admitted alone while the probe's refresh is out
                if client is a._client and not slipped:
                    slipped.append(await a.admit(slots_plan(), clock.now()))
                return await real(client, cmds)

            monkeypatch.setattr(RedisClient, "round_trip", round_trip)
            assert await a.probe() and a.mode == MODE_SHARED
            assert isinstance(slipped[0], Grant) and slipped[0].id.startswith("local:")
            live.append(slipped[0])
            # Redis holds A's two live requests: B finds the other 2 slots and no more.
            got = [await b.admit(slots_plan(), clock.now()) for _ in range(3)]
            assert sum(isinstance(g, Grant) for g in got) + len(live) <= 4
        finally:
            await a.close()
            await b.close()


class _Seen:
    """_Seen stands for a grant's node charge where only the store runs: what its node's last
    mark saw of it (``node.Charge.seen``, tokens), the one field a refresh publishes."""

    def __init__(self, seen: int) -> None:
        self.seen = seen


@pytest.mark.parametrize("published", [False, True])
async def test_replicas_cut_off_do_not_refill_a_node_whose_foreign_kv_rose_past_their_holds(redis_server,
                                                                                          published):
    """A and B each hold 3,000 tokens on a 10,000-token node, and their requests end while
    both are cut off. 7,000 tokens that are not kvgate's came meanwhile. Each reads 3,000
    free on the node and holds 3,000 of room there: refilling both, they would put 13,000
    on it (and the shared rule admits no more than 3,000). The holds overshoot the node by
    3,000, which each takes from its own room: neither refills.

    ``published``: each request was in the node's cache when its replica last published
    (3,000 tokens seen), and the reports read during the cut are stamped after that
    generation. Subtracting the other's stale generation, each would read 4,000 foreign,
    no shortfall, and both would refill: a request another replica published may have
    ended since, so a replica cut off subtracts none of it."""
    clock = ManualClock(1000.0)
    since: list[float] = []
    other = 3000 if published else 0  # what each reads of the other's request before it ends

    def plan(foreign: int) -> Plan:
        return Plan(slots_plan(64).limits, "a", "standard", 10, None,
                    NodeAsk((C("n0", 10_000, foreign, 0, 0, since[0] if since else None, False),), 3000, 0.0, 1.0))

    with running(redis_server.port) as proxy:
        prefix = f"t{secrets.token_hex(6)}:"
        url = f"redis://127.0.0.1:{proxy.port}/0"
        a, b = (RedisStore(RedisStoreConfig(url=url, key_prefix=prefix, timeout_s=0.5, lease_ttl_s=30.0,
                                            expected_replicas=2), clock=clock) for _ in range(2))
        try:
            await a.start()
            await b.start()
            ga, gb = await a.admit(plan(0), clock.now()), await b.admit(plan(0), clock.now())
            assert isinstance(ga, Grant) and isinstance(gb, Grant) and ga.picked == gb.picked == "n0"
            if published:
                ga.node, gb.node = _Seen(3000), _Seen(3000)
                clock.advance(1.0)
            assert await a.refresh() and await b.refresh()   # each reads the node's 6,000 held
            if published:
                assert await a.refresh()                     # and A reads B's generation
                since.append(clock.now() + 0.5)              # the reports' marks saw the store after it
                assert a.others_seen("p", "n0", since[0], False) == 3000
                assert b.others_seen("p", "n0", since[0], False) == 3000
            proxy.set_mode("refuse")
            assert not isinstance(await a.admit(plan(other), clock.now()), Grant)
            assert not isinstance(await b.admit(plan(other), clock.now()), Grant)
            a.settle(ga, 10, clock.now())
            b.settle(gb, 10, clock.now())
            got = [await a.admit(plan(7000), clock.now()), await b.admit(plan(7000), clock.now())]
            assert a.mode == b.mode == MODE_LOCAL_SHARE
            assert not any(isinstance(g, Grant) for g in got)
            # With no rise the holds fit, and each refills its own room.
            got = [await a.admit(plan(other), clock.now()), await b.admit(plan(other), clock.now())]
            assert all(isinstance(g, Grant) for g in got)
        finally:
            await a.close()
            await b.close()


async def test_a_noscript_to_a_round_trip_sent_before_the_scripts_were_loaded_is_not_a_second_loss(monkeypatch):
    """On a server without the scripts, round trip A's NOSCRIPT is held back while B meets
    its own, reports the loss and loads the scripts. A's NOSCRIPT is that same loss: were
    it reported again, the store would open a rebuild window over a ledger B has just
    used (13 s of refusals, seen in the concurrency test on a loaded machine)."""
    with RedisServer() as server:
        lost: list[int] = []
        client = RedisClient(RedisStoreConfig(url=server.url, key_prefix="t:", timeout_s=5.0), "r1",
                             lambda: lost.append(1) or [])
        cmd = HEARTBEAT.command(HeartbeatKeys("t:replicas", "t:replica_addrs", "t:replicas_gone"),
                                *map(word, HeartbeatArg(None, "r1", 5.0, "-", 30.0)))
        real = RedisClient._send
        gate = asyncio.Event()
        held: list[object] = []

        async def send(self, cmds, retry_lost):
            got = await real(self, cmds, retry_lost)
            if not held:                       # A's first answer waits for B
                held.append(got)
                await gate.wait()
            return got

        monkeypatch.setattr(RedisClient, "_send", send)
        try:
            a = asyncio.create_task(client.round_trip([cmd]))
            await until(lambda: bool(held))
            assert held == [None]              # NOSCRIPT
            await client.round_trip([cmd])     # B: the loss, reported once; the scripts loaded
            assert lost == [1]
            gate.set()
            await a
            assert lost == [1]
        finally:
            await client.aclose()


async def test_a_replica_cut_off_with_no_leases_admits_nothing_alone(redis_server):
    """B shares the whole limit; A, cut off, holds nothing in Redis: a share of the limit
    would put A's requests on top of B's."""
    clock = ManualClock(1000.0)
    with running(redis_server.port) as proxy:
        prefix = f"t{secrets.token_hex(6)}:"
        a = RedisStore(RedisStoreConfig(url=f"redis://127.0.0.1:{proxy.port}/0", key_prefix=prefix,
                                        timeout_s=0.5, expected_replicas=2), clock=clock)
        b = RedisStore(RedisStoreConfig(url=redis_server.url, key_prefix=prefix, timeout_s=2.0,
                                        expected_replicas=2), clock=clock)
        try:
            await a.start()
            await b.start()
            held = [await b.admit(slots_plan(), clock.now()) for _ in range(4)]
            assert all(isinstance(g, Grant) for g in held)
            proxy.set_mode("refuse")
            got = [await a.admit(slots_plan(), clock.now()) for _ in range(3)]
            assert a.mode == MODE_LOCAL_SHARE and not any(isinstance(g, Grant) for g in got)
        finally:
            await a.close()
            await b.close()


async def test_a_redis_restarted_empty_admits_nothing_until_the_live_leases_are_back():
    """Redis lost the ledger while a replica held 3 of 4 slots: deciding over the empty
    ledger would let 4 more in. The first replica to meet the new server opens the
    rebuild window before any script runs there; admissions wait until the replicas had a
    refresh to take their live leases again, then only the free slot is granted."""
    clock = ManualClock(1000.0)
    with RedisServer() as server:
        store = RedisStore(config(server.url, lease_ttl_s=0.9, timeout_s=0.5), clock=clock)
        try:
            held = [await store.admit(slots_plan(), clock.now()) for _ in range(3)]
            assert all(isinstance(g, Grant) for g in held)
            server.restart()
            with pytest.raises(StoreUnavailableError, match="lost its state"):
                await store.admit(slots_plan(), clock.now())
            got: list[Grant] = []
            deadline = time.monotonic() + 15
            while len(got) < 1 and time.monotonic() < deadline:
                try:
                    g = await store.admit(slots_plan(), clock.now())
                except StoreUnavailableError:
                    await asyncio.sleep(0.05)  # the window runs on Redis's clock
                    continue
                assert isinstance(g, Grant), g
                got.append(g)
            assert len(got) == 1
            assert not isinstance(await store.admit(slots_plan(), clock.now()), Grant)
        finally:
            await store.close()


async def test_the_ledgers_node_totals_reach_the_observer_at_each_refresh(redis_server):
    seen = Recorder()
    clock = ManualClock(1000.0)
    a = RedisStore(config(redis_server.url), observer=seen, clock=clock)
    b = RedisStore(RedisStoreConfig(url=redis_server.url, key_prefix=a.config.key_prefix, timeout_s=1.0),
                   clock=clock)
    try:
        ask = NodeAsk((C("n0", 10_000, 0, 0), C("n1", 10_000, 0, 0)), 3000, 0.0, 1.0)
        plan = Plan(slots_plan(64).limits, "a", "standard", 10, None, ask)
        ga = await a.admit(plan, clock.now())
        gb = await b.admit(plan, clock.now())
        assert isinstance(ga, Grant) and isinstance(gb, Grant) and {ga.picked, gb.picked} == {"n0", "n1"}
        assert await a.refresh()
        assert seen.nodes["p"] == {"n0": 3000, "n1": 3000}  # both replicas' holds
        b.settle(gb, 10, clock.now())
        await b.flush()
        assert await a.refresh()
        assert seen.nodes["p"] == {ga.picked: 3000, gb.picked: 0}
    finally:
        await a.close()
        await b.close()


def test_the_shared_node_gauge_follows_the_ledger_and_drops_a_node_it_no_longer_names():
    from prometheus_client import CollectorRegistry

    from extproc.metrics import Metrics

    m = Metrics(CollectorRegistry())
    m.store_nodes("p", {"n0": 3000, "n1": 1200})
    m.store_nodes("p", {"n0": 500})
    value = m.registry.get_sample_value
    assert value("kvgate_shared_node_held_tokens", {"pool": "p", "node": "n0"}) == 500
    assert value("kvgate_shared_node_held_tokens", {"pool": "p", "node": "n1"}) == 0


# --- a replica whose heartbeat is gone ------------------------------------------------------------

def refusing_address() -> str:
    """refusing_address is a loopback host:port where nothing listens (a killed replica's)."""
    from kvgate_testkit.procs import free_port

    return f"127.0.0.1:{free_port()}"


async def admin_at(replica_id: str):
    """admin_at is a real admin endpoint answering /healthz for ``replica_id`` on a free port."""
    from prometheus_client import CollectorRegistry

    from extproc.admin import AdminServer, Readiness
    from extproc.metrics import Metrics

    admin = AdminServer(Metrics(CollectorRegistry()), Readiness(), "127.0.0.1", 0, replica_id)
    await admin.start()
    return admin


@pytest.mark.parametrize("answer", ["refused", "another process", "the same process"])
async def test_a_replica_whose_heartbeat_expired_loses_its_leases_only_when_it_no_longer_runs(redis_server,
                                                                                                answer):
    clock = ManualClock(1000.0)
    prefix = f"t{secrets.token_hex(6)}:"

    def store() -> RedisStore:
        return RedisStore(RedisStoreConfig(url=redis_server.url, key_prefix=prefix, timeout_s=1.0,
                                           lease_ttl_s=30.0, expected_replicas=2), clock=clock)

    a, b = store(), store()
    admin = None
    if answer == "refused":
        b.advertise = refusing_address()
    else:
        admin = await admin_at(b.replica_id if answer == "the same process" else "someone-else")
        b.advertise = f"127.0.0.1:{admin.port}"
    a.know_pools(["p"])  # the pools of the configuration, before A admitted in any
    try:
        await a.start()
        await b.start()
        held = [await b.admit(slots_plan(), clock.now()) for _ in range(3)]
        assert all(isinstance(g, Grant) for g in held)
        b._upkeep.task.cancel()  # B stops as SIGKILL stops it: no refresh, no goodbye
        clock.advance(b._presence_ttl + 0.1)  # its heartbeat expires; its leases have 29 s left
        assert await a.refresh()
        await until(lambda: not a._gone.checking)
        assert await a.refresh()
        assert await a.refresh()
        await until(lambda: not a._gone.checking)
        gone = a.usage("p", clock.now()).inflight == 0
        assert gone == (answer != "the same process")
        granted = [await a.admit(slots_plan(), clock.now()) for _ in range(4)]
        assert sum(isinstance(g, Grant) for g in granted) == (4 if gone else 1)
    finally:
        if admin is not None:
            await admin.stop()
        await a.close()
        b._closed = True
        await b._client.aclose()


async def test_an_admission_behind_settles_that_time_out_decides_alone_without_a_second_timeout():
    """Settles on the wire when Redis hangs time out after timeout_s; an admission queued
    behind them must not then spend its own timeout_s as well (two of them outlast Envoy's
    2 s message timeout: a 504), since the store is degraded by then."""
    clock = ManualClock(1000.0)
    seen = Recorder()
    with RedisServer() as server:
        store = RedisStore(config(server.url, timeout_s=0.4, lease_ttl_s=30.0, expected_replicas=1),
                           observer=seen, clock=clock)
        try:
            await store.start()
            held = [await store.admit(slots_plan(), clock.now()) for _ in range(2)]
            server.pause()
            try:
                store.settle(held[0], 10, clock.now())  # the flusher sends it, and hangs
                await until(lambda: store._settles.batch is not None)
                got = await store.admit(slots_plan(), clock.now())
                assert store.mode == MODE_LOCAL_SHARE
                assert isinstance(got, Grant) and got.id.startswith("local:")
                assert seen.errors == ["timeout"]  # the settles' round trip only
            finally:
                server.resume()
        finally:
            await store.close()
