"""types: the values that cross the admission core's boundary.

The service builds a ``Demand`` per request and gets back a ``Lease`` or a ``Rejection``;
the signal layer hands in ``PoolSignals``; metrics read ``PoolSnapshot``. None of these
know about gRPC, HTTP or Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


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


@dataclass(frozen=True, slots=True)
class Demand:
    """Demand is what one request asks of a pool, in tokens.

    ``prompt_tokens`` are counted; ``completion_tokens`` are reserved (max_tokens or the
    pool default). ``tenant`` and ``class_name`` are configured names (never raw input).
    ``among``: in a pool that picks nodes, the endpoints (``HOST:PORT``) the proxy allows
    (the endpoint picker protocol's subset hint; None: every node).
    """

    pool: str
    tenant: str
    class_name: str
    prompt_tokens: int
    completion_tokens: int
    among: frozenset[str] | None = None

    @property
    def tokens(self) -> int:
        """tokens is prompt + reserved completion: what TPM and the KV budget are charged."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class RateInfo:
    """RateInfo is what the ``x-ratelimit-*`` headers report, as of the decision.

    Requests are concurrency slots; tokens are the pool's TPM bucket (None when the pool
    has no bucket). Reset times are seconds until the bucket is full again / a slot frees
    (0 when unknown or already full).
    """

    limit_requests: int
    remaining_requests: int
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0
    reset_requests_s: float = 0.0


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
    ``at``: the clock instant (seconds) the signals describe.
    """

    kv_usage: float | None
    waiting: int | None
    stale: bool
    kv_capacity_tokens: int | None
    at: float


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
