"""A prompt prefix shared by requests running on one node is counted once there when the nodes'
ledger is shared by replicas through the Redis store, against a real Redis-protocol server.

The admit script and ``shared_nodes.pick_shared`` with ``sharing.SharedPrefixes`` agree on
random admissions, settles, expiries and a dead replica's release through three replicas;
what Redis keeps per node is what the Python rule counts; the charged KV on a node is never
below what an engine with prefix caching holds for the leases there; requests sharing a
prefix admitted through two replicas are charged it once; hostile prompts cannot grow
Redis without bound.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from collections import Counter

import pytest
import redis as redis_sync
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from extproc.admission import Admission, Demand, Lease, Outcome
from extproc.admission.types import NodeReport
from extproc.admission.shared_nodes import Candidate as C, NodeAsk, others_seen, pick_shared, room_bases
from extproc.admission.sharing import MAX_LINKS, MAX_NODE_KEYS, SharedPrefixes
from extproc.admission.store.fairshare import Want, deferred, gathering, wants as wants_room, yields
from extproc.admission.store.redis import RedisStore
from extproc.admission.store.redis_ledger import read_gens, read_shares
from extproc.admission.types import Budget, Chain, Grant, Plan, PoolLimits, Refusal
from extproc.clock import ManualClock
from extproc.config import RedisStoreConfig
from extproc.configparse import parse_config
from kvgate_testkit.redis_server import RedisServer
from tests.unit.admission.test_prefix_ledger import LEAVES, TRIE, engine_tokens, kvgate_chain, path_to

pytestmark = pytest.mark.redis

T0 = 1000.0
TTL = 60.0
NODES = ("n0", "n1")
WIDE = PoolLimits(pool="p", scale=1.0, limit=10_000, base_limit=10_000, retry_estimate_s=1.0)


def cfg(url: str, **kw) -> RedisStoreConfig:
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("expected_replicas", 2)
    return RedisStoreConfig(url=url, key_prefix=f"t{secrets.token_hex(6)}:", **kw)


def node_plan(ask: NodeAsk, waits: bool = False) -> Plan:
    return Plan(WIDE, "a", "standard", 1, None, ask, waits)


class _Seen:
    """_Seen stands for a grant's node charge where only the store runs: what its mark saw."""

    def __init__(self) -> None:
        self.seen = 0


def _quiet(store: RedisStore) -> RedisStore:
    """_quiet keeps a store from refreshing by itself: the test refreshes it when it says so."""
    store._closed = True
    return store


def _stored_shares(r: redis_sync.Redis, prefix: str) -> dict[str, tuple[int, int]]:
    return {n: v for n, v in read_shares(r.hgetall(f"{prefix}:ps")).items() if v != (0, 0)}


def _model_shares(model: dict[str, SharedPrefixes]) -> dict[str, tuple[int, int]]:
    return {n: (p.shared, p.cross) for n, p in model.items() if (p.shared, p.cross) != (0, 0)}


ADMIT = st.tuples(
    st.just("admit"), st.sampled_from("abc"), st.sampled_from(LEAVES), st.integers(0, 400),   # tail tokens
    st.lists(st.tuples(st.sampled_from(NODES), st.integers(0, 30_000), st.integers(0, 9_000), st.booleans(),
                       st.integers(0, 4_000)),                      # node, cap, foreign, other block, cached
             min_size=1, max_size=2, unique_by=lambda c: c[0]),
    st.sampled_from((0.0, 1.0, 2.5)), st.booleans(), st.booleans())  # affinity; mark saw the published; waits
OPS = st.lists(st.one_of(
    ADMIT,
    st.tuples(st.just("settle"), st.integers(0, 63)),
    st.tuples(st.just("publish"), st.floats(0.0, 1.0)),
    st.tuples(st.just("advance")),
    st.tuples(st.just("release_c"))), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, block=st.sampled_from((16, 32, 256)),
       error=st.dictionaries(st.sampled_from(LEAVES), st.integers(-255, 255)))
# b (half as many leases as a) has a waiting request closest to fitting on n0: a's next
# request takes n1, though n0 is roomier
@example(ops=[("admit", "a", "other", 0, [("n0", 12000, 0, False, 0)], 0.0, False, False),
              ("admit", "a", "other", 0, [("n1", 12000, 0, False, 0)], 0.0, False, False),
              ("admit", "b", "sys", 0, [("n1", 12000, 0, False, 0)], 0.0, False, False),
              ("admit", "b", "sys", 400, [("n0", 12000, 6200, False, 0), ("n1", 12000, 8000, False, 0)], 0.0, False, True),
              ("admit", "a", "sys", 400, [("n0", 12000, 0, False, 0), ("n1", 12000, 0, False, 0)], 0.0, False, False),
              ("admit", "a", "sys", 400, [("n0", 12000, 0, False, 0), ("n1", 12000, 0, False, 0)], 0.0, False, False)],
         block=16, error={})
