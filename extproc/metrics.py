"""metrics: every Prometheus metric kvgate exports; the only importer of prometheus_client.

Counters and histograms are updated by the service as requests are decided and released.
Gauges that mirror the admission core (in-flight, limits, scale, TPM, KV tokens) are not
kept up to date per request: a collector reads ``admission.snapshot(pool)`` when
``/metrics`` is scraped, so the hot path pays nothing for them. Label values are bounded:
configured pool and class names, outcome and cause enums, known route-metadata keys.
"""

from __future__ import annotations

import importlib.metadata
import bisect
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from extproc.admission.types import ERROR_REASONS as STORE_ERROR_REASONS
from extproc.admission.types import Outcome, PoolSnapshot
from extproc.outcomes import LogResult, RequestOutcome
from extproc.usage_log import RESULTS as LOGGED_USAGE_RESULTS

# The outcome label of kvgate_requests_total: the request's RequestOutcome, in its order.
OUTCOMES = tuple(outcome.value for outcome in RequestOutcome)
# The cause label of kvgate_releases_total: the admission core's Outcome, in its order.
CAUSES = tuple(cause.value for cause in Outcome)
# The result label of kvgate_access_log_entries_total: LogResult (Endings.logged).
ACCESS_LOG_RESULTS = tuple(result.value for result in LogResult)
# The reason label of kvgate_tenant_header_unseen_total (see the arrival's tenant lookup).
TENANT_HEADER_UNSEEN_REASONS = ("absent", "other_header")
# Decisions take tens of microseconds to a few milliseconds; waits in a class queue longer.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SCRAPE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class SnapshotSource(Protocol):
    """SnapshotSource is what the gauge collector reads: the admission core's pools."""

    @property
    def pools(self) -> tuple[str, ...]: ...

    def snapshot(self, pool: str) -> PoolSnapshot: ...

    def nodes(self, pool: str) -> tuple[Any, ...]: ...


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
        node_families = _node_families()
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
                _add_nodes(node_families, pool, source.nodes(pool))
        yield from (inflight, limit, scale, tpm, kv, kv_budget, alarm)
        yield from node_families.values()


class KvEventViews(Protocol):
    """KvEventViews is what the KV events collector reads (``signals.kv_events.KvEvents``)."""

    def views(self) -> list[tuple[str, str, Any]]: ...


# The state label of kvgate_kv_events_view (``signals.kv_events.ViewState``).
KV_EVENT_STATES = ("live", "partial", "down")


class _KvEventsCollector:
    """_KvEventsCollector turns each node's KV events view and counts into series at scrape time
    (the subscribers count on their own threads; nothing is updated per event here)."""

    def __init__(self, source: Callable[[], KvEventViews | None]) -> None:
        self._source = source

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "backend"]
        state = GaugeMetricFamily("kvgate_kv_events_view",
                                  "1 for the state of the node's KV events view: live (exact), "
                                  "partial (events missed) or down (not connected).",
                                  labels=[*labels, "state"])
        blocks = GaugeMetricFamily("kvgate_kv_events_cached_blocks",
                                   "Blocks the node's KV events say it caches, as kvgate indexes them.",
                                   labels=labels)
        batches = CounterMetricFamily("kvgate_kv_events_batches",
                                      "Event messages received from the node and applied.", labels=labels)
        events = CounterMetricFamily("kvgate_kv_events_events",
                                     "KV cache events applied (stored, removed, cleared).", labels=labels)
        dropped = CounterMetricFamily("kvgate_kv_events_dropped",
                                      "Event messages dropped unread, by reason.", labels=[*labels, "reason"])
        gaps = CounterMetricFamily("kvgate_kv_events_gaps",
                                   "Gaps in the node's event sequence numbers.", labels=labels)
        replayed = CounterMetricFamily("kvgate_kv_events_replayed",
                                       "Event messages a replay filled in.", labels=labels)
        skipped = CounterMetricFamily("kvgate_kv_events_unindexed_blocks",
                                      "Blocks stored but not indexed, by why: orphan (parent unknown, "
                                      "no token ids), skipped (LoRA, extra keys, other medium or group), "
                                      "forgotten (past max_blocks).", labels=[*labels, "why"])
        source = self._source()
        for pool, node, v in (source.views() if source is not None else ()):
            for s in KV_EVENT_STATES:
                state.add_metric([pool, node, s], 1.0 if v.state.value == s else 0.0)
            blocks.add_metric([pool, node], len(v.blocks))
            batches.add_metric([pool, node], v.batches)
            events.add_metric([pool, node], v.events)
            for reason, n in v.dropped.items():
                dropped.add_metric([pool, node, reason], n)
            gaps.add_metric([pool, node], v.gaps)
            replayed.add_metric([pool, node], v.replayed)
            b = v.blocks
            for why, n in (("orphan", b.orphans), ("skipped", b.skipped), ("forgotten", b.forgotten)):
                skipped.add_metric([pool, node, why], n)
        yield from (state, blocks, batches, events, dropped, gaps, replayed, skipped)


