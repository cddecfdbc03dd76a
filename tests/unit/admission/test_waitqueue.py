"""Bounded wait: priority then FIFO, no starvation of large requests, cancellation, deadlines.

Waiters are tasks on the test's event loop; ``until``/``quiet`` let them run until an
event (a store's answer, a walk's end), never for time to pass. Time moves only with the
manual clock, which is also the wait queues' timers (``ManualClock.call_later``): they
fire when a test moves it past them.
"""

from __future__ import annotations

import asyncio

import pytest

from extproc.admission import Admission, Demand, Lease, Outcome, PoolSignals, Reason, Rejection
from extproc.admission.store.base import Store
from extproc.clock import ManualClock
from tests.unit.admission.helpers import STALE_AFTER_S, YieldingStore, config, quiet, tenants, until

CLASSES = {
    "standard": {"max_wait_s": 30},
    "high": {"priority": 10, "max_wait_s": 30},
    "quick": {"max_wait_s": 0},
    "batch": {"priority": -5, "max_wait_s": 30, "sheddable": True},
}
BACKENDS = [{"name": "n1", "metrics_url": "http://127.0.0.1:9/metrics"}]


def demand(prompt: int = 10, completion: int = 0, class_name: str = "standard", tenant: str = "t",
           pool: str = "default") -> Demand:
    return Demand(pool=pool, tenant=tenant, class_name=class_name, prompt_tokens=prompt,
                  reserved_completion=completion)


def adm_with(clock: ManualClock, store: Store | None = None, **pool) -> Admission:
    return Admission(config(pool=pool or {"max_concurrency": 1}, tenants=tenants(CLASSES)), clock, store, timers=clock)


def waiting(adm: Admission, n: int):
    return lambda: adm.snapshot("default").waiting == n


async def tick(adm: Admission, clock: ManualClock, seconds: float) -> None:
    """tick moves the clock by ``seconds`` and lets the timers due by then fire and their walks end."""
    clock.advance(seconds)
    await quiet(adm)


async def test_a_waiter_gets_the_slot_that_frees(clock: ManualClock, store: Store):
    adm = adm_with(clock, store)
    held = await adm.acquire(demand())
    task = asyncio.create_task(adm.acquire(demand()))
    await until(waiting(adm, 1))
    assert not task.done()
    held.release(Outcome.COMPLETED, 1)
    await until(task.done)
    assert isinstance(task.result(), Lease)
    assert adm.snapshot("default").waiting == 0


async def test_higher_priority_first_then_fifo(clock: ManualClock, store: Store):
    adm = adm_with(clock, store)
    held = await adm.acquire(demand())
    order: list[str] = []

    async def want(name: str, class_name: str) -> None:
        lease = await adm.acquire(demand(class_name=class_name))
        order.append(name)
        await asyncio.sleep(0)
        lease.release(Outcome.COMPLETED, 1)

    tasks = []
    for i, (name, cls) in enumerate([("s1", "standard"), ("b1", "batch"), ("s2", "standard"),
                                     ("h1", "high"), ("s3", "standard"), ("h2", "high")]):
        tasks.append(asyncio.create_task(want(name, cls)))
        await until(waiting(adm, i + 1))
    held.release(Outcome.COMPLETED, 1)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert order == ["h1", "h2", "s1", "s2", "s3", "b1"]


async def test_a_large_request_is_not_starved_by_small_ones(clock: ManualClock, store: Store):
    adm = adm_with(clock, store, max_concurrency=10, kv_budget_tokens=1000)
    first = await adm.acquire(demand(500))
    large = asyncio.create_task(adm.acquire(demand(800)))
    await until(waiting(adm, 1))
    # Small requests of the same priority would fit in the 500 tokens left, but may not
    # go ahead of the large one: the zero-wait class is refused, the waiting one queues.
    r = await adm.acquire(demand(100, class_name="quick"))
    assert isinstance(r, Rejection) and r.reason is Reason.KV_BUDGET
    assert "queued earlier" in r.message and "800" not in r.message  # not the waiter's numbers
    small = asyncio.create_task(adm.acquire(demand(100)))
    await until(waiting(adm, 2))
    # A higher priority may.
    assert isinstance(await adm.acquire(demand(100, class_name="high")), Lease)
    await quiet(adm)
    assert not large.done() and not small.done()
    first.release(Outcome.COMPLETED, 1)
    await until(lambda: large.done() and small.done())
    assert isinstance(large.result(), Lease) and isinstance(small.result(), Lease)
    assert adm.snapshot("default").kv_inflight == 1000


async def test_a_waiter_that_fits_only_after_recovery_blocks_nobody(clock: ManualClock, store: Store):
    adm = adm_with(clock, store, max_concurrency=10, kv_budget_tokens=1000, backends=BACKENDS)
    assert adm.snapshot("default").kv_budget == 600  # no signals yet: scale 0.6
    large = asyncio.create_task(adm.acquire(demand(800)))  # fits the base budget, not 600
    await until(waiting(adm, 1))
    assert isinstance(await adm.acquire(demand(100, class_name="quick")), Lease)
    for _ in range(5):  # the signals come and the scale recovers
        adm.update_signals("default", PoolSignals(0.1, 0, False, None, clock.now(), clock.now() + STALE_AFTER_S))
        await tick(adm, clock, 1.0)
    await until(large.done)
    assert isinstance(large.result(), Lease)


