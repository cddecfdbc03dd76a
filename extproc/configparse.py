"""configparse: kvgate's configuration file read, typed into ``config.Config`` and validated.

Every problem is reported as a ``ConfigError`` naming the dotted key and the reason.
Unknown keys are errors too: a misspelled limit silently ignored is a GPU outage later.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from extproc import yamlload
from extproc.config import (ADAPTIVE_DEFAULTS, AGGREGATES, AdaptiveConfig, BackendConfig, ClassConfig, Config,
                            DEFAULT_PASS_PATHS, DiscoveryConfig, ENGINES, FAIRNESS_HEADER, FAIRNESS_MODES,
                            GROWTHS, Growth, KvEventsConfig, KvEventsEndpoint, LimitsConfig, MAX_FALLBACKS,
                            MAX_WEIGHT, OBJECTIVE_HEADER, ON_UNAVAILABLE, PickingConfig, PoolConfig,
                            REDIS_TIMEOUT_S, RedisStoreConfig, SIGNALS_DEFAULTS, ServerConfig, SignalsConfig,
                            StoreConfig, TenantConfig, TenantsConfig, UNKNOWN_PATHS)
from extproc.configread import Section
from extproc.engine_blocks import MAX_BLOCKS
from extproc.errors import ConfigError
from extproc.openai_shapes import TEMPLATES

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252}):([0-9]{1,5})$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def warnings(config: Config) -> list[str]:
    """warnings lists what a valid configuration does that an operator should know, one line each."""
    out: list[str] = []
    r = config.store.redis
    if r is not None and r.on_unavailable == "local_share" and r.expected_replicas is None:
        out.append("store.redis: on_unavailable is local_share but expected_replicas is not set: "
                   "a replica that has never reached Redis does not know its share and fails "
                   "closed until Redis answers (set expected_replicas to the replica count)")
    if r is not None:
        for name, pool in config.pools.items():
            if pool.picks and pool.picking.kv_events is not None:
                out.append(f"pools.{name}.picking.kv_events has no effect with the Redis store yet: "
                           "the shared ledger picks the node by room alone")
    if config.allow_destructive_reload:
        out.append("allow_destructive_reload is true: the reload that sets it may remove a pool, half "
                   "or more of a pool's backends, a class or a keyed tenant's keys, even from a file "
                   "cut short while being written; later reloads are guarded again while it stays, "
                   "so remove it once the reload it was meant for has applied")
    return out


def _name(key: str, value: str) -> str:
    if not _NAME.match(value):
        raise ConfigError(key, f"names use letters, digits, '_', '.', '-' (at most 63), got {value!r}")
    return value


def _backend(key: str, data: Any) -> BackendConfig:
    s = Section(key, data)
    name = _name(s.path("name"), s.string("name", None))
    url = s.string("metrics_url", None)
    if not url.startswith(("http://", "https://")):
        raise ConfigError(s.path("metrics_url"), f"must be an http:// or https:// URL, got {url!r}")
    address = s.string("address", None, optional=True)
    if address is not None:
        m = _ADDRESS.match(address)
        if m is None or not 0 < int(m.group(1)) < 65536:
            raise ConfigError(s.path("address"), f"must be HOST:PORT (the node's inference endpoint), "
                              f"got {address!r}")
    b = BackendConfig(name=name, metrics_url=url,
                      engine=s.string("engine", "vllm", choices=ENGINES),
                      model_name=s.string("model_name", None, optional=True),
                      address=address,
                      kv_capacity_tokens=s.integer("kv_capacity_tokens", None, optional=True))
    s.done()
    if b.address is not None and b.engine == "dcgm":
        raise ConfigError(s.path("address"), "a dcgm exporter serves no requests: give the address "
                          "on the inference node's backend")
    return b


_DNS_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


def _discovery(s: Section) -> DiscoveryConfig:
    # Every value is checked for its type before any is required, so an error names the
    # key that is wrong rather than one that is missing.
    name = s.string("dns", None, optional=True)
    port = s.integer("port", None, optional=True)
    path = s.string("metrics_path", "/metrics")
    engine = s.string("engine", "vllm", choices=ENGINES)
    model_name = s.string("model_name", None, optional=True)
    interval_s = s.number("interval_s", 5.0, low=0.5, high=3600.0)
    s.done()
    if name is None:
        raise ConfigError(s.path("dns"), "is required")
    if not _DNS_NAME.match(name):
        raise ConfigError(s.path("dns"), f"must be a DNS name (a headless Service's), got {name!r}")
    if port is None:
        raise ConfigError(s.path("port"), "is required")
    if port > 65535:
        raise ConfigError(s.path("port"), f"must be a TCP port, got {port}")
    if not path.startswith("/"):
        raise ConfigError(s.path("metrics_path"), f"must start with '/', got {path!r}")
    if engine == "dcgm":
        raise ConfigError(s.path("engine"), "discovered nodes serve requests: dcgm is no inference engine")
    return DiscoveryConfig(dns=name, port=port, metrics_path=path, engine=engine,
                           model_name=model_name, interval_s=interval_s)


def _ip_address(address: str) -> bool:
    """_ip_address tells whether ``HOST:PORT`` (already checked by _ADDRESS) names an IP literal."""
    try:
        ipaddress.ip_address(address.rpartition(":")[0].strip("[]"))
    except ValueError:
        return False
    return True


def _picking(s: Section) -> PickingConfig:
    growth = Growth(s.string("growth", "learned", choices=GROWTHS))
    picking = PickingConfig(
        growth=growth,
        quantile=s.number("quantile", 0.9, low=0.0, high=1.0, low_open=True),
        min_samples=s.integer("min_samples", 20, minimum=1),
        reserve_fraction=s.number("reserve_fraction", 0.02, low=0.0, high=0.5),
        shared_prefix=s.boolean("shared_prefix", False),
        block_tokens=s.integer("block_tokens", 16, minimum=1),
        prefix_affinity=s.number("prefix_affinity", 1.0, low=0.0, high=100.0),
        prefix_record_keys=s.integer("prefix_record_keys", 8192, minimum=0),
        kv_events=_kv_events(s.section("kv_events")) if s.has("kv_events") else None,
        fallbacks=s.integer("fallbacks", 0, minimum=0),
    )
    if picking.fallbacks > MAX_FALLBACKS:
        # Each fallback is one more retry of the proxy's route: a long list only delays the 503.
        raise ConfigError(s.path("fallbacks"), f"must be at most {MAX_FALLBACKS}, got {picking.fallbacks}")
    s.done()
    return picking


_ZMQ_IPC = re.compile(r"^ipc://[^\s]+$")


_ZMQ_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def _zmq_endpoint(s: Section, name: str) -> str | None:
    value = s.string(name, None, optional=True)
    if value is None:
        return None
    if _ZMQ_IPC.match(value):  # a socket file: an engine on the same host (vLLM binds ipc://)
        return value
    m = _ZMQ_ENDPOINT.match(value)
    if m is None or not 0 < int(m.group(2)) <= 65535:
        raise ConfigError(s.path(name), f"must be a ZMQ endpoint tcp://HOST:PORT or ipc://PATH, got {value!r}")
    return value


def _kv_events(s: Section) -> KvEventsConfig:
    port = s.integer("port", None, optional=True)
    replay_port = s.integer("replay_port", None, optional=True)
    for key, value in (("port", port), ("replay_port", replay_port)):
        if value is not None and value > 65535:
            raise ConfigError(s.path(key), f"must be a TCP port, got {value}")
    if replay_port is not None and port is None:
        raise ConfigError(s.path("replay_port"), "needs port (the nodes' event endpoint)")
    raw = s.raw("endpoints", [])
    if not isinstance(raw, list):
        raise ConfigError(s.path("endpoints"), "must be a list")
    endpoints: list[KvEventsEndpoint] = []
    for i, item in enumerate(raw):
        e = Section(f"{s.path('endpoints')}[{i}]", item)
        # Every value is checked for its type before any is required (see _discovery).
        backend = e.string("backend", None, optional=True)
        endpoint = _zmq_endpoint(e, "endpoint")
        replay = _zmq_endpoint(e, "replay_endpoint")
        e.done()
        if backend is None:
            raise ConfigError(e.path("backend"), "is required")
        if endpoint is None:
            raise ConfigError(e.path("endpoint"), "is required")
        if any(x.backend == backend for x in endpoints):
            raise ConfigError(e.path("backend"), f"duplicate backend {backend!r}")
        endpoints.append(KvEventsEndpoint(backend, endpoint, replay))
    config = KvEventsConfig(port=port, replay_port=replay_port, endpoints=tuple(endpoints),
                            topic=s.string("topic", None, optional=True) or "",
                            max_blocks=s.integer("max_blocks", MAX_BLOCKS, minimum=1))
    s.done()
    if port is None and not endpoints:
        raise ConfigError(s.path("port"), "is required unless endpoints names every node's")
    return config


def _backends(s: Section) -> tuple[BackendConfig, ...]:
    """_backends is a pool section's ``backends`` list, each parsed, their names distinct."""
    backends_raw = s.raw("backends", [])
    if backends_raw is None:
        backends_raw = []
    if not isinstance(backends_raw, list):
        raise ConfigError(s.path("backends"), "must be a list")
    backends = tuple(_backend(f"{s.path('backends')}[{i}]", b) for i, b in enumerate(backends_raw))
    seen: set[str] = set()
    for i, b in enumerate(backends):
        if b.name in seen:
            raise ConfigError(f"{s.path('backends')}[{i}].name", f"duplicate backend {b.name!r}")
        seen.add(b.name)
    return backends


