"""The wait queue's rule and walk alone: what a refusal blocks, when to walk again, one walk.

``Blocks`` and ``serve`` at fixed instants, with no controller and no store: the walk is
driven here by hand, as the in-process and the async drivers do.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, cast

import pytest

from extproc.admission.types import Budget, Demand, Grant, Plan, Refusal
from extproc.admission.waitqueue import Blocks, Step, Waiter, WaitQueue, serve

T0 = 100.0
PLAN = cast(Plan, object())  # the walk hands plans through, it never reads them


def refusal(budget: Budget, needed: float = 10.0, limit: float = 100.0, retry_after_s: float = 1.0) -> Refusal:
    return Refusal(budget, retry_after_s, True, needed, 0.0, limit)


def waiter(loop: asyncio.AbstractEventLoop, tenant: str = "t", class_name: str = "standard",
           priority: int = 0, deadline: float = T0 + 30.0) -> Waiter:
    d = Demand(pool="default", tenant=tenant, class_name=class_name, prompt_tokens=10, reserved_completion=0)
    return Waiter(d, priority, T0, deadline, loop.create_future(), refusal(Budget.SLOTS), PLAN)


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.mark.parametrize("budget, needed, step, stops, tenant, klass", [
    (Budget.SLOTS, 10, Step.STOP, True, False, False),
    (Budget.KV, 10, Step.STOP, True, False, False),
    (Budget.POOL_TPM, 10, Step.STOP, True, False, False),
    (Budget.NODE_KV, 10, Step.STOP, True, False, False),
    (Budget.RESERVED_SLOTS, 10, Step.SKIP_CLASS, False, False, False),
    (Budget.CLASS_KV, 10, Step.SKIP_CLASS, False, False, True),
    (Budget.TENANT_TPM, 10, Step.SKIP_TENANT, False, True, False),
    # above the budget's size at the current scale: it blocks nobody
    (Budget.KV, 500, Step.NEXT, False, False, False),
    (Budget.CLASS_KV, 500, Step.NEXT, False, False, False),
    (Budget.POOL_TPM, 500, Step.NEXT, False, False, False),
])
def test_what_a_refusal_blocks(loop, budget, needed, step, stops, tenant, klass):
    b = Blocks()
    r = refusal(budget, needed=needed)
    assert b.note(waiter(loop), r) is step
    assert (b.stop == (0, r)) is stops and (b.stop is None) is not stops
    assert (b.tenants == {"t": r}) is tenant and (b.classes == {"standard": r}) is klass


def test_arrivals_may_not_jump_what_blocked_the_walk(loop):
    b = Blocks()
    stop = refusal(Budget.SLOTS)
    b.note(waiter(loop, priority=5), stop)
    b.note(waiter(loop, priority=1), refusal(Budget.KV))  # a lower stop does not replace it
    assert b.stop == (5, stop)
    other = Demand(pool="default", tenant="u", class_name="gold", prompt_tokens=1, reserved_completion=0)
    assert b.blocker(other, 5) is stop and b.blocker(other, 6) is None
    assert b.may_jump(other, 6, top=5) and not b.may_jump(other, 5, top=5) and b.may_jump(other, 0, None)
    own = refusal(Budget.TENANT_TPM)
    b.note(waiter(loop, tenant="u"), own)
    assert b.blocker(other, 6) is own and not b.may_jump(other, 6, top=5)
    b.reset()
    assert b.stop is None and not b.tenants and not b.classes and b.blocker(other, 0) is None


def test_when_the_queue_is_walked_again(loop):
    q = WaitQueue()
    b = Blocks()
    assert b.next_wake(q, T0, None) == math.inf  # nobody waits and nothing refills
    q.push(waiter(loop, deadline=T0 + 30))
    assert b.next_wake(q, T0, None) == T0 + 30  # the first deadline
    assert b.next_wake(q, T0, 0.05) == T0 + 0.05  # others may free capacity unseen
    b.note(waiter(loop), refusal(Budget.SLOTS, retry_after_s=2.0))
    assert b.next_wake(q, T0, None) == T0 + 30  # slots come back by a release, seen here
    assert b.next_wake(q, T0, 0.05) == T0 + 0.05
    b.reset()
    b.note(waiter(loop), refusal(Budget.POOL_TPM, retry_after_s=2.0))
    assert b.next_wake(q, T0, 0.05) == T0 + 2.0  # the pool's refill, even with a shared store
    b.note(waiter(loop, tenant="u"), refusal(Budget.TENANT_TPM, retry_after_s=0.5))
    assert b.next_wake(q, T0, None) == T0 + 0.5  # a blocked tenant's refill


def drive(walk: Any, answers: dict[str, Grant | Refusal | None]) -> list[str]:
    """drive answers each waiter the walk yields by its tenant's answer; returns the tenants tried."""
    tried = []
    try:
        w, _plan = next(walk)
        while True:
            tried.append(w.demand.tenant)
            w, _plan = walk.send(answers[w.demand.tenant])
    except StopIteration:
        pass
    finally:
        walk.close()
    return tried


def test_one_walk_tries_in_order_and_stops_where_told(loop):
    q = WaitQueue()
    for t in "abcd":
        q.push(waiter(loop, tenant=t))
    skipped = q.waiters()[1]
    served: list[str] = []

    def prepare(w: Waiter) -> Plan | Step:
        return Step.NEXT if w is skipped else PLAN  # e.g. shed: no try

    def on_answer(w: Waiter, plan: Plan, res: Grant | Refusal) -> Step:
        served.append(w.demand.tenant)
        return Step.STOP if isinstance(res, Refusal) and res.budget is Budget.SLOTS else Step.NEXT

    answers: dict[str, Grant | Refusal | None] = {"a": refusal(Budget.TENANT_TPM), "c": refusal(Budget.SLOTS)}
    assert drive(serve(q, prepare, on_answer), answers) == ["a", "c"]  # b needs no try; c stops the walk
    assert served == ["a", "c"]
    # a store that cannot answer stops the walk without an answer to act on
    served.clear()
    assert drive(serve(q, prepare, on_answer), {"a": None}) == ["a"]
    assert served == []


def test_a_walk_closed_midway_leaves_the_queue_as_pushes_and_removes_made_it(loop):
    q = WaitQueue()
    first, second = waiter(loop, tenant="a"), waiter(loop, tenant="b")
    q.push(first)
    q.push(second)
    walk = serve(q, lambda w: PLAN, lambda w, plan, res: Step.NEXT)
    w, _ = next(walk)
    assert w is first
    late = waiter(loop, tenant="c", priority=9)
    q.push(late)  # during the walk: queued, yielded only by the next walk
    q.remove(second)
    walk.close()  # the driver's store raised: the walk ends here
    assert q.size == 2 and {x.demand.tenant for x in q.waiters()} == {"a", "c"}
    order = drive(serve(q, lambda w: PLAN, lambda w, plan, res: Step.NEXT), {"a": refusal(Budget.KV),
                                                                            "c": refusal(Budget.KV)})
    assert order == ["c", "a"]  # the late one, of a higher priority, first
