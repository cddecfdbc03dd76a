"""waiting: the bounded wait of every pool: a request queued until its class's ``max_wait_s``,
re-tried when capacity may have come back.

``BoundedWait.wait`` queues a refused request (``waitqueue``: the queue, what blocks it and
its walk); ``kick`` walks a pool's queue when capacity may have freed (a release, new
signals, a node's report, a reload): at once with a store that answers at once, in a task
with one that answers asynchronously; one timer per pool walks it again at its next event
(a deadline, a bucket's refill, a shared store's poll). Each waiter the walk reaches is
decided as a new request is (``decide.Decider``); what the walk does with the answer is
``_served``. Everything runs on the event-loop thread; times are seconds on the admission
clock.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Generator
from functools import partial

from extproc.admission.decide import Decider
from extproc.admission.lease import Lease, LeaseOwner
from extproc.admission.pool import PoolControl
from extproc.admission.store.base import StoreError
from extproc.admission.types import Demand, Grant, Plan, Refusal, Rejection
from extproc.admission.waitqueue import Answer, Step, Waiter, serve
from extproc.clock import Clock, Timers
from extproc.config import ClassConfig

# With a shared store, releases by other replicas are not seen here: waiters blocked on
# slots or KV are re-tried this often (seconds).
SHARED_POLL_S = 0.05


class BoundedWait:
    """BoundedWait queues the requests a pool cannot take now and admits them as capacity frees.

    ``decide`` decides each waiter; ``owner`` is the port the leases it grants report
    through; ``current`` tells whether a pool is still configured (a removed pool's timer
    walks nothing); ``timers`` arm each pool's timer, on ``clock``'s scale.
    """

    __slots__ = ("_clock", "_timers", "_decide", "_owner", "_current")

    def __init__(self, clock: Clock, timers: Timers, decide: Decider, owner: LeaseOwner,
                 current: Callable[[PoolControl], bool]) -> None:
        self._clock = clock
        self._timers = timers
        self._decide = decide
        self._owner = owner
        self._current = current

    def blocked(self, p: PoolControl, demand: Demand, cls: ClassConfig) -> Refusal | None:
        """blocked is the refusal of a waiter that ``demand`` may not jump, or None (``Blocks.blocker``)."""
        if p.blocks.may_jump(demand, cls.priority, p.queue.top_priority()):
            return None
        if self._decide.sync is not None:
            self.kick(p)  # time has passed since the last walk: serve the queue first
        return p.blocks.blocker(demand, cls.priority)

    async def wait(self, p: PoolControl, demand: Demand, cls: ClassConfig, plan: Plan,
                   refusal: Refusal, behind: bool, now: float) -> Lease | Rejection:
        """wait queues ``demand``, refused for ``refusal`` (``behind``: that of a waiter queued
        ahead), until it is admitted or refused for good, or its class's wait runs out. A
        waiter cancelled while it waits (its client went away) leaves the queue and holds
        nothing."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Lease | Rejection] = loop.create_future()
        share = None if cls.fairness == "fifo" else \
            max(1, demand.tokens) / self._decide.tenants.weight(demand.flow)
        w = Waiter(demand, cls.priority, now, now + cls.max_wait_s, fut, refusal, plan, share)
        w.behind = behind
        p.loop = loop
        p.queue.push(w)
        p.blocks.note(w, refusal)
        self._schedule(p, now)
        try:
            return await fut
        except asyncio.CancelledError:
            if p.queue.remove(w):
                self.kick(p)  # it may have been the waiter others were queued behind
            if fut.done() and not fut.cancelled():
                got = fut.result()
                if isinstance(got, Lease):
                    got.abandon()
            raise

    def _resolve(self, p: PoolControl, w: Waiter, result: Lease | Rejection) -> None:
        """_resolve ends waiter ``w`` with ``result`` (a lease nobody takes any more is abandoned)."""
        p.queue.remove(w, served=type(result) is Lease)
        if w.future.done():
            if isinstance(result, Lease):
                result.abandon()
        else:
            w.future.set_result(result)

    def shed_waiters(self, p: PoolControl, now: float) -> None:
        """shed_waiters refuses the waiters of sheddable classes (the pool entered alarm)."""
        for w in p.queue.waiters():
            cls = self._decide.tenants.class_rule(w.demand.class_name)
            if cls.sheddable:
                self._resolve(p, w, self._decide.shed(p, cls, p.limits_at(now)))

    def close_pool(self, p: PoolControl, reason: str = "its pool is no longer configured") -> None:
        """close_pool stops the pool's timer and refuses every waiter for good, for ``reason``."""
        p.cancel_timer()
        for w in p.queue.waiters():
            self._resolve(p, w, Rejection(reason=w.refusal.budget.reason, retry_after_s=0.0,
                                          retryable=False, message=f"The request was refused: {reason}."))

    def _expire(self, p: PoolControl, now: float) -> None:
        """_expire refuses the waiters whose wait ran out by ``now``."""
        for w in p.queue.expired(now):
            if not w.future.done():
                waited = now - w.since
                r = self._decide.rejection(p, w.refusal, w.plan, now, behind=w.behind)
                w.future.set_result(Rejection(
                    reason=r.reason, retry_after_s=r.retry_after_s, retryable=r.retryable,
                    message=f"{r.message} (waited {max(0.0, waited):.1f}s for capacity)", rate=r.rate))

    def kick(self, p: PoolControl) -> None:
        """kick serves the queue now (in-process store) or makes sure a drain task runs.

        A kick during a walk (a release made by the walk itself) only asks for one more.
        """
        if p.draining:
            p.drain_again = True
            return
        if self._decide.sync is not None:
            p.draining = True
            try:
                while True:
                    p.drain_again = False
                    self._drain(p)
                    if not p.drain_again:
                        break
            finally:
                p.draining = False
            return
        if p.loop is None or p.loop.is_closed():
            return
        p.draining = True
        p.drain_task = p.loop.create_task(self._drain_async(p))

    def _walk(self, p: PoolControl, now: float) -> Generator[tuple[Waiter, Plan], Answer, None]:
        """_walk is one walk of the pool's queue at ``now`` (``waitqueue.serve``): expired waiters are
        refused first; its driver answers each (waiter, plan) it yields for the store."""
        self._expire(p, now)
        p.blocks.reset()
        return serve(p.queue, partial(self._prepare, p, now), partial(self._served, p, now))

    def _prepare(self, p: PoolControl, now: float, w: Waiter) -> Plan | Step:
        """_prepare is the plan to try for waiter ``w``, or the Step when it needs no try."""
        if w.future.done():  # cancelled; its task has not run its handler yet
            p.queue.remove(w)
            return Step.NEXT
        tenants = self._decide.tenants
        cls = tenants.class_rule(w.demand.class_name)
        limits = p.limits_at(now)
        if cls.sheddable and p.tracker.alarm:
            self._resolve(p, w, self._decide.shed(p, cls, limits))
            return Step.NEXT
        d = w.demand
        plan = w.plan = Plan(limits, d.tenant, cls.name, d.prompt_tokens + d.reserved_completion,
                             tenants.bucket(d.tenant, cls.name), None, True)
        return plan

    def _served(self, p: PoolControl, now: float, w: Waiter, plan: Plan, res: Grant | Refusal) -> Step:
        """_served acts on the store's answer for waiter ``w`` and is the walk's next step: a grant
        admits it (or is taken back if it left), a refusal for good refuses it, any other
        refusal is noted in the pool's ``Blocks``."""
        if type(res) is Grant:
            if not w.queued or w.future.done():
                self._decide.undo(res, now)  # its requester left while the store answered
                return Step.NEXT
            self._resolve(p, w, Lease(self._owner, res, w.demand, p.config.context_window))
            return Step.NEXT
        w.refusal, w.behind = res, False
        if not res.retryable:
            self._resolve(p, w, self._decide.rejection(p, res, plan, now))
            return Step.NEXT
        return p.blocks.note(w, res)

    def _drain(self, p: PoolControl) -> None:
        """_drain walks the queue once with the in-process store, then re-arms the timer."""
        now = self._clock.now()
        walk = self._walk(p, now)
        try:
            w, plan = next(walk)
            while True:
                w, plan = walk.send(self._decide.admit_now(p, w.demand, plan, now))
        except StopIteration:
            pass
        finally:
            walk.close()
        self._schedule(p, now)

    async def _drain_async(self, p: PoolControl) -> None:
        """_drain_async walks the queue with a store that answers asynchronously, until no change is pending."""
        try:
            while True:
                p.drain_again = False
                now = self._clock.now()
                walk = self._walk(p, now)
                try:
                    w, plan = next(walk)
                    while True:
                        answer: Answer
                        try:
                            answer = await self._decide.admit(p, w.demand, plan, now)
                        except StoreError:
                            answer = None  # a store failing closed: see waitqueue.serve
                        w, plan = walk.send(answer)
                except StopIteration:
                    pass
                finally:
                    walk.close()
                self._schedule(p, self._clock.now())
                if not p.drain_again:
                    break
        finally:
            p.draining = False
            p.drain_task = None

    def _schedule(self, p: PoolControl, now: float) -> None:
        """_schedule arms one timer for the pool's next event (``Blocks.next_wake``)."""
        if not p.queue.size or p.loop is None or p.loop.is_closed():
            p.cancel_timer()
            return
        wake = p.blocks.next_wake(p.queue, now, SHARED_POLL_S if self._decide.store.shared else None)
        if p.timer is not None:
            if p.timer_at <= wake:
                return
            p.timer.cancel()
        if wake == math.inf:
            p.timer, p.timer_at = None, math.inf
            return
        p.timer_at = wake
        p.timer = self._timers.call_later(p.loop, max(0.0, wake - now), partial(self._on_timer, p))

    def _on_timer(self, p: PoolControl) -> None:
        """_on_timer walks the pool's queue at its next event, if the pool is still configured."""
        p.timer, p.timer_at = None, math.inf
        if self._current(p) and p.queue.size:
            self.kick(p)