def _check_picking(s: Section, picking: PickingConfig, backends: tuple[BackendConfig, ...], addressed: bool,
                   discovery: DiscoveryConfig | None) -> None:
    """_check_picking refuses a pool section's ``picking`` where its backends cannot serve it:
    no addresses (``addressed`` False) nor discovery, fallbacks without listed IP addresses,
    KV event endpoints naming no backend."""
    if s.has("picking") and not addressed and discovery is None:
        raise ConfigError(s.path("picking"), "needs every backend of the pool to have an address")
    if picking.fallbacks and discovery is not None:
        # Envoy tries a fallback only among the hosts its cluster lists (override_host), and
        # a pool discovered in DNS has no list kvgate can write into Envoy's file.
        raise ConfigError(f"{s.path('picking')}.fallbacks", "needs the pool's backends listed with their "
                          "addresses: a pool discovered in DNS cannot name fallbacks (set 0)")
    if picking.fallbacks:
        for i, b in enumerate(backends):
            if b.address is not None and not _ip_address(b.address):
                # Envoy's listed cluster is STATIC, and matches the names kvgate sends by IP.
                raise ConfigError(f"{s.path('backends')}[{i}].address", "must be an IP address and port "
                                  f"where picking.fallbacks is set, got {b.address!r}")
    if picking.kv_events is not None:
        names = {b.name for b in backends}
        for i, e in enumerate(picking.kv_events.endpoints):
            if discovery is None and e.backend not in names:
                raise ConfigError(f"{s.path('picking')}.kv_events.endpoints[{i}].backend",
                                  f"names no backend of the pool: {e.backend!r}")


