"""Unit tests of the endpoint-picker-log file's access log handling without Envoy
(deploy/envoy-endpoint-picker-log.yaml): kvgate names the node on the request, its stream
ends there, and Envoy's periodic access log entries of the stream in flight tell the node's
ledger the tokens generated so far, the first token and the node that serves; only the final
entry releases. On a manual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import usage_log
from extproc.admission.types import NodeReport
from extproc.request.accesslog import AccessLogReceiver, upstream_address
from extproc.request.profile import ReleaseMode
from kvgate_testkit.stream import Stream
from extproc.service import ExtProcService
from tests.unit.test_exchange import body_msg, chat, headers_msg, route_metadata
from tests.unit.test_exchange_picking import node_of, picking_rig
from tests.unit.test_usage_log import entry as usage_entry

# What Envoy sends with the first message in this file: request headers and body, no response.
PICKER_LOG = pb.ProtocolConfiguration(request_body_mode=pm.ProcessingMode.BUFFERED,
                                      response_body_mode=pm.ProcessingMode.NONE)
PROMPT_MAX = 100
NODE_PORTS = (7000, 7001)  # the picking rig's two nodes, 10,000 KV tokens each
PERIODIC = accesslog_pb2.AccessLogType.DownstreamPeriodic


def admit(rig: Any, service: ExtProcService) -> Stream:
    """admit sends a streamed chat's headers and body as Envoy does in this file, and hands the
    request to the service's endings as the Process loop does."""
    meta = route_metadata(pool="default", release="access_log")
    meta.filter_metadata[usage_log.NAMESPACE].fields[usage_log.FILTER_KEY].number_value = 1
    ex = Stream(rig.gate, service.endings)
    assert ex.request_headers(headers_msg(), meta, PICKER_LOG) is not None
    resp = asyncio.run(ex.request_body(body_msg(chat(max_tokens=PROMPT_MAX, stream=True)), None,
                                       None, meta))
    assert ex.ending.mode is ReleaseMode.ACCESS_LOG and ex.ending.link is not None
    assert node_of(resp)[0] == ex.admitted.lease.node  # the node is named, as in the picker file
    assert ex.handed_over
    return ex


def periodic(ex: Stream, events: Any, upstream: tuple[str, int] | None = None) -> accesslog_pb2.HTTPAccessLogEntry:
    """periodic is Envoy's periodic entry of ``ex``'s stream in flight: the usage filter has
    counted ``events`` so far (None: no event yet), the upstream is ``upstream``."""
    e = usage_entry(ex.ending.link, {} if events is None else {usage_log.EVENTS_KEY: events}, cut_short=True)
    e.common_properties.access_log_type = PERIODIC
    e.response.response_code.value = 200
    if upstream is not None:
        sock = e.common_properties.upstream_remote_address.socket_address
        sock.address, sock.port_value = upstream
    return e


def receive(rig: Any, service: ExtProcService, *entries: accesslog_pb2.HTTPAccessLogEntry) -> None:
    """receive hands ``entries`` to kvgate's access log service as one message of Envoy's."""
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend(entries)

    async def stream() -> Any:
        yield message.SerializeToString()  # the raw bytes, as the server registers the method

    asyncio.run(AccessLogReceiver(service.endings, rig.metrics).StreamAccessLogs(stream(), None))


def footprints(rig: Any) -> dict[str, int]:
    return {n.address: n.inflight_tokens for n in rig.admission.nodes("default")}


def test_periodic_entries_tell_the_ledger_the_tokens_so_far_and_never_release() -> None:
    rig = picking_rig()
    service = ExtProcService(rig.gate, rig.metrics)
    ex = admit(rig, service)
    node = ex.admitted.lease.node
    prompt = footprints(rig)[node]
    for events in (None, 3, 10, 7):  # a lower count (a reordered entry) never shrinks it
        assert service.endings.logged(periodic(ex, events)) == "progress"
    assert footprints(rig)[node] == prompt + 10
    assert rig.inflight() == 1 and list(service.endings.parked) == [ex.ending.link]
    assert rig.count("kvgate_releases_total") == 0
    # The final entry releases, with the filter's count.
    final = usage_entry(ex.ending.link, {usage_log.EVENTS_KEY: 12, usage_log.COMPLETION_KEY: "12"})
    final.common_properties.access_log_type = accesslog_pb2.AccessLogType.DownstreamEnd
    assert service.endings.logged(final) == "released"
    assert rig.inflight() == 0 and footprints(rig)[node] == 0
    assert rig.count("kvgate_releases_total", cause="completed") == 1
    # A periodic entry after the end (flushed before the final one was handled) does nothing.
    assert service.endings.logged(periodic(ex, 20)) == "periodic"
    assert rig.count("kvgate_releases_total") == 1


