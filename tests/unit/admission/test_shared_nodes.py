"""The per-node rule shared by replicas through the Redis store, against a real server.

The Lua admit script and ``shared_nodes.pick_shared`` (``rules.pick_node`` over every
replica's holds) agree on random states; two replicas' requests on one node never pass its
room; a dead replica's node holds come back with its leases; and the rule while Redis is
unreachable (``pick_within``) keeps the replicas together within each node's room.
Instants come from manual clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import pytest
import redis as redis_sync
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.admission import Admission, Demand, Lease, Outcome, Reason, Rejection, rules
from extproc.admission.types import NodeReport
from extproc.admission.shared_nodes import Candidate as C, NodeAsk, Pooled, others_seen, pick_shared, pick_within
from extproc.admission.types import Budget, Grant, Plan, PoolLimits, Refusal
from extproc.admission.store.fallback import FLAP_WINDOW_S, MODE_LOCAL_SHARE, MODE_SHARED
from extproc.admission.store.redis import RedisStore
from extproc.admission.store.redis_ledger import read_gens, read_sums
from extproc.clock import ManualClock
from extproc.config import RedisStoreConfig
from extproc.configparse import parse_config
from kvgate_testkit.redis_server import RedisServer
from tests.unit.admission.helpers import no_jitter

pytestmark = pytest.mark.redis

T0 = 1000.0
CAP = 10_000
NODES = ("n0", "n1", "n2")
# Pool budgets far above anything asked: only the node rule decides here.
WIDE = PoolLimits(pool="p", scale=1.0, limit=10_000, base_limit=10_000, retry_estimate_s=1.0)


RECOVER_S = 0.5  # the hysteresis these tests set (``store.redis.recover_s``; default 0)


def cfg(url: str, **kw) -> RedisStoreConfig:
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("recover_s", RECOVER_S)
    kw.setdefault("expected_replicas", 2)
    return RedisStoreConfig(url=url, key_prefix=f"t{secrets.token_hex(6)}:", **kw)


def want(prompt: int, max_tokens: int) -> Demand:
    """want is a request of tenant t (the default class) to the default pool that reserves its
    ``max_tokens`` (``kvbudget.reserved_completion`` of a request that gives them)."""
    return Demand(pool="default", tenant="t", class_name="standard", prompt_tokens=prompt,
                  reserved_completion=max_tokens)


def node_plan(ask: NodeAsk, tokens: int = 1) -> Plan:
    return Plan(WIDE, "a", "standard", tokens, None, ask)


# --- the rule in Lua and in Python ------------------------------------------------------------

ASK = st.tuples(
    st.integers(0, 6000),                                     # need
    st.sampled_from((0.0, 0.1, 0.15, 1 / 3)),                 # reserve fraction
    st.sampled_from((1.0, 0.55, 0.9, 0.3)),                   # class watermark
    st.lists(st.tuples(st.sampled_from(NODES), st.integers(0, 20_000), st.integers(0, 9000)),
             min_size=0, max_size=3, unique_by=lambda c: c[0]),  # (node, capacity, foreign)
)
OPS = st.lists(st.one_of(st.tuples(st.just("admit"), ASK),
                         st.tuples(st.just("settle"), st.integers(0, 63))), min_size=1, max_size=30)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_the_lua_script_picks_like_the_python_rule(redis_server: RedisServer, ops: list[tuple]) -> None:
    """Random holds, capacities, foreign KV, reserves and watermarks: the same node, or the
    same refusal, from the script as from ``pick_shared``; the holds in Redis follow."""

    async def run() -> None:
        clock = ManualClock(T0)
        rs = RedisStore(cfg(redis_server.url, lease_ttl_s=3600.0), clock=clock)
        held = dict.fromkeys(NODES, 0)
        live: list[Grant] = []
        try:
            for op in ops:
                if op[0] == "admit":
                    need, reserve, wm, cands = op[1]
                    ask = NodeAsk(tuple(C(n, c, f, 0) for n, c, f in cands), need, reserve, wm)
                    want = pick_shared(ask, held)
                    got = await rs.admit(node_plan(ask), T0)
                    if want.chosen is None:
                        assert isinstance(got, Refusal), (got, want)
                        assert got.budget is (Budget.CLASS_KV if want.by_watermark else Budget.NODE_KV)
                        assert got.used == (want.best_room or 0) and got.needed == need
                    else:
                        assert isinstance(got, Grant) and got.picked == want.chosen, (got, want)
                        held[want.chosen] += need
                        live.append(got)
                elif live:
                    g = live.pop(op[1] % len(live))
                    rs.settle(g, 1, T0)
                    held[g.picked] -= g.node_hold
                await rs.flush()
            r = redis_sync.Redis.from_url(redis_server.url)
            stored = r.hgetall(f"{rs.config.key_prefix}{{p}}:nk")
            assert {k.decode(): int(v) for k, v in stored.items() if int(v)} == \
                {k: v for k, v in held.items() if v}
        finally:
            await rs.close()

    asyncio.run(run())


async def test_the_script_computes_the_effective_capacity_on_the_same_double(redis_server):
    """floor(C x (1 - r)) at a reserve whose product is not exact: the script rounds as Python."""
    rs = RedisStore(cfg(redis_server.url), clock=ManualClock(T0))
    try:
        eff = rules.effective_capacity(10_000, 1 / 3)
        assert eff == 6666
        over = await rs.admit(node_plan(NodeAsk((C("n0", 10_000, 0, 0),), eff + 1, 1 / 3, 1.0)), T0)
        assert isinstance(over, Refusal) and over.used == eff
        fits = await rs.admit(node_plan(NodeAsk((C("n0", 10_000, 0, 0),), eff, 1 / 3, 1.0)), T0)
        assert isinstance(fits, Grant) and fits.picked == "n0"
    finally:
        await rs.close()


# --- two replicas, one node's room --------------------------------------------------------------

async def test_two_replicas_never_fill_a_node_past_its_room(redis_server):
    clock = ManualClock(T0)
    config = cfg(redis_server.url)
    a, b = RedisStore(config, clock=clock), RedisStore(config, clock=clock)
    try:
        ask = NodeAsk((C("n0", CAP, 1000, 0),), 2000, 0.1, 1.0)  # room: 9000 - 1000 = 8000
        got = [await (a if i % 2 else b).admit(node_plan(ask), T0) for i in range(6)]
        granted = [g for g in got if isinstance(g, Grant)]
        assert len(granted) == 4 and {g.picked for g in granted} == {"n0"}
        assert all(isinstance(g, Refusal) and g.budget is Budget.NODE_KV for g in got[4:])
        # each replica granted two: alone it would have admitted four
        assert sum(g.id.startswith(a.replica_id) for g in granted) == 2
        a.settle(granted[1], 1, T0)
        await a.flush()
        again = await b.admit(node_plan(ask), T0)
        assert isinstance(again, Grant) and again.picked == "n0"
    finally:
        await a.close()
        await b.close()


async def test_a_dead_replicas_node_holds_come_back_with_its_leases(redis_server):
    clock = ManualClock(T0)
    config = cfg(redis_server.url, lease_ttl_s=5.0)
    dead, alive = RedisStore(config, clock=clock), RedisStore(config, clock=clock)
    try:
        ask = NodeAsk((C("n0", CAP, 0, 0),), 5000, 0.0, 1.0)
        assert isinstance(await dead.admit(node_plan(ask), T0), Grant)
        assert isinstance(await dead.admit(node_plan(ask), T0), Grant)
        # `dead` stops refreshing (SIGKILL): its holds stand until the TTL
        assert isinstance(await alive.admit(node_plan(ask), T0 + 4.9), Refusal)
        clock.advance(5.0)
        got = await alive.admit(node_plan(ask), clock.now())
        assert isinstance(got, Grant) and got.picked == "n0"
    finally:
        await alive.close()
        dead._closed = True  # a killed process settles nothing and deregisters nothing
        await dead._client.aclose()


async def test_a_refresh_moves_a_leases_node_hold_to_its_current_estimate(redis_server):
    clock = ManualClock(T0)
    rs = RedisStore(cfg(redis_server.url), clock=clock)
    try:
        ask = NodeAsk((C("n0", CAP, 0, 0),), 6000, 0.0, 1.0)
        g = await rs.admit(node_plan(ask), T0)
        assert isinstance(g, Grant)
        assert isinstance(await rs.admit(node_plan(NodeAsk(ask.candidates, 5000, 0.0, 1.0)), T0), Refusal)
        g.node_hold = 4000  # the controller's estimate after some tokens (learned growth)
        assert await rs.refresh()
        fits = await rs.admit(node_plan(NodeAsk(ask.candidates, 5000, 0.0, 1.0)), T0)
        assert isinstance(fits, Grant)
        r = redis_sync.Redis.from_url(redis_server.url)
        assert int(r.hget(f"{rs.config.key_prefix}{{p}}:nk", "n0")) == 9000
    finally:
        await rs.close()


async def test_a_restarted_redis_gets_the_live_node_holds_again_and_no_settled_one():
    clock = ManualClock(T0)
    server = RedisServer().start()
    rs = RedisStore(cfg(server.url), clock=clock)
    try:
        ask = NodeAsk((C("n0", CAP, 0, 0), C("n1", CAP, 0, 0)), 3000, 0.0, 1.0)
        live, settled = await rs.admit(node_plan(ask), T0), await rs.admit(node_plan(ask), T0)
        assert isinstance(live, Grant) and isinstance(settled, Grant) and live.picked != settled.picked
        server.restart()  # empty, as a crashed Redis without persistence
        rs.settle(settled, 1, T0)
        live.node_hold = 2500
        assert await rs.refresh()
        await rs.flush()
        r = redis_sync.Redis.from_url(server.url)
        holds = {k.decode(): int(v) for k, v in r.hgetall(f"{rs.config.key_prefix}{{p}}:nk").items()}
        assert {k: v for k, v in holds.items() if v} == {live.picked: 2500}
    finally:
        await rs.close()
        server.close()


# --- through the controller: two replicas, three nodes ------------------------------------------

def picking_config() -> object:
    return parse_config({"pools": {"default": {
        "max_concurrency": 1000,
        "backends": [{"name": n, "metrics_url": f"http://127.0.0.1:9/{n}",
                      "address": f"127.0.0.1:{8001 + i}", "kv_capacity_tokens": CAP}
                     for i, n in enumerate(NODES)],
        "picking": {"growth": "worst_case", "reserve_fraction": 0.0}}}})


async def test_two_controllers_share_every_nodes_room(redis_server):
    """Two replicas with their own reports, one Redis: together they fill each node once."""
    clock = ManualClock(T0)
    config = picking_config()
    shared = cfg(redis_server.url)  # one key prefix: one shared budget
    stores = [RedisStore(shared, clock=clock) for _ in range(2)]
    adms = [Admission(config, clock, s) for s in stores]
    try:
        for adm in adms:
            for n in NODES:
                adm.report_node("default", n, NodeReport(kv_usage=0.0, capacity_tokens=CAP, at=T0))
        leases: list[Lease] = []
        for i in range(12):
            adm = adms[i % 2]
            got = await adm.acquire(want(2000, 1000))
            if isinstance(got, Lease):
                leases.append(got)
            else:
                assert isinstance(got, Rejection)
        # 3000 tokens each, 10,000 per node: three per node, nine in all
        assert len(leases) == 9
        per_node: dict[str, int] = {}
        for x in leases:
            per_node[x.node] = per_node.get(x.node, 0) + 3000
        assert sorted(per_node.values()) == [9000, 9000, 9000]
        # each replica's own ledger shows its own requests only; together, what was admitted
        shown = [sum(s.inflight_tokens for s in adm.nodes("default")) for adm in adms]
        assert sum(shown) == 9 * 2000 and all(shown)
        for x in leases:
            x.release(Outcome.COMPLETED, 10)
        for s in stores:
            await s.flush()
        r = redis_sync.Redis.from_url(redis_server.url)
        assert all(int(v) == 0 for v in r.hvals(f"{stores[0].config.key_prefix}{{default}}:nk"))
    finally:
        for adm in adms:
            await adm.close()


async def test_the_proxys_allowed_endpoints_bound_the_shared_pick(redis_server):
    """An InferencePool's subset hint (Demand.among) holds with the shared ledger too: every
    request lands on an allowed node, and one that fits only elsewhere is refused."""
    clock = ManualClock(T0)
    store = RedisStore(cfg(redis_server.url), clock=clock)
    adm = Admission(picking_config(), clock, store)
    try:
        for n in NODES:
            adm.report_node("default", n, NodeReport(kv_usage=0.0, capacity_tokens=CAP, at=T0))
        among = frozenset({"127.0.0.1:8002"})  # n1 only
        got = [await adm.acquire(want(2000, 1000)._replace(among=among))
               for _ in range(4)]
        leases = [x for x in got if isinstance(x, Lease)]
        assert [x.node for x in leases] == ["127.0.0.1:8002"] * 3  # n1: 3,000 each in 10,000
        assert isinstance(got[3], Rejection)
        # Served by n0 after all: the shared ledger keeps the charge where its script put it
        # (n0's own report counts the request), and an address that is no node is said so.
        assert leases[0].served("127.0.0.1:8001") and leases[0].node == "127.0.0.1:8002"
        assert not leases[0].served("127.0.0.1:9999")
        for x in leases:
            x.release(Outcome.COMPLETED, 10)
    finally:
        await adm.close()


# --- while Redis is unreachable -----------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(cap=st.integers(0, 50_000), reserve=st.sampled_from((0.0, 0.1, 0.25)),
       foreign=st.integers(0, 20_000),
       before=st.lists(st.integers(1, 8000), max_size=8),
       steps=st.lists(st.tuples(st.sampled_from(("a_admit", "a_end", "b_admit", "b_end")), st.integers(1, 8000),
                                st.integers(0, 63)), min_size=1, max_size=60))
def test_a_replica_alone_and_one_sharing_never_fill_a_node_past_its_room(cap, reserve, foreign, before, steps):
    """Replica A is cut off from Redis, replica B is not. B decides over the ledger
    (``pick_shared``), where A's leases keep their holds because A's settles cannot be
    sent; A decides within the room its leases hold beyond its live requests
    (``pick_within``). Neither sees the other's requests in the node's reports (none is in
    the cache yet: the worst case): together they stay within floor(C x (1 - r)) - foreign."""
    eff = rules.effective_capacity(cap, reserve)
    a_ledger: list[int] = []  # holds of A's leases in the ledger
    a_live: list[int] = []
    b_live: list[int] = []

    def shared_admit(need: int) -> bool:
        ask = NodeAsk((C("n0", cap, foreign, 0),), need, reserve, 1.0)
        return pick_shared(ask, {"n0": sum(a_ledger) + sum(b_live)}).chosen == "n0"

    for need in before:  # A's admissions while it still reached Redis
        if shared_admit(need):
            a_ledger.append(need)
            a_live.append(need)
    for op, need, k in steps:
        if op == "a_admit":
            ask = NodeAsk((C("n0", cap, foreign, sum(a_live)),), need, reserve, 1.0)
            if pick_within(ask, {"n0": sum(a_ledger) - sum(a_live)}).chosen == "n0":
                a_live.append(need)
        elif op == "a_end" and a_live:
            a_live.pop(k % len(a_live))  # its settle waits: the lease keeps holding in the ledger
        elif op == "b_admit" and shared_admit(need):
            b_live.append(need)
        elif op == "b_end" and b_live:
            b_live.pop(k % len(b_live))
        assert sum(a_live) + sum(b_live) <= max(0, eff - foreign) or not (a_live or b_live) or \
            (sum(a_live) + sum(b_live) <= sum(before))


def test_the_only_replica_picks_by_its_own_reading():
    ask = NodeAsk((C("n0", CAP, 1000, 2000),), 7000, 0.0, 1.0)
    assert pick_within(ask, None).chosen == "n0"
    assert pick_within(ask, {}).chosen is None and pick_within(ask, {"n0": 7000}).chosen == "n0"


async def test_redis_down_picks_nodes_within_the_room_of_this_replicas_leases(redis_server):
    clock = ManualClock(T0)
    server = RedisServer().start()
    rs = RedisStore(cfg(server.url, timeout_s=0.5), clock=clock)
    try:
        ask = NodeAsk((C("n0", CAP, 0, 0), C("n1", CAP, 0, 0)), 3000, 0.0, 1.0)
        held = await rs.admit(node_plan(ask), T0)
        assert isinstance(held, Grant) and held.picked == "n0"
        server.stop()
        # its one lease holds 3000 on n0, all taken by its live request: no room alone
        both = NodeAsk((C("n0", CAP, 0, 3000), C("n1", CAP, 0, 0)), 3000, 0.0, 1.0)
        full = await rs.admit(node_plan(both), T0)
        assert rs.mode == MODE_LOCAL_SHARE
        assert isinstance(full, Refusal) and full.budget is Budget.NODE_KV and full.used == 0
        rs.settle(held, 1, T0)  # ended; the lease holds its room in Redis until its settle lands
        ended = NodeAsk((C("n0", CAP, 0, 0), C("n1", CAP, 0, 0)), 3000, 0.0, 1.0)
        got = await rs.admit(node_plan(ended), T0)
        assert isinstance(got, Grant) and got.picked == "n0" and got.id.startswith("local:")
        assert isinstance(await rs.admit(node_plan(NodeAsk((C("n0", CAP, 0, 3000), C("n1", CAP, 0, 0)),
                                                           1, 0.0, 1.0)), T0), Refusal)
    finally:
        await rs.close()
        server.close()


# --- hysteresis -------------------------------------------------------------------------------

async def test_a_flapping_store_waits_longer_each_time_before_it_shares_again():
    """Rule: a failed round trip degrades at once; shared mode returns only once Redis has
    answered every probe for ``recover_s``, which doubles when the store fails again
    within FLAP_WINDOW_S of a return, and is RECOVER_S again otherwise."""
    clock = ManualClock(T0)
    server = RedisServer().start()
    # the only replica: it admits alone while Redis is away (the hysteresis is under test)
    rs = RedisStore(cfg(server.url, timeout_s=0.5, expected_replicas=1), clock=clock)
    modes: list[str] = []
    try:
        await rs.start()
        lim_plan = Plan(WIDE, "a", "standard", 1)
        waits = []
        for _ in range(3):
            server.stop()
            assert isinstance(await rs.admit(lim_plan, clock.now()), Grant)
            assert rs.mode == MODE_LOCAL_SHARE
            server.start()
            waits.append(rs.recover_s)
            assert not await rs.probe()          # answers, the clock has not moved
            for _ in range(50):                  # requests meanwhile stay local: no flip each
                g = await rs.admit(lim_plan, clock.now())
                assert g.id.startswith("local:")
                rs.settle(g, 1, clock.now())
            clock.advance(rs.recover_s / 2)
            assert not await rs.probe()
            clock.advance(rs.recover_s / 2)
            assert await rs.probe() and rs.mode == MODE_SHARED
            modes.append(rs.mode)
        assert waits == [RECOVER_S, 2 * RECOVER_S, 2 * RECOVER_S]
        # stable for the window: the next outage waits the base time again
        clock.advance(FLAP_WINDOW_S)
        server.stop()
        await rs.admit(lim_plan, clock.now())
        assert rs.recover_s == RECOVER_S
        # a probe that fails in the middle starts the wait again
        server.start()
        assert not await rs.probe()
        clock.advance(RECOVER_S / 2)
        server.stop()
        assert not await rs.probe()
        server.start()
        clock.advance(RECOVER_S / 2)
        assert not await rs.probe()
    finally:
        await rs.close()
        server.close()


# --- every replica's requests counted once --------------------------------------------------------

def one_node_config(cap: int) -> object:
    return parse_config({"pools": {"default": {
        "max_concurrency": 1000,
        "backends": [{"name": "n0", "metrics_url": "http://127.0.0.1:9/n0", "address": "127.0.0.1:8001",
                      "kv_capacity_tokens": cap}],
        "picking": {"growth": "worst_case", "reserve_fraction": 0.0}}}})


async def _two_replicas_one_full(redis_server, seen_by_b: str):
    """Replica b holds 3 requests of 2,500 tokens (2,000 prompt + 500 reserved) on one node of
    10,000, and the node reports their footprints (or not); a then asks for a fourth."""
    clock = ManualClock(T0)
    config = one_node_config(10_000)
    shared = cfg(redis_server.url)
    sa, sb = RedisStore(shared, clock=clock), RedisStore(shared, clock=clock)
    a, b = Admission(config, clock, sa), Admission(config, clock, sb)
    for s in (sa, sb):
        s.know_pools(["default"])  # as the server does at start
    for adm in (a, b):
        adm.report_node("default", "n0", NodeReport(kv_usage=0.0, capacity_tokens=10_000, at=T0))
    held = []
    for _ in range(3):
        got = await b.acquire(want(2000, 500))
        assert isinstance(got, Lease)
        held.append(got)
    if seen_by_b == "first token":
        for x in held:
            x.progress(1)      # b saw each one's first token: in the node's cache from then on
    clock.advance(0.5)
    b.mark_nodes(1)            # b's scrape round; its refresh publishes what the mark saw
    assert await sb.refresh()
    clock.advance(0.5)
    assert await sa.refresh()  # a hears from Redis after b's refresh...
    a.mark_nodes(1)            # ...then takes its mark, and the node renders its report
    used = 3 * 2001 / 10_000 if seen_by_b == "first token" else 3 * 2000 / 10_000
    a.report_node("default", "n0", NodeReport(kv_usage=used, capacity_tokens=10_000, at=clock.now(),
                                              mark=1, waiting=0, running=3))
    fourth = await a.acquire(want(2000, 500))
    return a, b, held, fourth


class _HintPair(NamedTuple):
    """_HintPair is two replicas a and b over one node n0 of 10,000 tokens, a having learned
    that its requests hold the node 8 s each; ``report`` hands both a report of n0 empty;
    ``held`` are the leases the test takes (released at the end)."""

    clock: ManualClock
    a: Admission
    b: Admission
    sa: RedisStore
    report: Callable[[], None]
    held: list[Lease]


@contextlib.asynccontextmanager
async def _hint_pair(redis_server) -> AsyncIterator[_HintPair]:
    clock = ManualClock(T0)
    config = one_node_config(10_000)
    shared = cfg(redis_server.url)
    sa, sb = RedisStore(shared, clock=clock), RedisStore(shared, clock=clock)
    a, b = Admission(config, clock, sa, rand=no_jitter), Admission(config, clock, sb, rand=no_jitter)
    held: list[Lease] = []
    try:
        for s in (sa, sb):
            s.know_pools(["default"])

        def report() -> None:
            for adm in (a, b):
                adm.report_node("default", "n0", NodeReport(kv_usage=0.0, capacity_tokens=10_000, at=clock.now()))

        report()
        for _ in range(4):                      # a learns its holds: 8 s each
            x = await a.acquire(want(2000, 500))
            assert isinstance(x, Lease)
            clock.advance(8.0)
            report()
            x.release(Outcome.COMPLETED, 10)
        await sa.flush()
        yield _HintPair(clock, a, b, sa, report, held)
    finally:
        for x in held:
            x.release(Outcome.COMPLETED, 1)
        await a.close()
        await b.close()


async def _take(adm: Admission, n: int, held: list[Lease]) -> None:
    """_take admits ``n`` requests of 2,000 prompt tokens and 500 reserved through ``adm``."""
    for _ in range(n):
        x = await adm.acquire(want(2000, 500))
        assert isinstance(x, Lease)
        held.append(x)


async def test_a_node_refusals_retry_hint_counts_every_replicas_holds(redis_server):
    """Beside another replica, a refused client is told when room is expected back on the
    node as every replica holds it. a's requests held their node 8 s each; b holds 5,000
    of n0's 10,000 and a 2,500, 3 s in. a's reading alone shows 7,500 free, so a request
    of 5,000 would be told to come back at once; the shared holds leave 2,500, and a's
    holder, a third of them, is taken to free its third of what is missing: when it ends,
    5 s on."""
    async with _hint_pair(redis_server) as t:
        await _take(t.b, 2, t.held)
        await _take(t.a, 1, t.held)
        t.clock.advance(3.0)
        t.report()
        assert await t.sa.refresh()             # a reads every replica's holds: 7,500 on n0
        r = await t.a.acquire(want(4000, 1000))
        assert isinstance(r, Rejection) and r.reason is Reason.KV_BUDGET
        assert r.retry_after_s == pytest.approx(5.0)


async def test_a_node_refusals_retry_hint_reads_the_holds_the_refusal_saw(redis_server):
    """The holds a refused replica last refreshed can be older than another replica's
    admissions: b takes 5,000 of n0's 10,000 after a's refresh, which read a's 2,500 alone.
    By that reading a request of 5,000 fits now, and its client would spend its retries in
    the first second; the admit script's refusal carries the holds it saw, so the hint is
    the one of the shared holds: a's holder frees its third of what is missing when it
    ends, 5 s on."""
    async with _hint_pair(redis_server) as t:
        await _take(t.a, 1, t.held)
        t.clock.advance(3.0)
        t.report()
        assert await t.sa.refresh()             # a reads its own 2,500 on n0...
        assert t.sa.node_holds("default") == {"n0": 2500}
        await _take(t.b, 2, t.held)             # ...then b takes 5,000 more
        r = await t.a.acquire(want(4000, 1000))
        assert isinstance(r, Rejection) and r.reason is Reason.KV_BUDGET
        assert t.sa.node_holds("default") == {"n0": 7500}
        assert r.retry_after_s == pytest.approx(5.0)


async def test_another_replicas_requests_in_a_report_are_not_counted_twice(redis_server):
    """b's three requests are in the node's report a reads and in the shared holds: a counts
    them once and admits the fourth that fits (10,000 - 3 x 2,500 = 2,500). Counted twice
    (3 x 2,001 as foreign, and their holds), a refused it: 0 admitted where 1 fit."""
    a, b, held, fourth = await _two_replicas_one_full(redis_server, "first token")
    try:
        assert isinstance(fourth, Lease) and fourth.node == "127.0.0.1:8001", fourth
        # and no further: the node is full for a as for b
        assert isinstance(await a.acquire(want(1, 1)), Rejection)
        assert isinstance(await b.acquire(want(1, 1)), Rejection)
        shown = {s.name: s.foreign_tokens for s in a.nodes("default")}
        assert shown == {"n0": 0}
    finally:
        for x in [*held, fourth]:
            if isinstance(x, Lease):
                x.release(Outcome.COMPLETED, 1)
        await a.close()
        await b.close()


async def test_requests_no_replica_saw_in_the_cache_stay_counted_as_foreign(redis_server):
    """Without a first token (and not yet settled), b cannot tell whether the node's cache
    holds its requests: nothing of them is subtracted, and a refuses (the safe side)."""
    a, b, held, fourth = await _two_replicas_one_full(redis_server, "nothing")
    try:
        assert isinstance(fourth, Rejection) and fourth.message.startswith("No node")
    finally:
        for x in held:
            x.release(Outcome.COMPLETED, 1)
        await a.close()
        await b.close()


async def test_a_request_that_ended_after_it_was_published_is_counted_by_its_hold(redis_server):
    """b's requests end after their generation was published and before a's report: the node no
    longer holds them, and their holds leave Redis with what was published of them, so a's
    next decision reads neither: the node's room comes back once, not twice."""
    a, b, held, fourth = await _two_replicas_one_full(redis_server, "first token")
    try:
        assert isinstance(fourth, Lease)
        for x in held:
            x.release(Outcome.COMPLETED, 1)
        await b.close()  # flushes the settles
        r = redis_sync.Redis.from_url(redis_server.url)
        prefix = f"{a.store.config.key_prefix}{{default}}"
        assert r.hgetall(f"{prefix}:sn") == {}
        assert {k: int(v) for k, v in r.hgetall(f"{prefix}:nk").items() if int(v)} == {b"n0": 2500}
        # the report a read still shows b's three: until a reads a new one they are foreign
        # again (6,003), as they were before b published them: 10,000 - 6,003 - 2,500 < 2,500
        got = await a.acquire(want(2000, 500))
        assert isinstance(got, Rejection) and got.message.startswith("No node")
    finally:
        if isinstance(fourth, Lease):
            fourth.release(Outcome.COMPLETED, 1)
        await a.close()


