"""decide: one demand's decision now, from its plan to the store's answer, refusals worded.

``Decider.plan`` checks a demand and plans it (the pool's limits at the current adaptive
scale, the class, the tenant's bucket), or sheds it in alarm; ``admit_now`` (an
in-process store) and ``admit`` (a store that answers asynchronously) place it on a node
in a picking pool (``placement``) and ask the store; ``rejection`` and ``shed`` word a
refusal with its spread retry hint and the pool's rate headers. The controller
(``controller.Admission``) calls these for a request that arrives, the bounded wait
(``waiting.BoundedWait``) for each waiter it re-tries. Everything runs on the event-loop
thread; times are seconds on the admission clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from extproc.admission import rules
from extproc.admission.errors import InvalidDemandError
from extproc.admission.nodes import Seen
from extproc.admission.placement import Placement, attach, place, undo
from extproc.admission.pool import PoolControl
from extproc.admission.retry import spread
from extproc.admission.store.base import Store, SyncStore
from extproc.admission.tenants import NOT_CACHED, Tenants
from extproc.admission.types import (CachedView, Demand, Grant, Plan, PoolLimits, RateInfo, Reason, Refusal,
                                     Rejection)
from extproc.clock import Clock
from extproc.config import ClassConfig


class Decider:
    """Decider decides one demand now against a pool's budgets in ``store``.

    ``tenants``: the classes and buckets of the configuration in force (a reload replaces
    it); ``rand``: a uniform draw in [0, 1) for each refusal, that spreads its retry hint
    (``retry.spread``); ``node_events``: per (pool, node), what the node's KV events say it
    caches (``extproc.signals.kv_events``; None: not read); ``sync``: the store when it
    answers at once (None: it answers asynchronously).
    """

    __slots__ = ("clock", "store", "sync", "rand", "tenants", "node_events")

    def __init__(self, clock: Clock, store: Store, rand: Callable[[], float] | None, tenants: Tenants) -> None:
        self.clock = clock
        self.store = store
        self.sync: SyncStore | None = store if isinstance(store, SyncStore) else None
        self.rand = rand or random.random
        self.tenants = tenants
        self.node_events: Callable[[str, str], CachedView | None] | None = None

    def plan(self, p: PoolControl, demand: Demand) -> tuple[ClassConfig, Plan, float] | Rejection:
        """plan checks ``demand`` and builds its plan now: (its class, the plan, the clock's now
        in s); a Rejection when its class is shed. Raises ``InvalidDemandError``."""
        now = self.clock.now()
        pt, ct = demand.prompt_tokens, demand.reserved_completion
        if type(pt) is not int or type(ct) is not int or pt < 0 or ct < 0:
            raise InvalidDemandError(f"token counts must be integers >= 0, got prompt={pt!r} completion={ct!r}")
        tenants = self.tenants
        cls = tenants.classes.get(demand.class_name) or tenants.default
        limits = p.limits
        if limits is None or p.adaptive:
            limits = p.limits_at(now)
        if cls.sheddable and p.tracker.alarm:
            return self.shed(p, cls, limits)
        tb = tenants.buckets.get(demand.tenant, NOT_CACHED)
        if tb is NOT_CACHED:
            tb = tenants.bucket(demand.tenant, cls.name)
        # waits: a retryable refusal of a class that waits queues the request (controller.acquire)
        return cls, Plan(limits, demand.tenant, cls.name, pt + ct, tb, None, cls.max_wait_s > 0), now

    def _seen(self, pool: str, blocks: tuple[int, ...] | None) -> Seen | None:
        """_seen is what each node of ``pool`` caches of the prompt of ``blocks`` by its KV
        events (None: no keys, or no events read)."""
        events = self.node_events
        if blocks is None or events is None:
            return None

        def seen(node: str) -> tuple[int, bool] | None:
            view = events(pool, node)
            return None if view is None else view.cached(blocks)
        return seen

    def _place(self, p: PoolControl, demand: Demand, plan: Plan, now: float) -> Placement | Refusal:
        """_place is ``placement.place`` for a picking pool's demand."""
        assert p.nodes is not None
        return place(p.nodes, demand, self.tenants.class_rule(plan.class_name), plan, now, p.retry_estimate_s,
                     self.store.shares_nodes, self._seen(p.config.name, demand.blocks))

    def admit_now(self, p: PoolControl, demand: Demand, plan: Plan, now: float) -> Grant | Refusal:
        """admit_now is the in-process store's admission, placed on a node in a picking pool."""
        store = self.sync
        assert store is not None
        if p.nodes is None:
            return store.admit_now(plan, now)
        placed = self._place(p, demand, plan, now)
        if type(placed) is Refusal:
            return placed
        assert isinstance(placed, Placement)
        return attach(placed, store.admit_now(placed.plan, now), now, p.retry_estimate_s)

    async def admit(self, p: PoolControl, demand: Demand, plan: Plan, now: float) -> Grant | Refusal:
        """admit is ``admit_now`` for a store that answers asynchronously.

        A node charged here is charged before the store is asked (so that no other request
        takes the same room meanwhile) and uncharged when the store refuses or fails.
        """
        if p.nodes is None:
            return await self.store.admit(plan, now)
        placed = self._place(p, demand, plan, now)
        if isinstance(placed, Refusal):
            return placed
        try:
            res = await self.store.admit(placed.plan, now)
        except BaseException:
            undo(placed)
            raise
        return attach(placed, res, now, p.retry_estimate_s, self.store.node_holds(p.name))

    def undo(self, grant: Grant, now: float) -> None:
        """undo takes back a grant nobody received: the store's charge and the node's."""
        self.store.settle(grant, 0, now)
        charge = grant.node
        if charge is not None and charge.held:
            charge.drop()

    def _rate(self, p: PoolControl, limits: PoolLimits, now: float) -> RateInfo:
        """_rate is the pool's rate headers now: requests, and tokens where it has a bucket."""
        usage = self.store.usage(p.name, now)
        b = limits.bucket
        if b is None:
            return RateInfo(limit_requests=limits.limit,
                            remaining_requests=max(0, limits.limit - usage.inflight))
        tokens = b.capacity if usage.bucket_tokens is None else min(usage.bucket_tokens, b.capacity)
        return RateInfo(limit_requests=limits.limit, remaining_requests=max(0, limits.limit - usage.inflight),
                        limit_tokens=int(b.capacity), remaining_tokens=max(0, int(tokens)),
                        reset_tokens_s=(b.capacity - tokens) / b.rate)

    def rejection(self, p: PoolControl, refusal: Refusal, plan: Plan, now: float,
                  behind: bool = False) -> Rejection:
        """rejection words a refusal with its retry hint (when the budget is expected back,
        spread); ``behind``: the refusal is that of a waiter queued ahead."""
        refusal = p.expected(refusal, plan, now)
        if refusal.retryable:
            refusal = Refusal(refusal.budget, spread(refusal.retry_after_s, self.rand()), True,
                              refusal.needed, refusal.used, refusal.limit)
        text = rules.queued_message(refusal, plan) if behind else rules.message(refusal, plan)
        return Rejection(reason=refusal.budget.reason, retry_after_s=refusal.retry_after_s,
                         retryable=refusal.retryable, message=text, rate=self._rate(p, plan.limits, now))

    def shed(self, p: PoolControl, cls: ClassConfig, limits: PoolLimits) -> Rejection:
        """shed is the refusal of a request of sheddable class ``cls`` while its pool is in alarm."""
        wait = spread(p.retry_estimate_s, self.rand())
        return Rejection(reason=Reason.SHED, retry_after_s=wait, retryable=True,
                         message=rules.shed_message(p.name, cls.name, wait),
                         rate=self._rate(p, limits, self.clock.now()))
