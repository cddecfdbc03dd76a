"""Thousands of asyncio tasks acquiring, waiting, being cancelled and releasing at random.

Whatever the interleaving, at the end nothing is held: no slot, no KV token, no waiter;
and at every point the pool holds at least what the tasks hold (a double release would
show as less).
"""

from __future__ import annotations

import asyncio
import random

from extproc.admission import Admission, Demand, Lease, Outcome, PoolSignals
from extproc.admission.store.base import Store
from extproc.admission.store.memory import MemoryStore
from extproc.clock import ManualClock
from tests.unit.admission.helpers import STALE_AFTER_S, YieldingStore, config, quiet, tenants, until

CLASSES = {
    "standard": {"max_wait_s": 5},
    "high": {"priority": 5, "max_wait_s": 5},
    "quick": {"max_wait_s": 0},
    "batch": {"priority": -1, "max_wait_s": 5, "sheddable": True},
    "gold": {"priority": 1, "guaranteed_slots": 3, "max_wait_s": 5},
}
TENANTS = {"a": {"class": "gold"}, "b": {"class": "standard", "tpm": 200_000},
           "c": {"class": "batch"}, "d": {"class": "quick"}, "e": {"class": "high"}}
BACKENDS = [{"name": "n1", "metrics_url": "http://127.0.0.1:9/metrics"}]


async def test_thousands_of_tasks_end_with_nothing_held(clock: ManualClock, store: Store):
    local = isinstance(store, (MemoryStore, YieldingStore))
    n = 3000 if local else 400
    rng = random.Random(20_260_1)
    cfg = config(pool={"max_concurrency": 16, "tpm": 3_000_000, "kv_budget_tokens": 15_000,
                       "backends": BACKENDS},
                 tenants=tenants(CLASSES, TENANTS))
    adm = Admission(cfg, clock, store, timers=clock)  # its timers fire as the clock moves past them
    adm.update_signals("default", PoolSignals(0.1, 0, False, None, clock.now(), clock.now() + STALE_AFTER_S))
    held: set[Lease] = set()
    in_acquire: list[asyncio.Task[None]] = []
    outcomes = list(Outcome)

    async def worker() -> None:
        tenant = rng.choice(sorted(TENANTS))
        d = Demand("default", tenant, TENANTS[tenant]["class"], rng.randint(1, 2000), rng.randint(0, 1000))
        me = asyncio.current_task()
        in_acquire.append(me)
        try:
            res = await adm.acquire(d)
        finally:
            in_acquire.remove(me)
        if not isinstance(res, Lease):
            return
        held.add(res)
        try:
            for _ in range(rng.randint(0, 6)):
                await asyncio.sleep(0)
        finally:  # as the service does: every end of the request releases, cancellation included
            held.discard(res)
            used = None if rng.random() < 0.3 else rng.randint(0, d.reserved_completion + 100)
            res.release(rng.choice(outcomes), used)
            if in_acquire and rng.random() < 0.5:
                # A client goes away at the moment capacity frees: maybe the very waiter
                # the release just granted, before it ran again.
                rng.choice(in_acquire[:3] + in_acquire[-3:]).cancel()

    tasks: list[asyncio.Task[None]] = []
    rounds = 0
    while len(tasks) < n or not all(t.done() for t in tasks):
        rounds += 1
        assert rounds < 20_000, "the tasks did not finish"
        for _ in range(rng.randint(0, 40)):
            if len(tasks) < n:
                tasks.append(asyncio.create_task(worker()))
        for _ in range(rng.randint(0, 3)):
            rng.choice(tasks).cancel()
        if rng.random() < 0.2:
            clock.advance(rng.uniform(0.0, 1.5))
            usage = rng.choice([0.1, 0.5, 0.8, 0.9])
            now = clock.now()
            adm.update_signals("default", PoolSignals(usage, rng.randint(0, 10), False, None, now,
                                                      now + STALE_AFTER_S))
        for _ in range(rng.randint(1, 4)):
            await asyncio.sleep(0)
        if local and rng.random() < 0.05:
            # Granted leases whose task has not run yet are in flight but not yet in
            # ``held``: the pool holds at least what the tasks hold, never less.
            snap = adm.snapshot("default")
            assert snap.inflight >= len(held)
            assert snap.kv_inflight >= sum(x.demand.tokens for x in held)
        if len(tasks) >= n and rng.random() < 0.1:
            clock.advance(6.0)  # past every deadline: the stragglers give up
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
    await quiet(adm)
    assert not held
    if not local:
        # A grant whose waiter was cancelled during its round trip is undone when its answer
        # comes, a few real milliseconds later on a loaded machine: wait for the answers
        # (bounded), not for time. A lease leaked would never reach 0.
        await until(lambda: adm.snapshot("default").inflight == 0)
    snap = adm.snapshot("default")
    assert (snap.inflight, snap.kv_inflight, snap.waiting, snap.inflight_by_class) == (0, 0, 0, {})
    assert sum(1 for t in tasks if t.cancelled()) > 0
