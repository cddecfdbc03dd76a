"""config: kvgate's configuration, as typed sections (frozen dataclasses) and their defaults.

Reading, typing and validating a file into them: ``configparse``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from extproc.engine_blocks import MAX_BLOCKS

ENGINES = ("vllm", "sglang", "tgi", "dcgm")
AGGREGATES = ("max", "mean")


class Growth(StrEnum):
    """Growth is how a picking pool expects a running request to grow (``PickingConfig``)."""

    WORST_CASE = "worst_case"
    LEARNED = "learned"
    POOLED = "pooled"


GROWTHS = tuple(g.value for g in Growth)
ON_UNAVAILABLE = ("local_share", "fail_closed")
# The most fallback endpoints a picking pool may name (``PickingConfig.fallbacks``).
MAX_FALLBACKS = 8


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """BackendConfig is one inference node's (or GPU exporter's) metrics endpoint.

    ``address`` (``HOST:PORT``) is where the node's requests go when kvgate picks the node
    for each request (None: Envoy routes, kvgate admits at the pool level);
    ``kv_capacity_tokens`` overrides the KV capacity the node reports (tokens).
    """

    name: str
    metrics_url: str
    engine: str = "vllm"
    model_name: str | None = None
    address: str | None = None
    kv_capacity_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """DiscoveryConfig finds a pool's nodes in DNS: every A record of ``dns`` is a node.

    For a Kubernetes headless Service: each pod's IP, with the inference server on
    ``port`` and its metrics on ``metrics_path`` (same port); ``engine`` and
    ``model_name`` as for a backend; names are re-resolved every ``interval_s`` seconds.
    """

    dns: str
    port: int
    metrics_path: str = "/metrics"
    engine: str = "vllm"
    model_name: str | None = None
    interval_s: float = 5.0

    def backends(self, ips: list[str]) -> tuple[BackendConfig, ...]:
        """backends are the nodes at ``ips``, named and addressed ``IP:PORT``, in a stable order."""
        out = []
        for ip in sorted(set(ips)):
            host = f"[{ip}]" if ":" in ip else ip
            address = f"{host}:{self.port}"
            out.append(BackendConfig(name=address.replace("[", "").replace("]", "").replace(":", "_"),
                                     metrics_url=f"http://{address}{self.metrics_path}",
                                     engine=self.engine, model_name=self.model_name, address=address))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class KvEventsEndpoint:
    """KvEventsEndpoint is where one backend's engine publishes its KV cache events:
    ``endpoint`` (ZMQ, ``tcp://HOST:PORT`` or ``ipc://PATH``) and ``replay_endpoint`` (None: no
    replay)."""

    backend: str
    endpoint: str
    replay_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """KvEventsConfig says where a picking pool's engines publish their KV cache events (vLLM's
    ``--kv-events-config``, ``extproc.signals.kv_events``), so that placement knows what each
    node caches.

    ``port`` / ``replay_port``: every node publishes at ``tcp://<host of its address>:port``
    (None: only the backends in ``endpoints``); ``endpoints``: a backend's own endpoints,
    before ``port``; ``topic``: the engines' topic; ``max_blocks``: blocks remembered per node.
    """

    port: int | None = None
    replay_port: int | None = None
    endpoints: tuple[KvEventsEndpoint, ...] = ()
    topic: str = ""
    max_blocks: int = MAX_BLOCKS

    def endpoint_of(self, backend: str, address: str | None) -> tuple[str, str | None] | None:
        """endpoint_of is a node's (endpoint, replay endpoint), None where it has none."""
        for e in self.endpoints:
            if e.backend == backend:
                return e.endpoint, e.replay_endpoint
        if self.port is None or not address:
            return None
        host = address.rsplit(":", 1)[0]
        replay = None if self.replay_port is None else f"tcp://{host}:{self.replay_port}"
        return f"tcp://{host}:{self.port}", replay