def test_the_lua_script_counts_shared_prefixes_like_the_python_rule(redis_server: RedisServer, ops: list[tuple],
                                                                     block: int, error: dict[str, int]) -> None:
    """Three replicas admit prompts from a trie of shared prefixes (their ends up to a block off
    the engine's), settle, publish what their marks saw, let replica c's leases expire (it
    never refreshes) or release them as a dead replica's: the script picks, refuses and
    credits as ``pick_shared`` over ``SharedPrefixes`` and the published generations; each
    node's shared and cross tokens in Redis are the model's; and what the ledger charges a
    node (holds less shared) is never below what an engine with prefix caching holds for
    the leases running there."""

    async def run() -> None:
        clock = ManualClock(T0)
        config = cfg(redis_server.url, lease_ttl_s=TTL)
        stores = {name: _quiet(RedisStore(config, clock=clock)) for name in "abc"}
        for who in "ab":  # as serving replicas do: their refreshes run (and purge) in the pool from the start
            stores[who].know_pools(["p"])
        r = redis_sync.Redis.from_url(redis_server.url)
        prefix = f"{config.key_prefix}{{p}}"
        model: dict[str, SharedPrefixes] = {n: SharedPrefixes() for n in NODES}
        held = dict.fromkeys(NODES, 0)
        # live leases: grant, replica, path, tail, keys taken, expiry (s)
        live: list[tuple[Grant, str, list[str], int, tuple[int, ...], float]] = []
        wanting: dict[str, Want] = {}  # replica id -> its latest refusal that wants room (fairshare)

        def end(i: int) -> None:
            g, who, _path, _tail, keys, _exp = live.pop(i)
            model[g.picked].drop(keys, stores[who].replica_id)
            held[g.picked] -= g.node_hold

        def expire() -> None:  # every script first purges the leases whose expiry has passed
            for i in reversed(range(len(live))):
                if live[i][5] <= clock.now():
                    end(i)

        try:
            for op in ops:
                if op[0] == "admit":
                    _, who, leaf, tail, rows, affinity, saw, waits = op
                    path = path_to(leaf)
                    chain = kvgate_chain(path, error, block)
                    prompt = sum(TRIE[n][1] for n in path) + tail
                    since = clock.now() + 0.1 if saw else None
                    cands = tuple(C(n, cap, f, 0, 0, since, False, 2 * block if other else block, min(prompt, cached))
                                  for n, cap, f, other, cached in rows)
                    ask = NodeAsk(cands, prompt, 0.0, 1.0, None, chain, prompt, affinity)
                    expire()
                    gens = read_gens(r.hgetall(f"{prefix}:sr"), r.hgetall(f"{prefix}:sn"))
                    me = stores[who].replica_id
                    others = {c.name: others_seen(gens, me, c.name, since, False) for c in cands}
                    plan = node_plan(ask, waits)
                    # the nodes the wants this replica defers to gather room on are taken last
                    leases = Counter(stores[w].replica_id for _g, w, *_ in live)
                    totals = {c.name: held[c.name] - model[c.name].shared for c in cands}
                    last = gathering(deferred(me, plan.tokens, leases, wanting, clock.now()), totals)
                    want = pick_shared(ask, held, others, None, model, last)
                    got = await stores[who].admit(plan, clock.now())
                    if want.chosen is None:
                        assert isinstance(got, Refusal), (got, want)
                        assert got.budget is Budget.NODE_KV and got.used == (want.best_room or 0)
                        if wants_room(got.budget, got.retryable, plan.waits):
                            wanting[me] = Want(clock.now(), plan.tokens, ask.need, room_bases(ask, others, model))
                        continue
                    if yields(me, plan.tokens, leases, wanting, clock.now(), totals, want.chosen):
                        assert isinstance(got, Refusal) and got.budget is Budget.FAIR_SHARE, (got, leases, wanting)
                        continue
                    wanting.pop(me, None)
                    assert isinstance(got, Grant) and got.picked == want.chosen, (got, want)
                    c = next(c for c in cands if c.name == want.chosen)
                    shares = model[want.chosen]
                    credit = min(prompt, shares.credit(chain, c.block))
                    sh = got.node_shared
                    assert (sh.credit, sh.by_affinity) == (credit, want.by_affinity) if sh else \
                        credit == 0 and not want.by_affinity
                    k = shares.add(chain, c.block, me)
                    held[want.chosen] += prompt
                    got.node = _Seen()
                    live.append((got, who, path, tail, chain.keys[:k], clock.now() + TTL))
                elif op[0] == "settle":
                    # a lease this model holds is settled: its script purges the expired ones
                    # first (none runs when there is no lease to settle)
                    if live:
                        g, who = live[op[1] % len(live)][:2]
                        stores[who].settle(g, 1, clock.now())
                        await stores[who].flush()
                        expire()
                        j = next((k for k, x in enumerate(live) if x[0] is g), None)
                        if j is not None:
                            end(j)
                elif op[0] in ("publish", "advance"):
                    # a and b refresh their leases (publishing what their marks saw); c never
                    # does: its leases run out in two advances
                    for g, who, *_ in live:
                        if who != "c" and op[0] == "publish":
                            g.node.seen = int(op[1] * g.node_hold)
                    expire()
                    for who in "ab":
                        assert await stores[who].refresh()
                    for i, (g, who, path, tail, keys, _exp) in enumerate(live):
                        if who != "c":
                            live[i] = (g, who, path, tail, keys, clock.now() + TTL)
                    if op[0] == "advance":
                        clock.advance(TTL * 0.6)
                elif op[0] == "release_c":
                    stores["a"].know_pools(["p"])
                    await stores["a"]._gone.release(stores["c"].replica_id)
                    for i in reversed(range(len(live))):
                        if live[i][1] == "c":
                            end(i)
                    expire()
                assert _stored_shares(r, prefix) == _model_shares(model)
                nk = {k.decode(): int(v) for k, v in r.hgetall(f"{prefix}:nk").items()}
                for n in NODES:
                    running = [(path, tail) for g, _w, path, tail, _k, _e in live if g.picked == n]
                    charged = nk.get(n, 0) - model[n].shared
                    assert charged == held[n] - model[n].shared
                    assert charged >= engine_tokens(running, block), (n, running)
            for g, who, *_ in live:
                stores[who].settle(g, 1, clock.now())
                await stores[who].flush()
            for suffix in ("pk", "ps", "lk"):
                assert r.hlen(f"{prefix}:{suffix}") == 0, suffix
        finally:
            for s in stores.values():
                await s._client.aclose()

    asyncio.run(run())


