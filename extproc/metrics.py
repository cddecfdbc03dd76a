"""metrics: every Prometheus metric kvgate exports; the only importer of prometheus_client.

Counters and histograms are updated by the service as requests are decided and released.
Gauges that mirror the admission core (in-flight, limits, scale, TPM, KV tokens) are not
kept up to date per request: a collector reads ``admission.snapshot(pool)`` when
``/metrics`` is scraped, so the hot path pays nothing for them. Label values are bounded:
configured pool and class names, outcome and cause enums, known route-metadata keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from extproc.admission.types import PoolSnapshot

# The outcome label of kvgate_requests_total (the list, in this order).
OUTCOMES = ("admitted", "rejected_concurrency", "rejected_tpm", "rejected_kv_budget",
            "rejected_shed", "rejected_context_length", "rejected_body_too_large",
            "rejected_invalid", "rejected_store_unavailable", "rejected_unauthenticated",
            "rejected_path")
# The cause label of kvgate_releases_total.
CAUSES = ("completed", "client_disconnect", "upstream_error", "timeout", "ended")
# Decisions take tens of microseconds to a few milliseconds; waits in a class queue longer.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SCRAPE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class SnapshotSource(Protocol):
    """SnapshotSource is what the gauge collector reads: the admission core's pools."""

    @property
    def pools(self) -> tuple[str, ...]: ...

    def snapshot(self, pool: str) -> PoolSnapshot: ...


class _AdmissionCollector:
    """_AdmissionCollector turns pool snapshots into gauges at scrape time."""

    def __init__(self, source: Callable[[], SnapshotSource | None],
                 classes: Callable[[], Sequence[str]]) -> None:
        self._source = source
        self._classes = classes

    def describe(self) -> Iterable[Metric]:
        # Describing nothing keeps the registry from calling collect() at registration.
        return ()

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily("kvgate_inflight_requests",
                                     "Admitted requests not yet released, per pool and tenant class.",
                                     labels=["pool", "class"])
        limit = GaugeMetricFamily("kvgate_concurrency_limit",
                                  "Effective concurrency limit (base limit times the admission scale).",
                                  labels=["pool"])
        scale = GaugeMetricFamily("kvgate_admission_scale",
                                  "Adaptive scale applied to the pool's limits (ratio, 1 = base).",
                                  labels=["pool"])
        tpm = GaugeMetricFamily("kvgate_tpm_available_tokens",
                                "Tokens available now in the pool's TPM bucket (negative while in debt).",
                                labels=["pool"])
        kv = GaugeMetricFamily("kvgate_kv_inflight_tokens",
                               "Prompt plus reserved completion tokens of admitted, unreleased requests.",
                               labels=["pool"])
        kv_budget = GaugeMetricFamily("kvgate_kv_budget_tokens",
                                      "Effective in-flight KV-token budget (absent when unbounded).",
                                      labels=["pool"])
        alarm = GaugeMetricFamily("kvgate_pool_alarm",
                                  "1 when the pool is at or above the high watermark or its signals are stale.",
                                  labels=["pool"])
        source = self._source()
        if source is not None:
            classes = tuple(self._classes())
            for pool in source.pools:
                snap = source.snapshot(pool)
                for cls in classes:
                    inflight.add_metric([pool, cls], snap.inflight_by_class.get(cls, 0))
                for cls, n in snap.inflight_by_class.items():
                    if cls not in classes:  # a class removed by a reload, still draining
                        inflight.add_metric([pool, cls], n)
                limit.add_metric([pool], snap.concurrency_limit)
                scale.add_metric([pool], snap.scale)
                if snap.tpm_available is not None:
                    tpm.add_metric([pool], snap.tpm_available)
                kv.add_metric([pool], snap.kv_inflight)
                if snap.kv_budget is not None:
                    kv_budget.add_metric([pool], snap.kv_budget)
                alarm.add_metric([pool], 1.0 if snap.alarm else 0.0)
        yield from (inflight, limit, scale, tpm, kv, kv_budget, alarm)


