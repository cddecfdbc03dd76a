"""waitqueue: requests waiting (boundedly) for capacity: higher priority first, tenants in turn within a class.

The queue only orders and walks; its driver (``waiting.BoundedWait``) decides, for each waiter the walk
yields, what the walk does next (``Step``). The anti-starvation rule lives in those
steps: a waiter that does not fit on a budget every request needs (slots, KV tokens, the
pool's bucket) STOPs the walk, so no smaller request of the same or a lower priority
jumps it; a waiter refused by its own tenant's bucket blocks only its own tenant; a
waiter refused because the free slots are guaranteed to other classes, or by its class's
KV watermark, blocks only its own class. A large request therefore waits only for
capacity and for its turn among its class's tenants (below), never behind an endless
stream of small ones. One exception: a waiter larger than the
KV budget, its class's KV ceiling or the pool's bucket *at the current scale* (it fits
only once the scale recovers) blocks nobody, since holding the others back would not
bring the recovery sooner. ``Blocks`` keeps what the last walk stopped on (arrivals may
not jump it) and says when to walk again; ``serve`` is the walk itself, written once for
the in-process store and for a store that answers asynchronously.

Waiters added or removed while a walk is under way (the walk may suspend on a shared
store) take effect when it ends; a removed waiter is never yielded.

Within one class (a ``Lane``), tenants are served in turn, by weight: self-clocked fair
queueing (SCFQ, Golestani 1994), a virtual-time relative of deficit round robin. Each waiter
gets a tag when it is queued, ``max(V, F[flow]) + cost / weight``: ``F[flow]`` is the tag
of its flow's last queued waiter, ``V`` the largest tag the lane has served (granted). The
lane is walked in tag order; among equal tags a flow back from idle goes first, then
arrival order. A flow with a backlog thus gets tags spaced by its costs over its weight,
and a flow that was idle starts at ``V``: in the next round, ahead of the backlogged
flows' waiters of that round, not behind another flow's burst. Between two flows backlogged
over any stretch of grants, the service each got over its weight differs by at most one
largest request of each over its weight (the SCFQ bound; ``tests/unit/admission/
test_fairness.py`` checks it). The flow is the tenant, or the fairness id of an
anonymous request (``Demand.flow``); ``cost`` is the request's tokens (prompt +
reserved completion): the KV budget, the pool's bucket and, roughly, the slot's time are
spent in tokens, so that counting requests would let a tenant of 30,000-token prompts
take 100 times the KV of a tenant of 300-token ones in the same turns. Tags replace DRR's
round pointer and deficit counters because the walk must yield an order it can resume
from, any number of times, without serving: a refused waiter keeps its tag and its turn.

A large request is still not starved: an arrival's tag is at least ``V`` plus its cost
(a token at least), granting it moves ``V`` up to that tag, and a waiter's tag is fixed,
so only finitely many arrivals can be ordered before it (``test_fairness.py``: eight
100-token ones before an 800-token one); once it is first, the STOP rule holds the rest
behind it.
A lane in ``fifo`` mode (``tenants.classes.<c>.fairness: fifo``) tags every waiter ``V``:
arrival order, as before. Memory: ``F`` and the counts keep only flows with a waiter
queued (a flow's state goes with its last waiter: after its last grant ``V`` is at least
its ``F`` anyway), a lane only while it has waiters, and a lane's heap at most twice its
waiters (removed waiters are dropped lazily, the heap rebuilt past that). Push is
O(log n); remove O(log n) amortised; a walk O(log n) per waiter it yields.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable, Generator, Iterator
from enum import Enum
from typing import Any

from extproc.admission.types import Budget, Demand, Grant, Plan, Refusal

# Budgets every request of the pool needs: a waiter they refuse stops the walk.
_STOPS = (Budget.SLOTS, Budget.FAIR_SHARE, Budget.KV, Budget.POOL_TPM, Budget.NODE_KV)
# Budgets that do not fit above their size at the current scale: only the scale's recovery
# lets such a waiter in, and holding others back would not bring that sooner.
_SCALED = (Budget.KV, Budget.CLASS_KV, Budget.POOL_TPM)


class Step(Enum):
    """Step is what the walk does after its driver has served one waiter."""

    NEXT = 1        # go on with the next waiter in order
    SKIP_CLASS = 2  # no later waiter of this class fits now
    SKIP_TENANT = 3  # no later waiter of this tenant fits now
    STOP = 4        # nobody later may go ahead of this waiter


class Waiter:
    """Waiter is one waiting request: its demand, order, deadline and the future it waits on.

    ``since`` and ``deadline`` are clock instants (s): when it began and stops waiting;
    ``refusal``/``plan`` are the last refusal it got and the plan it was made for (for the
    message when the wait ends without capacity).
    """

    __slots__ = ("demand", "priority", "since", "deadline", "future", "refusal", "plan", "behind", "seq",
                 "queued", "share", "flow", "tag", "lane")

    def __init__(self, demand: Demand, priority: int, since: float, deadline: float,
                 future: asyncio.Future[Any], refusal: Refusal, plan: Plan,
                 share: float | None = None) -> None:
        self.demand = demand
        self.priority = priority
        self.since = since
        self.deadline = deadline
        self.future = future
        self.refusal = refusal
        self.plan = plan
        self.behind = False
        self.seq = 0
        self.queued = False
        # Its cost over its flow's weight (tokens; None: its class is served in arrival order),
        # its flow, and its tag in its lane (set when it enters one).
        self.share = share
        self.flow = demand.flow
        self.tag = 0.0
        self.lane: Lane | None = None


# A lane's heap may hold this many removed waiters beyond its live ones before a rebuild.
_SLACK = 16


class Lane:
    """Lane is one class's waiters at one priority, in tag order (module doc: fair queueing).

    ``heap``: (tag, rank, seq, waiter), removed waiters included until dropped (rank 0: its
    flow had nothing queued, 1: it had); ``live``: the
    waiters queued; ``vtime``: the largest tag granted (V); ``finish``: per flow with a
    waiter queued, its last tag (F); ``count``: how many waiters each such flow has queued.
    """

    __slots__ = ("heap", "live", "vtime", "finish", "count")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, Waiter]] = []
        self.live = 0
        self.vtime = 0.0
        self.finish: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def add(self, w: Waiter) -> None:
        """add tags ``w`` (fair: after its flow's last waiter and ``vtime``, by its share) and queues it."""
        flow = w.flow
        rank = 1
        if w.share is None:
            tag = self.vtime
        else:
            last = self.finish.get(flow)
            if last is None or last < self.vtime:
                last, rank = self.vtime, 0  # back from idle: first among equal tags
            tag = last + w.share
            self.finish[flow] = tag
        self.count[flow] = self.count.get(flow, 0) + 1
        w.tag, w.lane = tag, self
        self.live += 1
        heapq.heappush(self.heap, (tag, rank, w.seq, w))

    def drop(self, w: Waiter, served: bool) -> None:
        """drop forgets ``w`` (already marked not queued); ``served``: it was granted, so ``vtime`` moves up to its tag."""
        w.lane = None
        self.live -= 1
        flow = w.flow
        n = self.count[flow] - 1
        if n:
            self.count[flow] = n
        else:
            del self.count[flow]
            self.finish.pop(flow, None)
        if served and w.tag > self.vtime:
            self.vtime = w.tag
        heap = self.heap
        while heap and not heap[0][3].queued:
            heapq.heappop(heap)
        if len(heap) > 2 * self.live + _SLACK:
            self.heap = [e for e in heap if e[3].queued]
            heapq.heapify(self.heap)

    def in_order(self) -> Iterator[Waiter]:
        """in_order yields the lane's queued waiters in tag order, without changing the heap
        (the heap must not change meanwhile): a second heap of the frontier's indices."""
        heap = self.heap
        n = len(heap)
        if not n:
            return
        frontier = [(heap[0], 0)]
        while frontier:
            entry, i = heapq.heappop(frontier)
            c = 2 * i + 1
            if c < n:
                heapq.heappush(frontier, (heap[c], c))
                if c + 1 < n:
                    heapq.heappush(frontier, (heap[c + 1], c + 1))
            if entry[3].queued:
                yield entry[3]


class WaitQueue:
    """WaitQueue holds one pool's waiters by priority, then class (a ``Lane``: tenants in turn).

    ``size`` counts the waiters queued (including those added during a walk).
    """

    __slots__ = ("_levels", "_deadlines", "_seq", "size", "_walking", "_added", "_removed")

    def __init__(self) -> None:
        self._levels: dict[int, dict[str, Lane]] = {}
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._seq = 0
        self.size = 0
        self._walking = False
        self._added: list[Waiter] = []
        self._removed: list[tuple[Waiter, bool]] = []

    def push(self, w: Waiter) -> None:
        """push queues ``w`` in its lane: behind every waiter of its flow (module doc)."""
        self._seq += 1
        w.seq = self._seq
        w.queued = True
        self.size += 1
        heapq.heappush(self._deadlines, (w.deadline, w.seq, w))
        if self._walking:
            self._added.append(w)
        else:
            self._insert(w)

    def _insert(self, w: Waiter) -> None:
        level = self._levels.get(w.priority)
        if level is None:
            level = self._levels[w.priority] = {}
        lane = level.get(w.demand.class_name)
        if lane is None:
            lane = level[w.demand.class_name] = Lane()
        lane.add(w)

    def remove(self, w: Waiter, served: bool = False) -> bool:
        """remove takes ``w`` out of the queue; ``served``: because it was granted (its lane's
        turn moves on); False when it was not queued."""
        if not w.queued:
            return False
        w.queued = False
        self.size -= 1
        if self._walking:
            self._removed.append((w, served))
        else:
            self._delete(w, served)
        if not self.size:
            self._deadlines.clear()
        return True

    def _delete(self, w: Waiter, served: bool) -> None:
        lane = w.lane
        if lane is None:  # added during a walk and removed before it ended
            return
        lane.drop(w, served)
        if not lane.live:
            level = self._levels[w.priority]
            del level[w.demand.class_name]
            if not level:
                del self._levels[w.priority]

    def top_priority(self) -> int | None:
        """top_priority is the highest priority with a waiter, or None when nobody waits."""
        if not self.size:
            return None
        if self._walking and self._added:
            return max(max(self._levels, default=self._added[0].priority),
                       max(w.priority for w in self._added if w.queued))
        return max(self._levels) if self._levels else None

    def waiters(self) -> list[Waiter]:
        """waiters lists the queued waiters (any order)."""
        out = [e[3] for level in self._levels.values() for lane in level.values()
               for e in lane.heap if e[3].queued]
        if self._walking:
            out.extend(w for w in self._added if w.queued)
        return out

    def expired(self, now: float) -> list[Waiter]:
        """expired removes and returns the waiters whose deadline is at or before ``now`` (s)."""
        out = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            w = heapq.heappop(heap)[2]
            if self.remove(w):
                out.append(w)
        return out

    def next_deadline(self) -> float | None:
        """next_deadline is the earliest deadline (s) of a queued waiter, or None."""
        heap = self._deadlines
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def walk(self) -> Generator[Waiter, Step, None]:
        """walk yields the queued waiters in service order and obeys the ``Step`` sent back for each.

        Order: priority descending; within a class, tag order (tenants in turn, module doc);
        between the classes of one priority, arrival order of each class's next waiter.
        """
        self._walking = True
        try:
            skip_tenants: set[str] = set()
            for prio in sorted(self._levels, reverse=True):
                heads: dict[str, list[Any]] = {}  # class -> [its iterator, its head waiter]
                for cname, lane in self._levels[prio].items():
                    it = lane.in_order()
                    head = _next_queued(it)
                    if head is not None:
                        heads[cname] = [it, head]
                while heads:
                    if len(heads) == 1:
                        cname, entry = next(iter(heads.items()))
                    else:
                        cname, entry = min(heads.items(), key=lambda kv: kv[1][1].seq)
                    w = entry[1]
                    step = Step.NEXT
                    if w.queued and w.demand.tenant not in skip_tenants:
                        step = yield w
                    if step is Step.STOP:
                        return
                    if step is Step.SKIP_CLASS:
                        del heads[cname]
                        continue
                    if step is Step.SKIP_TENANT:
                        skip_tenants.add(w.demand.tenant)
                    nxt = _next_queued(entry[0])
                    if nxt is None:
                        del heads[cname]
                    else:
                        entry[1] = nxt
        finally:
            self._walking = False
            removed, self._removed = self._removed, []
            for w, served in removed:
                self._delete(w, served)
            added, self._added = self._added, []
            for w in added:
                if w.queued:
                    self._insert(w)


def _next_queued(it: Iterator[Waiter]) -> Waiter | None:
    for w in it:
        if w.queued:
            return w
    return None


class Blocks:
    """Blocks is what the last walk of a pool's queue stopped on: what arrivals may not jump.

    ``stop``: (priority, refusal) of the waiter the walk stopped at (None: it did not
    stop); ``tenants``: per tenant, the refusal of its first waiter by its own bucket;
    ``classes``: per class, that of its first waiter by the class's KV watermark.
    """

    __slots__ = ("stop", "tenants", "classes")

    def __init__(self) -> None:
        self.stop: tuple[int, Refusal] | None = None
        self.tenants: dict[str, Refusal] = {}
        self.classes: dict[str, Refusal] = {}

    def reset(self) -> None:
        """reset forgets the last walk (a new one begins)."""
        self.stop = None
        self.tenants.clear()
        self.classes.clear()

    def note(self, w: Waiter, refusal: Refusal) -> Step:
        """note records what waiter ``w``'s refusal blocks (see the module docstring) and is the
        walk's next step."""
        b = refusal.budget
        if b in _SCALED and refusal.needed > refusal.limit:
            return Step.NEXT  # above the budget's scaled size: see _SCALED
        if b in _STOPS:
            if self.stop is None or w.priority > self.stop[0]:
                self.stop = (w.priority, refusal)
            return Step.STOP
        if b is Budget.RESERVED_SLOTS:
            return Step.SKIP_CLASS
        if b is Budget.CLASS_KV:
            # Only its own class is held to this watermark: later requests of the class
            # may not jump it (a large document is not starved by small ones), others may.
            self.classes.setdefault(w.demand.class_name, refusal)
            return Step.SKIP_CLASS
        self.tenants.setdefault(w.demand.tenant, refusal)
        return Step.SKIP_TENANT

    def may_jump(self, demand: Demand, priority: int, top: int | None) -> bool:
        """may_jump tells whether an arrival of ``priority`` goes ahead of the queue without a look
        at the last walk: nobody waits (``top`` None), or every waiter has a lower priority and
        none of them blocks the arrival's tenant or class."""
        return top is None or (top < priority and demand.tenant not in self.tenants
                               and demand.class_name not in self.classes)

    def blocker(self, demand: Demand, priority: int) -> Refusal | None:
        """blocker is the refusal of the waiter that an arrival of ``priority`` may not jump, or None.

        Waiters of a higher or the same priority that stopped the walk, earlier waiters of
        the same tenant stopped by its bucket, and earlier waiters of the same class stopped
        by its KV watermark, go first.
        """
        stop = self.stop
        if stop is not None and priority <= stop[0]:
            return stop[1]
        refusal = self.tenants.get(demand.tenant)
        return refusal if refusal is not None else self.classes.get(demand.class_name)

    def next_wake(self, queue: WaitQueue, now: float, poll_s: float | None) -> float:
        """next_wake is the instant (s) the queue must be walked again: its first deadline, the
        refill its walk stopped on, a blocked tenant's refill, or ``now + poll_s`` when others
        may free capacity unseen (``poll_s`` None: only this process frees it); inf: never."""
        first = queue.next_deadline()
        wake = math.inf if first is None else first
        stop = self.stop
        if stop is not None and stop[1].budget is Budget.POOL_TPM:
            wake = min(wake, now + stop[1].retry_after_s)
        elif poll_s is not None:
            wake = min(wake, now + poll_s)
        for r in self.tenants.values():
            wake = min(wake, now + r.retry_after_s)
        return wake


# What a walk is sent for each waiter it yields: the store's answer, None when the store
# could not answer (a shared store failing closed).
Answer = Grant | Refusal | None


def serve(queue: WaitQueue, prepare: Callable[[Waiter], Plan | Step],
          served: Callable[[Waiter, Plan, Grant | Refusal], Step]) -> Generator[tuple[Waiter, Plan], Answer, None]:
    """serve is one walk of ``queue``, for whatever answers for the store: it yields (waiter,
    plan) for each waiter to try and is sent the store's ``Answer``.

    ``prepare`` gives a waiter's plan, or the walk's next step when it needs no try (it left,
    or was shed); ``served`` acts on the store's answer and gives the next step. A store
    that cannot answer (None) stops the walk: the waiters keep waiting, bounded by their
    deadlines, and the next walk tries again. Whoever drives the walk closes it.
    """
    walk = queue.walk()
    try:
        w = next(walk)
        while True:
            plan = prepare(w)
            if isinstance(plan, Step):
                step = plan
            else:
                answer = yield w, plan
                step = Step.STOP if answer is None else served(w, plan, answer)
            w = walk.send(step)
    except StopIteration:
        return
    finally:
        walk.close()