def test_the_first_periodic_entry_with_a_token_is_the_first_token() -> None:
    """The first token puts a charge in the node's cache for the next scrape (``mark``): its
    footprint is then taken out of the node's report, not counted as foreign KV."""
    rig = picking_rig()
    service = ExtProcService(rig.gate, rig.metrics)
    ex = admit(rig, service)
    node = ex.admitted.lease.node
    name = next(n.name for n in rig.admission.nodes("default") if n.address == node)

    def foreign_after_report(mark: int) -> int:
        rig.admission.mark_nodes(mark)
        used = footprints(rig)[node] / 10_000
        rig.admission.report_node("default", name, NodeReport(kv_usage=used, capacity_tokens=None,
                                                              at=rig.clock.now(), mark=mark))
        return next(n.foreign_tokens for n in rig.admission.nodes("default") if n.address == node)

    assert service.endings.logged(periodic(ex, None)) == "progress"  # no token yet
    assert foreign_after_report(1) > 0  # not yet known to be in the cache: counted twice
    rig.clock.advance(0.25)
    assert service.endings.logged(periodic(ex, 1)) == "progress"
    assert foreign_after_report(2) == 0


@pytest.mark.parametrize("events", ["12abc", "-3", "1e3", 2.5, -1.0, float("inf"), "9" * 40])
def test_a_hostile_event_count_is_ignored_and_counted(events: Any) -> None:
    rig = picking_rig()
    service = ExtProcService(rig.gate, rig.metrics)
    ex = admit(rig, service)
    receive(rig, service, periodic(ex, 5))
    before = footprints(rig)
    receive(rig, service, periodic(ex, events))
    assert footprints(rig) == before and rig.inflight() == 1
    assert rig.count("kvgate_access_log_entries_total", result="progress") == 1
    assert rig.count("kvgate_access_log_entries_total", result="progress_invalid") == 1
    assert rig.count("kvgate_releases_total") == 0


def test_the_node_that_serves_takes_the_charge() -> None:
    rig = picking_rig()
    service = ExtProcService(rig.gate, rig.metrics)
    ex = admit(rig, service)
    picked = ex.admitted.lease.node
    other = next(f"127.0.0.1:{p}" for p in NODE_PORTS if f"127.0.0.1:{p}" != picked)
    host, port = other.split(":")
    assert service.endings.logged(periodic(ex, 4, (host, int(port)))) == "progress"
    held = footprints(rig)
    assert held[picked] == 0 and held[other] > 0 and ex.admitted.lease.node == other
    # An address that is no node of the pool leaves the charge where it is, loudly.
    assert service.endings.logged(periodic(ex, 5, ("10.9.9.9", 1))) == "progress"
    assert footprints(rig)[other] == held[other] + 1
    assert rig.count("kvgate_served_unknown_endpoint_total") == 1


def test_periodic_entries_of_requests_not_parked_here_touch_nothing() -> None:
    rig = picking_rig()
    service = ExtProcService(rig.gate, rig.metrics)
    ex = admit(rig, service)
    before = footprints(rig)
    no_link = accesslog_pb2.HTTPAccessLogEntry()
    no_link.common_properties.access_log_type = PERIODIC
    assert service.endings.logged(no_link) == "periodic"  # a request kvgate refused, or before its answer
    stranger = periodic(ex, 50)
    stranger.common_properties.metadata.filter_metadata["kvgate"].fields["link"].string_value = "other"
    assert service.endings.logged(stranger) == "periodic"
    # The deprecated flag of older Envoys marks a periodic entry too: never a release.
    old = usage_entry(ex.ending.link, {usage_log.EVENTS_KEY: 2})
    old.common_properties.intermediate_log_entry = True
    assert service.endings.logged(old) == "progress"
    assert rig.inflight() == 1 and footprints(rig)[ex.admitted.lease.node] == before[ex.admitted.lease.node] + 2


def test_upstream_address_reads_ipv4_ipv6_and_nothing() -> None:
    e = accesslog_pb2.HTTPAccessLogEntry()
    assert upstream_address(e) is None
    sock = e.common_properties.upstream_remote_address.socket_address
    sock.address, sock.port_value = "10.0.0.7", 8000
    assert upstream_address(e) == "10.0.0.7:8000"
    sock.address = "fd00::7"
    assert upstream_address(e) == "[fd00::7]:8000"
