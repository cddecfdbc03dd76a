"""controller: ``Admission`` decides per request whether a pool takes it now; ``Lease`` gives it back.

The controller turns a ``Demand`` into a ``Plan`` (the pool's limits at the current
adaptive scale, the class's guarantees, the tenant's bucket), hands it to the store, and
returns a ``Lease`` or a ``Rejection``. It adds what no store does: load shedding in alarm,
the bounded wait of a class (``waitqueue``), and re-trying waiters when capacity frees.

Everything runs on one event loop thread: ``try_acquire``, ``lease.release``,
``update_signals``, ``reconfigure`` and ``snapshot`` are synchronous and never wait;
``acquire`` suspends only to wait for capacity (or on a shared store).
"""

from __future__ import annotations

import asyncio
import math

from extproc.admission import rules
from extproc.admission.adaptive import ScaleParams, ScaleTracker
from extproc.admission.errors import InvalidDemandError, UnknownPoolError
from extproc.admission.kvbudget import base_kv_budget, effective_kv_budget, kv_ceilings, reserved_completion
from extproc.admission.nodes import Charge, NodeReport, NodeSnapshot, PassedOver, PoolNodes
from extproc.admission.retry import HoldTimes, expected_wait
from extproc.admission.slots import effective_guarantees, effective_limit
from extproc.admission.store.base import Store, StoreError, SyncStore
from extproc.admission.types import POOL_BUCKET, Budget, BucketSpec, Grant, Plan, PoolLimits, Refusal
from extproc.admission.store.memory import MemoryStore
from extproc.admission.tenants import Tenants
from extproc.admission.types import (Demand, Outcome, PoolSignals, PoolSnapshot, RateInfo, Reason,
                                     Rejection)
from extproc.admission.waitqueue import Step, Waiter, WaitQueue
from extproc.clock import Clock
from extproc.config import ClassConfig, Config, PoolConfig

# With a shared store, releases by other replicas are not seen here: waiters blocked on
# slots or KV are re-tried this often (seconds).
SHARED_POLL_S = 0.05

_STOPS = (Budget.SLOTS, Budget.KV, Budget.POOL_TPM, Budget.NODE_KV)
# Budgets that do not fit above their size at the current scale: only the scale's recovery
# lets such a waiter in, and holding others back would not bring that sooner.
_SCALED = (Budget.KV, Budget.CLASS_KV, Budget.POOL_TPM)
_UNCACHED = object()
# Budgets that come back when leases are released: their retry hint is learned.
_RELEASED = (Budget.SLOTS, Budget.RESERVED_SLOTS, Budget.KV, Budget.CLASS_KV)