@dataclass(frozen=True, slots=True)
class PickingConfig:
    """PickingConfig says how kvgate judges a node's room when it picks nodes.

    ``growth``: how many more tokens a running request is expected to generate:
    ``worst_case`` (its whole remaining reservation) or ``learned`` (the ``quantile`` of
    the completion lengths settled in its pool and class that are above what it has
    generated, never above its reservation, and the worst case until ``min_samples``
    were settled) or ``pooled`` (from the same lengths, the ``quantile`` of the summed
    growth of a node's requests, see ``rules.pooled_growth``); ``reserve_fraction``:
    share of each node's KV capacity kept free (block rounding, reports a few
    milliseconds off kvgate's own view); ``shared_prefix``: a prompt prefix that requests
    running on one node share is charged once there (``extproc.prefix``), as engines with
    prefix caching hold it; ``block_tokens``: the engines' KV block size (tokens), the unit
    in which they share (vLLM's default is 16), until a node reports its own (vLLM's
    ``cache_config_info``); ``prefix_affinity``: among the nodes where a request fits, a
    node's room counts this many times more the tokens it shares there (0: room alone),
    so that requests go where their prefix is cached unless another node has much more room;
    ``prefix_record_keys``: prefix keys (pieces of ~256 tokens, ``extproc.prefix``) remembered
    per node of the requests that ended there, what its cache may still hold (placement only,
    never credited; 0: none), the least recently ended first out;
    ``kv_events``: where the engines publish their KV cache events (None: not read), so that a
    node's cached prefix is known exactly rather than from kvgate's record;
    ``fallbacks``: how many other nodes that also fit a request kvgate names after the one it
    charged (the endpoint picker protocol's ``ip:port,ip:port``), for the proxy to try in
    order when the first refuses the connection (0: the one node).
    """

    growth: Growth = Growth.LEARNED
    quantile: float = 0.9
    min_samples: int = 20
    reserve_fraction: float = 0.02
    shared_prefix: bool = False
    block_tokens: int = 16
    prefix_affinity: float = 1.0
    prefix_record_keys: int = 8192
    kv_events: KvEventsConfig | None = None
    fallbacks: int = 0


@dataclass(frozen=True, slots=True)
class SignalsConfig:
    """SignalsConfig says how a pool's backend signals combine.

    ``aggregate``: how node KV usages combine (max or mean); ``waiting_threshold``:
    queued requests (summed over nodes) at or above which the pool counts as saturated;
    ``kv_budget_fraction``: share of the nodes' reported KV capacity (tokens) used as
    the in-flight KV budget when ``kv_budget_tokens`` is not set.
    """

    aggregate: str = "max"
    waiting_threshold: int = 8
    kv_budget_fraction: float = 0.9


SIGNALS_DEFAULTS = SignalsConfig()

@dataclass(frozen=True, slots=True)
class PoolConfig:
    """PoolConfig holds the base limits of one pool (nodes serving one model).

    ``max_concurrency``: in-flight requests; ``tpm``: tokens per minute (None: no
    bucket); ``kv_budget_tokens``: in-flight KV tokens (None: derived from the
    backends' capacity, or unbounded without backends); ``context_window`` and
    ``default_max_tokens`` in tokens; ``enforce_max_tokens``: a request without a
    completion cap is sent upstream with ``max_tokens`` set to what was reserved.
    """

    name: str
    max_concurrency: int = 64
    tpm: int | None = None
    kv_budget_tokens: int | None = None
    context_window: int = 32768
    default_max_tokens: int = 1024
    tokenizer: str = "cl100k_base"
    chat_template: str = "openai"
    enforce_max_tokens: bool = False
    backends: tuple[BackendConfig, ...] = ()
    signals: SignalsConfig = field(default_factory=SignalsConfig)
    picking: PickingConfig = field(default_factory=PickingConfig)
    discovery: DiscoveryConfig | None = None

    @property
    def picks(self) -> bool:
        """picks is True when kvgate picks the node of each request: every backend has an
        address, or the nodes are discovered in DNS (addresses by construction)."""
        if self.discovery is not None:
            return True
        return bool(self.backends) and all(b.address is not None for b in self.backends)


