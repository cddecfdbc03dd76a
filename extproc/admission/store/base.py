"""base: the Store interface, where a pool's budget state lives, and the plan it decides on.

The controller turns a request into a ``Plan``: pure data that says how many tokens the
request reserves and what the limits are *now* (after the adaptive scale, per class and
per tenant). A store holds the mutable state (in-flight counts, in-flight KV tokens,
token buckets) and applies ONE rule, ``extproc.admission.rules``, to a plan against that
state, atomically: the in-memory store calls the Python rule under the event loop; a
shared store (Redis) mirrors the same rule in one Lua script, so that both answer the same
plan on the same state identically. The controller never reads the state to decide.

Times are seconds on the caller's monotonic clock (``now``); a shared store may use its
own clock instead (Redis ``TIME``) so that replicas agree, as long as it uses one clock for
all its buckets. Token amounts are tokens (prompt + completion).

Contract of every store:
- ``admit`` is atomic: either every budget is charged (one slot, the plan's tokens on the
  KV budget and on each bucket of the plan) and a ``Grant`` comes back, or nothing changes
  and a ``Refusal`` comes back.
- ``settle`` undoes exactly what its grant charged, except that the buckets are charged
  ``charged_tokens`` in the end (refund ``plan.tokens - charged_tokens`` when positive,
  clamped at the bucket's capacity; extra charge, possibly into debt, when negative). It
  must not block and must not raise for a grant it issued; settling the same grant twice
  is a caller bug that the controller prevents (``Lease.release`` is idempotent).
- ``usage`` reports the state for metrics; a shared store may answer from its last view.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from extproc.admission.types import Reason
from extproc.errors import KvgateError


# The key of the pool's own bucket in ``BucketSpec.key`` (tenant buckets are "tenant:<name>").
POOL_BUCKET = "pool"


class StoreError(KvgateError):
    """StoreError is a store that cannot answer (unreachable, timed out, bad reply)."""


class Budget(StrEnum):
    """Budget names the exact budget that refused a plan (finer than ``Reason``).

    ``slots``: the pool's effective concurrency limit is reached; ``reserved_slots``:
    free slots exist but are kept for other classes' unused guarantees; ``kv``: the
    in-flight KV-token budget; ``class_kv``: the part of the KV budget the request's class
    may fill (its ``kv_watermark``), the rest being kept for other classes; ``pool_tpm``:
    the pool's token bucket; ``tenant_tpm``: the tenant's own token bucket; ``node_kv``:
    no node of a pool that picks nodes has room for the request's KV (``rules.pick_node``).
    """

    SLOTS = "slots"
    RESERVED_SLOTS = "reserved_slots"
    KV = "kv"
    CLASS_KV = "class_kv"
    POOL_TPM = "pool_tpm"
    TENANT_TPM = "tenant_tpm"
    NODE_KV = "node_kv"

    @property
    def reason(self) -> Reason:
        """reason maps the budget to the client-facing ``Reason``."""
        return _REASON[self]


_REASON = {
    Budget.SLOTS: Reason.CONCURRENCY,
    Budget.RESERVED_SLOTS: Reason.CONCURRENCY,
    Budget.KV: Reason.KV_BUDGET,
    Budget.CLASS_KV: Reason.KV_BUDGET,
    Budget.POOL_TPM: Reason.TPM,
    Budget.TENANT_TPM: Reason.TPM,
    Budget.NODE_KV: Reason.KV_BUDGET,
}


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """BucketSpec is one token bucket's limits for this plan.

    ``key``: the bucket's name inside its pool (``POOL_BUCKET`` or ``"tenant:<name>"``);
    ``capacity``: the effective capacity in tokens (after the scale); ``rate``: refill in
    tokens per second (capacity / 60); ``base_capacity``: the capacity at scale 1.0, in
    tokens: a plan above it can never fit.

    A bucket that does not exist yet starts full at ``capacity``. When a plan brings a
    different capacity, the store refills at the old rate up to ``now`` and then clamps
    the tokens at the new capacity (a shrink takes tokens away, a rise does not add any).
    """

    key: str
    capacity: float
    rate: float
    base_capacity: float


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """PoolLimits is a pool's effective limits at one scale: the shared part of every plan.

    ``limit``: concurrency slots (max(1, floor(base × scale))); ``base_limit``: slots at
    scale 1.0; ``guarantees``: effective guaranteed slots per class name (only classes
    with at least one); ``kv_budget``: in-flight KV tokens (None: unbounded);
    ``base_kv_budget``: the KV budget at scale 1.0 (a plan above it can never fit);
    ``kv_ceilings``: per class name with a KV watermark below 1, the in-flight KV tokens
    (all classes counted) up to which the class may fill the budget, as (now, at scale
    1.0): ``(floor(w × kv_budget), floor(w × base_kv_budget))``; empty without a KV
    budget; ``bucket``: the pool's token bucket (None: no pool TPM); ``retry_estimate_s``:
    the retry delay, in seconds, given for budgets whose release time nobody knows (slots,
    KV); ``scale``: the adaptive scale these limits were computed at.
    """

    pool: str
    scale: float
    limit: int
    base_limit: int
    guarantees: Mapping[str, int] = field(default_factory=dict)
    kv_budget: int | None = None
    base_kv_budget: int | None = None
    kv_ceilings: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    bucket: BucketSpec | None = None
    retry_estimate_s: float = 1.0


@dataclass(slots=True)
class Plan:
    """Plan is one admission to decide: who asks, how many tokens, under which limits.

    ``tokens`` is prompt + reserved completion (what the KV budget and the buckets are
    charged at admission); ``tenant_bucket`` is the tenant's own bucket (None: none);
    ``nodes`` is the per-node question (``shared_nodes.NodeAsk``) a store that shares the
    nodes' ledger answers with the pool's budgets (None: no node to pick there).
    Treat it as immutable; it is not frozen only because one is built per request on
    the hot path, and a frozen dataclass costs three times as much to build.
    """

    limits: PoolLimits
    tenant: str
    class_name: str
    tokens: int
    tenant_bucket: BucketSpec | None = None
    nodes: Any = None

    @property
    def pool(self) -> str:
        """pool is the name of the pool the plan is for."""
        return self.limits.pool


@dataclass(slots=True)
class Grant:
    """Grant is an admitted plan, as the store recorded it; ``settle`` takes it back.

    ``id`` is unique within the store (a shared store makes it unique across replicas);
    ``node`` is the node charge taken with it in a pool that picks nodes (the controller
    sets it); ``picked`` is the node a store that shares the nodes' ledger picked (None:
    the plan asked no node), and ``node_hold`` the hold (tokens) the store charged there,
    kept current by the controller as the request generates;
    ``inflight`` is the pool's in-flight count just after this admission;
    ``bucket_tokens``/``bucket_capacity``/``bucket_rate`` describe the binding bucket
    (the one with fewer tokens left: tenant or pool) just after the charge, in tokens and
    tokens per second; all three are None when the plan has no bucket.
    """

    id: str
    plan: Plan
    inflight: int
    bucket_tokens: float | None = None
    bucket_capacity: float | None = None
    bucket_rate: float | None = None
    node: Any = None
    picked: str | None = None
    node_hold: int = 0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Refusal says which budget refused a plan, and the numbers that explain it.

    ``retry_after_s``: seconds after which the plan would fit (exact for token buckets at
    the current rate; ``limits.retry_estimate_s`` for slots and KV); ``retryable``: False
    when the plan can never fit (more tokens than a budget's base capacity); ``needed``,
    ``used`` and ``limit``: the plan's amount, what is in use (or missing) and the budget's
    effective limit, in slots or tokens, for the client message.
    """

    budget: Budget
    retry_after_s: float
    retryable: bool
    needed: float
    used: float
    limit: float


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """PoolUsage is what a store holds for one pool, for metrics and health pages.

    ``inflight``: admitted, unsettled grants; ``by_class``: the same per class name;
    ``kv_inflight``: tokens reserved by them; ``bucket_tokens``: the pool bucket's tokens
    as of ``now`` (None: no pool bucket seen yet; negative while in debt).
    """

    inflight: int = 0
    by_class: Mapping[str, int] = field(default_factory=dict)
    kv_inflight: int = 0
    bucket_tokens: float | None = None