class _Published:
    """_Published stands for a grant's node charge where only the store runs: what its mark saw
    of it (``node.Charge.seen``, tokens), the one field a refresh reads."""

    def __init__(self) -> None:
        self.seen = 0


def _expected_gens(r: redis_sync.Redis, prefix: str) -> dict[str, dict[str, dict[str, int]]]:
    """_expected_gens is what the published sums must be, from the lease records alone."""
    rounds = {k.decode(): int(v.split()[2]) for k, v in r.hgetall(f"{prefix}:sr").items()}
    out: dict[str, dict[str, dict[str, int]]] = {}
    for lease_id, rec in r.hgetall(f"{prefix}:lh").items():
        f = rec.decode().split("\t")
        if len(f) < 7:
            continue
        node, rnd, fn, fo = f[2], int(f[4]), int(f[5]), int(f[6])
        replica = lease_id.decode().removeprefix("local:").rsplit(".", 1)[0]
        cur = rounds.get(replica)
        parts = [(fn, False), (fo, True)] if cur == rnd else [(fn, True)] if cur == rnd + 1 else []
        for v, old in parts:
            if v:
                kind = ("F" if v > 0 else "I").lower() if old else ("F" if v > 0 else "I")
                sums = out.setdefault(replica, {}).setdefault(node, {})
                sums[kind] = sums.get(kind, 0) + abs(v)
    return out


