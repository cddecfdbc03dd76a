"""types: the values that cross the admission core's boundary.

The service builds a ``Demand`` per request and gets back a ``Lease`` or a ``Rejection``;
the signal layer hands in ``PoolSignals``; metrics read ``PoolSnapshot``. Between the
controller and its store: the ``Plan`` to decide (with its ``PoolLimits`` and
``BucketSpec``s), and the ``Grant`` or ``Refusal`` (naming the ``Budget``) that comes back.
None of these know about gRPC, HTTP, Prometheus or Redis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple, Protocol, final


class Outcome(StrEnum):
    """Outcome is how a lease's request ended (the ``cause`` label of releases)."""

    COMPLETED = "completed"
    CLIENT_DISCONNECT = "client_disconnect"
    UPSTREAM_ERROR = "upstream_error"
    TIMEOUT = "timeout"
    # The response body was not read (deploy/envoy-reservation.yaml): the stream ended,
    # completed or cut short.
    ENDED = "ended"


class Reason(StrEnum):
    """Reason names the budget that refused a request."""

    CONCURRENCY = "concurrency"
    TPM = "tpm"
    KV_BUDGET = "kv_budget"
    SHED = "shed"
    FAIR_SHARE = "fair_share"


@dataclass(frozen=True, slots=True)
class NodeReport:
    """NodeReport is what one scrape of a node says, as the signal layer hands it in.

    ``kv_usage``: KV-cache usage ratio in [0, 1] (None: no usable sample this round);
    ``capacity_tokens``: the KV capacity the node reports (None: not reported); ``at``: the
    instant (s) the sample was read; ``refused``: the scrape's connection was refused;
    ``mark``: the id of the mark taken before the scrape (None: none was taken);
    ``waiting``: requests the node queues (None: not reported); ``running``: requests in
    its batch, those that hold KV (None: not reported); ``block_tokens``: its KV block size
    (None: not reported); ``early``: scraped between rounds, to end a double count
    (``Scraper.poke``): its foreign KV counts, its interval does not read a rise.
    """

    kv_usage: float | None
    capacity_tokens: int | None
    at: float
    refused: bool = False
    mark: int | None = None
    waiting: int | None = None
    running: int | None = None
    block_tokens: int | None = None
    early: bool = False


class CachedView(Protocol):
    """CachedView is what one node's KV events say it caches (``extproc.signals.kv_events``)."""

    def cached(self, keys: tuple[int, ...]) -> tuple[int, bool] | None:
        """cached is the tokens of the prompt of ``keys`` the node caches and whether that is
        exact; None while its events cannot be read."""
        ...


MAX_KEYS = 256
"""MAX_KEYS is the most keys of a prompt's prefix chain (``extproc.prefix``): the rest of a
longer prompt is charged in full. Here, beside ``Chain``, so that the admission package reads
it without importing ``extproc.prefix``, which imports this package (an import circle)."""


@dataclass(frozen=True, slots=True)
class Chain:
    """Chain is a prompt's prefix chain (``extproc.prefix``): ``keys``, each a hash covering
    every piece of the prompt up to its own, and ``ends``, the prompt tokens up to the end
    of each key's piece (ascending)."""

    keys: tuple[int, ...]
    ends: tuple[int, ...]