class Store(ABC):
    """Store holds the budgets of every pool and applies the admission rule atomically.

    ``shared`` is True when other processes change the same state (then the controller
    cannot learn of releases by itself and re-tries its waiters on a timer);
    ``shares_nodes`` is True when the store also picks nodes over every replica's holds
    (a plan's ``nodes``), answering ``Grant.picked`` or a ``node_kv`` refusal.
    """

    shared: bool = False
    shares_nodes: bool = False

    @abstractmethod
    async def admit(self, plan: Plan, now: float) -> Grant | Refusal:
        """admit charges every budget of ``plan`` at instant ``now`` (s) or refuses it.

        Raises ``StoreError`` when the store cannot answer.
        """

    @abstractmethod
    def settle(self, grant: Grant, charged_tokens: int, now: float) -> None:
        """settle releases ``grant`` at ``now`` (s): the buckets end up charged ``charged_tokens``.

        Never blocks: a remote store queues the write. Never raises for its own grants.
        """

    @abstractmethod
    def usage(self, pool: str, now: float) -> PoolUsage:
        """usage reports the pool's state at ``now`` (s) for metrics (possibly a last view)."""

    async def close(self) -> None:
        """close releases the store's connections; the in-memory store has none."""


class SyncStore(Store):
    """SyncStore is an in-process store that answers at once: ``try_acquire`` needs one."""

    @abstractmethod
    def admit_now(self, plan: Plan, now: float) -> Grant | Refusal:
        """admit_now is ``admit`` without the coroutine, for the synchronous hot path."""

    async def admit(self, plan: Plan, now: float) -> Grant | Refusal:
        return self.admit_now(plan, now)