def _pool(key: str, name: str, data: Any) -> PoolConfig:
    """_pool is pool ``name``'s section (at ``key``) typed and checked."""
    s = Section(key, data)
    backends = _backends(s)
    sig = s.section("signals")
    signals = SignalsConfig(
        aggregate=sig.string("aggregate", SIGNALS_DEFAULTS.aggregate, choices=AGGREGATES),
        waiting_threshold=sig.integer("waiting_threshold", SIGNALS_DEFAULTS.waiting_threshold, minimum=1),
        kv_budget_fraction=sig.number("kv_budget_fraction", SIGNALS_DEFAULTS.kv_budget_fraction,
                                      low=0.0, high=1.0, low_open=True),
    )
    framebuffer_only = sig.boolean("framebuffer_only", False)
    sig.done()
    addresses = [b.address for b in backends if b.address is not None]
    if addresses and len(addresses) != len(backends):
        missing = next(i for i, b in enumerate(backends) if b.address is None)
        raise ConfigError(f"{s.path('backends')}[{missing}].address",
                          "is required when another backend of the pool has one: kvgate picks "
                          "a node for every request only when it knows every node's address")
    seen_addresses: set[str] = set()
    for i, address in enumerate(addresses):
        if address in seen_addresses:
            raise ConfigError(f"{s.path('backends')}[{i}].address", f"duplicate address {address!r}")
        seen_addresses.add(address)
    discovery = _discovery(s.section("discovery")) if s.has("discovery") else None
    if discovery is not None and backends:
        raise ConfigError(s.path("discovery"), "a pool lists its backends or discovers them, not both")
    picking = _picking(s.section("picking"))
    _check_picking(s, picking, backends, bool(addresses), discovery)
    if backends and all(b.engine == "dcgm" for b in backends) and not framebuffer_only:
        # vLLM reserves gpu_memory_utilization (0.9 by default) of the framebuffer at start,
        # SGLang its mem_fraction_static, TGI its KV cache: with DCGM alone such a node
        # reads as saturated from its first second, whatever its load.
        raise ConfigError(s.path("backends"),
                          "every backend is dcgm: GPU framebuffer use is no KV signal for "
                          "vLLM, SGLang or TGI, which reserve most of the memory at start "
                          "(the pool would always read as saturated). Add the engine's own "
                          "metrics (engine: vllm, sglang or tgi), or set "
                          "signals.framebuffer_only: true if this engine allocates on demand")
    tokenizer = s.string("tokenizer", "cl100k_base")
    if tokenizer.startswith(("tiktoken:", "hf:")) and not tokenizer.split(":", 1)[1]:
        raise ConfigError(s.path("tokenizer"), "needs a path after the prefix")
    pool = PoolConfig(
        name=name,
        max_concurrency=s.integer("max_concurrency", 64),
        tpm=s.integer("tpm", None, optional=True),
        kv_budget_tokens=s.integer("kv_budget_tokens", None, optional=True),
        context_window=s.integer("context_window", 32768),
        default_max_tokens=s.integer("default_max_tokens", 1024),
        tokenizer=tokenizer,
        chat_template=s.string("chat_template", "openai", choices=tuple(TEMPLATES)),
        enforce_max_tokens=s.boolean("enforce_max_tokens", False),
        backends=backends,
        signals=signals,
        picking=picking,
        discovery=discovery,
    )
    s.done()
    if pool.default_max_tokens >= pool.context_window:
        raise ConfigError(s.path("default_max_tokens"),
                          f"must be below context_window ({pool.context_window})")
    return pool