UNKNOWN_PATHS = ("refuse", "pass")
# Endpoints of vLLM, SGLang and TGI that generate nothing: listing models, health, version,
# the engines' own metrics.
DEFAULT_PASS_PATHS = ("/v1/models", "/v1/models/*", "/health", "/health_generate", "/ping",
                      "/version", "/metrics", "/info")


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """LimitsConfig holds request-level caps: ``max_body_bytes`` is the largest request body.

    Paths: the admitted ones (chat, completions, embeddings, responses, POST only) are
    decided; ``pass_paths`` (exact, or a prefix ending in ``*``) go through unchecked, as
    the engines' endpoints that generate nothing; any other path or method is refused
    (``unknown_paths: refuse``, 404 or 405) or passed through (``pass``).
    """

    max_body_bytes: int = 1_048_576
    unknown_paths: str = "refuse"
    pass_paths: tuple[str, ...] = DEFAULT_PASS_PATHS


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """AdaptiveConfig drives the adaptive scale from backend signals.

    Watermarks are KV-cache usage ratios; ``min_scale`` is the scale at or above the
    high watermark; ``recovery_per_s`` is the largest rise of the scale per second
    (a shrink applies at once). Polling times are in seconds; ``max_scrape_bytes`` caps
    the size of one metrics response. ``early_scrape_gap_s``: a node whose last report
    subtracted a request kvgate has since released is scraped again this long after that
    report at the soonest, before its next round (0: not before its round;
    ``extproc.signals.scraper``).
    """

    high_watermark: float = 0.85
    low_watermark: float = 0.70
    min_scale: float = 0.6
    recovery_per_s: float = 0.1
    poll_interval_s: float = 1.0
    scrape_timeout_s: float = 0.5
    stale_after_s: float = 3.0
    early_scrape_gap_s: float = 0.2
    max_scrape_bytes: int = 4 * 1024 * 1024


# The defaults of the sections, owned by their dataclasses: the parser and the admission
# core read them here instead of repeating the numbers.
ADAPTIVE_DEFAULTS = AdaptiveConfig()

@dataclass(frozen=True, slots=True)
class ClassConfig:
    """ClassConfig is a tenant class: how its requests share a pool.

    ``priority``: higher is served first from the wait queue; ``guaranteed_slots``:
    slots per pool no other class may take while this class is below them; ``tpm``:
    a bucket per tenant of the class (None: none); ``max_wait_s``: how long a request
    may wait for capacity (0: refuse at once); ``sheddable``: refused first when the
    pool is in alarm; ``kv_watermark``: ratio in (0, 1] of the pool's effective KV
    budget up to which requests of this class may fill it (every class's in-flight KV
    tokens count): below 1, the rest of the budget is kept for classes with a higher
    watermark (1.0: the whole budget). ``fairness``: how its waiters are ordered, ``tenant``
    (tenants in turn by weight, ``waitqueue``'s module doc) or ``fifo`` (arrival order).
    """

    name: str
    priority: int = 0
    guaranteed_slots: int = 0
    tpm: int | None = None
    max_wait_s: float = 0.0
    sheddable: bool = False
    kv_watermark: float = 1.0
    fairness: str = "tenant"


# How a class's waiters are ordered (ClassConfig.fairness).
FAIRNESS_MODES = ("tenant", "fifo")
# The largest tenant weight: a ratio of turns, not a priority (that is what classes are for).
MAX_WEIGHT = 1000.0


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """TenantConfig is a known tenant: its class, its own TPM (None: the class's), its API keys'
    SHA-256, and its ``weight``: its share of its class's turns in the wait queue against
    the other tenants of the class (1.0 each by default; 2.0: twice the tokens per turn)."""

    name: str
    class_name: str
    tpm: int | None = None
    api_key_sha256: tuple[str, ...] = ()
    weight: float = 1.0


