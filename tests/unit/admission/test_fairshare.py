"""Replicas share a saturated pool fairly (``store.fairshare``): the rule, and the admit
script applying it through a real Redis-protocol server, at fixed instants."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import redis as redis_sync
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from extproc.admission import Admission, Demand, Lease, Outcome, Rejection
from extproc.admission.shared_nodes import Candidate, NodeAsk
from extproc.admission.rules import choose_node
from extproc.admission.store.fairshare import FAIR_WINDOW_S, Want, deferred, gathering, target, wants, yields
from extproc.admission.store.redis import RedisStore
from extproc.admission.types import Budget, Grant, Plan, PoolLimits, Refusal
from extproc.clock import ManualClock
from extproc.configparse import parse_config
from extproc.outcomes import REJECTED_BY, RequestOutcome
from tests.unit.admission.test_redis_store import (T0, cfg, limits, open_store, plan, stores,  # noqa: F401
                                                   wait_for_event)

pytestmark = pytest.mark.redis


def waiting(p: Plan) -> Plan:
    """waiting is ``p`` as the bounded wait re-tries it: its refusal keeps it waiting."""
    return dataclasses.replace(p, waits=True)


@pytest.mark.parametrize("budget, retryable, waits, expected", [
    (Budget.SLOTS, True, True, True),
    (Budget.NODE_KV, True, True, True),
    (Budget.SLOTS, True, False, False),     # answered with a 429 at once: never comes back for the room
    (Budget.SLOTS, False, True, False),     # refused for good
    (Budget.POOL_TPM, True, True, False),   # a bucket's refusal is about time, not room
])
def test_only_a_refusal_that_keeps_its_request_waiting_wants_room(budget, retryable, waits, expected):
    assert wants(budget, retryable, waits) is expected


@pytest.mark.parametrize("leases, wants, now, expected", [
    ({"a": 2, "b": 1}, {}, T0, False),                                   # nobody wants room
    ({"a": 2, "b": 1}, {"b": Want(T0, 10)}, T0, True),                       # b wants and holds fewer
    ({"a": 2, "b": 1}, {"b": Want(T0, 11)}, T0, False),                      # b's request is larger
    ({"a": 2, "b": 1}, {"b": Want(T0, 10)}, T0 + FAIR_WINDOW_S, False),      # b stopped asking
    ({"a": 2, "b": 2}, {"b": Want(T0, 10)}, T0, False),                      # equal: a takes it
    ({"a": 1, "b": 2}, {"b": Want(T0, 10)}, T0, False),                      # b holds more
    ({"a": 2}, {"b": Want(T0, 1)}, T0, True),                                # b holds none
    ({"a": 2, "b": 1}, {"a": Want(T0, 10)}, T0, False),                      # a's own want
    ({}, {"b": Want(T0, 10)}, T0, False),                                    # a holds none
])
def test_a_replica_yields_only_to_one_that_wants_room_and_holds_less(leases, wants, now, expected):
    assert yields("a", 10, leases, wants, now) is expected


async def test_the_room_a_replica_frees_goes_to_the_one_refused_meanwhile(stores, redis_server):
    """a holds three of four slots and b one; b is refused; a's request ends, and a's next
    admission (which a replica sends at once, with the settle) leaves the slot to b's next
    try; once b is served (or stops asking), a admits again. Without the rule a takes the
    slot back at once, and the replica with more leases keeps getting more."""
    clock = ManualClock(T0)
    config = cfg(redis_server.url)
    a, b = open_store(stores, config, clock), open_store(stores, config, clock)
    lim = limits(base=4, kv=None, tpm=None, guarantees={})
    held = [*[await a.admit(plan(10, lim), T0) for _ in range(3)], await b.admit(plan(10, lim), T0)]
    assert all(isinstance(g, Grant) for g in held)
    refused = await b.admit(waiting(plan(10, lim)), T0)
    assert isinstance(refused, Refusal) and refused.budget is Budget.SLOTS
    a.settle(held[0], 10, T0 + 0.01)
    yielded = await a.admit(plan(10, lim), T0 + 0.01)
    assert isinstance(yielded, Refusal) and yielded.budget is Budget.FAIR_SHARE and yielded.retryable
    # the client is told why: this replica's leases (two live) and the wanting one's (one)
    assert (yielded.used, yielded.limit) == (2, 1)
    taken = await b.admit(waiting(plan(10, lim)), T0 + 0.02)
    assert isinstance(taken, Grant)
    # a holds two and b one again, and nobody wants room: a takes what frees next
    b.settle(taken, 10, T0 + 0.03)
    await b.flush()
    assert isinstance(await a.admit(plan(10, lim), T0 + 0.03), Grant)


async def test_a_want_ends_after_its_window_and_the_counts_leave_with_the_leases(stores, redis_server):
    clock = ManualClock(T0)
    config = cfg(redis_server.url, lease_ttl_s=30.0)
    a, b, c = (open_store(stores, config, clock) for _ in range(3))
    lim = limits(base=2, kv=None, tpm=None, guarantees={})
    first = await a.admit(plan(10, lim), T0)
    assert isinstance(first, Grant) and isinstance(await a.admit(plan(10, lim), T0), Grant)
    assert isinstance(await b.admit(waiting(plan(10, lim)), T0), Refusal)
    a.settle(first, 10, T0)
    assert isinstance(await a.admit(plan(10, lim), T0), Refusal)  # b wants room, holds none
    assert isinstance(await a.admit(plan(10, lim), T0 + FAIR_WINDOW_S), Grant)  # b stopped asking
    st = f"{config.key_prefix}{{p}}:st"
    r = redis_sync.Redis.from_url(redis_server.url)
    assert int(r.hget(st, f"r:{a.replica_id}")) == 2
    # a dies (no settle, no refresh): its leases expire and its count goes with them
    await a.close()
    clock.advance(31.0)
    assert isinstance(await c.admit(plan(10, lim), clock.now()), Grant)
    assert r.hget(st, f"r:{a.replica_id}") is None and int(r.hget(st, f"r:{c.replica_id}")) == 1


@pytest.mark.parametrize("want, held, expected", [
    (Want(T0, 10), {"n0": 0}, None),                                              # slots: no node
    (Want(T0, 10, 2500, (("n0", 10_000), ("n1", 9000))), {"n0": 7000, "n1": 5000}, "n1"),  # 4,000 of room
    (Want(T0, 10, 2500, (("n0", 10_000), ("n1", 9000))), {"n0": 5000, "n1": 5000}, "n0"),
    (Want(T0, 10, 2500, (("n0", 10_000), ("n1", 9000))), {"n1": 9000}, "n1"),     # n0 not read: not counted
    (Want(T0, 10, 2500, (("n2", 10_000),)), {"n0": 0}, None),
])
def test_a_node_want_gathers_room_where_its_request_is_closest_to_fitting(want, held, expected):
    assert target(want, held) == expected


@pytest.mark.parametrize("node, expected", [("n0", True), ("n1", False), (None, False)])
def test_a_replica_yields_to_a_node_want_only_on_the_node_it_gathers_on(node, expected):
    want = Want(T0, 10, 2500, (("n0", 10_000), ("n1", 10_000)))
    held = {"n0": 7000, "n1": 8000}
    assert gathering(deferred("a", 10, {"a": 3, "b": 2}, {"b": want}, T0), held) == {"n0"}
    assert yields("a", 10, {"a": 3, "b": 2}, {"b": want}, T0, held, node) is expected
    # a want of slots is yielded to wherever the request goes
    assert yields("a", 10, {"a": 3, "b": 2}, {"b": Want(T0, 10)}, T0, held, node) is True
    # and so is a replica holding less than half as many leases (as after a fault)
    assert yields("a", 10, {"a": 3, "b": 1}, {"b": want}, T0, held, node) is True


def test_the_nodes_gathered_on_are_chosen_only_when_no_other_fits():
    rooms = [("n0", 6000, None), ("n1", 5000, None)]
    assert choose_node(rooms, 4000).chosen == "n0"
    taken = choose_node(rooms, 4000, last=frozenset({"n0"}))
    assert taken.chosen == "n1" and not taken.by_affinity  # not an affinity's choice
    assert choose_node(rooms, 5500, last=frozenset({"n0"})).chosen == "n0"  # n0 alone fits


def two_node_plan(lim: PoolLimits, need: int, foreign: int, waits: bool = False) -> Plan:
    """two_node_plan is a plan of ``need`` tokens on nodes n0 and n1 of 10,000 tokens each,
    which the asking replica reads holding ``foreign`` tokens for others on each."""
    ask = NodeAsk((Candidate("n0", 10_000, foreign, 0), Candidate("n1", 10_000, foreign, 0)), need, 0.0, 1.0)
    return Plan(lim, "a", "standard", need, None, ask, waits)


async def test_a_replica_leaves_the_node_a_poorer_replicas_request_gathers_room_on(stores, redis_server):
    """a holds 4,000 tokens on n0 and 5,000 on n1; b reads 3,000 more on each node (the
    others' requests its reading counts as foreign) and its waiting request of 4,000 is
    refused: it is closest to fitting on n0. a's next request of 4,000 fits both nodes and
    would take n0, the roomier: it takes n1, and is granted (the old rule refused it, and
    the room on n0 seated nothing of b's). a's request after that fits only n0: a leaves it
    to b's request, and b's next try is granted once b reads n0 as a does."""
    clock = ManualClock(T0)
    config = cfg(redis_server.url)
    a, b = open_store(stores, config, clock), open_store(stores, config, clock)
    lim = limits(base=100, kv=None, tpm=None, guarantees={})
    first = await a.admit(two_node_plan(lim, 4000, 0), T0)
    second = await a.admit(two_node_plan(lim, 5000, 0), T0)
    assert isinstance(first, Grant) and isinstance(second, Grant)
    assert (first.picked, second.picked) == ("n0", "n1")
    small = await b.admit(two_node_plan(lim, 100, 0), T0)   # b holds half as many leases as a
    assert isinstance(small, Grant) and small.picked == "n0"
    refused = await b.admit(two_node_plan(lim, 4000, 3000, waits=True), T0)
    assert isinstance(refused, Refusal) and refused.budget is Budget.NODE_KV
    away = await a.admit(two_node_plan(lim, 4000, 0), T0 + 0.01)
    assert isinstance(away, Grant) and away.picked == "n1"
    left = await a.admit(two_node_plan(lim, 4000, 0), T0 + 0.02)
    assert isinstance(left, Refusal) and left.budget is Budget.FAIR_SHARE and left.retryable
    got = await b.admit(two_node_plan(lim, 4000, 0, waits=True), T0 + 0.03)
    assert isinstance(got, Grant) and got.picked == "n0"


async def test_a_request_answered_with_a_429_at_once_leaves_no_want(stores, redis_server):
    """b's request that does not wait is refused and answered with a 429 (it never comes back
    for the room): the room a's request frees goes to a's next admission at once, and Redis
    keeps no want of b's. Were every refusal a want, a would leave the slot empty for the
    window while nobody takes it (the replicas' end-to-end test of the global limit failed
    under load that way)."""
    clock = ManualClock(T0)
    config = cfg(redis_server.url)
    a, b = open_store(stores, config, clock), open_store(stores, config, clock)
    lim = limits(base=2, kv=None, tpm=None, guarantees={})
    held = [await a.admit(plan(10, lim), T0) for _ in range(2)]
    assert all(isinstance(g, Grant) for g in held)
    refused = await b.admit(plan(10, lim), T0)
    assert isinstance(refused, Refusal) and refused.budget is Budget.SLOTS and refused.retryable
    r = redis_sync.Redis.from_url(redis_server.url)
    st = f"{config.key_prefix}{{p}}:st"
    assert r.hget(st, f"w:{b.replica_id}") is None
    a.settle(held[0], 10, T0 + 0.01)
    assert isinstance(await a.admit(plan(10, lim), T0 + 0.01), Grant)


def demand(cls: str) -> Demand:
    """demand is a request of class ``cls`` to the pool of ``two_replicas``."""
    return Demand(pool="default", tenant="t", class_name=cls, prompt_tokens=10, reserved_completion=10)


def two_replicas(stores, redis_server, clock: ManualClock, slots: int) -> tuple[Admission, Admission, str, str]:
    """two_replicas is the controllers of replicas a and b on one Redis, a pool of ``slots``
    shared by a class that answers at once (``standard``) and one that waits (``patient``);
    with the pool's ledger hash and b's want field in it."""
    config = parse_config({"pools": {"default": {"max_concurrency": slots}},
                           "tenants": {"classes": {"standard": {}, "patient": {"max_wait_s": 30}}}})
    store_cfg = cfg(redis_server.url)
    a = Admission(config, clock, open_store(stores, store_cfg, clock))
    b_store = open_store(stores, store_cfg, clock)
    return (a, Admission(config, clock, b_store), f"{store_cfg.key_prefix}{{default}}:st",
            f"w:{b_store.replica_id}")


async def test_only_requests_that_wait_make_their_replica_want_room(stores, redis_server):
    """Through the controller: b's request of a class that answers a refusal with a 429 at
    once leaves no want; one of a class with a ``max_wait_s`` wants room from its first
    try, and its re-tries in the bounded wait keep wanting (each re-try stamps its instant)."""
    clock = ManualClock(T0)
    a, b, st, want = two_replicas(stores, redis_server, clock, 1)
    r = redis_sync.Redis.from_url(redis_server.url)
    held = await a.acquire(demand("standard"))
    assert isinstance(held, Lease)
    assert isinstance(await b.acquire(demand("standard")), Rejection)
    assert r.hget(st, want) is None
    waiter = asyncio.create_task(b.acquire(demand("patient")))
    await wait_for_event(lambda: r.hget(st, want) is not None)
    assert float(r.hget(st, want).split()[0]) == T0
    clock.advance(FAIR_WINDOW_S)  # the next re-try (one shared poll on) wants again, at its instant
    await wait_for_event(lambda: float(r.hget(st, want).split()[0]) == T0 + FAIR_WINDOW_S)
    held.release(Outcome.COMPLETED, 5)
    assert isinstance(await asyncio.wait_for(waiter, 10), Lease)
    assert r.hget(st, want) is None  # granted: it wants no more


async def test_a_yield_reaches_the_client_as_a_fair_share_refusal(stores, redis_server):
    """Through the controller: a holds both slots, b's request waits for one; a's request ends,
    and a's next request fits but is left to b's waiter. Its client gets a 429 of its own
    reason (``fair_share``, counted as ``rejected_fair_share``), not of a full pool: a slot
    is free, and the message says whose requests wait for it."""
    clock = ManualClock(T0)
    a, b, st, want = two_replicas(stores, redis_server, clock, 2)
    r = redis_sync.Redis.from_url(redis_server.url)
    held = [await a.acquire(demand("standard")) for _ in range(2)]
    assert all(isinstance(h, Lease) for h in held)
    waiter = asyncio.create_task(b.acquire(demand("patient")))
    await wait_for_event(lambda: r.hget(st, want) is not None)
    held[0].release(Outcome.COMPLETED, 5)
    refused = await a.acquire(demand("standard"))
    assert isinstance(refused, Rejection) and refused.retryable
    assert REJECTED_BY[refused.reason] == RequestOutcome.REJECTED_FAIR_SHARE
    assert "this one holds 1 of its requests" in refused.message and "a replica holding 0" in refused.message
    clock.advance(FAIR_WINDOW_S)  # b's waiter re-tries at its next poll and takes the slot
    assert isinstance(await asyncio.wait_for(waiter, 10), Lease)


# --- the script against the rule, on random traffic of three replicas --------------------------

FAIR_ADMIT = st.tuples(st.just("admit"), st.sampled_from("aaabc"), st.sampled_from((5, 10, 20)), st.booleans())  # waits
# admissions three times as often as the rest, and most by a, so that the pool is full, a holds
# more than the others and the rule has work
FAIR_OPS = st.lists(st.one_of(
    FAIR_ADMIT, FAIR_ADMIT, FAIR_ADMIT,
    st.tuples(st.just("settle"), st.integers(0, 63)),
    st.tuples(st.just("advance"), st.sampled_from((0.05, 0.1, 0.3)))), min_size=10, max_size=50)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=FAIR_OPS, slots=st.integers(1, 4))
# a holds both slots, b's waiting request is refused, a's request ends: a's next yields to b
@example(ops=[("admit", "a", 10, False), ("admit", "a", 10, False), ("admit", "b", 10, True), ("settle", 0),
              ("admit", "a", 10, False), ("admit", "b", 10, True), ("admit", "a", 10, False)], slots=2)
# the same with a request of c's that is answered with a 429 at once: a takes the room back
@example(ops=[("admit", "a", 10, False), ("admit", "a", 10, False), ("admit", "c", 10, False), ("settle", 0),
              ("admit", "a", 10, False)], slots=2)
def test_the_admit_script_shares_slots_as_the_python_rule(redis_server, ops: list[tuple], slots: int) -> None:
    """Three replicas admit (waiting or not), settle and let time pass over a pool of
    ``slots`` slots: the script grants, refuses for slots, and yields exactly as ``wants``
    and ``yields`` say over the model's leases and wants."""

    async def run() -> None:
        clock = ManualClock(T0)
        config = cfg(redis_server.url, lease_ttl_s=3600.0)
        stores = {who: RedisStore(config, clock=clock) for who in "abc"}
        lim = limits(base=slots, kv=None, tpm=None, guarantees={})
        live: list[tuple[Grant, str]] = []
        wanting: dict[str, Want] = {}
        try:
            for op in ops:
                if op[0] == "admit":
                    _, who, tokens, waits = op
                    me, now = stores[who].replica_id, clock.now()
                    got = await stores[who].admit(dataclasses.replace(plan(tokens, lim), waits=waits), now)
                    leases = Counter(stores[w].replica_id for _g, w in live)
                    if len(live) >= slots:
                        assert isinstance(got, Refusal) and got.budget is Budget.SLOTS, got
                        if wants(got.budget, got.retryable, waits):
                            wanting[me] = Want(now, tokens)
                    elif yields(me, tokens, leases, wanting, now):
                        assert isinstance(got, Refusal) and got.budget is Budget.FAIR_SHARE, (got, leases, wanting)
                    else:
                        assert isinstance(got, Grant), (got, leases, wanting)
                        wanting.pop(me, None)
                        live.append((got, who))
                elif op[0] == "settle" and live:
                    g, who = live.pop(op[1] % len(live))
                    stores[who].settle(g, g.plan.tokens, clock.now())
                    await stores[who].flush()
                elif op[0] == "advance":
                    clock.advance(op[1])
        finally:
            for s in stores.values():
                await s.close()

    asyncio.run(run())
