"""fallback: where a shared store decides while its server does not answer, and when it shares again.

Three modes (``MODES``): ``shared`` (the server decides for every replica), ``local_share``
(this replica admits alone in an in-memory store, within what it holds of the shared
ledger) and
``fail_closed`` (every admission is refused with ``StoreUnavailableError``). ``Fallback``
owns the mode, the rule that changes it and the local store; the shared store tells it
what its round trips did (``degrade``, ``probe_failed``, ``answered``) and asks it to
decide while degraded (``admit``).

Return: a failed round trip degrades at once (no answer is no decision), and shared mode
comes back once the server has answered every probe for ``recover_s``
(``store.redis.recover_s``), doubled once when the store degrades again within
FLAP_WINDOW_S of a return. Its default, 0, shares again at the first probe answered:
alone near a full node a replica admits little more than it would failing closed (the
shortfall rule, ``redis_escrow``), so waiting out a hysteresis costs as much as the
stall of the next failure it would spare (a flapping Redis's goodput with and without
one: docs/operations.md). Every change is loud: a log line and ``StoreObserver.store_mode``.

The local share never over-admits, whatever the other replicas do meanwhile (some may
still reach the server and decide over the shared ledger): a replica alone admits only
within what its own leases still hold in the ledger beyond what its live requests take
(``Within``: the room of its requests that ended while their settles could not be sent,
slots, KV tokens and tokens per node), because every other replica counts those leases
until they expire; the shared store stops counting a lease a safety margin before its
expiry. Token buckets are not held but spent, so a replica alone gets 1/N of each
bucket, N the replicas last seen through heartbeats or ``expected_replicas`` when that
is more; a replica that never saw the count and has no ``expected_replicas`` fails
closed. What it admits alone reaches the ledger before it shares again (the shared
store's business, ``store.redis``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from extproc.admission.shared_nodes import pick_within
from extproc.admission.slots import effective_guarantees
from extproc.admission.store.base import StoreError
from extproc.admission.store.memory import MemoryStore
from extproc.admission.types import Budget, BucketSpec, Grant, Plan, Refusal

log = logging.getLogger("kvgate.store")

MODE_SHARED = "shared"
MODE_LOCAL_SHARE = "local_share"
MODE_FAIL_CLOSED = "fail_closed"
MODES = (MODE_SHARED, MODE_LOCAL_SHARE, MODE_FAIL_CLOSED)
"""MODES are the values of ``kvgate_store_mode{mode}``: where admissions are decided."""

LOCAL_PREFIX = "local:"
"""LOCAL_PREFIX starts the id of every grant made locally while the server was unavailable."""

FLAP_WINDOW_S = 30.0
"""FLAP_WINDOW_S: a store that degrades again within this long (s) of a return is flapping,
and waits twice its ``recover_s`` before the next return."""


class StoreObserver(Protocol):
    """StoreObserver hears what the shared store does, for metrics (``extproc.metrics``).

    ``store_error(reason)``: one failed round trip or dropped settle, ``reason`` in
    ``redis_client.ERROR_REASONS``; ``store_mode(mode)``: the store now decides in ``mode``
    (one of ``MODES``), called once at start and on every change; ``store_nodes(pool,
    held)``: what every replica's leases hold on each node of ``pool`` (tokens per node),
    as the ledger said at a refresh. All are called on the event loop and must not block.
    """

    def store_error(self, reason: str) -> None: ...

    def store_mode(self, mode: str) -> None: ...

    def store_nodes(self, pool: str, held: dict[str, int]) -> None: ...


class UnobservedStore:
    """UnobservedStore is the store's observer that ignores everything: a store without metrics."""

    __slots__ = ()

    def store_error(self, reason: str) -> None:
        pass

    def store_mode(self, mode: str) -> None:
        pass

    def store_nodes(self, pool: str, held: dict[str, int]) -> None:
        pass