def _stored_gens(r: redis_sync.Redis, prefix: str) -> dict[str, dict[str, dict[str, int]]]:
    out: dict[str, dict[str, dict[str, int]]] = {}
    for field, v in r.hgetall(f"{prefix}:sn").items():
        replica, node, kind = field.decode().split("\t")
        out.setdefault(replica, {}).setdefault(node, {})[kind] = int(v)
    return out


SEEN_OPS = st.lists(st.one_of(
    st.tuples(st.just("admit_b"), st.sampled_from(NODES), st.integers(1, 4000)),
    st.tuples(st.just("seen"), st.integers(0, 63), st.sampled_from((0, 1, -1)), st.floats(0.0, 1.0)),
    st.tuples(st.just("refresh_b"), st.lists(st.tuples(st.sampled_from((0, 1, 1, -1)), st.floats(0.0, 1.0)),
                                             min_size=1, max_size=6)),
    st.tuples(st.just("refresh_b_without"), st.integers(0, 63)),
    st.tuples(st.just("settle_b"), st.integers(0, 63)),
    st.tuples(st.just("admit_a"), st.integers(0, 6000),
              st.lists(st.tuples(st.sampled_from(NODES), st.integers(0, 20_000), st.integers(0, 9000),
                                 st.integers(0, 3000), st.integers(-1, 4), st.booleans()),
                       min_size=1, max_size=3, unique_by=lambda c: c[0]))),
    min_size=4, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=SEEN_OPS)