# --- two replicas through the controller -------------------------------------------------------

SYSTEM_TOKENS = 10_000
BLOCK = 16


def chain_of(names: list[tuple[str, int]]) -> Chain:
    from tests.unit.admission.test_prefix_ledger import chain_of as chained
    return chained(names)


def picking_config(cap: int, shared_prefix: bool = True) -> object:
    return parse_config({"pools": {"default": {
        "max_concurrency": 1000,
        "backends": [{"name": "n0", "metrics_url": "http://127.0.0.1:9/n0", "address": "127.0.0.1:8001",
                      "kv_capacity_tokens": cap}],
        "picking": {"growth": "worst_case", "reserve_fraction": 0.0, "shared_prefix": shared_prefix,
                    "block_tokens": BLOCK}}}})


def shared_ask(i: int) -> Demand:
    return Demand(pool="default", tenant="t", class_name="standard", prompt_tokens=SYSTEM_TOKENS + 200,
                  reserved_completion=800, prefix=chain_of([("system", SYSTEM_TOKENS), (f"q{i}", 200)]))


async def _admit_through(replicas: list[Admission], n: int) -> list[Lease | object]:
    out = []
    for i in range(n):
        adm = replicas[i % len(replicas)]
        out.append(await adm.acquire(shared_ask(i)))
    return out