class StoreUnavailableError(StoreError):
    """StoreUnavailableError is a refusal to admit because the shared store cannot answer.

    Raised by ``RedisStore.admit`` with ``on_unavailable: fail_closed``. The request may
    be retried shortly: the store probes the server and returns to shared mode by itself.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"shared budget store unavailable ({reason})")
        self.reason = reason


class Fallback:
    """Fallback is a shared store's mode, the hysteresis that changes it and the local store.

    ``on_unavailable``: the mode a failure leads to (``local_share`` or ``fail_closed``);
    ``expected_replicas``: the least number of replicas a local share divides by (None:
    only the count seen); ``where``: the server, for log lines; ``recover_s``: how long the
    server must answer every probe before the store shares again (s). Instants are the
    callers' (s). Starts shared and tells ``observer`` so.
    """

    __slots__ = ("mode", "replicas", "replicas_seen", "recover_s", "local", "_on_unavailable",
                 "_expected", "_observer", "_where", "_answering_since", "_shared_since", "_recover")

    def __init__(self, on_unavailable: str, expected_replicas: int | None, observer: StoreObserver,
                 where: str, recover_s: float = 0.0) -> None:
        if on_unavailable not in (MODE_LOCAL_SHARE, MODE_FAIL_CLOSED):
            raise ValueError(f"on_unavailable is local_share or fail_closed, not {on_unavailable!r}")
        self.mode = MODE_SHARED
        self.replicas = 1
        self.replicas_seen = False
        self.recover_s = self._recover = recover_s
        self.local = MemoryStore()
        self._on_unavailable = on_unavailable
        self._expected = expected_replicas
        self._observer = observer
        self._where = where
        # since when the server has answered every probe, and since when the store is
        # shared again (both None: not yet)
        self._answering_since: float | None = None
        self._shared_since: float | None = None
        observer.store_mode(MODE_SHARED)

    @property
    def shared(self) -> bool:
        """shared is True while the server decides (mode ``shared``)."""
        return self.mode == MODE_SHARED

    @property
    def share_replicas(self) -> int:
        """share_replicas is what a local share divides the limits by: the replicas last
        seen, at least ``expected_replicas``."""
        return max(self.replicas, self._expected or 1)

    def saw_replicas(self, n: int) -> None:
        """saw_replicas keeps the number of live replicas a heartbeat counted (itself included)."""
        self.replicas = max(1, n)
        self.replicas_seen = True

    def degrade(self, reason: str, detail: str, now: float) -> bool:
        """degrade records one failed round trip at ``now`` and leaves shared mode, loudly.

        Returns True when the mode changed (it was shared).
        """
        self._observer.store_error(reason)
        if self.mode != MODE_SHARED:
            return False
        since = self._shared_since
        # A store that fails again soon after it came back is flapping: it must answer
        # twice as long before the next return.
        self.recover_s = (2.0 * self._recover if since is not None and now - since < FLAP_WINDOW_S
                          else self._recover)
        self._answering_since = None
        self.mode = self._on_unavailable
        if self.mode == MODE_LOCAL_SHARE:
            what = (f"admitting locally within this replica's leases, with 1/{self.share_replicas} "
                    "of each token bucket")
        else:
            what = "refusing every admission"
        log.warning("shared store: Redis at %s unavailable (%s: %s): %s until it answers again",
                    self._where, reason, detail, what)
        self._observer.store_mode(self.mode)
        return True

    def probe_failed(self, reason: str) -> None:
        """probe_failed records a probe the server did not answer: the wait starts again."""
        self._observer.store_error(reason)
        self._answering_since = None

    def answered(self, now: float) -> bool:
        """answered records a probe the server answered at ``now``; returns to shared mode once
        it has answered every probe for ``recover_s``. True when the store is shared afterwards."""
        if self.mode == MODE_SHARED:
            return True
        if self._answering_since is None:
            self._answering_since = now
        if now - self._answering_since < self.recover_s:
            return False
        previous = self.mode
        self._shared_since = now
        self.mode = MODE_SHARED
        log.warning("shared store: Redis at %s answers again: back to shared mode (was %s, %d replicas seen)",
                    self._where, previous, self.replicas)
        self._observer.store_mode(MODE_SHARED)
        return True

    def admit(self, plan: Plan, now: float, within: Within) -> Grant | Refusal:
        """admit decides ``plan`` at ``now`` in this replica alone, within what its own leases
        hold in the ledger (``within``, see the module doc).

        Raises ``StoreUnavailableError`` in fail_closed mode and when the share of the token
        buckets is unknown.
        """
        if self.mode == MODE_FAIL_CLOSED:
            raise StoreUnavailableError(f"Redis at {self._where} does not answer")
        if not self.replicas_seen and self._expected is None:
            raise StoreUnavailableError(f"Redis at {self._where} does not answer and the number of "
                                        "replicas is unknown (set store.redis.expected_replicas)")
        picked: str | None = None
        if plan.nodes is not None:
            verdict = pick_within(plan.nodes, within.nodes)
            if verdict.chosen is None:
                room = verdict.best_room or 0
                budget = Budget.CLASS_KV if verdict.by_watermark else Budget.NODE_KV
                return Refusal(budget, plan.limits.retry_estimate_s, True, plan.nodes.need, room, room)
            picked = verdict.chosen
        used = self.local.usage(plan.limits.pool, now)
        decision = self.local.admit_now(local_within(plan, self.share_replicas, within,
                                                     (used.inflight, used.kv_inflight)), now)
        if isinstance(decision, Grant):
            decision.id = LOCAL_PREFIX + decision.id
            if picked is not None:
                decision.picked = picked
                decision.node_hold = plan.nodes.need
                decision.node_pooled = plan.nodes.pooled
        return decision


@dataclass(frozen=True, slots=True)
class Within:
    """Within is what one replica may still admit alone in one pool while the ledger cannot be
    reached: what its own leases hold in the ledger (and will until they expire) beyond
    what its live requests take now, in ``slots``, KV tokens (``kv``) and tokens per node
    (``nodes``; missing: none; None: no bound but each node's own reading, for a replica
    that is the only one). Negative when its requests grew past their leases."""

    slots: int = 0
    kv: int = 0
    nodes: Mapping[str, int] | None = field(default_factory=dict)


def local_within(plan: Plan, replicas: int, within: Within, local: tuple[int, int] = (0, 0)) -> Plan:
    """local_within is ``plan`` with the limits this replica admits under alone: slots and KV
    no more than its local grants (``local``: slots, KV tokens) plus what its leases hold
    in the ledger beyond its live requests (``within``), and no more than the pool's own
    limits; the classes' KV ceilings cut the same way; guarantees and the token buckets
    (capacity and rate) at 1 / ``replicas`` of the pool's, since tokens spent are not held
    and so cannot be kept in the ledger. Capacities at scale 1.0 stay whole: a request that
    fits the shared budget is not told it can never fit because of an outage.
    """
    share = 1.0 / max(1, replicas)
    lim = plan.limits
    slots = min(lim.limit, local[0] + max(0, within.slots))
    kv_cap = local[1] + max(0, within.kv)
    limits = replace(lim, limit=slots,
                     guarantees=effective_guarantees(lim.guarantees, share, slots),
                     kv_budget=None if lim.kv_budget is None else min(lim.kv_budget, kv_cap),
                     kv_ceilings={name: (min(now, kv_cap), base) for name, (now, base) in lim.kv_ceilings.items()},
                     bucket=_share_bucket(lim.bucket, share))
    return Plan(limits, plan.tenant, plan.class_name, plan.tokens,
                _share_bucket(plan.tenant_bucket, share), plan.nodes, plan.waits)


def _share_bucket(spec: BucketSpec | None, share: float) -> BucketSpec | None:
    if spec is None:
        return None
    return BucketSpec(spec.key, spec.capacity * share, spec.rate * share, spec.base_capacity)