def test_the_lua_script_subtracts_what_other_replicas_published_like_python(redis_server: RedisServer,
                                                                             ops: list[tuple]) -> None:
    """Replica b admits, publishes what its marks saw (firm, idle, nothing), refreshes and
    settles in random order; replica a asks with random foreign KV, rise, mark instants and
    idle flags: the script picks as ``pick_shared`` with ``others_seen`` over the published
    generations, and the published sums always equal what the live leases' records say."""

    async def run() -> None:
        clock = ManualClock(T0)
        config = cfg(redis_server.url, lease_ttl_s=3600.0)
        a, b = RedisStore(config, clock=clock), RedisStore(config, clock=clock)
        r = redis_sync.Redis.from_url(redis_server.url)
        prefix = f"{config.key_prefix}{{p}}"
        live: list[Grant] = []
        instants = [clock.now()]
        try:
            for op in ops:
                clock.advance(0.25)
                instants.append(clock.now())
                if op[0] == "admit_b":
                    got = await b.admit(node_plan(NodeAsk((C(op[1], 10**9, 0, 0),), op[2], 0.0, 1.0)), clock.now())
                    assert isinstance(got, Grant)
                    got.node = _Published()
                    live.append(got)
                elif op[0] == "seen" and live:
                    g = live[op[1] % len(live)]
                    g.node.seen = op[2] * int(op[3] * g.node_hold)
                elif op[0] == "refresh_b":
                    for i, g in enumerate(live):  # what b's mark saw of each, then its refresh
                        kind, frac = op[1][i % len(op[1])]
                        g.node.seen = kind * int(frac * g.node_hold)
                    assert await b.refresh()
                elif op[0] == "refresh_b_without" and live:
                    # a round that misses one lease (a refresh cut in two by another client's
                    # script, a chunk lost): its count of the round before ages out
                    g = live[op[1] % len(live)]
                    b._live["p"].pop(g.id)
                    assert await b.refresh()
                    b._live["p"][g.id] = g
                elif op[0] == "settle_b" and live:
                    b.settle(live.pop(op[1] % len(live)), 1, clock.now())
                    await b.flush()
                elif op[0] == "admit_a":
                    need, rows = op[1], op[2]
                    cands = tuple(C(n, cap, f + rise, 0, rise,
                                    None if k < 0 else instants[max(0, len(instants) - 1 - k)] - 0.1, idle)
                                  for n, cap, f, rise, k, idle in rows)
                    ask = NodeAsk(cands, need, 0.0, 1.0)
                    held = {k.decode(): int(v) for k, v in r.hgetall(f"{prefix}:nk").items()}
                    gens = read_gens(r.hgetall(f"{prefix}:sr"), r.hgetall(f"{prefix}:sn"))
                    others = {c.name: others_seen(gens, a.replica_id, c.name, c.since, c.idle) for c in cands}
                    want = pick_shared(ask, held, others)
                    got = await a.admit(node_plan(ask), clock.now())
                    if want.chosen is None:
                        assert isinstance(got, Refusal), (got, want)
                        assert got.used == (want.best_room or 0)
                    else:
                        assert isinstance(got, Grant) and got.picked == want.chosen, (got, want)
                        a.settle(got, 1, clock.now())  # a's own leases are not under test
                        await a.flush()
                assert _stored_gens(r, prefix) == _expected_gens(r, prefix)
            for g in live:
                b.settle(g, 1, clock.now())
            await b.flush()
            assert r.hgetall(f"{prefix}:sn") == {}
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