async def test_requests_sharing_a_prefix_through_two_replicas_are_charged_it_once(redis_server):
    """12 requests of 11,000 tokens (10,000 of them a shared system prompt) on a node of
    50,000: whole, four fit; one replica alone charges the prefix once and takes all 12; so
    do two replicas through Redis, alternating, and the node's charge in Redis is what the
    one replica's own ledger holds."""
    alone_clock = ManualClock(T0)
    alone = Admission(picking_config(50_000), alone_clock)
    alone.report_node("default", "n0", NodeReport(kv_usage=0.0, capacity_tokens=50_000, at=T0))
    by_one = await _admit_through([alone], 12)
    assert all(isinstance(x, Lease) for x in by_one)
    (one,) = alone.nodes("default")
    clock = ManualClock(T0)
    shared = cfg(redis_server.url)
    a, b = (Admission(picking_config(50_000), clock, RedisStore(shared, clock=clock)) for _ in range(2))
    blind = Admission(picking_config(50_000, shared_prefix=False), clock, RedisStore(cfg(redis_server.url),
                                                                                     clock=clock))
    got: list = []
    try:
        for adm in (a, b, blind):
            adm.report_node("default", "n0", NodeReport(kv_usage=0.0, capacity_tokens=50_000, at=T0))
        got = await _admit_through([a, b], 12)
        assert all(isinstance(x, Lease) for x in got)
        r = redis_sync.Redis.from_url(redis_server.url)
        prefix = f"{shared.key_prefix}{{default}}"
        (shares,) = read_shares(r.hgetall(f"{prefix}:ps")).values()
        charged = int(r.hget(f"{prefix}:nk", "n0")) - shares[0]
        assert charged == one.held_tokens == 12 * 11_000 - 11 * (SYSTEM_TOKENS - BLOCK)
        # half the requests through each replica: the cross-replica part is the prefix once
        assert shares[1] == SYSTEM_TOKENS
        mine = [sum(s.credit_tokens for s in adm.nodes("default")) for adm in (a, b)]
        assert sum(mine) == 11 * (SYSTEM_TOKENS - BLOCK)
        whole = await _admit_through([blind], 5)
        assert [isinstance(x, Lease) for x in whole] == [True] * 4 + [False]
        for x in [*got, *whole]:
            if isinstance(x, Lease):
                x.release(Outcome.COMPLETED, 10)
        for s in (a.store, b.store, blind.store):
            await s.flush()
        assert all(r.hlen(f"{prefix}:{k}") == 0 for k in ("pk", "ps", "lk"))
    finally:
        for x in by_one:
            if isinstance(x, Lease):
                x.release(Outcome.COMPLETED, 10)
        for adm in (alone, a, b, blind):
            await adm.close()


async def test_a_report_subtracts_a_prefix_held_through_two_replicas_once(redis_server):
    """Replicas a and b each run 3 requests sharing one 10,000-token prefix on a node that also
    holds 20,000 tokens of others', all streaming: the node holds the prefix once. a's mark
    subtracts its three with the prefix once, b publishes its three with the prefix once:
    subtracted twice, but the script gives the cross-replica part back, so a reads the
    foreign KV less only the ends' margin (a block per request that shares) and admits just
    the room there is. Without the give-back a read 10,000 tokens more room than there is."""
    clock = ManualClock(T0)
    cap = 100_000
    shared = cfg(redis_server.url)
    sa, sb = RedisStore(shared, clock=clock), RedisStore(shared, clock=clock)
    a, b = Admission(picking_config(cap), clock, sa), Admission(picking_config(cap), clock, sb)
    held = []
    try:
        for s in (sa, sb):
            s.know_pools(["default"])
        for adm in (a, b):
            adm.report_node("default", "n0", NodeReport(kv_usage=0.2, capacity_tokens=cap, at=T0))
        for i in range(6):
            adm = (a, b)[i % 2]
            got = await adm.acquire(shared_ask(i))
            assert isinstance(got, Lease)
            got.progress(1)
            held.append(got)
        clock.advance(0.5)
        b.mark_nodes(1)
        assert await sb.refresh()
        clock.advance(0.5)
        assert await sa.refresh()
        a.mark_nodes(1)
        # the engine: 20,000 foreign, the prefix once, each request's question and first token
        usage = (20_000 + SYSTEM_TOKENS + 6 * 201) / cap
        a.report_node("default", "n0", NodeReport(kv_usage=usage, capacity_tokens=cap, at=clock.now(),
                                                  mark=1, waiting=0, running=6))
        once = 3 * 10_201 - 2 * (SYSTEM_TOKENS - BLOCK)   # each replica's three, the prefix once
        foreign = math.ceil(usage * cap) - once - (once - SYSTEM_TOKENS)
        assert 20_000 - 4 * BLOCK <= foreign <= 20_000
        ours = 6 * 11_000 - 5 * (SYSTEM_TOKENS - BLOCK)    # every hold, the prefix once
        room = cap - foreign - ours
        for need, fits in ((room + 1, False), (room, True)):
            got = await a.acquire(Demand(pool="default", tenant="t", class_name="standard",
                                         prompt_tokens=need, reserved_completion=0))
            assert isinstance(got, Lease) is fits, (need, got)
            if isinstance(got, Lease):
                got.release(Outcome.COMPLETED, 0)
                await sa.flush()
    finally:
        for x in held:
            x.release(Outcome.COMPLETED, 1)
        await a.close()
        await b.close()