def _classes(s: Section) -> dict[str, ClassConfig]:
    raw = s.section("classes")
    classes: dict[str, ClassConfig] = {}
    for cname in raw.data:
        c = raw.section(cname)
        _name(c.key, cname)
        classes[cname] = ClassConfig(
            name=cname,
            priority=c.integer("priority", 0, minimum=-1000),
            guaranteed_slots=c.integer("guaranteed_slots", 0, minimum=0),
            tpm=c.integer("tpm", None, optional=True),
            max_wait_s=c.number("max_wait_s", 0.0, low=0.0, high=600.0),
            sheddable=c.boolean("sheddable", False),
            kv_watermark=c.number("kv_watermark", 1.0, low=0.0, high=1.0, low_open=True),
            fairness=c.string("fairness", "tenant", choices=FAIRNESS_MODES),
        )
        c.done()
    if not classes:
        classes["standard"] = ClassConfig(name="standard")
    return classes


# An HTTP field name (RFC 9110 token), lower-cased as Envoy passes header names on.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")


def _tenants(data: Any) -> TenantsConfig:
    s = Section("tenants", data)
    header = s.string("header", "x-tenant-id").lower()
    if not _HEADER_NAME.fullmatch(header):
        raise ConfigError("tenants.header", f"must be an HTTP header name (letters, digits and "
                                            f"!#$%&'*+-.^_`|~, no spaces or colons), got {header!r}")
    seen = {header: "header"}
    optional_headers: dict[str, str | None] = {}
    for key, default in (("fairness_header", FAIRNESS_HEADER), ("objective_header", OBJECTIVE_HEADER)):
        name = s.string(key, default, optional=True)
        if name is not None:
            name = name.lower()
            if not _HEADER_NAME.fullmatch(name):
                raise ConfigError(f"tenants.{key}", f"must be an HTTP header name or null, got {name!r}")
            if name in seen:
                raise ConfigError(f"tenants.{key}", f"is the same header as tenants.{seen[name]} ({name!r})")
            seen[name] = key
        optional_headers[key] = name
    classes = _classes(s)
    if "default_class" not in s.data and "standard" not in classes:
        raise ConfigError("tenants.default_class",
                          f"is required: no class is named 'standard' (the default class); set "
                          f"default_class to one of {', '.join(sorted(classes)) or '(none defined)'}, "
                          f"or add a class named 'standard'")
    default_class = s.string("default_class", "standard")
    if default_class not in classes:
        raise ConfigError("tenants.default_class", f"names no class in tenants.classes: {default_class!r}")
    raw = s.section("tenants")
    tenants: dict[str, TenantConfig] = {}
    key_owner: dict[str, str] = {}
    for tname in raw.data:
        t = raw.section(tname)
        _name(t.key, tname)
        cname = t.string("class", default_class)
        if cname not in classes:
            raise ConfigError(t.path("class"), f"names no class in tenants.classes: {cname!r}")
        keys_raw = t.raw("api_key_sha256", [])
        if isinstance(keys_raw, str):
            keys_raw = [keys_raw]
        if not isinstance(keys_raw, list):
            raise ConfigError(t.path("api_key_sha256"), "must be a hex digest or a list of them")
        keys = []
        for k in keys_raw:
            if not isinstance(k, str) or not _SHA256.match(k.lower()):
                raise ConfigError(t.path("api_key_sha256"), "each entry must be 64 hex digits (SHA-256 of the key)")
            k = k.lower()
            if k in key_owner:
                raise ConfigError(t.path("api_key_sha256"), f"key already belongs to tenant {key_owner[k]!r}")
            key_owner[k] = tname
            keys.append(k)
        tenants[tname] = TenantConfig(name=tname, class_name=cname,
                                      tpm=t.integer("tpm", None, optional=True),
                                      api_key_sha256=tuple(keys),
                                      weight=t.number("weight", 1.0, low=0.0, low_open=True,
                                                      high=MAX_WEIGHT))
        t.done()
    unauthenticated = _unauthenticated(s, classes, default_class, any(t.api_key_sha256 for t in tenants.values()))
    s.done()
    return TenantsConfig(header=header, default_class=default_class, classes=classes, tenants=tenants,
                         unauthenticated=unauthenticated, **optional_headers)