async def test_a_released_replica_leaves_no_published_generation(redis_server):
    """A replica known dead has its leases released with what it published of them, and its
    stamps go: nothing of it is subtracted by anyone afterwards."""
    clock = ManualClock(T0)
    config = cfg(redis_server.url)
    dead, alive = RedisStore(config, clock=clock), RedisStore(config, clock=clock)
    r = redis_sync.Redis.from_url(redis_server.url)
    prefix = f"{config.key_prefix}{{p}}"
    try:
        g = await dead.admit(node_plan(NodeAsk((C("n0", CAP, 0, 0),), 3000, 0.0, 1.0)), T0)
        assert isinstance(g, Grant)
        g.node = _Published()
        g.node.seen = 2000
        assert await dead.refresh()
        assert r.hlen(f"{prefix}:sn") == 1 and r.hexists(f"{prefix}:sr", dead.replica_id)
        alive.know_pools(["p"])
        assert await alive._gone.release(dead.replica_id) == 1
        assert r.hlen(f"{prefix}:sn") == 0 and not r.hexists(f"{prefix}:sr", dead.replica_id)
    finally:
        await alive.close()
        await dead.close()


async def test_a_report_subtracts_the_generation_its_mark_saw(redis_server):
    """b publishes two generations of one lease (1,000 tokens seen, then 3,000): a report whose
    mark saw the store after the second subtracts 3,000, one that saw it between the two
    subtracts 1,000, one from before both subtracts nothing; the script as the Python rule."""
    clock = ManualClock(T0)
    config = cfg(redis_server.url, lease_ttl_s=3600.0)
    a, b = RedisStore(config, clock=clock), RedisStore(config, clock=clock)
    r = redis_sync.Redis.from_url(redis_server.url)
    prefix = f"{config.key_prefix}{{p}}"
    try:
        g = await b.admit(node_plan(NodeAsk((C("n0", CAP, 0, 0),), 5000, 0.0, 1.0)), clock.now())
        assert isinstance(g, Grant)
        g.node = _Published()
        stamps = []
        for seen in (1000, 3000):
            clock.advance(1.0)
            g.node.seen = seen
            assert await b.refresh()
            stamps.append(clock.now())
        for since, subtracted in ((stamps[1] + 0.1, 3000), (stamps[0] + 0.1, 1000), (stamps[0] - 0.1, 0)):
            ask = NodeAsk((C("n0", 100_000, 20_000, 0, 0, since, False),), 10**6, 0.0, 1.0)
            gens = read_gens(r.hgetall(f"{prefix}:sr"), r.hgetall(f"{prefix}:sn"))
            assert others_seen(gens, a.replica_id, "n0", since, False) == subtracted
            got = await a.admit(node_plan(ask), clock.now())
            assert isinstance(got, Refusal) and got.used == 100_000 - (20_000 - subtracted) - 5000, (since, got)
    finally:
        await a.close()
        await b.close()