async def test_a_cancelled_waiter_holds_nothing_and_unblocks_those_behind(clock: ManualClock, store: Store):
    adm = adm_with(clock, store, max_concurrency=10, kv_budget_tokens=1000)
    first = await adm.acquire(demand(500))
    large = asyncio.create_task(adm.acquire(demand(800)))
    await until(waiting(adm, 1))
    small = asyncio.create_task(adm.acquire(demand(100)))
    await until(waiting(adm, 2))
    large.cancel()
    await until(small.done)
    assert large.cancelled()
    assert isinstance(small.result(), Lease)  # it was queued only behind the large one
    snap = adm.snapshot("default")
    assert (snap.waiting, snap.inflight, snap.kv_inflight) == (0, 2, 600)
    first.release(Outcome.COMPLETED, 1)
    small.result().release(Outcome.COMPLETED, 1)
    await quiet(adm)
    snap = adm.snapshot("default")
    assert (snap.inflight, snap.kv_inflight) == (0, 0)


async def test_the_wait_ends_at_the_class_deadline(clock: ManualClock, store: Store):
    adm = adm_with(clock, store)
    held = await adm.acquire(demand())
    task = asyncio.create_task(adm.acquire(demand()))
    await until(waiting(adm, 1))
    await tick(adm, clock, 29.9)
    assert not task.done()
    await tick(adm, clock, 0.1)
    await until(task.done)
    r = task.result()
    assert isinstance(r, Rejection) and r.reason is Reason.CONCURRENCY and "waited 30.0s" in r.message
    held.release(Outcome.COMPLETED, 1)
    await quiet(adm)
    assert adm.snapshot("default").inflight == 0 and adm.snapshot("default").waiting == 0


async def test_a_waiter_for_tokens_is_admitted_when_the_bucket_refills(clock: ManualClock, store: Store):
    adm = adm_with(clock, store, max_concurrency=10, tpm=6000)  # 100 tokens/s
    assert isinstance(await adm.acquire(demand(6000)), Lease)
    task = asyncio.create_task(adm.acquire(demand(250)))
    await until(waiting(adm, 1))
    await tick(adm, clock, 2.49)
    assert not task.done()
    await tick(adm, clock, 0.01)
    await until(task.done)
    assert isinstance(task.result(), Lease)


async def test_a_tenant_waiting_on_its_own_bucket_blocks_only_itself(clock: ManualClock, store: Store):
    classes = dict(CLASSES, standard={"max_wait_s": 30, "tpm": 600})
    adm = Admission(config(pool={"max_concurrency": 10}, tenants=tenants(classes)), clock, store, timers=clock)
    assert isinstance(await adm.acquire(demand(600, tenant="a")), Lease)
    first = asyncio.create_task(adm.acquire(demand(10, tenant="a")))
    await until(waiting(adm, 1))
    assert isinstance(await adm.acquire(demand(10, tenant="b")), Lease)  # b is not held up
    later = asyncio.create_task(adm.acquire(demand(5, tenant="a")))
    await until(waiting(adm, 2))
    await tick(adm, clock, 0.5)  # 5 tokens back: enough for the later one, not for the first
    assert not first.done() and not later.done()  # FIFO within the tenant
    await tick(adm, clock, 0.5)
    await until(first.done)
    assert isinstance(first.result(), Lease) and not later.done()
    await tick(adm, clock, 0.5)
    await until(later.done)
    assert isinstance(later.result(), Lease)


async def test_guaranteed_slots_are_taken_past_waiters_of_other_classes(clock: ManualClock, store: Store):
    classes = dict(CLASSES, gold={"guaranteed_slots": 1, "max_wait_s": 30})
    adm = Admission(config(pool={"max_concurrency": 2}, tenants=tenants(classes)), clock, store, timers=clock)
    held = await adm.acquire(demand())
    queued = asyncio.create_task(adm.acquire(demand()))  # the free slot is gold's
    await until(waiting(adm, 1))
    assert isinstance(await adm.acquire(demand(class_name="gold")), Lease)
    assert not queued.done()
    held.release(Outcome.COMPLETED, 1)
    await until(queued.done)
    assert isinstance(queued.result(), Lease)


async def test_alarm_sheds_waiting_sheddable_requests(clock: ManualClock, store: Store):
    adm = Admission(config(pool={"max_concurrency": 10, "backends": BACKENDS}, tenants=tenants(CLASSES)),
                    clock, store, timers=clock)
    for _ in range(5):
        adm.update_signals("default", PoolSignals(0.1, 0, False, None, clock.now(), clock.now() + STALE_AFTER_S))
        clock.advance(1)
    held = [await adm.acquire(demand()) for _ in range(10)]
    assert all(isinstance(x, Lease) for x in held)
    batch = asyncio.create_task(adm.acquire(demand(class_name="batch")))
    std = asyncio.create_task(adm.acquire(demand()))
    await until(waiting(adm, 2))
    adm.update_signals("default", PoolSignals(0.95, 0, False, None, clock.now(), clock.now() + STALE_AFTER_S))
    await until(batch.done)
    assert batch.result().reason is Reason.SHED
    assert not std.done()
    std.cancel()
    for x in held:
        x.release(Outcome.COMPLETED, 1)
    await quiet(adm)
    assert adm.snapshot("default").inflight == 0