class Demand(NamedTuple):
    """Demand is what one request asks of a pool, in tokens.

    ``prompt_tokens`` are counted; ``reserved_completion`` are the completion tokens
    reserved (max_tokens or the pool default), not a count the upstream reported. ``tenant`` and ``class_name`` are configured names (never raw input).
    ``among``: in a pool that picks nodes, the endpoints (``HOST:PORT``) the proxy allows
    (the endpoint picker protocol's subset hint; None: every node). ``prefix``: the
    prompt's prefix chain, where the pool counts shared prefixes once (None: charged in full).
    ``fairness_id``: whom the wait queue serves in turn within the class, where that is not
    the tenant (an anonymous request's fairness header, prefixed; None: the tenant). It is
    client input: held only while the request waits, never a metric label. ``blocks``: the
    keys of the prompt's engine token ids (``engine_blocks.token_keys``), where the pool reads
    its nodes' KV events and kvgate knows those ids (None: it does not).

    A named tuple, immutable as a frozen dataclass is: every request makes one, and a frozen
    dataclass sets each of its nine fields through a call of ``object.__setattr__``.
    """

    pool: str
    tenant: str
    class_name: str
    prompt_tokens: int
    reserved_completion: int
    among: frozenset[str] | None = None
    prefix: Chain | None = None
    fairness_id: str | None = None
    blocks: tuple[int, ...] | None = None

    @property
    def tokens(self) -> int:
        """tokens is prompt + reserved completion: what TPM and the KV budget are charged."""
        return self.prompt_tokens + self.reserved_completion

    @property
    def flow(self) -> str:
        """flow is whom the wait queue serves in turn within the class: ``fairness_id``, else the tenant."""
        return self.fairness_id or self.tenant


class RateInfo(NamedTuple):
    """RateInfo is what the ``x-ratelimit-*`` headers report, as of the decision.

    Requests are concurrency slots; tokens are the pool's TPM bucket (None when the pool
    has no bucket). Reset times are seconds until the bucket is full again / a slot frees
    (0 when unknown or already full). A named tuple, immutable as a frozen dataclass is:
    every admitted request makes one, and a frozen dataclass sets each field through
    ``object.__setattr__`` (six calls, ~13k instructions under callgrind, a tuple ~3k).
    """

    limit_requests: int
    remaining_requests: int
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0
    reset_requests_s: float = 0.0


# final: the hot path tells it from the other answer by type(x) is Rejection (mypy narrows on it).
@final
@dataclass(frozen=True, slots=True)
class Rejection:
    """Rejection is a refusal as a value: which budget, when to retry, and whether ever.

    ``retry_after_s`` is the delay in seconds after which the same demand would fit at
    the current rate (for TPM: exact; for slots and KV: an estimate). ``retryable`` is
    False when the demand can never fit (larger than a budget's capacity).
    """

    reason: Reason
    retry_after_s: float
    retryable: bool
    message: str
    rate: RateInfo | None = None


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """PoolSignals is the pool's state as the backends last reported it.

    ``kv_usage``: aggregated KV-cache usage ratio in [0, 1], None when nothing usable
    was read; ``waiting``: queued requests summed over nodes (None: unknown); ``stale``:
    True when the data is too old or no node answered (counts as saturated);
    ``kv_capacity_tokens``: summed KV capacity the nodes report (None: not reported);
    ``at``: the clock instant (seconds) the signals describe; ``fresh_until``: the last
    clock instant (seconds) at which they may be used, after which they count as stale.

    Staleness is the signal layer's decision (``signals.aggregate``): the core applies
    ``trusted_until`` and keeps no age limit of its own.
    """

    kv_usage: float | None
    waiting: int | None
    stale: bool
    kv_capacity_tokens: int | None
    at: float
    fresh_until: float

    def trusted_until(self) -> float:
        """trusted_until is the last clock instant (s) at which the signals may be used:
        ``fresh_until``, or -inf when they are stale already or ``fresh_until`` is no finite
        number (never read as fresh forever)."""
        until = self.fresh_until
        if self.stale or isinstance(until, bool) or not isinstance(until, (int, float)) \
                or not math.isfinite(until):
            return -math.inf
        return float(until)


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """PoolSnapshot is a pool's state for metrics and health pages.

    ``inflight_by_class`` counts admitted, unreleased requests per class;
    ``tpm_available`` is the pool bucket's tokens now (None without a bucket; may be
    negative while in debt); ``kv_budget`` is the effective in-flight KV budget in
    tokens (None: unbounded); ``alarm`` is True at or above the high watermark or with
    stale signals.
    """

    pool: str
    scale: float
    concurrency_limit: int
    inflight: int
    inflight_by_class: dict[str, int] = field(default_factory=dict)
    tpm_capacity: int | None = None
    tpm_available: float | None = None
    kv_inflight: int = 0
    kv_budget: int | None = None
    alarm: bool = False
    waiting: int = 0


