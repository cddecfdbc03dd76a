"""pool: ``PoolControl``, what the controller keeps of one pool.

Its configuration, adaptive tracker and limits at the current scale; its wait queue and
what the last walk of it stopped on; the leases it holds and how long completed ones held,
and from them when a refused budget is expected back.
"""

from __future__ import annotations

import asyncio
import math
from operator import attrgetter

from extproc.admission.adaptive import ScaleParams, ScaleTracker
from extproc.admission.kvbudget import base_kv_budget, effective_kv_budget, kv_ceilings
from extproc.admission.lease import Lease
from extproc.admission.nodes import PoolNodes
from extproc.admission.retry import HoldTimes, expected_wait, first_end, own_share
from extproc.admission.slots import effective_guarantees, effective_limit
from extproc.admission.types import POOL_BUCKET, Budget, BucketSpec, Plan, PoolLimits, Refusal
from extproc.admission.waitqueue import Blocks, WaitQueue
from extproc.clock import Timer
from extproc.config import PoolConfig

# Budgets that come back when leases are released: their retry hint is learned.
_RELEASED = (Budget.SLOTS, Budget.RESERVED_SLOTS, Budget.FAIR_SHARE, Budget.KV, Budget.CLASS_KV)
_ADMITTED = attrgetter("admitted_at", "demand.reserved_completion")
_ADMITTED_TOKENS = attrgetter("admitted_at", "demand.tokens", "demand.reserved_completion")


class PoolControl:
    """PoolControl is what the controller keeps of one pool: its config, adaptive tracker, cached
    limits and wait queue.

    ``retry_estimate_s`` is the retry hint (s) for budgets that come back on release;
    ``guaranteed`` and ``kv_watermarks`` are the classes' guaranteed slots and KV
    watermarks (ratios); ``timer_at`` is the clock instant (s) the queue's timer fires.
    """

    __slots__ = ("name", "config", "tracker", "kv_capacity", "limits", "queue", "loop", "timer",
                 "timer_at", "blocks", "draining", "drain_again", "drain_task", "retry_estimate_s",
                 "guaranteed", "kv_watermarks", "adaptive", "nodes", "live", "live_tokens", "holds")

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
        self.timer: Timer | None = None
        self.timer_at = math.inf
        self.blocks = Blocks()
        self.draining = False
        self.drain_again = False
        self.drain_task: asyncio.Task[None] | None = None
        self.retry_estimate_s = retry_estimate_s
        self.guaranteed = guaranteed
        self.kv_watermarks = kv_watermarks
        # Per-node ledgers when the pool picks nodes; its KV is then guarded per node, not
        # by a pool-wide budget.
        self.nodes: PoolNodes | None = None
        # Leases held now (and their KV tokens), and how long completed ones held: when
        # slots and KV come back.
        self.live: dict[Lease, None] = {}
        self.live_tokens = 0
        self.holds = HoldTimes()

    def admitted(self, lease: Lease) -> None:
        """admitted records a lease of this pool as held."""
        self.live[lease] = None
        self.live_tokens += lease.demand.tokens

    def ended(self, lease: Lease) -> bool:
        """ended records that a lease no longer holds; False when it was not held here (ended
        before, or admitted before a reload replaced the pool)."""
        if self.live.pop(lease, 0) is not None:
            return False
        self.live_tokens -= lease.demand.tokens
        return True

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

    def expected(self, refusal: Refusal, plan: Plan, now: float) -> Refusal:
        """expected gives a slots (or fair-share) or pool-KV refusal the delay (s) until its budget is expected back.

        Over the pool's leases (their ages and holds) against the pool's completed holds,
        each lease is expected to end after its residual hold given its age: a slot comes
        back at the earliest end (``retry.first_end``), KV tokens when the leases in order
        of expected end have freed what is missing (``retry.expected_wait``). Where the
        refusal's tokens in use are more than this replica's (a shared store: other
        replicas hold the rest), its leases are taken to free their share of what is
        missing, the others' being like them, as a node's refusal does
        (``nodes.shared_short``); for a slot the first of its own ends stays the answer, a
        bound the others' can only bring nearer. ``live`` keeps
        the leases in the order they were admitted, each stamped by the clock as it is
        added: oldest first. A longer delay from a token bucket stays (``rules.decide`` gave
        the longest). Unchanged before any request completed, and for other budgets.
        """
        b = refusal.budget
        if not refusal.retryable or b not in _RELEASED or not len(self.holds):
            return refusal
        # map and attrgetter read the leases at C speed: a refusal reads up to WALK_LIMIT.
        if b in (Budget.SLOTS, Budget.RESERVED_SLOTS, Budget.FAIR_SHARE):  # a slot of this replica's
            wait = first_end(now, map(_ADMITTED, self.live), self.holds)
        else:
            short = own_share(int(refusal.needed + refusal.used - refusal.limit), self.live_tokens, int(refusal.used))
            wait = expected_wait(now, map(_ADMITTED_TOKENS, self.live), short, self.holds)
        if wait is None:
            return refusal
        if refusal.retry_after_s > plan.limits.retry_estimate_s:  # a bucket's exact, longer wait
            wait = max(wait, refusal.retry_after_s)
        return Refusal(b, wait, True, refusal.needed, refusal.used, refusal.limit)

    def cancel_timer(self) -> None:
        """cancel_timer stops the queue's timer, if one is armed."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer, self.timer_at = None, math.inf