# --- pooled growth shared by the replicas ---------------------------------------------------

POOLED_OPS = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 4000), st.integers(0, 3000), st.floats(0.0, 1.0),
              st.floats(0.0, 1.0), st.sampled_from((0.0, 0.1)),
              st.lists(st.tuples(st.sampled_from(NODES), st.integers(0, 30_000), st.integers(0, 9000)),
                       min_size=1, max_size=3, unique_by=lambda c: c[0])),
    st.tuples(st.just("progress"), st.integers(0, 63), st.floats(0.0, 1.0)),
    st.tuples(st.just("refresh")),
    st.tuples(st.just("settle"), st.integers(0, 63))), min_size=1, max_size=40)


def _pooled(footprint: int, left: int, mean_share: float, sd_share: float, q: float) -> Pooled:
    mean = mean_share * left
    return Pooled(footprint, left, mean, (sd_share * left) ** 2, q)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(q=st.sampled_from((0.5, 0.9, 0.99, 1.0)), ops=POOLED_OPS)
def test_the_lua_script_bounds_pooled_growth_like_the_python_rule(redis_server: RedisServer, q: float,
                                                                   ops: list[tuple]) -> None:
    """Pooled asks (random footprints and growth moments) admitted, progressed (new moments at
    a refresh), refreshed and settled in random order: the script picks, or refuses, as
    ``pick_shared`` over the footprints and moments' sums in Redis; the sums are those of the
    live leases, and nothing is left once they are gone."""

    async def run() -> None:
        clock = ManualClock(T0)
        rs = RedisStore(cfg(redis_server.url, lease_ttl_s=3600.0), clock=clock)
        r = redis_sync.Redis.from_url(redis_server.url)
        prefix = f"{rs.config.key_prefix}{{p}}"
        live: list[Grant] = []
        try:
            for op in ops:
                if op[0] == "admit":
                    _, footprint, left, mean_share, sd_share, reserve, cands = op
                    p = _pooled(footprint, left, mean_share, sd_share, q)
                    need = footprint + rules.pooled_bound(p.left, p.mean, p.var, q)
                    ask = NodeAsk(tuple(C(n, c, f, 0) for n, c, f in cands), need, reserve, 1.0, p)
                    held = {k.decode(): int(v) for k, v in r.hgetall(f"{prefix}:nk").items()}
                    want = pick_shared(ask, held, None, read_sums(r.hgetall(f"{prefix}:nm")))
                    got = await rs.admit(node_plan(ask), T0)
                    if want.chosen is None:
                        assert isinstance(got, Refusal), (got, want)
                        assert got.used == (want.best_room or 0)
                    else:
                        assert isinstance(got, Grant) and got.picked == want.chosen, (got, want)
                        assert got.node_pooled == p
                        live.append(got)
                elif op[0] == "progress" and live:
                    g = live[op[1] % len(live)]
                    p = g.node_pooled
                    gen = int(op[2] * p.left)  # generated: the footprint grows, what is left shrinks
                    g.node_pooled = _pooled(p.footprint + gen, p.left - gen, 0.5, 0.25, q)
                elif op[0] == "refresh":
                    assert await rs.refresh()
                elif op[0] == "settle" and live:
                    rs.settle(live.pop(op[1] % len(live)), 1, T0)
                    await rs.flush()
            assert await rs.refresh()  # every lease's latest moments in Redis
            sums = read_sums(r.hgetall(f"{prefix}:nm"))
            for node in NODES:
                mine = [g.node_pooled for g in live if g.picked == node and g.node_pooled.left > 0]
                left, mean, var = sums.get(node, (0, 0.0, 0.0))
                assert left == sum(p.left for p in mine)
                assert mean == pytest.approx(sum(p.mean for p in mine), rel=1e-9, abs=1e-6)
                assert var == pytest.approx(sum(p.var for p in mine), rel=1e-9, abs=1e-3)
            holds = {k.decode(): int(v) for k, v in r.hgetall(f"{prefix}:nk").items() if int(v)}
            assert holds == {n: t for n in NODES
                             if (t := sum(g.node_pooled.footprint for g in live if g.picked == n))}
            for g in live:
                rs.settle(g, 1, T0)
            await rs.flush()
            assert r.hgetall(f"{prefix}:nm") == {}
        finally:
            await rs.close()

    asyncio.run(run())