def _unauthenticated(s: Section, classes: Mapping[str, ClassConfig], default_class: str,
                     keyed: bool) -> str | None:
    """_unauthenticated reads ``tenants.unauthenticated``: a class name, or ``reject`` (None);
    unset, the lowest priority class where tenants have keys (the default class among
    equals), else the default class."""
    given = s.string("unauthenticated", None, optional=True)
    if given == "reject":
        return None
    if given is not None:
        if given not in classes:
            raise ConfigError("tenants.unauthenticated",
                              f"names no class in tenants.classes (or 'reject'): {given!r}")
        return given
    if not keyed:
        return default_class
    lowest = min(c.priority for c in classes.values())
    least = [c for c in classes.values() if c.priority == lowest]
    if any(c.name == default_class for c in least):
        return default_class
    return min(least, key=lambda c: (c.guaranteed_slots, c.name)).name


def _adaptive(data: Any) -> AdaptiveConfig:
    s = Section("adaptive", data)
    d = ADAPTIVE_DEFAULTS
    a = AdaptiveConfig(
        high_watermark=s.number("high_watermark", d.high_watermark, low=0.0, high=1.0, low_open=True),
        low_watermark=s.number("low_watermark", d.low_watermark, low=0.0, high=1.0),
        min_scale=s.number("min_scale", d.min_scale, low=0.0, high=1.0, low_open=True),
        recovery_per_s=s.number("recovery_per_s", d.recovery_per_s, low=0.0, low_open=True),
        poll_interval_s=s.number("poll_interval_s", d.poll_interval_s, low=0.01, high=60.0),
        scrape_timeout_s=s.number("scrape_timeout_s", d.scrape_timeout_s, low=0.001, high=60.0),
        stale_after_s=s.number("stale_after_s", d.stale_after_s, low=0.0, low_open=True),
        early_scrape_gap_s=s.number("early_scrape_gap_s", d.early_scrape_gap_s, low=0.0, high=60.0),
        max_scrape_bytes=s.integer("max_scrape_bytes", d.max_scrape_bytes, minimum=1024),
    )
    s.done()
    if a.low_watermark >= a.high_watermark:
        raise ConfigError("adaptive.low_watermark",
                          f"must be below high_watermark ({a.high_watermark}), got {a.low_watermark}")
    if a.scrape_timeout_s > a.poll_interval_s:
        raise ConfigError("adaptive.scrape_timeout_s", "must not exceed poll_interval_s")
    if a.stale_after_s < a.poll_interval_s:
        raise ConfigError("adaptive.stale_after_s", "must be at least poll_interval_s")
    return a