# The fairness and objective headers of llm-d's endpoint picker (the Gateway API Inference
# Extension's own picker names them x-gateway-inference-fairness-id / -objective).
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    """TenantsConfig says how a request's tenant is found and which classes exist.

    ``fairness_header`` and ``objective_header``: the endpoint picker ecosystem's headers
    (llm-d's names by default), read as a tenant name when the tenant header is absent and
    as a class name; None: not read. Trusted like the tenant header: only as Envoy sets them.
    ``unauthenticated``: the class of a request that names no configured tenant (no
    valid key, no known name); None: such a request is refused (401). Where tenants have
    keys it is by default the lowest priority class, so that dropping or spoiling a key
    never buys a better class than a keyed tenant's; otherwise the default class.
    """

    header: str = "x-tenant-id"
    fairness_header: str | None = FAIRNESS_HEADER
    objective_header: str | None = OBJECTIVE_HEADER
    default_class: str = "standard"
    classes: Mapping[str, ClassConfig] = field(
        default_factory=lambda: {"standard": ClassConfig(name="standard")})
    tenants: Mapping[str, TenantConfig] = field(default_factory=dict)
    unauthenticated: str | None = "standard"


REDIS_TIMEOUT_S = 1.0
"""REDIS_TIMEOUT_S is the default limit of one Redis round trip (s): long enough for nearly
every round trip with every core loaded, where most exceed the old 50 ms
(``bench/results/redis-timeout.md``).
A trip that misses it costs throughput (the local share), not safety, and only the requests
in flight when Redis really stops wait this long; it stays well under the Envoy message
timeout (5 s)."""


@dataclass(frozen=True, slots=True)
class RedisStoreConfig:
    """RedisStoreConfig is the shared store: leases live ``lease_ttl_s`` seconds unless refreshed.

    ``expected_replicas``: the fewest replicas a local share assumes (a replica that starts
    while Redis is down has seen no peer); None (unset): a replica that has never reached
    Redis fails closed, whatever ``on_unavailable`` says, since no share is known safe.
    ``timeout_s``: one round trip's limit; its default is measured under load
    (``bench/results/redis-timeout.md``). ``recover_s``: how long Redis must answer every
    probe before a replica cut off shares again (0: at the first answer; see
    ``store.fallback``). ``refresh_s``: how often a replica in shared mode refreshes its
    leases, heartbeat and what it publishes of the nodes' caches, and reads the others'
    (None: min(1 s, lease_ttl_s / 3); ``store.redis.beats``).
    """

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvgate:"
    lease_ttl_s: float = 30.0
    timeout_s: float = REDIS_TIMEOUT_S
    on_unavailable: str = "local_share"
    expected_replicas: int | None = None
    recover_s: float = 0.0
    refresh_s: float | None = None


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """StoreConfig picks where budgets live: ``memory`` (one replica) or ``redis`` (shared)."""

    kind: str = "memory"
    redis: RedisStoreConfig | None = None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """ServerConfig holds listen addresses and shutdown timing (seconds).

    ``access_log_ttl_s``: how long a request released by Envoy's access log (route key
    ``release: access_log``) may wait for its entry before it is released anyway.
    ``envoy_message_timeout_s``: the ext_proc filter's base ``message_timeout`` (what
    ``kvgate envoy-filter`` writes and ``check-config --envoy`` expects); a request waiting in
    a queue whose stream is reset after about that long tells kvgate its override was ignored.
    """

    grpc_listen: str = "127.0.0.1:50051"
    admin_listen: str = "0.0.0.0:9464"
    drain_s: float = 5.0
    grace_s: float = 30.0
    access_log_ttl_s: float = 900.0
    envoy_message_timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Config:
    """Config is the whole validated configuration of one kvgate process.

    ``allow_destructive_reload``: a hot reload of this file may remove pools, half or more of a
    pool's backends, classes, keyed tenants or every key of a tenant, or flip a pool's picking
    (``configdiff``), once: only the reload that sets it; without it such a reload is refused
    and the configuration in force stays.
    """

    pools: Mapping[str, PoolConfig]
    default_pool: str = "default"
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    allow_destructive_reload: bool = False

    def pool(self, name: str | None) -> PoolConfig:
        """pool returns the named pool, or the default pool for None."""
        return self.pools[name or self.default_pool]

    def class_of(self, tenant: str) -> ClassConfig:
        """class_of returns the class of a tenant; unknown tenants get the default class."""
        known = self.tenants.tenants.get(tenant)
        name = known.class_name if known else (self.tenants.unauthenticated or self.tenants.default_class)
        return self.tenants.classes[name]