def pooled_config(cap: int, store: dict | None = None) -> object:
    raw = {"pools": {"default": {
        "max_concurrency": 1000,
        "backends": [{"name": "n0", "metrics_url": "http://127.0.0.1:9/n0", "address": "127.0.0.1:8001",
                      "kv_capacity_tokens": cap}],
        "picking": {"growth": "pooled", "quantile": 0.9, "reserve_fraction": 0.0}}}}
    if store is not None:
        raw["store"] = store
    return parse_config(raw)


async def _fill(replicas: list[Admission], clock: ManualClock) -> list[Lease]:
    """_fill teaches every replica the same completion lengths (0 to 490), then admits requests
    of 1,000 prompt tokens and 1,000 reserved in turn through the replicas until one is refused."""
    for adm in replicas:
        adm.report_node("default", "n0", NodeReport(kv_usage=0.0, capacity_tokens=60_000, at=clock.now()))
        for n in range(0, 500, 10):
            got = await adm.acquire(want(10, 1000))
            assert isinstance(got, Lease)
            got.release(Outcome.COMPLETED, n)
        if isinstance(adm.store, RedisStore):
            await adm.store.flush()
    held: list[Lease] = []
    while len(held) < 200:
        adm = replicas[len(held) % len(replicas)]
        got = await adm.acquire(want(1000, 1000))
        if not isinstance(got, Lease):
            assert got.message.startswith("No node"), got
            return held
        held.append(got)
    raise AssertionError("never refused")