def _store(data: Any) -> StoreConfig:
    if data is None or data == "memory":
        return StoreConfig()
    if isinstance(data, str):
        raise ConfigError("store", f"must be 'memory' or a mapping with 'redis', got {data!r}")
    s = Section("store", data)
    if not s.has("redis"):
        if s.raw("memory", None) is not None or s.has("memory"):
            s.done()
            return StoreConfig()
        raise ConfigError("store", "must be 'memory' or a mapping with 'redis'")
    r = s.section("redis")
    url = r.string("url", "redis://127.0.0.1:6379/0")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("store.redis.url", f"must be a redis:// URL, got {url!r}")
    cfg = RedisStoreConfig(
        url=url,
        key_prefix=r.string("key_prefix", "kvgate:"),
        lease_ttl_s=r.number("lease_ttl_s", 30.0, low=1.0, high=3600.0),
        timeout_s=r.number("timeout_s", REDIS_TIMEOUT_S, low=0.0, low_open=True, high=10.0),
        on_unavailable=r.string("on_unavailable", "local_share", choices=ON_UNAVAILABLE),
        expected_replicas=r.integer("expected_replicas", None, minimum=1, optional=True),
        recover_s=r.number("recover_s", 0.0, low=0.0, high=60.0),
        refresh_s=None if r.raw("refresh_s", None) is None else r.number("refresh_s", 1.0, low=0.05, high=10.0),
    )
    if cfg.refresh_s is not None and cfg.refresh_s > cfg.lease_ttl_s / 3.0:
        raise ConfigError("store.redis.refresh_s", f"must be at most lease_ttl_s / 3 ({cfg.lease_ttl_s / 3.0:g} s), "
                          f"so that a lease outlives two missed refreshes; got {cfg.refresh_s:g}")
    r.done()
    s.done()
    return StoreConfig(kind="redis", redis=cfg)