def _node_families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    labels = ["pool", "backend"]
    return {
        "inflight": GaugeMetricFamily(
            "kvgate_backend_kv_inflight_tokens",
            "KV tokens kvgate's admitted requests hold on the node now (prompt + generated), "
            "in pools that pick nodes.", labels=labels),
        "shared": GaugeMetricFamily(
            "kvgate_backend_kv_shared_prefix_tokens",
            "KV tokens of prompt prefixes kvgate's requests on the node share, counted once "
            "(picking.shared_prefix; one block less per request that shares).", labels=labels),
        "held": GaugeMetricFamily(
            "kvgate_backend_kv_expected_tokens",
            "KV tokens kvgate's requests on the node are expected to hold at most (with the "
            "growth still to come).", labels=labels),
        "foreign": GaugeMetricFamily(
            "kvgate_backend_kv_foreign_tokens",
            "KV tokens the node reported that kvgate did not admit.", labels=labels),
        "headroom": GaugeMetricFamily(
            "kvgate_backend_kv_headroom_tokens",
            "KV tokens left on the node for a new request (absent before its first report).",
            labels=labels),
        "capacity": GaugeMetricFamily(
            "kvgate_backend_kv_capacity_tokens",
            "The node's KV capacity in tokens, configured or reported.", labels=labels),
        "pickable": GaugeMetricFamily(
            "kvgate_backend_pickable",
            "1 when the node may be picked (fresh report, answering), 0 when pending, stale "
            "or down.", labels=labels),
        "picks": CounterMetricFamily(
            "kvgate_backend_picks", "Requests kvgate sent to the node.", labels=labels),
        "prompt": CounterMetricFamily(
            "kvgate_backend_prompt_tokens",
            "Prompt tokens of the requests kvgate sent to the node.", labels=labels),
        "credit": CounterMetricFamily(
            "kvgate_backend_prefix_credit_tokens",
            "Of those, the tokens shared with kvgate's requests running there when sent, "
            "counted once (picking.shared_prefix): kvgate's estimate of the node's prefix "
            "cache hits, beside kvgate_backend_prefix_cache_hit_tokens.", labels=labels),
        "affinity": CounterMetricFamily(
            "kvgate_backend_prefix_affinity_picks",
            "Requests kvgate sent to the node for the prompt prefix its requests there share, "
            "where another node had more room.", labels=labels),
        "passed": CounterMetricFamily(
            "kvgate_backend_passed_over",
            "Times the node was not picked for a request, by reason.", labels=[*labels, "reason"]),
    }


def _add_nodes(families: dict[str, GaugeMetricFamily | CounterMetricFamily], pool: str,
               nodes: tuple[Any, ...]) -> None:
    from extproc.admission.node import PassedOver  # the core's enum of reasons
    for n in nodes:
        key = [pool, n.name]
        families["inflight"].add_metric(key, n.inflight_tokens)
        families["held"].add_metric(key, n.held_tokens)
        families["shared"].add_metric(key, n.shared_tokens)
        families["foreign"].add_metric(key, n.foreign_tokens)
        if n.headroom_tokens is not None:
            families["headroom"].add_metric(key, n.headroom_tokens)
        if n.capacity_tokens is not None:
            families["capacity"].add_metric(key, n.capacity_tokens)
        families["pickable"].add_metric(key, 1.0 if n.state == "up" else 0.0)
        families["picks"].add_metric(key, n.picks)
        families["affinity"].add_metric(key, n.affinity_picks)
        families["prompt"].add_metric(key, n.prompt_tokens)
        families["credit"].add_metric(key, n.credit_tokens)
        for reason in PassedOver:
            families["passed"].add_metric([*key, reason.value], n.passed_over.get(reason.value, 0))