class Lease:
    """Lease is an admitted request's hold on its pool's budgets, until ``release``.

    ``demand`` is what was asked; ``id`` is the store's grant id; ``released`` tells
    whether it was released; ``outcome`` is how it ended (None while held).
    """

    __slots__ = ("_adm", "_grant", "demand", "released", "outcome", "_max_completion", "_charge",
                 "admitted_at")

    def __init__(self, adm: Admission, grant: Grant, demand: Demand, max_completion: int) -> None:
        self._adm = adm
        self._grant = grant
        self.demand = demand
        self.released = False
        self.outcome: Outcome | None = None
        # n choices (or a batch of prompts) reserve and generate up to n x max_tokens,
        # which can exceed one context window.
        self._max_completion = max(max_completion, demand.completion_tokens)
        self._charge: Charge | None = grant.node
        self.admitted_at = adm._admitted(self)

    @property
    def node(self) -> str | None:
        """node is the address (``HOST:PORT``) of the node picked for the request (None: not picked)."""
        return None if self._charge is None else self._charge.address

    def progress(self, generated_tokens: int) -> None:
        """progress tells a picked node's ledger how many tokens the request has generated so far."""
        c = self._charge
        if c is not None and not self.released:
            self._adm._progress(self.demand.pool, c, generated_tokens, self._grant)

    def served(self, address: str) -> bool:
        """served moves the request's node charge to ``address`` (``HOST:PORT``), the endpoint
        the proxy says served it, when that is another node of the pool than the one picked.
        False when nothing moved: not picked, released, the same node, or an address that is
        no node of the pool (the charge then stays on the node picked). With a store that
        shares the nodes' ledger the charge stays on the node picked (see ``_move``): True
        for an address that is a node of the pool."""
        c = self._charge
        if c is None or self.released:
            return False
        return self._adm._move(self.demand.pool, c, address)

    @property
    def id(self) -> str:
        """id is the grant's id in the store."""
        return self._grant.id

    @property
    def rate(self) -> RateInfo:
        """rate is what the ``x-ratelimit-*`` headers report, as of the admission.

        Tokens describe the binding bucket (the tenant's or the pool's, whichever had
        fewer tokens left); None without buckets.
        """
        g = self._grant
        limit = g.plan.limits.limit
        if g.bucket_capacity is None:
            return RateInfo(limit_requests=limit, remaining_requests=max(0, limit - g.inflight))
        cap = g.bucket_capacity
        left = g.bucket_tokens or 0.0
        return RateInfo(limit_requests=limit, remaining_requests=max(0, limit - g.inflight),
                        limit_tokens=int(cap), remaining_tokens=max(0, int(left)),
                        reset_tokens_s=max(0.0, (cap - left) / g.bucket_rate) if g.bucket_rate else 0.0)

    def release(self, outcome: Outcome, completion_tokens: int | None = None) -> bool:
        """release gives the lease back once; True only for the call that released it.

        ``completion_tokens`` is the completion the upstream reported; the buckets end up
        charged prompt + that. None (unknown), or anything that is not an integer >= 0,
        charges the whole reservation, never zero. A count above the larger of the pool's
        context window and the reservation is capped there (a backend's report is outside
        input).
        """
        if self.released:
            return False
        self.released = True
        self.outcome = outcome
        d = self.demand
        known: int | None = None
        if type(completion_tokens) is int and completion_tokens >= 0:
            known = completion_tokens if completion_tokens < self._max_completion else self._max_completion
            charged = d.prompt_tokens + known
        else:
            charged = d.prompt_tokens + d.completion_tokens
        self._adm._settle(self._grant, charged, known if outcome is Outcome.COMPLETED else None,
                          outcome is Outcome.COMPLETED, self)
        return True

    def __repr__(self) -> str:
        return f"Lease({self.id}, {self.demand.pool}/{self.demand.tenant}, released={self.released})"


class _Pool:
    """_Pool is one pool's runtime: its config, adaptive tracker, cached limits and wait queue."""

    __slots__ = ("name", "config", "tracker", "kv_capacity", "limits", "queue", "loop", "timer",
                 "timer_at", "stop", "blocked_tenants", "blocked_classes", "draining", "drain_again",
                 "drain_task", "retry_estimate_s", "guaranteed", "kv_watermarks", "adaptive", "nodes",
                 "live", "holds")

    def __init__(self, config: PoolConfig, params: ScaleParams, retry_estimate_s: float,
                 guaranteed: dict[str, int], kv_watermarks: dict[str, float], now: float) -> None:
        self.name = config.name
        self.config = config
        self.tracker = ScaleTracker(params, now)
        self.adaptive = params.enabled  # False: scale 1.0 forever, limits cached until invalidated
        self.kv_capacity: int | None = None
        self.limits: PoolLimits | None = None
        self.queue = WaitQueue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf
        # What blocked the last walk of the queue: (priority, refusal) of the waiter it
        # stopped at, the tenants whose own bucket refused their first waiter, and the
        # classes whose KV watermark refused their first waiter.
        self.stop: tuple[int, Refusal] | None = None
        self.blocked_tenants: dict[str, Refusal] = {}
        self.blocked_classes: dict[str, Refusal] = {}
        self.draining = False
        self.drain_again = False
        self.drain_task: asyncio.Task[None] | None = None
        self.retry_estimate_s = retry_estimate_s
        self.guaranteed = guaranteed
        self.kv_watermarks = kv_watermarks
        # Per-node ledgers when the pool picks nodes; its KV is then guarded per node, not
        # by a pool-wide budget.
        self.nodes: PoolNodes | None = None
        # Leases held now, and how long completed ones held: when slots and KV come back.
        self.live: dict[Lease, None] = {}
        self.holds = HoldTimes()

    def limits_at(self, now: float) -> PoolLimits:
        """limits_at is the pool's limits at ``now``'s scale (cached while the scale holds)."""
        scale = self.tracker.at(now)
        lim = self.limits
        if lim is not None and lim.scale == scale:
            return lim
        cfg = self.config
        limit = effective_limit(cfg.max_concurrency, scale)
        base_kv = None if self.nodes is not None else \
            base_kv_budget(cfg.kv_budget_tokens, self.kv_capacity, cfg.signals.kv_budget_fraction)
        bucket = None
        if cfg.tpm is not None:
            cap = cfg.tpm * scale
            bucket = BucketSpec(key=POOL_BUCKET, capacity=cap, rate=cap / 60.0, base_capacity=float(cfg.tpm))
        kv = effective_kv_budget(base_kv, scale)
        lim = self.limits = PoolLimits(
            pool=self.name, scale=scale, limit=limit, base_limit=cfg.max_concurrency,
            guarantees=effective_guarantees(self.guaranteed, scale, limit),
            kv_budget=kv, base_kv_budget=base_kv,
            kv_ceilings=kv_ceilings(self.kv_watermarks, kv, base_kv) if self.kv_watermarks else {},
            bucket=bucket, retry_estimate_s=self.retry_estimate_s)
        return lim


