"""Metrics conventions: process metrics and kvgate_build_info, and labelled counters that exist
at zero from the start for every known label value (configured pools and classes, enums)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from extproc.admission import Admission
from extproc.clock import ManualClock
from extproc.configparse import parse_config
from extproc.metrics import (ACCESS_LOG_RESULTS, CAUSES, LOGGED_USAGE_RESULTS, OUTCOMES, STORE_ERROR_REASONS,
                             TENANT_HEADER_UNSEEN_REASONS, Metrics)
from kvgate_testkit.admission import acquire_now

CONFIG = {"pools": {"a": {"max_concurrency": 2}, "b": {"max_concurrency": 2}}, "default_pool": "a",
          "tenants": {"classes": {"standard": {}, "gold": {"priority": 10}}}}


def samples(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    from prometheus_client import generate_latest
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def attached(config: dict) -> Metrics:
    cfg = parse_config(config)
    metrics = Metrics(CollectorRegistry())
    metrics.attach(Admission(cfg, ManualClock(1000.0)), tuple(cfg.tenants.classes))
    return metrics


def test_process_metrics_and_build_info_are_exported() -> None:
    got = samples(Metrics(CollectorRegistry()))
    names = {name for name, _ in got}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds"} <= names
    (info,) = [(labels, v) for (name, labels), v in got.items() if name == "kvgate_build_info"]
    assert info[1] == 1.0 and dict(info[0])["version"] not in ("", None)


def test_every_known_counter_series_is_there_at_zero_before_any_event() -> None:
    got = samples(attached(CONFIG))
    for pool in ("a", "b"):
        for cls in ("standard", "gold"):
            for outcome in OUTCOMES:
                key = ("kvgate_requests_total", frozenset({"pool": pool, "class": cls, "outcome": outcome}.items()))
                assert got.get(key) == 0.0, key
        for cause in CAUSES:
            assert got[("kvgate_releases_total", frozenset({"pool": pool, "cause": cause}.items()))] == 0.0
    for reason in STORE_ERROR_REASONS:
        assert got[("kvgate_store_errors_total", frozenset({"reason": reason}.items()))] == 0.0
    for result in ACCESS_LOG_RESULTS:
        assert got[("kvgate_access_log_entries_total", frozenset({"result": result}.items()))] == 0.0
    for result in LOGGED_USAGE_RESULTS:
        assert got[("kvgate_logged_usage_total", frozenset({"result": result}.items()))] == 0.0
    for cls in ("standard", "gold"):
        assert got[("kvgate_envoy_override_ignored_total", frozenset({"class": cls}.items()))] == 0.0
    for reason in TENANT_HEADER_UNSEEN_REASONS:
        assert got[("kvgate_tenant_header_unseen_total", frozenset({"reason": reason}.items()))] == 0.0


def test_the_refusals_of_identity_and_paths_are_known_outcomes() -> None:
    """A client without a valid key and a path kvgate does not know are refusals of their own,
    so the loop above gives each its series at zero."""
    assert {"rejected_unauthenticated", "rejected_path"} <= set(OUTCOMES)


def test_a_class_added_by_a_reload_gets_its_series_and_counting_still_adds_up() -> None:
    metrics = attached(CONFIG)
    metrics.set_classes(("standard", "gold", "batch"))
    metrics.request("a", "batch", "admitted")
    metrics.request("a", "batch", "admitted")
    got = samples(metrics)
    assert got[("kvgate_requests_total", frozenset({"pool": "a", "class": "batch", "outcome": "admitted"}.items()))] == 2.0
    assert got[("kvgate_requests_total", frozenset({"pool": "b", "class": "batch", "outcome": "rejected_tpm"}.items()))] == 0.0


def test_a_nodes_prefix_hits_and_kvgates_estimate_are_exported_side_by_side() -> None:
    from extproc.admission import Demand, Lease
    from extproc.admission.types import NodeReport
    from tests.unit.admission.test_prefix_ledger import SYSTEM, chain_of
    cfg = parse_config({"pools": {"default": {
        "max_concurrency": 10,
        "backends": [{"name": "n0", "metrics_url": "http://127.0.0.1:9/m", "address": "127.0.0.1:8001",
                      "kv_capacity_tokens": 100_000}],
        "picking": {"shared_prefix": True, "growth": "worst_case", "reserve_fraction": 0.0}}}})
    clock = ManualClock(1000.0)
    adm = Admission(cfg, clock)
    metrics = Metrics(CollectorRegistry())
    metrics.attach(adm, tuple(cfg.tenants.classes))
    adm.report_node("default", "n0", NodeReport(kv_usage=0.0, capacity_tokens=100_000, at=clock.now()))
    for q in ("a", "b"):
        lease = acquire_now(adm, Demand(pool="default", tenant="t", class_name="standard", prompt_tokens=10_200,
                                       reserved_completion=800, prefix=chain_of([*SYSTEM, (q, 200)])))
        assert isinstance(lease, Lease)
    metrics.prefix_cache("default", "n0", 9_984, 20_400)
    got = samples(metrics)
    key = frozenset({"pool": "default", "backend": "n0"}.items())
    assert got[("kvgate_backend_prompt_tokens_total", key)] == 20_400
    assert got[("kvgate_backend_prefix_credit_tokens_total", key)] == 10_000 - 16
    assert got[("kvgate_backend_kv_shared_prefix_tokens", key)] == 10_000 - 16
    assert got[("kvgate_backend_prefix_cache_hit_tokens", key)] == 9_984
    assert got[("kvgate_backend_prefix_cache_query_tokens", key)] == 20_400