class Metrics:
    """Metrics owns kvgate's registry and the counters the service updates.

    One instance per process (tests make their own, each with a fresh registry). Child
    counters are cached per label tuple: ``labels()`` is too slow for every request.
    It also implements the scraper's ``ScrapeObserver`` and the shared store's
    ``StoreObserver`` protocols.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvgate_requests_total",
                                "Admission decisions on LLM requests, by outcome.",
                                ["pool", "class", "outcome"], registry=r)
        self.releases = Counter("kvgate_releases_total",
                                "Leases released, by how the request ended.",
                                ["pool", "cause"], registry=r)
        self.decision = Histogram("kvgate_decision_seconds",
                                  "Time from the request body's arrival to the admission answer (seconds).",
                                  buckets=DECISION_BUCKETS, registry=r)
        self.route_metadata_errors = Counter(
            "kvgate_route_metadata_errors_total",
            "Per-route kvgate metadata entries that were unknown or invalid and were ignored.",
            ["key"], registry=r)
        self.tenant_header_unseen = Counter(
            "kvgate_tenant_header_unseen_total",
            "Requests without the configured tenant header (and without a tenant's API key) "
            "while tenants are configured that only that header can name; with reason "
            "other_header, Envoy sent another request header kvgate does not read.",
            ["reason"], registry=r)
        self.streams = Gauge("kvgate_streams_active", "ext_proc gRPC streams open now.", registry=r)
        self.ready = Gauge("kvgate_ready", "1 while kvgate accepts traffic, 0 while draining.",
                           registry=r)
        self.reloads = Counter("kvgate_config_reload_total", "Configuration reloads applied.",
                               registry=r)
        self.reload_errors = Counter("kvgate_config_reload_errors_total",
                                     "Configuration reloads refused (the old config stays).",
                                     registry=r)
        self.reload_success = Gauge("kvgate_config_last_reload_success_timestamp_seconds",
                                    "Unix time of the last configuration load that was applied.",
                                    registry=r)
        self.internal_errors = Counter("kvgate_internal_errors_total",
                                       "Unexpected errors inside kvgate while handling a stream.",
                                       registry=r)
        self.access_log_entries = Counter(
            "kvgate_access_log_entries_total",
            "Envoy access log entries received: released a parked request, had no lease "
            "(refused, passed through), or named a lease parked nowhere here.",
            ["result"], registry=r)
        # Scraper observer metrics.
        self.backend_kv = Gauge("kvgate_backend_kv_cache_usage_ratio",
                                "KV-cache usage a backend last reported (ratio 0..1).",
                                ["pool", "backend"], registry=r)
        self.backend_waiting = Gauge("kvgate_backend_requests_waiting",
                                     "Requests queued on a backend, as last reported.",
                                     ["pool", "backend"], registry=r)
        self.backend_up = Gauge("kvgate_backend_up", "1 when the backend's last scrape succeeded.",
                                ["pool", "backend"], registry=r)
        self.scrape_errors = Counter("kvgate_backend_scrape_errors_total",
                                     "Failed scrapes of backend metrics, by reason.",
                                     ["pool", "backend", "reason"], registry=r)
        self.scrape_seconds = Histogram("kvgate_backend_scrape_seconds",
                                        "Duration of one backend metrics scrape (seconds).",
                                        buckets=SCRAPE_BUCKETS, registry=r)
        self.pool_stale_gauge = Gauge("kvgate_pool_signals_stale",
                                      "1 while the pool's backend signals are missing or too old.",
                                      ["pool"], registry=r)
        # Shared-store (Redis) observer metrics.
        self.store_mode_gauge = Gauge("kvgate_store_mode",
                                      "1 for where admissions are decided now (shared, local_share, "
                                      "fail_closed), 0 for the other modes seen.", ["mode"], registry=r)
        self.store_errors = Counter("kvgate_store_errors_total",
                                    "Failed round trips to the shared store, by reason.", ["reason"],
                                    registry=r)
        self._store_modes: set[str] = set()
        self._request_children: dict[tuple[str, str, str], Any] = {}
        self._release_children: dict[tuple[str, str], Any] = {}
        self._source: SnapshotSource | None = None
        self._classes: Sequence[str] = ()
        self.registry.register(_AdmissionCollector(lambda: self._source, lambda: self._classes))
        self.ready.set(0)

    def attach(self, source: SnapshotSource, classes: Sequence[str]) -> None:
        """attach makes the gauges read ``source`` (the admission core) at scrape time.

        ``classes`` are the configured class names, listed at 0 when idle so that
        dashboards see every series from the start.
        """
        self._source = source
        self._classes = tuple(classes)

    def set_classes(self, classes: Sequence[str]) -> None:
        """set_classes updates the configured class names after a reload."""
        self._classes = tuple(classes)

    # --- hot path ----------------------------------------------------------------

    def request(self, pool: str, class_name: str, outcome: str) -> None:
        """request counts one admission decision (``outcome`` is one of OUTCOMES)."""
        key = (pool, class_name, outcome)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(pool, class_name, outcome)
        child.inc()

    def release(self, pool: str, cause: str) -> None:
        """release counts one released lease (``cause`` is one of CAUSES)."""
        key = (pool, cause)
        child = self._release_children.get(key)
        if child is None:
            child = self._release_children[key] = self.releases.labels(pool, cause)
        child.inc()

    def decision_time(self, seconds: float) -> None:
        """decision_time records how long one admission decision took (seconds)."""
        self.decision.observe(seconds)

    def access_log_entry(self, result: str) -> None:
        """access_log_entry counts one entry of Envoy's access log (``released``,
        ``no_lease``, ``unmatched``)."""
        self.access_log_entries.labels(result).inc()

    def route_metadata_error(self, key: str) -> None:
        """route_metadata_error counts one ignored per-route setting (``key`` bounded by the caller)."""
        self.route_metadata_errors.labels(key).inc()

    # --- reloads -------------------------------------------------------------------

    def reload_ok(self, unix_time: float) -> None:
        """reload_ok counts an applied configuration and records when (Unix seconds)."""
        self.reloads.inc()
        self.reload_success.set(unix_time)

    def reload_failed(self) -> None:
        """reload_failed counts a configuration that was refused."""
        self.reload_errors.inc()

    # --- ScrapeObserver --------------------------------------------------------------

    def scrape_done(self, pool: str, backend: str, seconds: float, ok: bool) -> None:
        """scrape_done records one scrape's duration (seconds) and whether it succeeded."""
        self.scrape_seconds.observe(seconds)
        self.backend_up.labels(pool, backend).set(1.0 if ok else 0.0)

    def scrape_error(self, pool: str, backend: str, reason: str) -> None:
        """scrape_error counts a failed scrape; ``reason`` is a short enum from the scraper."""
        self.scrape_errors.labels(pool, backend, reason).inc()

    def backend_state(self, pool: str, backend: str, up: bool, kv_usage: float | None,
                      waiting: int | None) -> None:
        """backend_state records what a backend last reported (usage ratio, queued requests)."""
        self.backend_up.labels(pool, backend).set(1.0 if up else 0.0)
        if kv_usage is not None:
            self.backend_kv.labels(pool, backend).set(kv_usage)
        if waiting is not None:
            self.backend_waiting.labels(pool, backend).set(waiting)

    def pool_stale(self, pool: str, stale: bool) -> None:
        """pool_stale records whether a pool's signals are missing or too old."""
        self.pool_stale_gauge.labels(pool).set(1.0 if stale else 0.0)

    # --- StoreObserver (the Redis store) -----------------------------------------------

    def store_error(self, reason: str) -> None:
        """store_error counts one failed round trip to the shared store (``reason`` an enum)."""
        self.store_errors.labels(reason).inc()

    def store_mode(self, mode: str) -> None:
        """store_mode records where admissions are decided now; other modes seen drop to 0."""
        self._store_modes.add(mode)
        for m in self._store_modes:
            self.store_mode_gauge.labels(m).set(1.0 if m == mode else 0.0)

    # --- exposition ------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """render returns the Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
