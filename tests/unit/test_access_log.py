"""Unit tests of the access-log release (deploy/envoy-access-log.yaml) without gRPC:
an admitted request parked by its link, released by an HTTPAccessLogEntry or by the TTL."""

from __future__ import annotations

import asyncio

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.request.registry import CAUSE_WAIT_S, LINK_KEY
from extproc.request.profile import ReleaseMode
from kvgate_testkit.stream import Stream
from extproc.gate import METADATA_NAMESPACE
from extproc.service import ExtProcService
from tests.unit.test_exchange import Rig, body_msg, chat, route_metadata
from kvgate_testkit import held
from tests.unit.test_exchange_attributes import attrs

NO_RESPONSE = pb.ProtocolConfiguration(request_body_mode=pm.ProcessingMode.BUFFERED,
                                       response_body_mode=pm.ProcessingMode.NONE)


def park(rig: Rig, service: ExtProcService, release: str = "access_log") -> Stream:
    """park admits a request as the Process loop does, and hands it to the service's endings
    as the loop does once it is admitted."""
    ex = Stream(rig.gate, service.endings)
    meta = route_metadata(pool="default", release=release)
    asyncio.run(ex.request_body(body_msg(chat(max_tokens=50)), None, attrs(), meta, NO_RESPONSE))
    assert ex.ending.link is not None and ex.ending.mode is ReleaseMode.ACCESS_LOG
    assert ex.handed_over
    return ex


def entry(link: str | None, status: int = 200, upstream_done: bool = True,
          **flags: bool) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    if link is not None:
        e.common_properties.metadata.filter_metadata[METADATA_NAMESPACE].fields[LINK_KEY].string_value = link
    e.response.response_code.value = status
    if upstream_done:
        e.common_properties.time_to_last_upstream_rx_byte.nanos = 5_000_000
    for name, value in flags.items():
        setattr(e.common_properties.response_flags, name, value)
    return e


@pytest.mark.parametrize(("status", "upstream_done", "flags", "cause"), [
    (200, True, {}, "completed"),
    # a client closing on the last event of a complete stream: Envoy may set the flag
    (200, True, {"downstream_connection_termination": True}, "completed"),
    (200, False, {"downstream_connection_termination": True}, "client_disconnect"),
    (200, False, {"stream_idle_timeout": True}, "client_disconnect"),
    (0, False, {}, "client_disconnect"),
    (503, False, {"upstream_connection_failure": True}, "upstream_error"),
    (503, True, {}, "upstream_error"),
])
def test_an_entry_releases_its_parked_request_with_the_cause_it_tells(
        status: int, upstream_done: bool, flags: dict, cause: str) -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    ex = park(rig, service)
    assert rig.inflight() == 1
    assert service.endings.logged(entry(ex.ending.link, status, upstream_done, **flags)) == "released"
    assert rig.inflight() == 0 and not service.endings.parked
    assert rig.count("kvgate_releases_total", cause=cause) == 1
    assert service.endings.logged(entry(ex.ending.link)) == "unmatched"  # a second entry changes nothing
    assert rig.count("kvgate_releases_total") == 1


def test_entries_without_a_lease_or_for_another_process_touch_nothing() -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    park(rig, service)
    assert service.endings.logged(entry(None)) == "no_lease"
    assert service.endings.logged(entry("not-a-link-of-this-process")) == "unmatched"
    assert rig.inflight() == 1 and len(service.endings.parked) == 1


def test_a_lost_entry_is_released_by_the_ttl_and_only_then() -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    old = park(rig, service)
    rig.clock.advance(100.0)
    young = park(rig, service)
    assert service.endings.sweep_parked(rig.clock.now(), ttl_s=100.5) == 0
    rig.clock.advance(1.0)
    assert service.endings.sweep_parked(rig.clock.now(), ttl_s=100.5) == 1
    assert list(service.endings.parked) == [young.ending.link] and rig.inflight() == 1
    assert rig.count("kvgate_releases_total", cause="timeout") == 1
    assert service.endings.logged(entry(old.ending.link)) == "unmatched"


def test_a_parked_request_whose_answer_never_got_out_is_released_after_the_cause_wait() -> None:
    # The service's own loop: Envoy reset the stream while kvgate wrote the admitted body's
    # answer, so the request may never have gone upstream and no entry may ever name it. It is
    # not handed over (kept only till the cause wait, not the parked TTL).
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)

    class Reset(held.Stream):
        async def write(self, resp: pb.ProcessingResponse) -> None:
            raise asyncio.CancelledError  # as grpc.aio's write on a stream Envoy reset

    async def stream() -> None:
        with pytest.raises(asyncio.CancelledError):
            await service.Process(None, Reset(held.messages("access-log", chat(max_tokens=50))))

    asyncio.run(stream())
    assert rig.inflight() == 1 and list(service.endings.unsure) == list(service.endings.parked)
    rig.clock.advance(CAUSE_WAIT_S)
    assert service.endings.sweep_parked(rig.clock.now(), ttl_s=900.0) == 1
    assert rig.inflight() == 0 and not service.endings.parked
    assert rig.count("kvgate_releases_total", cause="client_disconnect") == 1


def test_give_up_releases_the_parked_requests_too() -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    park(rig, service)
    park(rig, service)
    assert service.give_up() == 2
    assert rig.inflight() == 0 and not service.endings.parked


def test_a_route_without_release_access_log_is_not_parked() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    asyncio.run(ex.request_body(body_msg(chat(max_tokens=50)), None, attrs(),
                                route_metadata(pool="default"), NO_RESPONSE))
    assert ex.ending.link is not None and ex.ending.mode is ReleaseMode.OBSERVED
    bad = Stream(rig.gate)
    asyncio.run(bad.request_body(body_msg(chat(max_tokens=50)), None, attrs(),
                                 route_metadata(pool="default", release="sometimes"), NO_RESPONSE))
    assert bad.ending.mode is ReleaseMode.OBSERVED
    assert rig.count("kvgate_route_metadata_errors_total", key="release") == 1