# The key of the pool's own bucket in ``BucketSpec.key`` (tenant buckets are "tenant:<name>").
POOL_BUCKET = "pool"


class Budget(StrEnum):
    """Budget names the exact budget that refused a plan (finer than ``Reason``).

    ``slots``: the pool's effective concurrency limit is reached; ``reserved_slots``:
    free slots exist but are kept for other classes' unused guarantees; ``kv``: the
    in-flight KV-token budget; ``class_kv``: the part of the KV budget the request's class
    may fill (its ``kv_watermark``), the rest being kept for other classes; ``pool_tpm``:
    the pool's token bucket; ``tenant_tpm``: the tenant's own token bucket; ``node_kv``:
    no node of a pool that picks nodes has room for the request's KV (``rules.pick_node``);
    ``fair_share``: the request fits, but another gateway replica sharing the pool through
    Redis, holding fewer of its requests, waits for that room (``store.fairshare``).
    """

    SLOTS = "slots"
    RESERVED_SLOTS = "reserved_slots"
    KV = "kv"
    CLASS_KV = "class_kv"
    POOL_TPM = "pool_tpm"
    TENANT_TPM = "tenant_tpm"
    NODE_KV = "node_kv"
    FAIR_SHARE = "fair_share"

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
    Budget.FAIR_SHARE: Reason.FAIR_SHARE,
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
    ``waits``: a retryable refusal of this plan puts (or keeps) its request in the bounded
    wait, rather than answering it with a 429 at once; a shared store lets only such
    refusals claim room from the other replicas (``store.fairshare``).
    Treat it as immutable; it is not frozen only because one is built per request on
    the hot path, and a frozen dataclass costs three times as much to build.
    """

    limits: PoolLimits
    tenant: str
    class_name: str
    tokens: int
    tenant_bucket: BucketSpec | None = None
    nodes: Any = None
    waits: bool = False

    @property
    def pool(self) -> str:
        """pool is the name of the pool the plan is for."""
        return self.limits.pool


# final: the hot path tells it from the other answer by type(x) is Grant (mypy narrows on it).
@final
@dataclass(slots=True)
class Grant:
    """Grant is an admitted plan, as the store recorded it; ``settle`` takes it back.

    ``id`` is unique within the store (a shared store makes it unique across replicas);
    ``node`` is the node charge taken with it in a pool that picks nodes (the controller
    sets it); ``picked`` is the node a store that shares the nodes' ledger picked (None:
    the plan asked no node), and ``node_hold`` the hold (tokens) the store charged there,
    kept current by the controller as the request generates (with pooled growth, its hold
    alone on a node, and ``node_pooled`` the ``shared_nodes.Pooled`` the store records
    there: its footprint as its hold, and its growth's moments); ``node_shared``: where its
    prompt's prefix took keys or credit in that store's ledger, the ``shared_nodes.Shared``
    answer (None: none);
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
    node_pooled: Any = None
    node_shared: Any = None


# final: the hot path tells it from the other answer by type(x) is Refusal (mypy narrows on it).
@final
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


# A failed round trip to the shared store, by reason: the label tuple lives here, so that the
# metrics name the reasons without loading the store and its client library.
ERROR_TIMEOUT = "timeout"
ERROR_CONNECTION = "connection"
ERROR_RESPONSE = "response"
ERROR_DROPPED = "dropped"
ERROR_INTERNAL = "internal"
ERROR_REASONS = (ERROR_TIMEOUT, ERROR_CONNECTION, ERROR_RESPONSE, ERROR_DROPPED, ERROR_INTERNAL)
"""ERROR_REASONS are the values of ``kvgate_store_errors_total{reason}``.

``timeout``: no answer within ``timeout_s``; ``connection``: refused or reset; ``response``:
Redis answered with an error or something this store does not understand; ``dropped``: a
settle was dropped because too many were queued during an outage (its lease expires);
``internal``: the store's background work (probe, refresh, settles) survived an exception it
did not expect, logged with its traceback, and went on.
"""