def _hostport(key: str, value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(key, f"must be HOST:PORT, got {value!r}")
    return value


def _server(data: Any) -> ServerConfig:
    s = Section("server", data)
    cfg = ServerConfig(
        grpc_listen=_hostport("server.grpc_listen", s.string("grpc_listen", "127.0.0.1:50051")),
        admin_listen=_hostport("server.admin_listen", s.string("admin_listen", "0.0.0.0:9464")),
        drain_s=s.number("drain_s", 5.0, low=0.0, high=600.0),
        grace_s=s.number("grace_s", 30.0, low=0.0, high=3600.0),
        access_log_ttl_s=s.number("access_log_ttl_s", 900.0, low=1.0, high=86400.0),
        envoy_message_timeout_s=s.number("envoy_message_timeout_s", 5.0, low=0.01, high=3600.0),
    )
    s.done()
    return cfg


def parse_config(data: Any) -> Config:
    """parse_config validates a decoded configuration mapping and returns a ``Config``.

    Raises ``ConfigError`` naming the first bad key.
    """
    root = Section("", data)
    pools_raw = root.section("pools")
    if not pools_raw.data:
        raise ConfigError("pools", "needs at least one pool")
    pools = {}
    for pname in pools_raw.data:
        _name(pools_raw.path(pname), pname)
        pools[pname] = _pool(pools_raw.path(pname), pname, pools_raw.raw(pname))
    default_pool = root.string("default_pool", "default" if "default" in pools else next(iter(pools)))
    if default_pool not in pools:
        raise ConfigError("default_pool", f"names no pool in pools: {default_pool!r}")
    limits_s = root.section("limits")
    pass_raw = limits_s.raw("pass_paths", list(DEFAULT_PASS_PATHS))
    if not isinstance(pass_raw, list) or not all(isinstance(p, str) and p.startswith("/")
                                                 for p in pass_raw):
        raise ConfigError(limits_s.path("pass_paths"),
                          "must be a list of paths starting with '/' (a trailing '*' makes a prefix)")
    limits = LimitsConfig(max_body_bytes=limits_s.integer("max_body_bytes", 1_048_576, minimum=64),
                          unknown_paths=limits_s.string("unknown_paths", "refuse", choices=UNKNOWN_PATHS),
                          pass_paths=tuple(pass_raw))
    limits_s.done()
    tenants = _tenants(root.raw("tenants"))
    for pool in pools.values():
        guaranteed = sum(c.guaranteed_slots for c in tenants.classes.values())
        if guaranteed > pool.max_concurrency:
            raise ConfigError("tenants.classes",
                              f"guaranteed_slots add up to {guaranteed}, above "
                              f"pools.{pool.name}.max_concurrency ({pool.max_concurrency})")
    cfg = Config(pools=pools, default_pool=default_pool, limits=limits,
                 adaptive=_adaptive(root.raw("adaptive")), tenants=tenants,
                 store=_store(root.raw("store")), server=_server(root.raw("server")),
                 allow_destructive_reload=root.boolean("allow_destructive_reload", False))
    root.done()
    return cfg


def load_config(path: str | Path) -> Config:
    """load_config reads and validates a YAML configuration file.

    Raises ``ConfigError`` for unreadable files, YAML syntax errors and bad keys.
    """
    return parse_config(read_yaml(path))


def read_yaml(path: str | Path) -> Any:
    """read_yaml reads a YAML file (a key given twice refused) and returns its document.

    Raises ``ConfigError`` for unreadable files and YAML syntax errors.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(p), f"cannot read: {exc}") from None
    try:
        data = yamlload.load(text)
    except yamlload.DuplicateKeyError as exc:
        raise ConfigError(str(p), f"line {exc.line}: {exc}: remove one") from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(p), f"is not valid YAML: {exc}") from None
    return data