# --- bounds ------------------------------------------------------------------------------------

def _unique_chain(tag: str, keys: int, each: int = 64) -> Chain:
    base = int.from_bytes(tag.encode()[:6].ljust(6, b"\0"), "little") << 16
    return Chain(tuple(base + i for i in range(keys)), tuple(each * (i + 1) for i in range(keys)))


async def test_hostile_prompts_cannot_grow_the_shared_ledger_without_bound(redis_server):
    """A chain of more than MAX_LINKS keys takes MAX_LINKS; once a node holds MAX_NODE_KEYS
    distinct keys, a request with new ones takes only those it shares (its credit is the
    same) and one sharing nothing takes none: Redis holds at most MAX_NODE_KEYS keys a node,
    and settling everything leaves nothing."""
    clock = ManualClock(T0)
    rs = _quiet(RedisStore(cfg(redis_server.url, lease_ttl_s=3600.0), clock=clock))
    r = redis_sync.Redis.from_url(redis_server.url)
    prefix = f"{rs.config.key_prefix}{{p}}"
    cand = (C("n0", 10**12, 0, 0, 0, None, False, 16, 0),)
    grants: list[Grant] = []

    async def admit(chain: Chain) -> Grant:
        ask = NodeAsk(cand, chain.ends[-1], 0.0, 1.0, None, chain, chain.ends[-1], 1.0)
        got = await rs.admit(node_plan(ask), T0)
        assert isinstance(got, Grant)
        grants.append(got)
        return got

    try:
        long = await admit(_unique_chain("long", 4 * MAX_LINKS))
        assert len(r.hget(f"{prefix}:lk", long.id).split()) == MAX_LINKS
        i = 0
        while int(r.hget(f"{prefix}:ps", "n0\tn")) + MAX_LINKS <= MAX_NODE_KEYS:
            await admit(_unique_chain(f"u{i}", MAX_LINKS))
            i += 1
        full = int(r.hget(f"{prefix}:ps", "n0\tn"))
        stranger = await admit(_unique_chain("stranger", MAX_LINKS))
        assert stranger.node_shared is None and not r.hexists(f"{prefix}:lk", stranger.id)
        # shares the long one's first 100 keys, then goes its own way
        half = _unique_chain("long", 100)
        own = _unique_chain("tail", MAX_LINKS - 100)
        sharer = await admit(Chain(half.keys + own.keys, half.ends + tuple(6400 + e for e in own.ends)))
        assert sharer.node_shared.credit == 6400 - 16
        assert len(r.hget(f"{prefix}:lk", sharer.id).split()) == 100
        assert int(r.hget(f"{prefix}:ps", "n0\tn")) == full <= MAX_NODE_KEYS
        for g in grants:
            rs.settle(g, 1, T0)
        await rs.flush()
        assert all(r.hlen(f"{prefix}:{k}") == 0 for k in ("pk", "ps", "lk"))
    finally:
        await rs._client.aclose()


# --- while Redis is away ------------------------------------------------------------------------

async def test_alone_a_replica_counts_a_shared_lease_only_for_its_unshared_room(redis_server):
    """Cut off from Redis, a replica admits within the room its ended leases keep in the ledger.
    A lease whose prefix the ledger may count once with another replica's keeps its hold less
    the prefix's blocks for sure, so only that much is counted on: the new request is
    charged whole there."""
    clock = ManualClock(T0)
    server = RedisServer().start()
    rs = RedisStore(cfg(server.url, timeout_s=0.5), clock=clock)
    try:
        chain = chain_of([("system", SYSTEM_TOKENS), ("q", 200)])
        cand = (C("n0", 100_000, 0, 0, 0, None, False, BLOCK, 0),)
        first = await rs.admit(node_plan(NodeAsk(cand, 11_000, 0.0, 1.0, None, chain, 10_200, 0.0)), T0)
        assert isinstance(first, Grant) and first.node_shared.keyed == 10_192
        server.stop()
        # the first round trip fails: alone from now on, with no room while the lease runs
        assert isinstance(await rs.admit(node_plan(NodeAsk((C("n0", 100_000, 0, 11_000),), 1, 0.0, 1.0)), T0),
                          Refusal)
        rs.settle(first, 1, T0)  # ended; its settle waits for Redis
        room = 11_000 - 10_192
        for need, fits in ((room + 1, False), (room, True)):
            ask = NodeAsk((C("n0", 100_000, 0, 0),), need, 0.0, 1.0)
            got = await rs.admit(node_plan(ask), T0)
            assert isinstance(got, Grant) is fits, got
    finally:
        await rs.close()
        server.close()