def _version() -> str:
    """_version is the installed kvgate distribution's version, or "unknown" from a bare checkout."""
    try:
        return importlib.metadata.version("kvgate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _Tally:
    """_Tally is a labelled Prometheus counter (``name``_total, and ``name``_created as
    prometheus_client writes them) kept as a count per label tuple, exposed when collected.

    Two are counted on every request: incrementing a prometheus_client child costs three
    Python calls and a lock (~6k instructions under callgrind), a dict's get and set a
    sixth of that. Counted on the event loop's thread, where /metrics is served too.
    """

    __slots__ = ("name", "documentation", "labelnames", "counts", "created")

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.counts: dict[tuple[str, ...], int] = {}
        self.created: dict[tuple[str, ...], float] = {}  # unix time of each series' first count

    def zero(self, key: tuple[str, ...]) -> None:
        """zero lists the series ``key`` (its label values) at 0 if it is not listed yet."""
        if key not in self.counts:
            self.counts[key] = 0
            self.created[key] = time.time()

    def inc(self, key: tuple[str, ...]) -> None:
        """inc counts one event of the series ``key``."""
        counts = self.counts
        n = counts.get(key)
        if n is None:
            self.zero(key)
            n = 0
        counts[key] = n + 1

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        created = self.created
        for key, n in list(self.counts.items()):
            family.add_metric(key, float(n), created=created[key])
        yield family


class _Timings:
    """_Timings is a Prometheus histogram with one label (``name``_bucket, _count, _sum and
    _created, as prometheus_client writes them) kept as counts per bucket, exposed when
    collected: observing through a prometheus_client child costs four Python calls and
    three locks, on every request; a bisection and two additions cost a fraction of that.
    """

    __slots__ = ("name", "documentation", "label", "bounds", "series")

    def __init__(self, name: str, documentation: str, label: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.label = label
        self.bounds = tuple(bounds)
        # label value -> [counts by bucket (the last: above every bound), sum, created]
        self.series: dict[str, list[Any]] = {}

    def observe(self, value: str, seconds: float) -> None:
        """observe records one ``seconds`` in the series of label ``value``."""
        series = self.series.get(value)
        if series is None:
            series = self.series[value] = [[0] * (len(self.bounds) + 1), 0.0, time.time()]
        series[0][bisect.bisect_left(self.bounds, seconds)] += 1  # le: at most the bound
        series[1] += seconds

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=[self.label])

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for value, (counts, total, created) in list(self.series.items()):
            family.add_metric([value], list(zip(les, accumulate(counts))), total)
            family.samples.append(Sample(f"{self.name}_created", {self.label: value}, created))
        yield family


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
        ProcessCollector(registry=r)  # process_*: CPU, memory, open files, start time
        self.build_info = Gauge("kvgate_build_info", "Always 1; the labels say which kvgate runs.",
                                ["version", "python"], registry=r)
        self.build_info.labels(_version(), platform.python_version()).set(1)
        self.requests = _Tally("kvgate_requests", "Admission decisions on LLM requests, by outcome.",
                               ("pool", "class", "outcome"))
        self.releases = _Tally("kvgate_releases", "Leases released, by how the request ended.",
                               ("pool", "cause"))
        r.register(self.requests)
        r.register(self.releases)
        self.decision = _Timings("kvgate_decision_seconds",
                                 "Time from the request body's arrival to the admission answer (seconds).",
                                 "pool", DECISION_BUCKETS)
        r.register(self.decision)
        self._request_path_series(r)
        self._backend_series(r)
        self._store_series(r)
        self._store_modes: set[str] = set()
        self._shared_nodes: dict[str, set[str]] = {}
        # One child a result, looked up once: the picker-log file counts thousands of
        # periodic entries a second, and ``labels`` costs more than the rest of the count.
        self._log_children = {result: self.access_log_entries.labels(result)
                              for result in ACCESS_LOG_RESULTS}
        # The same for counts met on every request of some files (one a final log entry,
        # one a request without the tenant header), made at the first count.
        self._usage_children: dict[str, Any] = {}
        self._unseen_children: dict[str, Any] = {}
        self._source: SnapshotSource | None = None
        self._classes: Sequence[str] = ()
        self.registry.register(_AdmissionCollector(lambda: self._source, lambda: self._classes))
        self._kv_events: KvEventViews | None = None
        self.registry.register(_KvEventsCollector(lambda: self._kv_events))
        self.ready.set(0)

    def _request_path_series(self, r: CollectorRegistry) -> None:
        """_request_path_series registers the series of the request path, the process's
        lifecycle (ready, reloads) and the access log."""
        self.route_metadata_errors = Counter(
            "kvgate_route_metadata_errors_total",
            "Per-route kvgate metadata entries that were unknown or invalid and were ignored.",
            ["key"], registry=r)
        self.overrides_ignored = Counter(
            "kvgate_envoy_override_ignored_total",
            "Waiting requests whose ext_proc stream Envoy reset at its base message_timeout: "
            "the override asked for was above Envoy's max_message_timeout (each got a 504).",
            ["class"], registry=r)
        self.tenant_header_unseen = Counter(
            "kvgate_tenant_header_unseen_total",
            "Requests without the configured tenant header (and without a tenant's API key) "
            "while tenants are configured that only that header can name; with reason "
            "other_header, Envoy sent another request header kvgate does not read.",
            ["reason"], registry=r)
        self.served_unknown = Counter(
            "kvgate_served_unknown_endpoint_total",
            "Responses the proxy says an endpoint that is no node of the pool served (endpoint "
            "picker protocol): the request's KV stays charged to the node kvgate picked.",
            ["pool"], registry=r)
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
            "Envoy access log entries received: released a parked request, told the cause "
            "of a stream's end, came after a complete stream's end, had no lease (refused, "
            "passed through), or named a lease known nowhere here; periodic entries of "
            "streams in flight: progress applied, progress_invalid (a count that is not one, "
            "ignored), periodic (no parked request); malformed: an entry that does not parse, or "
            "a batch whose framing is broken (one for the batch), refused.",
            ["result"], registry=r)
        self.logged_usage_counts = Counter(
            "kvgate_logged_usage_total",
            "Completion counts brought by the access log's usage filter (deploy/envoy-access-log.yaml): "
            "reported (settled with it), invalid (not a whole number in [0, 2^40): settled as "
            "without usage), none (no usage in the response).",
            ["result"], registry=r)

    def _backend_series(self, r: CollectorRegistry) -> None:
        """_backend_series registers the scraper observer's series: what each backend reported."""
        self.backend_kv = Gauge("kvgate_backend_kv_cache_usage_ratio",
                                "KV-cache usage a backend last reported (ratio 0..1).",
                                ["pool", "backend"], registry=r)
        self.backend_waiting = Gauge("kvgate_backend_requests_waiting",
                                     "Requests queued on a backend, as last reported.",
                                     ["pool", "backend"], registry=r)
        self.backend_prefix_hits = Gauge(
            "kvgate_backend_prefix_cache_hit_tokens",
            "The backend's own prefix cache hits (tokens; vLLM prefix_cache_hits_total), as last "
            "reported: rate() it beside kvgate_backend_prefix_credit_tokens_total.",
            ["pool", "backend"], registry=r)
        self.backend_prefix_queries = Gauge(
            "kvgate_backend_prefix_cache_query_tokens",
            "The backend's own prefix cache queries (tokens; vLLM prefix_cache_queries_total), as "
            "last reported.", ["pool", "backend"], registry=r)
        self.backend_up = Gauge("kvgate_backend_up", "1 when the backend's last scrape succeeded.",
                                ["pool", "backend"], registry=r)
        self.scrape_errors = Counter("kvgate_backend_scrape_errors_total",
                                     "Failed scrapes of backend metrics, by reason.",
                                     ["pool", "backend", "reason"], registry=r)
        self.scrape_seconds = Histogram("kvgate_backend_scrape_seconds",
                                        "Duration of one backend metrics scrape (seconds).",
                                        labelnames=["pool"], buckets=SCRAPE_BUCKETS, registry=r)
        self.pool_stale_gauge = Gauge("kvgate_pool_signals_stale",
                                      "1 while the pool's backend signals are missing or too old.",
                                      ["pool"], registry=r)

    def _store_series(self, r: CollectorRegistry) -> None:
        """_store_series registers the shared store's (Redis) observer series."""
        self.store_mode_gauge = Gauge("kvgate_store_mode",
                                      "1 for where admissions are decided now (shared, local_share, "
                                      "fail_closed), 0 for the other modes seen.", ["mode"], registry=r)
        self.store_mode_since = Gauge("kvgate_store_mode_since_seconds",
                                      "Unix time at which the shared store entered its current mode.",
                                      registry=r)
        self.store_errors = Counter("kvgate_store_errors_total",
                                    "Failed round trips to the shared store, by reason.", ["reason"],
                                    registry=r)
        self.shared_node_held = Gauge("kvgate_shared_node_held_tokens",
                                      "KV tokens every replica's leases hold on each node, as the shared "
                                      "ledger (Redis) said at this replica's last refresh.",
                                      ["pool", "node"], registry=r)

    def attach(self, source: SnapshotSource, classes: Sequence[str]) -> None:
        """attach makes the gauges read ``source`` (the admission core) at scrape time.

        ``classes`` are the configured class names, listed at 0 when idle so that
        dashboards see every series from the start.
        """
        self._source = source
        self._classes = tuple(classes)
        self._zero_series()

    def attach_kv_events(self, source: KvEventViews | None) -> None:
        """attach_kv_events makes the KV events series read ``source`` at scrape time (None: none)."""
        self._kv_events = source

    def set_classes(self, classes: Sequence[str]) -> None:
        """set_classes updates the configured class names after a reload."""
        self._classes = tuple(classes)
        self._zero_series()

    def _zero_series(self) -> None:
        """_zero_series creates every labelled counter series whose label values are known
        (configured pools and classes, outcome, cause and reason enums) at 0, so that rates
        and alerts see a series before its first event rather than none."""
        pools = self._source.pools if self._source is not None else ()
        for pool in pools:
            for cls in self._classes:
                for outcome in OUTCOMES:
                    self.requests.zero((pool, cls, outcome))
            for cause in CAUSES:
                self.releases.zero((pool, cause))
        for cls in self._classes:
            self.overrides_ignored.labels(cls)
        for reason in STORE_ERROR_REASONS:
            self.store_errors.labels(reason)
        for result in ACCESS_LOG_RESULTS:
            self.access_log_entries.labels(result)
        for result in LOGGED_USAGE_RESULTS:
            self.logged_usage_counts.labels(result)
        for reason in TENANT_HEADER_UNSEEN_REASONS:
            self.tenant_header_unseen.labels(reason)

    # --- hot path ----------------------------------------------------------------

    def request(self, pool: str, class_name: str, outcome: str) -> None:
        """request counts one admission decision (``outcome`` is one of OUTCOMES)."""
        self.requests.inc((pool, class_name, outcome))

    def release(self, pool: str, cause: str) -> None:
        """release counts one released lease (``cause`` is one of CAUSES)."""
        self.releases.inc((pool, cause))

    def decision_time(self, pool: str, seconds: float) -> None:
        """decision_time records how long one admission decision of ``pool`` took (seconds)."""
        self.decision.observe(pool, seconds)

    def access_log_entry(self, result: str) -> None:
        """access_log_entry counts one entry of Envoy's access log (``result`` is one of
        ACCESS_LOG_RESULTS)."""
        self._log_children[result].inc()

    def logged_usage(self, result: str) -> None:
        """logged_usage counts one completion count read from an access log entry (``result``
        one of usage_log.RESULTS)."""
        child = self._usage_children.get(result)
        if child is None:
            child = self._usage_children[result] = self.logged_usage_counts.labels(result)
        child.inc()

    def header_unseen(self, why: str) -> None:
        """header_unseen counts one request whose tenant header was not where kvgate reads
        it (``why``: absent, other_header)."""
        child = self._unseen_children.get(why)
        if child is None:
            child = self._unseen_children[why] = self.tenant_header_unseen.labels(why)
        child.inc()

    def override_ignored(self, class_name: str) -> None:
        """override_ignored counts one waiting request cut at Envoy's base message timeout."""
        self.overrides_ignored.labels(class_name).inc()

    def served_unknown_endpoint(self, pool: str) -> None:
        """served_unknown_endpoint counts one response served by an endpoint no node of ``pool`` has."""
        self.served_unknown.labels(pool).inc()

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
        self.scrape_seconds.labels(pool).observe(seconds)
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

    def prefix_cache(self, pool: str, backend: str, hits: int, queries: int) -> None:
        """prefix_cache records a backend's own prefix cache counters (tokens), as reported."""
        self.backend_prefix_hits.labels(pool, backend).set(hits)
        self.backend_prefix_queries.labels(pool, backend).set(queries)

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
        self.store_mode_since.set_to_current_time()
        for m in self._store_modes:
            self.store_mode_gauge.labels(m).set(1.0 if m == mode else 0.0)

    def store_nodes(self, pool: str, held: dict[str, int]) -> None:
        """store_nodes records what every replica's leases hold on each node of ``pool``; a node
        the ledger no longer names drops to 0."""
        seen = self._shared_nodes.setdefault(pool, set())
        for node in seen - held.keys():
            self.shared_node_held.labels(pool, node).set(0)
        for node, tokens in held.items():
            seen.add(node)
            self.shared_node_held.labels(pool, node).set(tokens)

    # --- exposition ------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """render returns the Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
