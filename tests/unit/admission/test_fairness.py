"""Fairness between the tenants of one class: the wait queue serves them in turn, by weight.

Through ``Admission`` with a manual clock (the order waiters get a slot that frees), then
the queue alone: a property test that it never loses or duplicates a waiter, keeps
priority between classes, and gives every backlogged flow of a class its share within
one largest request of each (``waitqueue``'s module doc: the SCFQ bound).
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.admission import Admission, Demand, Lease, Outcome
from extproc.admission.store.base import Store
from extproc.admission.types import Budget, Plan, Refusal
from extproc.admission.waitqueue import Step, Waiter, WaitQueue
from extproc.clock import ManualClock
from tests.unit.admission.helpers import config, quiet, tenants, until

CLASSES = {"standard": {"max_wait_s": 60}, "fifo": {"max_wait_s": 60, "fairness": "fifo"}}


def demand(tenant: str, class_name: str = "standard", prompt: int = 100,
           fairness_id: str | None = None) -> Demand:
    return Demand(pool="default", tenant=tenant, class_name=class_name, prompt_tokens=prompt,
                  reserved_completion=0, fairness_id=fairness_id)


async def served_order(adm: Admission, demands: list[tuple[str, Demand]]) -> list[str]:
    """served_order queues ``demands`` (name, demand) in order behind one held slot, then frees
    the slot and lets each waiter in turn run and release: the names in the order served."""
    held = await adm.acquire(demand("holder"))
    assert isinstance(held, Lease)
    order: list[str] = []

    async def want(name: str, d: Demand) -> None:
        lease = await adm.acquire(d)
        assert isinstance(lease, Lease)
        order.append(name)
        await asyncio.sleep(0)
        lease.release(Outcome.COMPLETED, 1)

    tasks = []
    for i, (name, d) in enumerate(demands):
        tasks.append(asyncio.create_task(want(name, d)))
        await until(lambda: adm.snapshot("default").waiting == i + 1)
    held.release(Outcome.COMPLETED, 1)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    await quiet(adm)
    return order


def one_slot(clock: ManualClock, store: Store | None = None, tenants_: dict[str, Any] | None = None) -> Admission:
    return Admission(config(pool={"max_concurrency": 1}, tenants=tenants(CLASSES, tenants_)), clock, store)


async def test_a_quiet_tenant_is_served_in_turn_not_after_a_loud_burst(clock: ManualClock, store: Store):
    # 10 of loud's requests queue first, then 2 of quiet's, all in one class: quiet's are
    # served in turn with loud's (2nd and 4th), not after the whole burst (11th and 12th).
    adm = one_slot(clock, store)
    order = await served_order(adm, [("L", demand("loud"))] * 10 + [("Q", demand("quiet"))] * 2)
    assert "".join(order) == "LQLQLLLLLLLL"


async def test_a_fifo_class_keeps_arrival_order(clock: ManualClock):
    adm = one_slot(clock)
    order = await served_order(adm, [("L", demand("loud", "fifo"))] * 10 + [("Q", demand("quiet", "fifo"))] * 2)
    assert "".join(order) == "L" * 10 + "QQ"


async def test_weights_share_the_turns(clock: ManualClock):
    # heavy has weight 3: three of its requests for each of light's, while both wait.
    adm = one_slot(clock, tenants_={"heavy": {"weight": 3}, "light": {}})
    order = await served_order(adm, [("H", demand("heavy"))] * 9 + [("l", demand("light"))] * 3)
    # Equal tags (light's 1st and heavy's 3rd) go in either order: tags are floats.
    for i in range(0, 12, 4):
        assert sorted(order[i:i + 4]) == ["H", "H", "H", "l"], order


async def test_turns_are_counted_in_tokens(clock: ManualClock):
    # big asks 1000 tokens a request, small 100: small gets ten turns for each of big's.
    adm = one_slot(clock)
    order = await served_order(adm, [("B", demand("big", prompt=1000))] * 3
                               + [("s", demand("small", prompt=100))] * 20)
    assert "".join(order[:13]) == "s" * 9 + "B" + "s" * 3  # B's tag 1000 ties s's 10th: B came first
    assert order.count("B") == 3 and order.count("s") == 20


async def test_anonymous_requests_share_one_turn_unless_the_fairness_header_names_them(clock: ManualClock):
    adm = one_slot(clock)
    order = await served_order(adm, [("a", demand("_anonymous"))] * 4 + [("b", demand("_anonymous"))] * 2)
    assert "".join(order) == "aaaabb"  # one flow: arrival order
    adm = one_slot(ManualClock(clock.now()))
    order = await served_order(adm, [("a", demand("_anonymous", fairness_id="_anonymous:a"))] * 4
                               + [("b", demand("_anonymous", fairness_id="_anonymous:b"))] * 2)
    assert "".join(order) == "ababaa"


async def test_a_tenant_back_from_idle_waits_one_turn_not_behind_the_backlog(clock: ManualClock):
    # quiet's request arrives after loud's backlog has been served for a while: it is
    # tagged from the turn granted last, and goes first among that round's: next.
    adm = one_slot(clock)
    held = await adm.acquire(demand("holder"))
    assert isinstance(held, Lease)
    loud = [asyncio.create_task(adm.acquire(demand("loud"))) for _ in range(8)]
    await until(lambda: adm.snapshot("default").waiting == 8)
    held.release(Outcome.COMPLETED, 1)
    for t in loud[:2]:
        await until(t.done)
        cast(Lease, t.result()).release(Outcome.COMPLETED, 1)
    await until(loud[2].done)
    late = asyncio.create_task(adm.acquire(demand("quiet")))
    await until(lambda: adm.snapshot("default").waiting == 6)
    cast(Lease, loud[2].result()).release(Outcome.COMPLETED, 1)
    await until(late.done)  # its tag ties loud's next: a flow back from idle goes first
    assert isinstance(late.result(), Lease) and not loud[3].done()
    late.result().release(Outcome.COMPLETED, 1)
    for t in loud[3:]:
        await until(t.done)
        cast(Lease, t.result()).release(Outcome.COMPLETED, 1)
    await quiet(adm)
    assert adm.snapshot("default").waiting == 0 and adm.snapshot("default").inflight == 0


# --- the queue alone ------------------------------------------------------------------

PLAN = cast(Plan, object())
REFUSAL = Refusal(Budget.SLOTS, 1.0, True, 1.0, 0.0, 1.0)
# (class, priority): two classes share priority 0, one is above them.
LANES = [("a", 0), ("b", 0), ("h", 5)]


def make(seq: int, tenant: int, lane: int, cost: int, weights: list[float], fair: bool = True) -> Waiter:
    cname, prio = LANES[lane]
    d = Demand(pool="default", tenant=f"t{tenant}", class_name=cname, prompt_tokens=cost, reserved_completion=0)
    w = Waiter(d, prio, 0.0, 1e9 + seq, cast(Any, None), REFUSAL, PLAN,
               cost / weights[tenant] if fair else None)
    return w


def full_walk(q: WaitQueue, steps: list[Step] | None = None,
              during: Any = None) -> list[Waiter]:
    """full_walk walks ``q`` answering each waiter with the next of ``steps`` (NEXT when they
    run out), calls ``during`` after the first waiter; the waiters yielded."""
    out: list[Waiter] = []
    walk = q.walk()
    steps = list(steps or [])
    try:
        w = next(walk)
        while True:
            out.append(w)
            if during is not None and len(out) == 1:
                during()
            w = walk.send(steps.pop(0) if steps else Step.NEXT)
    except StopIteration:
        pass
    finally:
        walk.close()
    return out


ops = st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(0, 3), st.integers(0, 2), st.integers(1, 60)),
    st.tuples(st.just("serve"), st.integers(0, 0), st.integers(0, 0), st.integers(0, 0)),
    st.tuples(st.just("remove"), st.integers(0, 1000), st.integers(0, 0), st.integers(0, 0)),
    st.tuples(st.just("walk"), st.integers(0, 1000), st.integers(0, 3), st.integers(0, 1)),
), max_size=120)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=4, max_size=4),
       fifo=st.booleans())
def test_the_queue_never_loses_or_duplicates_a_waiter_and_keeps_priority(ops, weights, fifo):
    q = WaitQueue()
    queued: dict[int, Waiter] = {}  # id -> waiter: what the queue must hold
    seq = 0
    for op, x, y, z in ops:
        if op == "push":
            seq += 1
            w = make(seq, x, y, z, weights, fair=not (fifo and y == 1))
            q.push(w)
            queued[id(w)] = w
        elif op == "serve" and queued:
            got = full_walk(q, [Step.STOP])
            top = max(w.priority for w in queued.values())
            assert got and got[0].priority == top  # the highest priority goes first
            assert q.remove(got[0], served=True)
            del queued[id(got[0])]
        elif op == "remove" and queued:
            w = list(queued.values())[x % len(queued)]
            assert q.remove(w) and not q.remove(w)
            del queued[id(w)]
        elif op == "walk":
            # A whole walk, a tenant or class skipped on the way, a waiter removed and one
            # pushed while it is under way (they take effect when it ends).
            extra: list[Waiter] = []
            gone: list[Waiter] = []

            def during() -> None:
                nonlocal seq
                if queued:
                    v = list(queued.values())[x % len(queued)]
                    q.remove(v)
                    del queued[id(v)]
                    gone.append(v)
                seq += 1
                n = make(seq, x % 4, z, 5, weights)
                q.push(n)
                queued[id(n)] = n
                extra.append(n)

            step = [Step.NEXT, Step.SKIP_TENANT, Step.SKIP_CLASS, Step.NEXT][y]
            got = full_walk(q, [step], during)
            ids = [id(w) for w in got]
            assert len(ids) == len(set(ids))  # never twice in one walk
            assert not any(v in got[1:] for v in gone) and not any(n in got for n in extra)
            prios = [w.priority for w in got]
            assert prios == sorted(prios, reverse=True)
            if got and step is Step.SKIP_TENANT:
                assert all(w.demand.tenant != got[0].demand.tenant for w in got[1:])
            if got and step is Step.SKIP_CLASS:
                assert all(w.demand.class_name != got[0].demand.class_name for w in got[1:])
            if step is Step.NEXT and not gone:
                assert set(ids) | {id(n) for n in extra} == set(queued)
        held = q.waiters()
        assert len(held) == len({id(w) for w in held}) == q.size == len(queued)
        assert {id(w) for w in held} == set(queued)
    # Everything removed: no state is left behind.
    for w in list(queued.values()):
        q.remove(w)
    assert q.size == 0 and q.top_priority() is None and q.waiters() == []
    assert not q._levels  # noqa: SLF001 (no lane, no flow state is kept for an empty queue)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(0, 3), st.integers(1, 50)),
    st.tuples(st.just("serve"), st.integers(0, 0), st.integers(0, 0))), max_size=200),
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=4, max_size=4))
def test_each_backlogged_tenant_gets_its_share_within_one_largest_request(ops, weights):
    """Over any stretch of grants in one class during which two tenants always had a waiter
    queued, the tokens each was served over its weight differ by at most the largest
    request of each over its weight."""
    q = WaitQueue()
    counts = [0, 0, 0, 0]
    largest = [0, 0, 0, 0]
    # Per grant: the tenant served and its cost, who had a waiter queued just before it,
    # and who still had one just after it (only a grant empties a tenant's queue).
    grants: list[tuple[int, int]] = []
    before: list[set[int]] = []
    after: list[set[int]] = []
    seq = 0
    for op, t, cost in ops:
        if op == "push":
            seq += 1
            q.push(make(seq, t, 0, cost, weights))
            counts[t] += 1
            largest[t] = max(largest[t], cost)
        elif q.size:
            before.append({i for i in range(4) if counts[i]})
            w = full_walk(q, [Step.STOP])[0]
            i = int(w.demand.tenant[1:])
            assert q.remove(w, served=True)
            counts[i] -= 1
            grants.append((i, w.demand.prompt_tokens))
            after.append({i for i in range(4) if counts[i]})
    for a in range(len(grants)):
        both = set(before[a])
        served = [0.0] * 4
        for b in range(a, len(grants)):
            i, cost = grants[b]
            served[i] += cost
            for x in both:
                for y in both:
                    if x < y:
                        gap = abs(served[x] / weights[x] - served[y] / weights[y])
                        assert gap <= largest[x] / weights[x] + largest[y] / weights[y] + 1e-9, \
                            (a, b, x, y, gap)
            both &= after[b]


def test_a_large_waiter_is_first_after_a_bounded_number_of_fresh_tenants_small_ones():
    # A large request (800 tokens) waits while a new tenant's 100-token request arrives
    # before each grant: each grant moves the turn on, so the arrivals' tags soon pass the
    # large one's and it comes first (where the STOP rule then holds everyone behind it).
    q = WaitQueue()
    weights = [1.0] * 4
    large = make(1, 0, 0, 800, weights)
    q.push(large)
    for n in range(1, 50):
        d = Demand(pool="default", tenant=f"fresh{n}", class_name="a", prompt_tokens=100, reserved_completion=0)
        q.push(Waiter(d, 0, 0.0, 1e9, cast(Any, None), REFUSAL, PLAN, 100.0))
        first = full_walk(q, [Step.STOP])[0]
        if first is large:
            break
        q.remove(first, served=True)
    assert first is large and n <= 9, n