async def test_a_grant_that_arrives_after_its_waiter_left_is_given_back(clock: ManualClock):
    store = YieldingStore()
    adm = adm_with(clock, store)
    held = await adm.acquire(demand(5, 5))
    task = asyncio.create_task(adm.acquire(demand(7, 3)))
    await until(waiting(adm, 1))
    held.release(Outcome.COMPLETED, 1)  # starts a drain; its admit is in flight...
    await asyncio.sleep(0)
    assert adm.draining
    task.cancel()                        # ...when the client goes away
    await quiet(adm)
    assert task.cancelled()
    snap = adm.snapshot("default")
    assert (snap.inflight, snap.kv_inflight, snap.waiting) == (0, 0, 0)


async def test_waiters_of_a_removed_pool_are_refused(clock: ManualClock, store: Store):
    cfg = config(pools={"default": {"max_concurrency": 1}, "other": {"max_concurrency": 1}},
                 tenants=tenants(CLASSES))
    adm = Admission(cfg, clock, store, timers=clock)
    held = await adm.acquire(demand(pool="other"))
    task = asyncio.create_task(adm.acquire(demand(pool="other")))
    await until(lambda: adm.snapshot("other").waiting == 1)
    adm.reconfigure(config(tenants=tenants(CLASSES)))
    await until(task.done)
    r = task.result()
    assert isinstance(r, Rejection) and not r.retryable and "no longer configured" in r.message
    assert held.release(Outcome.COMPLETED, 1)


async def test_close_refuses_waiters(clock: ManualClock):
    adm = adm_with(clock)
    await adm.acquire(demand())
    task = asyncio.create_task(adm.acquire(demand()))
    await until(waiting(adm, 1))
    await adm.close()
    await until(task.done)
    assert isinstance(task.result(), Rejection)


@pytest.mark.parametrize("class_name", ["quick", "standard"])
async def test_not_retryable_never_waits(clock: ManualClock, class_name: str):
    adm = adm_with(clock, None, max_concurrency=1, tpm=1000)
    r = await adm.acquire(demand(2000, class_name=class_name))
    assert isinstance(r, Rejection) and not r.retryable and adm.snapshot("default").waiting == 0


async def test_a_waiter_held_by_its_class_kv_watermark_holds_back_only_its_class(clock: ManualClock,
                                                                                 store: Store):
    # KV budget 1000; 'bulk' (same priority as 'standard') may fill it up to 500.
    classes = {"standard": {"max_wait_s": 30}, "bulk": {"max_wait_s": 30, "kv_watermark": 0.5}}
    adm = Admission(config(pool={"max_concurrency": 10, "kv_budget_tokens": 1000},
                           tenants=tenants(classes)), clock, store, timers=clock)
    first = await adm.acquire(demand(400, class_name="bulk"))
    assert isinstance(first, Lease)
    big = asyncio.create_task(adm.acquire(demand(300, class_name="bulk")))   # 700 > 500: waits
    await until(waiting(adm, 1))
    # Another class of the same priority is not held behind it: the budget has room.
    chat = await adm.acquire(demand(300))
    assert isinstance(chat, Lease)
    # Once the chat ends, a smaller request of the waiter's own class would fit
    # (400 + 100 <= 500), yet it queues behind the larger one instead of jumping it.
    chat.release(Outcome.COMPLETED, 1)
    await quiet(adm)
    small = asyncio.create_task(adm.acquire(demand(100, class_name="bulk")))
    await until(waiting(adm, 2))
    assert not big.done() and not small.done()
    first.release(Outcome.COMPLETED, 1)
    await asyncio.wait_for(asyncio.gather(big, small), timeout=10)
    assert isinstance(big.result(), Lease) and isinstance(small.result(), Lease)
    assert adm.snapshot("default").kv_inflight == 400


async def test_a_request_above_its_class_ceiling_at_scale_one_is_refused_at_once(clock: ManualClock,
                                                                                 store: Store):
    classes = {"standard": {"max_wait_s": 30}, "bulk": {"max_wait_s": 30, "kv_watermark": 0.5}}
    adm = Admission(config(pool={"max_concurrency": 10, "kv_budget_tokens": 1000},
                           tenants=tenants(classes)), clock, store, timers=clock)
    r = await adm.acquire(demand(501, class_name="bulk"))
    assert isinstance(r, Rejection) and r.reason is Reason.KV_BUDGET and not r.retryable
    assert "class 'bulk'" in r.message and "(500 tokens)" in r.message
    assert adm.snapshot("default").waiting == 0 and adm.snapshot("default").kv_inflight == 0
