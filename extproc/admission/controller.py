"""controller: ``Admission`` decides per request whether a pool takes it now.

The controller turns a ``Demand`` into a ``Plan`` (the pool's limits at the current
adaptive scale, the class's guarantees, the tenant's bucket), hands it to the store, and
returns a ``Lease`` (``lease``), which gives it back, or a ``Rejection``. It adds what no
store does: load shedding in alarm, a node picked first in a pool that picks nodes
(``decide``: one demand's decision, from its plan to the store's answer), and the bounded
wait of a class, with waiters re-tried when capacity frees (``waiting``). Each pool's state
is a ``pool.PoolControl``.

Everything runs on one event loop thread: ``lease.release``, ``update_signals``,
``reconfigure`` and ``snapshot`` are synchronous and never wait; ``acquire`` suspends only
to wait for capacity (or on a store that answers asynchronously). The wait queues' timers
walk them on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial

from extproc.admission.adaptive import ScaleParams
from extproc.admission.decide import Decider
from extproc.admission.errors import UnknownPoolError
from extproc.admission.lease import Lease
from extproc.admission.node import Charge
from extproc.admission.nodes import NodeSnapshot, PoolNodes
from extproc.admission.pool import PoolControl
from extproc.admission.store.base import Store
from extproc.admission.store.memory import MemoryStore
from extproc.admission.tenants import Tenants
from extproc.admission.types import (CachedView, Demand, Grant, NodeReport, PoolSignals, PoolSnapshot, Refusal,
                                     Rejection)
from extproc.admission.waiting import BoundedWait
from extproc.clock import Clock, LoopTimers, Timers
from extproc.config import Config, PoolConfig


class Admission:
    """Admission admits requests to pools by slots, tokens per minute and in-flight KV tokens.

    ``config`` gives the pools, classes and tenants; ``clock`` the instants (seconds);
    ``store`` where budgets live (None: in this process); ``rand`` a uniform draw in
    [0, 1) for each refusal, that spreads its retry hint (``retry.spread``; None: the
    ``random`` module's); ``timers`` arm the wait queues' timers on ``clock``'s scale (None:
    the event loop's, for a clock that runs at its pace; a ``ManualClock`` is its own). See
    the module docstring for the threading rule.
    """

    def __init__(self, config: Config, clock: Clock, store: Store | None = None,
                 rand: Callable[[], float] | None = None, timers: Timers | None = None) -> None:
        self._clock = clock
        self._store: Store = MemoryStore() if store is None else store
        self._decide = Decider(clock, self._store, rand, Tenants(config.tenants))
        self._waits = BoundedWait(clock, LoopTimers() if timers is None else timers, self._decide, self,
                                  lambda p: self._pools.get(p.name) is p)
        # (pool, node): asks for an early scrape of a node (``PoolNodes.poke``; None: none).
        self.poke_node: Callable[[str, str], None] | None = None
        now = clock.now()
        self._pools: dict[str, PoolControl] = {
            name: self._new_pool(pc, config, now) for name, pc in config.pools.items()}

    def _new_pool(self, pc: PoolConfig, config: Config, now: float) -> PoolControl:
        tenants = self._decide.tenants
        p = PoolControl(pc, ScaleParams.of(pc, config.adaptive), config.adaptive.poll_interval_s,
                        tenants.guaranteed, tenants.kv_watermarks, now)
        if pc.picks:
            p.nodes = self._new_nodes(pc, config)
        return p

    def _new_nodes(self, pc: PoolConfig, config: Config) -> PoolNodes:
        nodes = PoolNodes(pc, config.adaptive.stale_after_s)
        nodes.poke = partial(self._poke, pc.name)
        if self._store.shares_nodes:  # the other replicas learn what this one's requests completed
            nodes.growth.share = partial(self._store.teach, pc.name)
        return nodes

    def _poke(self, pool: str, node: str) -> None:
        if self.poke_node is not None:
            self.poke_node(pool, node)

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
    def node_events(self) -> Callable[[str, str], CachedView | None] | None:
        """node_events is, per (pool, node), what the node's KV events say it caches
        (``extproc.signals.kv_events``; None: not read)."""
        return self._decide.node_events

    @node_events.setter
    def node_events(self, view: Callable[[str, str], CachedView | None] | None) -> None:
        self._decide.node_events = view

    @property
    def draining(self) -> bool:
        """draining tells whether a walk of a wait queue is under way (a shared store's runs in a task)."""
        return any(p.draining for p in self._pools.values())

    async def acquire(self, demand: Demand) -> Lease | Rejection:
        """acquire admits ``demand``, waiting up to its class's ``max_wait_s`` for capacity.

        A request admitted at once costs no task and no future, and with a store that
        answers at once (``SyncStore``) it does not suspend. A waiter cancelled while it
        waits (its client went away) leaves the queue and holds nothing. Raises
        ``UnknownPoolError`` or ``InvalidDemandError``.
        """
        decide = self._decide
        p = self._pool(demand.pool)
        got = decide.plan(p, demand)
        if type(got) is Rejection:
            return got
        cls, plan, now = got
        blocker = self._waits.blocked(p, demand, cls) if p.queue.size else None
        behind = blocker is not None
        if blocker is None:
            res = decide.admit_now(p, demand, plan, now) if decide.sync is not None else \
                await decide.admit(p, demand, plan, now)
            if isinstance(res, Grant):
                return Lease(self, res, demand, p.config.context_window)
            refusal: Refusal = res
            if not refusal.retryable or cls.max_wait_s <= 0:
                return decide.rejection(p, refusal, plan, now)
        elif cls.max_wait_s <= 0:
            return decide.rejection(p, blocker, plan, now, behind=True)
        else:
            refusal = blocker
        return await self._waits.wait(p, demand, cls, plan, refusal, behind, now)

    def _pool(self, name: str) -> PoolControl:
        """_pool returns the named pool's state; raises UnknownPoolError for an unknown name."""
        p = self._pools.get(name)
        if p is None:
            raise UnknownPoolError(name)
        return p

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
                self._waits.shed_waiters(p, now)
            self._waits.kick(p)

    def mark_nodes(self, mark: int, only: Collection[tuple[str, str]] | None = None) -> None:
        """mark_nodes starts a scrape round in every picking pool (``nodes.PoolNodes.mark``);
        an early round's on the (pool, backend) nodes ``only`` it scrapes (None: every node).

        ``mark`` is an increasing id that the round's ``report_node`` calls carry. A store
        shared by replicas stamps it with its instant, so that the round's reports are read
        net of the other replicas' requests (``shared_nodes``).
        """
        now = self._clock.now()
        since = self._store.instant()
        for name, p in self._pools.items():
            if p.nodes is not None:
                shared = self._store.learned(name)
                if shared:
                    p.nodes.growth.adopt(shared)
                p.nodes.mark(mark, now, since,
                             None if only is None else {b for pool, b in only if pool == name})

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
            self._waits.kick(p)

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
        tenants = self._decide.tenants = Tenants(config.tenants)
        pools: dict[str, PoolControl] = {}
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
            p.guaranteed = tenants.guaranteed
            p.kv_watermarks = tenants.kv_watermarks
            if pc.picks:
                if p.nodes is None:
                    p.nodes = self._new_nodes(pc, config)
                else:
                    p.nodes.reconfigure(pc, config.adaptive.stale_after_s)
            else:
                p.nodes = None  # charges held keep their node ledger until released
            p.limits = None
            pools[name] = p
        removed = [p for name, p in self._pools.items() if name not in pools]
        self._pools = pools
        for p in removed:
            self._waits.close_pool(p)
        for p in pools.values():
            if p.queue.size:
                self._waits.kick(p)

    async def close(self) -> None:
        """close refuses every waiter, stops timers and closes the store."""
        for p in self._pools.values():
            self._waits.close_pool(p, reason="kvgate is shutting down")
        await self._store.close()

    # --- the port leases report through (``lease.LeaseOwner``) ----------------------

    def lease_admitted(self, lease: Lease) -> float:
        """lease_admitted registers a new lease with its pool; returns the instant of admission (s)."""
        now = self._clock.now()
        p = self._pools.get(lease.demand.pool)
        if p is not None:
            p.admitted(lease)
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
        if p is not None and lease is not None and p.ended(lease) and completed:
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
            self._waits.kick(p)
