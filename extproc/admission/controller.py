"""controller: ``Admission`` decides per request whether a pool takes it now.

The controller turns a ``Demand`` into a ``Plan`` (the pool's limits at the current
adaptive scale, the class's guarantees, the tenant's bucket), hands it to the store, and
returns a ``Lease`` (``lease``), which gives it back, or a ``Rejection``. It adds what no
store does: load shedding in alarm, a node picked first in a pool that picks nodes, the
bounded wait of a class, and re-trying waiters when capacity frees (``waitqueue``: the
queue, what blocks it and its walk; here, what the walk does with each waiter and the
two drivers of it, one per kind of store). Each pool's state is a ``pool.PoolRuntime``.

Everything runs on one event loop thread: ``try_acquire``, ``lease.release``,
``update_signals``, ``reconfigure`` and ``snapshot`` are synchronous and never wait;
``acquire`` suspends only to wait for capacity (or on a shared store).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Generator
from functools import partial

from extproc.admission import rules
from extproc.admission.adaptive import ScaleParams
from extproc.admission.errors import InvalidDemandError, UnknownPoolError
from extproc.admission.kvbudget import reserved_completion
from extproc.admission.lease import Lease
from extproc.admission.node import Charge
from extproc.admission.nodes import NodeSnapshot, PoolNodes, Seen
from extproc.admission.placement import Placement, attach, place, undo
from extproc.admission.pool import PoolRuntime
from extproc.admission.retry import spread
from extproc.admission.store.base import Store, StoreError, SyncStore
from extproc.admission.store.memory import MemoryStore
from extproc.admission.tenants import NOT_CACHED, Tenants
from extproc.admission.types import (CachedView, Demand, Grant, NodeReport, Outcome, Plan, PoolLimits, PoolSignals,
                                     PoolSnapshot, RateInfo, Reason, Refusal, Rejection)
from extproc.admission.waitqueue import Answer, Step, Waiter, serve
from extproc.clock import Clock
from extproc.config import ClassConfig, Config, PoolConfig

# With a shared store, releases by other replicas are not seen here: waiters blocked on
# slots or KV are re-tried this often (seconds).
SHARED_POLL_S = 0.05


class Admission:
    """Admission admits requests to pools by slots, tokens per minute and in-flight KV tokens.

    ``config`` gives the pools, classes and tenants; ``clock`` the instants (seconds);
    ``store`` where budgets live (None: in this process); ``rand`` a uniform draw in
    [0, 1) for each refusal, that spreads its retry hint (``retry.spread``; None: the
    ``random`` module's). See the module docstring for the threading rule.
    """

    def __init__(self, config: Config, clock: Clock, store: Store | None = None,
                 rand: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self._rand = rand or random.random
        self._store: Store = MemoryStore() if store is None else store
        self._sync: SyncStore | None = self._store if isinstance(self._store, SyncStore) else None
        # (pool, node) -> what the node's KV events say it caches (``extproc.signals.kv_events``)
        self.node_events: Callable[[str, str], CachedView | None] | None = None
        self._config = config
        self._tenants = Tenants(config.tenants)
        now = clock.now()
        self._pools: dict[str, PoolRuntime] = {
            name: self._new_pool(pc, config, now) for name, pc in config.pools.items()}

    def _new_pool(self, pc: PoolConfig, config: Config, now: float) -> PoolRuntime:
        p = PoolRuntime(pc, ScaleParams.of(pc, config.adaptive), config.adaptive.poll_interval_s,
                  self._tenants.guaranteed, self._tenants.kv_watermarks, now)
        if pc.picks:
            p.nodes = PoolNodes(pc, config.adaptive.stale_after_s)
        return p

    # --- public API -------------------------------------------------------------

    @property
    def pools(self) -> tuple[str, ...]:
        """pools names the configured pools."""
        return tuple(self._pools)

    @property
    def store(self) -> Store:
        """store is where the budgets live."""
        return self._store

    @property
    def draining(self) -> bool:
        """draining tells whether a walk of a wait queue is under way (a shared store's runs in a task)."""
        return any(p.draining for p in self._pools.values())

    def demand(self, tenant: str, prompt_tokens: int, max_tokens: int | None = None,
               pool: str | None = None) -> Demand:
        """demand builds a request's Demand: the tenant's class and the completion it reserves.

        ``tenant`` is a configured tenant name (unknown ones get the default class);
        ``max_tokens`` is the request's max_tokens or max_completion_tokens (None: the
        pool's ``min(context_window - prompt, default_max_tokens)``); ``pool`` None is the
        default pool.
        """
        name = pool or self._config.default_pool
        cfg = self._pool(name).config
        return Demand(pool=name, tenant=tenant, class_name=self._config.class_of(tenant).name,
                      prompt_tokens=prompt_tokens,
                      reserved_completion=reserved_completion(prompt_tokens, max_tokens,
                                                            cfg.context_window, cfg.default_max_tokens))

    def try_acquire(self, demand: Demand) -> Lease | Rejection:
        """try_acquire admits ``demand`` now or refuses it; it never waits (in-process store only).

        Raises ``UnknownPoolError``, ``InvalidDemandError``, or ``TypeError`` with a shared store.
        """
        store = self._sync
        if store is None:
            raise TypeError("try_acquire needs an in-process store; use acquire with a shared store")
        got = self._plan(demand)
        if type(got) is Rejection:
            return got
        p, cls, plan, now = got
        if p.queue.size:
            blocker = self._blocked(p, demand, cls)
            if blocker is not None:
                return self._rejection(p, blocker, plan, now, behind=True)
        res = self._admit_now(p, demand, plan, now)
        if type(res) is Grant:
            return Lease(self, res, demand, p.config.context_window)
        return self._rejection(p, res, plan, now)

    async def acquire(self, demand: Demand) -> Lease | Rejection:
        """acquire admits ``demand``, waiting up to its class's ``max_wait_s`` for capacity.

        A request admitted at once costs no task and no future. A waiter cancelled while
        it waits (its client went away) leaves the queue and holds nothing. Raises like
        ``try_acquire`` (but works with every store).
        """
        got = self._plan(demand)
        if type(got) is Rejection:
            return got
        p, cls, plan, now = got
        blocker = self._blocked(p, demand, cls) if p.queue.size else None
        behind = blocker is not None
        if blocker is None:
            res = self._admit_now(p, demand, plan, now) if self._sync is not None else \
                await self._admit(p, demand, plan, now)
            if isinstance(res, Grant):
                return Lease(self, res, demand, p.config.context_window)
            refusal: Refusal = res
            if not refusal.retryable or cls.max_wait_s <= 0:
                return self._rejection(p, refusal, plan, now)
        elif cls.max_wait_s <= 0:
            return self._rejection(p, blocker, plan, now, behind=True)
        else:
            refusal = blocker
        return await self._wait(p, demand, cls, plan, refusal, behind, now)

    def _pool(self, name: str) -> PoolRuntime:
        """_pool returns the named pool's state; raises UnknownPoolError for an unknown name."""
        p = self._pools.get(name)
        if p is None:
            raise UnknownPoolError(name)
        return p

    def _plan(self, demand: Demand) -> tuple[PoolRuntime, ClassConfig, Plan, float] | Rejection:
        """_plan checks a demand and builds its plan now: (its pool, its class, the plan, the clock's
        now in s); a Rejection when its class is shed. Raises like ``try_acquire``."""
        p = self._pool(demand.pool)
        now = self._clock.now()
        pt, ct = demand.prompt_tokens, demand.reserved_completion
        if type(pt) is not int or type(ct) is not int or pt < 0 or ct < 0:
            raise InvalidDemandError(f"token counts must be integers >= 0, got prompt={pt!r} completion={ct!r}")
        tenants = self._tenants
        cls = tenants.classes.get(demand.class_name) or tenants.default
        limits = p.limits
        if limits is None or p.adaptive:
            limits = p.limits_at(now)
        if cls.sheddable and p.tracker.alarm:
            return self._shed(p, cls, limits)
        tb = tenants.buckets.get(demand.tenant, NOT_CACHED)
        if tb is NOT_CACHED:
            tb = tenants.bucket(demand.tenant, cls.name)
        return p, cls, Plan(limits, demand.tenant, cls.name, pt + ct, tb), now

    def update_signals(self, pool: str, signals: PoolSignals) -> None:
        """update_signals takes a pool's latest backend signals (on the event-loop thread).

        The scale follows at once when it shrinks, smoothly when it rises; entering alarm
        sheds the waiting requests of sheddable classes; a reported KV capacity (tokens)
        sets the derived KV budget. The signals count until their ``fresh_until`` (the
        signal layer decides it), then as saturated. Pools without backends keep scale
        1.0. Raises ``UnknownPoolError`` for a pool that is not configured.
        """
        p = self._pool(pool)
        now = self._clock.now()
        p.tracker.update(signals, now)
        cap = signals.kv_capacity_tokens
        if type(cap) is int and cap > 0 and cap != p.kv_capacity:
            p.kv_capacity = cap
            p.limits = None
        if p.queue.size:
            if p.tracker.alarm:
                self._shed_waiters(p, now)
            self._kick(p)

    def mark_nodes(self, mark: int) -> None:
        """mark_nodes starts a scrape round in every picking pool (``nodes.PoolNodes.mark``).

        ``mark`` is an increasing id that the round's ``report_node`` calls carry. A store
        shared by replicas stamps it with its instant, so that the round's reports are read
        net of the other replicas' requests (``shared_nodes``).
        """
        now = self._clock.now()
        since = self._store.instant()
        for p in self._pools.values():
            if p.nodes is not None:
                p.nodes.mark(mark, now, since)

    def report_node(self, pool: str, backend: str, report: NodeReport) -> None:
        """report_node hands in one node's scrape of a picking pool (on the event-loop thread).

        Room may have come back: the pool's waiters are re-tried. Reports for pools that
        do not pick, and for backends no longer configured, are ignored. Raises
        ``UnknownPoolError`` for a pool that is not configured.
        """
        p = self._pool(pool)
        store = self._store
        others = None if not store.shares_nodes else partial(store.others_seen, pool)
        if p.nodes is None or not p.nodes.report(backend, report, others):
            return
        if p.queue.size:
            self._kick(p)

    def any_node(self, pool: str, among: frozenset[str] | None = None) -> str | None:
        """any_node is the address of an up node of a picking pool, for a request kvgate does not
        admit (the one with fewest of kvgate's requests); None when none is up or the pool
        does not pick. ``among``: only the endpoints the proxy allows (None: all)."""
        p = self._pools.get(pool)
        return None if p is None or p.nodes is None else p.nodes.any_address(self._clock.now(),
                                                                             among=among)

    def eligible_nodes(self, pool: str, among: frozenset[str] | None) -> int:
        """eligible_nodes counts the nodes of a picking pool that may be picked now (up, of known
        capacity) and that ``among`` allows (None: all); 0 for a pool that does not pick."""
        p = self._pools.get(pool)
        return 0 if p is None or p.nodes is None else p.nodes.eligible(among, self._clock.now())

    def named_nodes(self, pool: str, among: frozenset[str] | None) -> int:
        """named_nodes counts the nodes of a picking pool that ``among`` allows, whatever their
        state (a node down or stale now may come back); 0 for a pool that does not pick."""
        p = self._pools.get(pool)
        return 0 if p is None or p.nodes is None else p.nodes.named(among)

    def nodes(self, pool: str) -> tuple[NodeSnapshot, ...]:
        """nodes reports the nodes of a picking pool now (empty for a pool that does not pick)."""
        p = self._pool(pool)
        return () if p.nodes is None else p.nodes.snapshot(self._clock.now())

    def snapshot(self, pool: str) -> PoolSnapshot:
        """snapshot reports a pool's scale, limits and usage now, for metrics and health pages."""
        p = self._pool(pool)
        now = self._clock.now()
        limits = p.limits_at(now)
        usage = self._store.usage(pool, now)
        bucket = limits.bucket
        available = usage.bucket_tokens
        if bucket is not None and available is None:
            available = bucket.capacity
        return PoolSnapshot(
            pool=pool, scale=limits.scale, concurrency_limit=limits.limit, inflight=usage.inflight,
            inflight_by_class={k: v for k, v in usage.by_class.items() if v},
            tpm_capacity=None if bucket is None else int(bucket.capacity),
            tpm_available=None if bucket is None or available is None else min(available, bucket.capacity),
            kv_inflight=usage.kv_inflight, kv_budget=limits.kv_budget, alarm=p.tracker.alarm,
            waiting=p.queue.size)

    def reconfigure(self, config: Config) -> None:
        """reconfigure applies a reloaded configuration to new admissions.

        Granted leases keep what they hold and release correctly; pools keep their
        adaptive state; waiters of a removed pool are refused (not retryable).
        """
        now = self._clock.now()
        self._config = config
        self._tenants = Tenants(config.tenants)
        pools: dict[str, PoolRuntime] = {}
        for name, pc in config.pools.items():
            p = self._pools.get(name)
            if p is None:
                pools[name] = self._new_pool(pc, config, now)
                continue
            p.config = pc
            params = ScaleParams.of(pc, config.adaptive)
            p.tracker.retune(params, now)
            p.adaptive = params.enabled
            p.retry_estimate_s = config.adaptive.poll_interval_s
            p.guaranteed = self._tenants.guaranteed
            p.kv_watermarks = self._tenants.kv_watermarks
            if pc.picks:
                if p.nodes is None:
                    p.nodes = PoolNodes(pc, config.adaptive.stale_after_s)
                else:
                    p.nodes.reconfigure(pc, config.adaptive.stale_after_s)
            else:
                p.nodes = None  # charges held keep their node ledger until released
            p.limits = None
            pools[name] = p
        removed = [p for name, p in self._pools.items() if name not in pools]
        self._pools = pools
        for p in removed:
            self._close_pool(p)
        for p in pools.values():
            if p.queue.size:
                self._kick(p)

    def poll(self, pool: str | None = None) -> None:
        """poll re-runs the wait queue of ``pool`` (None: all) at the clock's now.

        Overdue waiters are refused and waiters that now fit are admitted. Timers call it
        on their own; tests that move a ``ManualClock`` call it to stand in for them.
        """
        if pool is None:
            targets = list(self._pools.values())
        else:
            targets = [self._pool(pool)]
        for p in targets:
            if p.queue.size:
                self._kick(p)

    async def close(self) -> None:
        """close refuses every waiter, stops timers and closes the store."""
        for p in self._pools.values():
            self._close_pool(p, reason="kvgate is shutting down")
        await self._store.close()

    # --- the port leases report through (``lease.LeaseOwner``) ----------------------

    def lease_admitted(self, lease: Lease) -> float:
        """lease_admitted registers a new lease with its pool; returns the instant of admission (s)."""
        now = self._clock.now()
        p = self._pools.get(lease.demand.pool)
        if p is not None:
            p.live[lease] = None
        return now

    def lease_progress(self, pool: str, charge: Charge, generated: int, grant: Grant) -> None:
        """lease_progress records the tokens a lease's request has generated so far."""
        p = self._pools.get(pool)
        if p is not None and p.nodes is not None:
            p.nodes.progress(charge, generated, self._clock.now())
            if grant.picked is not None:
                # What a shared store holds on the node follows at its next lease refresh.
                grant.node_hold = p.nodes.growth.hold(charge.prompt, charge.reserved, charge.generated,
                                               charge.class_name)
                grant.node_pooled = p.nodes.pooled_of(charge)
        elif charge.first_at is None and generated > 0:
            charge.first_at = self._clock.now()

    def lease_served(self, pool: str, charge: Charge, address: str) -> bool:
        """lease_served moves a charge to the node at ``address`` that served it (``Lease.served``)."""
        p = self._pools.get(pool)
        if p is None or p.nodes is None:
            return False
        if self._store.shares_nodes:
            # The shared ledger keeps the node its script charged, and so does this replica's:
            # the node that served counts the request in its own report (foreign KV), so no
            # node is under-counted; the one picked is over-counted until the request ends.
            return any(n.address == address for n in p.nodes.nodes.values())
        return p.nodes.move(charge, address)

    def lease_settled(self, grant: Grant, charged: int, completion: int | None = None,
                      completed: bool = False, lease: Lease | None = None) -> None:
        """lease_settled gives a lease's budgets back: the store charged ``charged`` tokens, the
        node its charge (teaching its class's lengths when ``completed`` with a known
        ``completion``), and the pool's waiters a walk."""
        now = self._clock.now()
        self._store.settle(grant, charged, now)
        p = self._pools.get(grant.plan.limits.pool)
        if p is not None and lease is not None and p.live.pop(lease, 0) is None and completed:
            p.holds.add(now - lease.admitted_at, lease.demand.reserved_completion)
        charge = grant.node
        if charge is not None:
            # The pool may have been reloaded since: the charge's node ledger is its own.
            owner = p.nodes if p is not None and p.nodes is not None else None
            if owner is not None:
                owner.release(charge, completion, completed, now)
            else:
                charge.drop()
        if p is not None and p.queue.size:
            self._kick(p)

    # --- internals --------------------------------------------------------------

    def _undo(self, grant: Grant, now: float) -> None:
        """_undo takes back a grant nobody received: the store's charge and the node's."""
        self._store.settle(grant, 0, now)
        charge = grant.node
        if charge is not None and charge.held:
            charge.drop()

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

    def _place(self, p: PoolRuntime, demand: Demand, plan: Plan, now: float) -> Placement | Refusal:
        """_place is ``placement.place`` for a picking pool's demand."""
        assert p.nodes is not None
        return place(p.nodes, demand, self._tenants.class_rule(plan.class_name), plan, now, p.retry_estimate_s,
                     self._store.shares_nodes, self._seen(p.config.name, demand.blocks))

    def _admit_now(self, p: PoolRuntime, demand: Demand, plan: Plan, now: float) -> Grant | Refusal:
        """_admit_now is the in-process store's admission, placed on a node in a picking pool."""
        store = self._sync
        assert store is not None
        if p.nodes is None:
            return store.admit_now(plan, now)
        placed = self._place(p, demand, plan, now)
        if type(placed) is Refusal:
            return placed
        assert isinstance(placed, Placement)
        return attach(placed, store.admit_now(placed.plan, now), now, p.retry_estimate_s)

    async def _admit(self, p: PoolRuntime, demand: Demand, plan: Plan, now: float) -> Grant | Refusal:
        """_admit is ``_admit_now`` for a store that answers asynchronously.

        A node charged here is charged before the store is asked (so that no other request
        takes the same room meanwhile) and uncharged when the store refuses or fails.
        """
        if p.nodes is None:
            return await self._store.admit(plan, now)
        placed = self._place(p, demand, plan, now)
        if isinstance(placed, Refusal):
            return placed
        try:
            res = await self._store.admit(placed.plan, now)
        except BaseException:
            undo(placed)
            raise
        return attach(placed, res, now, p.retry_estimate_s)

    def _rate(self, p: PoolRuntime, limits: PoolLimits, now: float) -> RateInfo:
        usage = self._store.usage(p.name, now)
        b = limits.bucket
        if b is None:
            return RateInfo(limit_requests=limits.limit,
                            remaining_requests=max(0, limits.limit - usage.inflight))
        tokens = b.capacity if usage.bucket_tokens is None else min(usage.bucket_tokens, b.capacity)
        return RateInfo(limit_requests=limits.limit, remaining_requests=max(0, limits.limit - usage.inflight),
                        limit_tokens=int(b.capacity), remaining_tokens=max(0, int(tokens)),
                        reset_tokens_s=(b.capacity - tokens) / b.rate)

    def _rejection(self, p: PoolRuntime, refusal: Refusal, plan: Plan, now: float,
                   behind: bool = False) -> Rejection:
        """_rejection words a refusal with its retry hint (when the budget is expected back,
        spread); ``behind``: the refusal is that of a waiter queued ahead."""
        refusal = p.expected(refusal, plan, now)
        if refusal.retryable:
            refusal = Refusal(refusal.budget, spread(refusal.retry_after_s, self._rand()), True,
                              refusal.needed, refusal.used, refusal.limit)
        text = rules.queued_message(refusal, plan) if behind else rules.message(refusal, plan)
        return Rejection(reason=refusal.budget.reason, retry_after_s=refusal.retry_after_s,
                         retryable=refusal.retryable, message=text, rate=self._rate(p, plan.limits, now))

    def _shed(self, p: PoolRuntime, cls: ClassConfig, limits: PoolLimits) -> Rejection:
        wait = spread(p.retry_estimate_s, self._rand())
        return Rejection(reason=Reason.SHED, retry_after_s=wait, retryable=True,
                         message=rules.shed_message(p.name, cls.name, wait),
                         rate=self._rate(p, limits, self._clock.now()))

    def _blocked(self, p: PoolRuntime, demand: Demand, cls: ClassConfig) -> Refusal | None:
        """_blocked is the refusal of a waiter that ``demand`` may not jump, or None (``Blocks.blocker``)."""
        if p.blocks.may_jump(demand, cls.priority, p.queue.top_priority()):
            return None
        if self._sync is not None:
            self._kick(p)  # time has passed since the last walk: serve the queue first
        return p.blocks.blocker(demand, cls.priority)

    async def _wait(self, p: PoolRuntime, demand: Demand, cls: ClassConfig, plan: Plan,
                    refusal: Refusal, behind: bool, now: float) -> Lease | Rejection:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Lease | Rejection] = loop.create_future()
        share = None if cls.fairness == "fifo" else \
            max(1, demand.tokens) / self._tenants.weight(demand.flow)
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
                self._kick(p)  # it may have been the waiter others were queued behind
            if fut.done() and not fut.cancelled():
                got = fut.result()
                if isinstance(got, Lease):
                    got.abandon()
            raise

    def _resolve(self, p: PoolRuntime, w: Waiter, result: Lease | Rejection) -> None:
        p.queue.remove(w, served=type(result) is Lease)
        if w.future.done():
            if isinstance(result, Lease):
                result.abandon()
        else:
            w.future.set_result(result)

    def _shed_waiters(self, p: PoolRuntime, now: float) -> None:
        for w in p.queue.waiters():
            cls = self._tenants.class_rule(w.demand.class_name)
            if cls.sheddable:
                self._resolve(p, w, self._shed(p, cls, p.limits_at(now)))

    def _close_pool(self, p: PoolRuntime, reason: str = "its pool is no longer configured") -> None:
        p.cancel_timer()
        for w in p.queue.waiters():
            self._resolve(p, w, Rejection(reason=w.refusal.budget.reason, retry_after_s=0.0,
                                          retryable=False, message=f"The request was refused: {reason}."))

    def _expire(self, p: PoolRuntime, now: float) -> None:
        for w in p.queue.expired(now):
            if not w.future.done():
                waited = now - w.since
                r = self._rejection(p, w.refusal, w.plan, now, behind=w.behind)
                w.future.set_result(Rejection(
                    reason=r.reason, retry_after_s=r.retry_after_s, retryable=r.retryable,
                    message=f"{r.message} (waited {max(0.0, waited):.1f}s for capacity)", rate=r.rate))

    def _kick(self, p: PoolRuntime) -> None:
        """_kick serves the queue now (in-process store) or makes sure a drain task runs.

        A kick during a walk (a release made by the walk itself) only asks for one more.
        """
        if p.draining:
            p.drain_again = True
            return
        if self._sync is not None:
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

    def _walk(self, p: PoolRuntime, now: float) -> Generator[tuple[Waiter, Plan], Answer, None]:
        """_walk is one walk of the pool's queue at ``now`` (``waitqueue.serve``): expired waiters are
        refused first; its driver answers each (waiter, plan) it yields for the store."""
        self._expire(p, now)
        p.blocks.reset()
        return serve(p.queue, partial(self._prepare, p, now), partial(self._served, p, now))

    def _prepare(self, p: PoolRuntime, now: float, w: Waiter) -> Plan | Step:
        """_prepare is the plan to try for waiter ``w``, or the Step when it needs no try."""
        if w.future.done():  # cancelled; its task has not run its handler yet
            p.queue.remove(w)
            return Step.NEXT
        cls = self._tenants.class_rule(w.demand.class_name)
        limits = p.limits_at(now)
        if cls.sheddable and p.tracker.alarm:
            self._resolve(p, w, self._shed(p, cls, limits))
            return Step.NEXT
        d = w.demand
        plan = w.plan = Plan(limits, d.tenant, cls.name, d.prompt_tokens + d.reserved_completion,
                             self._tenants.bucket(d.tenant, cls.name))
        return plan

    def _served(self, p: PoolRuntime, now: float, w: Waiter, plan: Plan, res: Grant | Refusal) -> Step:
        """_served acts on the store's answer for waiter ``w`` and is the walk's next step: a grant
        admits it (or is taken back if it left), a refusal for good refuses it, any other
        refusal is noted in the pool's ``Blocks``."""
        if type(res) is Grant:
            if not w.queued or w.future.done():
                self._undo(res, now)  # its requester left while the store answered
                return Step.NEXT
            self._resolve(p, w, Lease(self, res, w.demand, p.config.context_window))
            return Step.NEXT
        w.refusal, w.behind = res, False
        if not res.retryable:
            self._resolve(p, w, self._rejection(p, res, plan, now))
            return Step.NEXT
        return p.blocks.note(w, res)

    def _drain(self, p: PoolRuntime) -> None:
        """_drain walks the queue once with the in-process store, then re-arms the timer."""
        now = self._clock.now()
        walk = self._walk(p, now)
        try:
            w, plan = next(walk)
            while True:
                w, plan = walk.send(self._admit_now(p, w.demand, plan, now))
        except StopIteration:
            pass
        finally:
            walk.close()
        self._schedule(p, now)

    async def _drain_async(self, p: PoolRuntime) -> None:
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
                            answer = await self._admit(p, w.demand, plan, now)
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

    def _schedule(self, p: PoolRuntime, now: float) -> None:
        """_schedule arms one timer for the pool's next event (``Blocks.next_wake``)."""
        if not p.queue.size or p.loop is None or p.loop.is_closed():
            p.cancel_timer()
            return
        wake = p.blocks.next_wake(p.queue, now, SHARED_POLL_S if self._store.shared else None)
        if p.timer is not None:
            if p.timer_at <= wake:
                return
            p.timer.cancel()
        if wake == math.inf:
            p.timer, p.timer_at = None, math.inf
            return
        p.timer_at = wake
        p.timer = p.loop.call_later(max(0.0, wake - now), self._on_timer, p)

    def _on_timer(self, p: PoolRuntime) -> None:
        p.timer, p.timer_at = None, math.inf
        if self._pools.get(p.name) is p and p.queue.size:
            self._kick(p)