class Admission:
    """Admission admits requests to pools by slots, tokens per minute and in-flight KV tokens.

    ``config`` gives the pools, classes and tenants; ``clock`` the instants (seconds);
    ``store`` where budgets live (None: in this process). See the module docstring for
    the threading rule.
    """

    def __init__(self, config: Config, clock: Clock, store: Store | None = None) -> None:
        self._clock = clock
        self._store: Store = MemoryStore() if store is None else store
        self._sync: SyncStore | None = self._store if isinstance(self._store, SyncStore) else None
        self._config = config
        self._tenants = Tenants(config.tenants)
        now = clock.now()
        self._pools: dict[str, _Pool] = {
            name: self._new_pool(pc, config, now) for name, pc in config.pools.items()}

    def _new_pool(self, pc: PoolConfig, config: Config, now: float) -> _Pool:
        p = _Pool(pc, ScaleParams.of(pc, config.adaptive), config.adaptive.poll_interval_s,
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
                      completion_tokens=reserved_completion(prompt_tokens, max_tokens,
                                                            cfg.context_window, cfg.default_max_tokens))

    def try_acquire(self, demand: Demand) -> Lease | Rejection:
        """try_acquire admits ``demand`` now or refuses it; it never waits (in-process store only).

        Raises ``UnknownPoolError``, ``InvalidDemandError``, or ``TypeError`` with a shared store.
        """
        store = self._sync
        if store is None:
            raise TypeError("try_acquire needs an in-process store; use acquire with a shared store")
        p = self._pool(demand.pool)
        now = self._clock.now()
        got = self._plan(p, demand, now)
        if type(got) is Rejection:
            return got
        cls, plan = got  # type: ignore[misc]
        if p.queue.size:
            blocker = self._blocked(p, demand, cls)
            if blocker is not None:
                return self._rejection(p, blocker, plan, now, behind=True)
        res = self._admit_now(p, demand, plan, now)
        if type(res) is Grant:
            return Lease(self, res, demand, p.config.context_window)
        return self._rejection(p, res, plan, now)  # type: ignore[arg-type]

    async def acquire(self, demand: Demand) -> Lease | Rejection:
        """acquire admits ``demand``, waiting up to its class's ``max_wait_s`` for capacity.

        A request admitted at once costs no task and no future. A waiter cancelled while
        it waits (its client went away) leaves the queue and holds nothing. Raises like
        ``try_acquire`` (but works with every store).
        """
        p = self._pool(demand.pool)
        now = self._clock.now()
        got = self._plan(p, demand, now)
        if type(got) is Rejection:
            return got
        cls, plan = got  # type: ignore[misc]
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

    def _pool(self, name: str) -> _Pool:
        """_pool returns the named pool's state; raises UnknownPoolError for an unknown name."""
        p = self._pools.get(name)
        if p is None:
            raise UnknownPoolError(name)
        return p

    def _plan(self, p: _Pool, demand: Demand, now: float) -> tuple[ClassConfig, Plan] | Rejection:
        """_plan checks a demand and builds its plan at ``now``; a Rejection when its class is shed."""
        pt, ct = demand.prompt_tokens, demand.completion_tokens
        if type(pt) is not int or type(ct) is not int or pt < 0 or ct < 0:
            raise InvalidDemandError(f"token counts must be integers >= 0, got prompt={pt!r} completion={ct!r}")
        tenants = self._tenants
        cls = tenants.classes.get(demand.class_name) or tenants.default
        limits = p.limits
        if limits is None or p.adaptive:
            limits = p.limits_at(now)
        if cls.sheddable and p.tracker.alarm:
            return self._shed(p, cls, limits)
        tb = tenants.buckets.get(demand.tenant, _UNCACHED)
        if tb is _UNCACHED:
            tb = tenants.bucket(demand.tenant, cls.name)
        return cls, Plan(limits, demand.tenant, cls.name, pt + ct, tb)  # type: ignore[arg-type]

    def update_signals(self, pool: str, signals: PoolSignals) -> None:
        """update_signals takes a pool's latest backend signals (on the event-loop thread).

        The scale follows at once when it shrinks, smoothly when it rises; entering alarm
        sheds the waiting requests of sheddable classes; a reported KV capacity (tokens)
        sets the derived KV budget. Pools without backends keep scale 1.0. Raises
        ``UnknownPoolError`` for a pool that is not configured.
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

        ``mark`` is an increasing id that the round's ``report_node`` calls carry.
        """
        for p in self._pools.values():
            if p.nodes is not None:
                p.nodes.mark(mark)

    def report_node(self, pool: str, backend: str, report: NodeReport) -> None:
        """report_node hands in one node's scrape of a picking pool (on the event-loop thread).

        Room may have come back: the pool's waiters are re-tried. Reports for pools that
        do not pick, and for backends no longer configured, are ignored. Raises
        ``UnknownPoolError`` for a pool that is not configured.
        """
        p = self._pool(pool)
        if p.nodes is None or not p.nodes.report(backend, report):
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
        pools: dict[str, _Pool] = {}
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

    # --- internals --------------------------------------------------------------

    def _admitted(self, lease: Lease) -> float:
        """_admitted registers a new lease with its pool; returns the instant of admission."""
        now = self._clock.now()
        p = self._pools.get(lease.demand.pool)
        if p is not None:
            p.live[lease] = None
        return now

    def _settle(self, grant: Grant, charged: int, completion: int | None = None,
                completed: bool = False, lease: Lease | None = None) -> None:
        now = self._clock.now()
        self._store.settle(grant, charged, now)
        p = self._pools.get(grant.plan.limits.pool)
        if p is not None and lease is not None and p.live.pop(lease, 0) is None and completed:
            p.holds.add(now - lease.admitted_at)
        charge = grant.node
        if charge is not None:
            # The pool may have been reloaded since: the charge's node ledger is its own.
            owner = p.nodes if p is not None and p.nodes is not None else None
            if owner is not None:
                owner.release(charge, completion, completed, now)
            else:
                charge.held = False
                charge.node.charges.discard(charge)
        if p is not None and p.queue.size:
            self._kick(p)

    def _undo(self, grant: Grant, now: float) -> None:
        """_undo takes back a grant nobody received: the store's charge and the node's."""
        self._store.settle(grant, 0, now)
        charge = grant.node
        if charge is not None and charge.held:
            charge.held = False
            charge.node.charges.discard(charge)

    @staticmethod
    def _never_fits(nodes: PoolNodes, demand: Demand, cls: ClassConfig) -> Refusal | None:
        """_never_fits refuses, for good (no retry), a request above every node's capacity."""
        pt, ct = demand.prompt_tokens, demand.completion_tokens
        largest = nodes.never_fits(cls.name, pt, ct)
        if largest is None:
            return None
        return Refusal(Budget.NODE_KV, 0.0, False, nodes.hold(pt, ct, 0, cls.name), 0, largest)

    def _node_refusal(self, p: _Pool, demand: Demand, cls: ClassConfig,
                      now: float) -> Charge | Refusal:
        """_node_refusal charges a node for ``demand`` (a picking pool), or says why none fits."""
        nodes = p.nodes
        assert nodes is not None
        pt, ct = demand.prompt_tokens, demand.completion_tokens
        never = self._never_fits(nodes, demand, cls)
        if never is not None:
            return never
        got = nodes.pick(cls.name, pt, ct, cls.kv_watermark, now, demand.among)
        if isinstance(got, Charge):
            return got
        wait = nodes.retry_after(got.need, now, p.retry_estimate_s)
        budget = Budget.CLASS_KV if got.by_watermark else Budget.NODE_KV
        return Refusal(budget, wait, True, got.need, got.best_room or 0, got.best_room or 0)

    def _admit_now(self, p: _Pool, demand: Demand, plan: Plan, now: float) -> Grant | Refusal:
        """_admit_now is the in-process store's admission, with a node picked first in a picking pool."""
        store = self._sync
        assert store is not None
        if p.nodes is None:
            return store.admit_now(plan, now)
        cls = self._tenants.class_rule(plan.class_name)
        charge = self._node_refusal(p, demand, cls, now)
        if type(charge) is Refusal:
            return charge
        res = store.admit_now(plan, now)
        self._attach(res, charge)  # type: ignore[arg-type]
        return res

    async def _admit(self, p: _Pool, demand: Demand, plan: Plan, now: float) -> Grant | Refusal:
        """_admit is ``_admit_now`` for a store that answers asynchronously.

        The node is charged before the store is asked (so that no other request takes the
        same room meanwhile) and uncharged when the store refuses or fails.
        """
        if p.nodes is None:
            return await self._store.admit(plan, now)
        cls = self._tenants.class_rule(plan.class_name)
        if self._store.shares_nodes:
            return await self._admit_shared_node(p, demand, plan, cls, now)
        charge = self._node_refusal(p, demand, cls, now)
        if type(charge) is Refusal:
            return charge
        try:
            res = await self._store.admit(plan, now)
        except BaseException:
            self._attach(None, charge)  # type: ignore[arg-type]
            raise
        self._attach(res, charge)  # type: ignore[arg-type]
        return res

    async def _admit_shared_node(self, p: _Pool, demand: Demand, plan: Plan, cls: ClassConfig,
                                 now: float) -> Grant | Refusal:
        """_admit_shared_node lets a store that shares the nodes' ledger pick the node with the
        pool's budgets, in one round trip, then records the request in this replica's ledger."""
        nodes = p.nodes
        assert nodes is not None
        pt, ct = demand.prompt_tokens, demand.completion_tokens
        never = self._never_fits(nodes, demand, cls)
        if never is not None:
            return never
        ask = nodes.ask(cls.name, pt, ct, cls.kv_watermark, now, demand.among)
        res = await self._store.admit(Plan(plan.limits, plan.tenant, plan.class_name, plan.tokens,
                                           plan.tenant_bucket, ask), now)
        if type(res) is Refusal:
            # A picking pool has no pool-wide KV budget, so its KV refusals are the node rule's.
            if res.budget is Budget.NODE_KV or res.budget is Budget.CLASS_KV:
                nodes.passed_over_all(ask, PassedOver.NO_ROOM if res.budget is Budget.NODE_KV
                                      else PassedOver.CLASS_WATERMARK)
                wait = nodes.retry_after(ask.need, now, p.retry_estimate_s)
                return Refusal(res.budget, wait, True, res.needed, res.used, res.limit)
            return res
        grant: Grant = res  # type: ignore[assignment]
        if grant.picked is not None:
            grant.node = nodes.charge(grant.picked, cls.name, pt, ct, now)
        return grant

    @staticmethod
    def _attach(res: Grant | Refusal | None, charge: Charge) -> None:
        if type(res) is Grant:
            res.node = charge
        else:  # refused by the store: the node's charge goes back untouched
            charge.held = False
            charge.node.charges.discard(charge)
            charge.node.picks -= 1

    def _move(self, pool: str, charge: Charge, address: str) -> bool:
        p = self._pools.get(pool)
        if p is None or p.nodes is None:
            return False
        if self._store.shares_nodes:
            # The shared ledger keeps the node its script charged, and so does this replica's:
            # the node that served counts the request in its own report (foreign KV), so no
            # node is under-counted; the one picked is over-counted until the request ends.
            return any(n.address == address for n in p.nodes.nodes.values())
        return p.nodes.move(charge, address)

    def _progress(self, pool: str, charge: Charge, generated: int, grant: Grant) -> None:
        p = self._pools.get(pool)
        if p is not None and p.nodes is not None:
            p.nodes.progress(charge, generated, self._clock.now())
            if grant.picked is not None:
                # What a shared store holds on the node follows at its next lease refresh.
                grant.node_hold = p.nodes.hold(charge.prompt, charge.reserved, charge.generated,
                                               charge.class_name)
        elif charge.first_at is None and generated > 0:
            charge.first_at = self._clock.now()

    def _rate(self, p: _Pool, limits: PoolLimits, now: float) -> RateInfo:
        usage = self._store.usage(p.name, now)
        b = limits.bucket
        if b is None:
            return RateInfo(limit_requests=limits.limit,
                            remaining_requests=max(0, limits.limit - usage.inflight))
        tokens = b.capacity if usage.bucket_tokens is None else min(usage.bucket_tokens, b.capacity)
        return RateInfo(limit_requests=limits.limit, remaining_requests=max(0, limits.limit - usage.inflight),
                        limit_tokens=int(b.capacity), remaining_tokens=max(0, int(tokens)),
                        reset_tokens_s=(b.capacity - tokens) / b.rate)

    def _rejection(self, p: _Pool, refusal: Refusal, plan: Plan, now: float,
                   behind: bool = False) -> Rejection:
        """_rejection words a refusal; ``behind``: the refusal is that of a waiter queued ahead."""
        refusal = self._expected(p, refusal, plan, now)
        text = rules.queued_message(refusal, plan) if behind else rules.message(refusal, plan)
        return Rejection(reason=refusal.budget.reason, retry_after_s=refusal.retry_after_s,
                         retryable=refusal.retryable, message=text, rate=self._rate(p, plan.limits, now))

    def _expected(self, p: _Pool, refusal: Refusal, plan: Plan, now: float) -> Refusal:
        """_expected gives a slots or pool-KV refusal the delay until its budget is expected back.

        ``retry.expected_wait`` over the pool's leases (their ages and holds) at the pool's
        median hold time; a longer delay from a token bucket stays (``rules.decide`` gave
        the longest). Unchanged before any request completed, and for other budgets.
        """
        b = refusal.budget
        if not refusal.retryable or b not in _RELEASED:
            return refusal
        typical = p.holds.median()
        if typical is None:
            return refusal
        if b in (Budget.SLOTS, Budget.RESERVED_SLOTS):
            holders = ((now - x.admitted_at, 1.0) for x in p.live)
            short = 1.0
        else:
            holders = ((now - x.admitted_at, float(x.demand.tokens)) for x in p.live)
            short = refusal.needed + refusal.used - refusal.limit
        wait = expected_wait(holders, short, typical)
        if wait is None:
            return refusal
        if refusal.retry_after_s > plan.limits.retry_estimate_s:  # a bucket's exact, longer wait
            wait = max(wait, refusal.retry_after_s)
        return Refusal(b, wait, True, refusal.needed, refusal.used, refusal.limit)

    def _shed(self, p: _Pool, cls: ClassConfig, limits: PoolLimits) -> Rejection:
        wait = p.retry_estimate_s
        return Rejection(reason=Reason.SHED, retry_after_s=wait, retryable=True,
                         message=rules.shed_message(p.name, cls.name, wait),
                         rate=self._rate(p, limits, self._clock.now()))

    def _blocked(self, p: _Pool, demand: Demand, cls: ClassConfig) -> Refusal | None:
        """_blocked is the refusal of a waiter that ``demand`` may not jump, or None.

        Waiters of a higher or the same priority that stopped on a budget everyone
        needs, earlier waiters of the same tenant stopped by its bucket, and earlier
        waiters of the same class stopped by its KV watermark, go first.
        """
        top = p.queue.top_priority()
        if top is None or (top < cls.priority and demand.tenant not in p.blocked_tenants
                           and demand.class_name not in p.blocked_classes):
            return None
        if self._sync is not None:
            self._kick(p)  # time has passed since the last walk: serve the queue first
        stop = p.stop
        if stop is not None and cls.priority <= stop[0]:
            return stop[1]
        blocker = p.blocked_tenants.get(demand.tenant)
        return blocker if blocker is not None else p.blocked_classes.get(demand.class_name)

    async def _wait(self, p: _Pool, demand: Demand, cls: ClassConfig, plan: Plan,
                    refusal: Refusal, behind: bool, now: float) -> Lease | Rejection:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Lease | Rejection] = loop.create_future()
        w = Waiter(demand, cls.priority, now, now + cls.max_wait_s, fut, refusal, plan)
        w.behind = behind
        p.loop = loop
        p.queue.push(w)
        self._note_block(p, w, refusal)
        self._schedule(p, now)
        try:
            return await fut
        except asyncio.CancelledError:
            if p.queue.remove(w):
                self._kick(p)  # it may have been the waiter others were queued behind
            if fut.done() and not fut.cancelled():
                got = fut.result()
                if isinstance(got, Lease):
                    self._abandon(got)
            raise

    def _abandon(self, lease: Lease) -> None:
        """_abandon takes back a lease its requester never received: nothing ran, nothing is charged."""
        if not lease.released:
            lease.released = True
            lease.outcome = Outcome.CLIENT_DISCONNECT
            self._settle(lease._grant, 0, None, False, lease)

    def _resolve(self, p: _Pool, w: Waiter, result: Lease | Rejection) -> None:
        p.queue.remove(w)
        if w.future.done():
            if isinstance(result, Lease):
                self._abandon(result)
        else:
            w.future.set_result(result)

    def _shed_waiters(self, p: _Pool, now: float) -> None:
        for w in p.queue.waiters():
            cls = self._tenants.class_rule(w.demand.class_name)
            if cls.sheddable:
                self._resolve(p, w, self._shed(p, cls, p.limits_at(now)))

    def _close_pool(self, p: _Pool, reason: str = "its pool is no longer configured") -> None:
        if p.timer is not None:
            p.timer.cancel()
            p.timer, p.timer_at = None, math.inf
        for w in p.queue.waiters():
            self._resolve(p, w, Rejection(reason=w.refusal.budget.reason, retry_after_s=0.0,
                                          retryable=False, message=f"The request was refused: {reason}."))

    def _expire(self, p: _Pool, now: float) -> None:
        for w in p.queue.expired(now):
            if not w.future.done():
                waited = now - w.since
                r = self._rejection(p, w.refusal, w.plan, now, behind=w.behind)
                w.future.set_result(Rejection(
                    reason=r.reason, retry_after_s=r.retry_after_s, retryable=r.retryable,
                    message=f"{r.message} (waited {max(0.0, waited):.1f}s for capacity)", rate=r.rate))

    def _kick(self, p: _Pool) -> None:
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

    def _begin_walk(self, p: _Pool, now: float) -> bool:
        self._expire(p, now)
        p.stop = None
        p.blocked_tenants.clear()
        p.blocked_classes.clear()
        return bool(p.queue.size)

    def _prepare(self, p: _Pool, w: Waiter, now: float) -> Plan | Step:
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
        plan = w.plan = Plan(limits, d.tenant, cls.name, d.prompt_tokens + d.completion_tokens,
                             self._tenants.bucket(d.tenant, cls.name))
        return plan

    def _served(self, p: _Pool, w: Waiter, plan: Plan, res: Grant | Refusal, now: float) -> Step:
        if type(res) is Grant:
            if not w.queued or w.future.done():
                self._undo(res, now)  # its requester left while the store answered
                return Step.NEXT
            self._resolve(p, w, Lease(self, res, w.demand, p.config.context_window))
            return Step.NEXT
        refusal: Refusal = res  # type: ignore[assignment]
        w.refusal, w.behind = refusal, False
        if not refusal.retryable:
            self._resolve(p, w, self._rejection(p, refusal, plan, now))
            return Step.NEXT
        return self._note_block(p, w, refusal)

    def _note_block(self, p: _Pool, w: Waiter, refusal: Refusal) -> Step:
        """_note_block records what a waiter's refusal blocks for arrivals and the walk (see waitqueue)."""
        b = refusal.budget
        if b in _SCALED and refusal.needed > refusal.limit:
            return Step.NEXT  # above the budget's scaled size: see _SCALED
        if b in _STOPS:
            if p.stop is None or w.priority > p.stop[0]:
                p.stop = (w.priority, refusal)
            return Step.STOP
        if b is Budget.RESERVED_SLOTS:
            return Step.SKIP_CLASS
        if b is Budget.CLASS_KV:
            # Only its own class is held to this watermark: later requests of the class
            # may not jump it (a large document is not starved by small ones), others may.
            p.blocked_classes.setdefault(w.demand.class_name, refusal)
            return Step.SKIP_CLASS
        p.blocked_tenants.setdefault(w.demand.tenant, refusal)
        return Step.SKIP_TENANT

    def _drain(self, p: _Pool) -> None:
        """_drain walks the queue once with the in-process store, then re-arms the timer."""
        now = self._clock.now()
        if self._begin_walk(p, now):
            store = self._sync
            assert store is not None
            walk = p.queue.walk()
            try:
                w = next(walk)
                while True:
                    plan = self._prepare(p, w, now)
                    step = plan if isinstance(plan, Step) else \
                        self._served(p, w, plan, self._admit_now(p, w.demand, plan, now), now)
                    w = walk.send(step)
            except StopIteration:
                pass
            finally:
                walk.close()
        self._schedule(p, now)

    async def _drain_async(self, p: _Pool) -> None:
        """_drain_async walks the queue with a store that answers asynchronously, until no change is pending."""
        try:
            while True:
                p.drain_again = False
                now = self._clock.now()
                if self._begin_walk(p, now):
                    walk = p.queue.walk()
                    try:
                        w = next(walk)
                        while True:
                            plan = self._prepare(p, w, now)
                            if isinstance(plan, Step):
                                step = plan
                            else:
                                try:
                                    res = await self._admit(p, w.demand, plan, now)
                                except StoreError:
                                    # A shared store that fails closed cannot answer: the
                                    # waiters keep waiting (bounded by their deadlines) and
                                    # the timer armed below tries again.
                                    step = Step.STOP
                                else:
                                    step = self._served(p, w, plan, res, now)
                            w = walk.send(step)
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

    def _schedule(self, p: _Pool, now: float) -> None:
        """_schedule arms one timer for the pool's next event: a deadline, or a bucket refill."""
        if not p.queue.size or p.loop is None or p.loop.is_closed():
            if p.timer is not None:
                p.timer.cancel()
                p.timer, p.timer_at = None, math.inf
            return
        wake = p.queue.next_deadline() or math.inf
        stop = p.stop
        if stop is not None and (stop[1].budget is Budget.POOL_TPM or self._store.shared):
            wake = min(wake, now + (stop[1].retry_after_s if stop[1].budget is Budget.POOL_TPM
                                    else SHARED_POLL_S))
        for r in p.blocked_tenants.values():
            wake = min(wake, now + r.retry_after_s)
        if self._store.shared and p.stop is None:
            wake = min(wake, now + SHARED_POLL_S)
        if p.timer is not None:
            if p.timer_at <= wake:
                return
            p.timer.cancel()
        if wake == math.inf:
            p.timer, p.timer_at = None, math.inf
            return
        p.timer_at = wake
        p.timer = p.loop.call_later(max(0.0, wake - now), self._on_timer, p)

    def _on_timer(self, p: _Pool) -> None:
        p.timer, p.timer_at = None, math.inf
        if self._pools.get(p.name) is p and p.queue.size:
            self._kick(p)
