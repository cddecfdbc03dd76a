"""The per-node rule shared by replicas through the Redis store, against a real server.

The Lua admit script and ``shared_nodes.pick_shared`` (``rules.pick_node`` over every
replica's holds) agree on random states; two replicas' requests on one node never pass its
room; a dead replica's node holds come back with its leases; and the rule while Redis is
unreachable (``pick_within``) keeps the replicas together within each node's room.
Instants come from manual clocks.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import replace

import pytest
import redis as redis_sync
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.admission import Admission, Lease, Outcome, Rejection, rules
from extproc.admission.nodes import NodeReport
from extproc.admission.shared_nodes import NodeAsk, pick_shared, pick_within
from extproc.admission.types import Budget, Grant, Plan, PoolLimits, Refusal
from extproc.admission.store.fallback import FLAP_WINDOW_S, MODE_LOCAL_SHARE, MODE_SHARED, RECOVER_MAX_S, RECOVER_S
from extproc.admission.store.redis import RedisStore
from extproc.clock import ManualClock
from extproc.config import RedisStoreConfig, parse_config
from kvgate_testkit.redis_server import RedisServer

pytestmark = pytest.mark.redis

T0 = 1000.0
CAP = 10_000
NODES = ("n0", "n1", "n2")
# Pool budgets far above anything asked: only the node rule decides here.
WIDE = PoolLimits(pool="p", scale=1.0, limit=10_000, base_limit=10_000, retry_estimate_s=1.0)


def cfg(url: str, **kw) -> RedisStoreConfig:
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("expected_replicas", 2)
    return RedisStoreConfig(url=url, key_prefix=f"t{secrets.token_hex(6)}:", **kw)


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
                    ask = NodeAsk(tuple((n, c, f, 0) for n, c, f in cands), need, reserve, wm)
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
        over = await rs.admit(node_plan(NodeAsk((("n0", 10_000, 0, 0),), eff + 1, 1 / 3, 1.0)), T0)
        assert isinstance(over, Refusal) and over.used == eff
        fits = await rs.admit(node_plan(NodeAsk((("n0", 10_000, 0, 0),), eff, 1 / 3, 1.0)), T0)
        assert isinstance(fits, Grant) and fits.picked == "n0"
    finally:
        await rs.close()


# --- two replicas, one node's room --------------------------------------------------------------

async def test_two_replicas_never_fill_a_node_past_its_room(redis_server):
    clock = ManualClock(T0)
    config = cfg(redis_server.url)
    a, b = RedisStore(config, clock=clock), RedisStore(config, clock=clock)
    try:
        ask = NodeAsk((("n0", CAP, 1000, 0),), 2000, 0.1, 1.0)  # room: 9000 - 1000 = 8000
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
        ask = NodeAsk((("n0", CAP, 0, 0),), 5000, 0.0, 1.0)
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
        ask = NodeAsk((("n0", CAP, 0, 0),), 6000, 0.0, 1.0)
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
        ask = NodeAsk((("n0", CAP, 0, 0), ("n1", CAP, 0, 0)), 3000, 0.0, 1.0)
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
            got = await adm.acquire(adm.demand("t", prompt_tokens=2000, max_tokens=1000))
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
        got = [await adm.acquire(replace(adm.demand("t", prompt_tokens=2000, max_tokens=1000), among=among))
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
        ask = NodeAsk((("n0", cap, foreign, 0),), need, reserve, 1.0)
        return pick_shared(ask, {"n0": sum(a_ledger) + sum(b_live)}).chosen == "n0"

    for need in before:  # A's admissions while it still reached Redis
        if shared_admit(need):
            a_ledger.append(need)
            a_live.append(need)
    for op, need, k in steps:
        if op == "a_admit":
            ask = NodeAsk((("n0", cap, foreign, sum(a_live)),), need, reserve, 1.0)
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
    ask = NodeAsk((("n0", CAP, 1000, 2000),), 7000, 0.0, 1.0)
    assert pick_within(ask, None).chosen == "n0"
    assert pick_within(ask, {}).chosen is None and pick_within(ask, {"n0": 7000}).chosen == "n0"


async def test_redis_down_picks_nodes_within_the_room_of_this_replicas_leases(redis_server):
    clock = ManualClock(T0)
    server = RedisServer().start()
    rs = RedisStore(cfg(server.url, timeout_s=0.5), clock=clock)
    try:
        ask = NodeAsk((("n0", CAP, 0, 0), ("n1", CAP, 0, 0)), 3000, 0.0, 1.0)
        held = await rs.admit(node_plan(ask), T0)
        assert isinstance(held, Grant) and held.picked == "n0"
        server.stop()
        # its one lease holds 3000 on n0, all taken by its live request: no room alone
        both = NodeAsk((("n0", CAP, 0, 3000), ("n1", CAP, 0, 0)), 3000, 0.0, 1.0)
        full = await rs.admit(node_plan(both), T0)
        assert rs.mode == MODE_LOCAL_SHARE
        assert isinstance(full, Refusal) and full.budget is Budget.NODE_KV and full.used == 0
        rs.settle(held, 1, T0)  # ended; the lease holds its room in Redis until its settle lands
        ended = NodeAsk((("n0", CAP, 0, 0), ("n1", CAP, 0, 0)), 3000, 0.0, 1.0)
        got = await rs.admit(node_plan(ended), T0)
        assert isinstance(got, Grant) and got.picked == "n0" and got.id.startswith("local:")
        assert isinstance(await rs.admit(node_plan(NodeAsk((("n0", CAP, 0, 3000), ("n1", CAP, 0, 0)),
                                                           1, 0.0, 1.0)), T0), Refusal)
    finally:
        await rs.close()
        server.close()


# --- hysteresis -------------------------------------------------------------------------------

async def test_a_flapping_store_waits_longer_each_time_before_it_shares_again():
    """Rule: a failed round trip degrades at once; shared mode returns only once Redis has
    answered every probe for ``recover_s``, which doubles (up to RECOVER_MAX_S) when the
    store fails again within FLAP_WINDOW_S of a return, and is RECOVER_S again otherwise."""
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
        assert waits == [min(RECOVER_MAX_S, RECOVER_S * 2 ** k) for k in range(3)]
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