async def test_two_replicas_pool_their_growth_as_one_replica_does(redis_server):
    """Pooled growth through the Redis store: two replicas fill a node of 60,000 tokens with
    exactly as many requests as one replica alone (the growth of all of them bounded
    together); learned growth, each request bounded alone, fits fewer."""
    alone_clock = ManualClock(T0)
    alone = Admission(pooled_config(60_000), alone_clock)
    n_alone = len(await _fill([alone], alone_clock))
    await alone.close()
    clock = ManualClock(T0)
    shared = cfg(redis_server.url)
    config = pooled_config(60_000, None)
    a, b = (Admission(config, clock, RedisStore(shared, clock=clock)) for _ in range(2))
    held = []
    try:
        held = await _fill([a, b], clock)
        assert len(held) == n_alone
        # the refusal's holds (for the hint) are what a refresh reads: the bound of them all
        refused = (a, b)[len(held) % 2].store
        assert isinstance(refused, RedisStore)
        seen = dict(refused.node_holds("default") or {})
        assert await refused.refresh()
        assert seen == refused.node_holds("default") and seen["n0"] > 0
        assert {x.node for x in held} == {"127.0.0.1:8001"}
        raw = config.pools["default"].picking
        learned = Admission(parse_config({"pools": {"default": {
            "max_concurrency": 1000, "backends": [{"name": "n0", "metrics_url": "http://127.0.0.1:9/n0",
                                                   "address": "127.0.0.1:8001", "kv_capacity_tokens": 60_000}],
            "picking": {"growth": "learned", "quantile": raw.quantile, "reserve_fraction": 0.0}}}}), clock)
        n_learned = len(await _fill([learned], clock))
        await learned.close()
        assert n_learned < n_alone, (n_learned, n_alone)
    finally:
        for x in held:
            x.release(Outcome.COMPLETED, 1)
        await a.close()
        await b.close()
