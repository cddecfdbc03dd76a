"""Unit tests of endings: the release mode each Envoy shape gives an admitted request, the
cause and charge table the endings apply, and the registry that holds the
requests whose end comes from elsewhere than their own stream."""

from __future__ import annotations

import asyncio

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.request import ending as endings
from extproc.admission import Outcome
from extproc.request.registry import CAUSE_WAIT_S, Endings
from kvgate_testkit.stream import Stream
from extproc.request.causes import cause_of, charged_completion
from extproc.request.profile import ReleaseMode, RouteRelease
from tests.unit.test_exchange import (BASE_CONFIG, Rig, body_msg, chat, headers_msg,
                                      response_headers_msg, route_metadata)
from tests.unit.test_access_log import entry
from tests.unit.test_exchange_attributes import attrs

S, A, L, U = RouteRelease.STREAM, RouteRelease.ACCESS_LOG, RouteRelease.STREAM_AND_LOG, RouteRelease.UNREAD


@pytest.mark.parametrize(("response_sent", "route", "duplex", "mode"), [
    (True, None, False, ReleaseMode.STREAM),
    (True, S, False, ReleaseMode.STREAM),
    (True, A, False, ReleaseMode.STREAM),  # access_log needs response body NONE
    (True, L, False, ReleaseMode.STREAM_AND_LOG),
    (True, L, True, ReleaseMode.STREAM),  # a duplex answer carries no link yet
    (False, None, False, ReleaseMode.OBSERVED),
    (False, S, False, ReleaseMode.OBSERVED),
    (False, L, False, ReleaseMode.OBSERVED_AND_LOG),
    (False, A, False, ReleaseMode.ACCESS_LOG),
    (False, A, True, ReleaseMode.ACCESS_LOG),
    (False, U, False, ReleaseMode.UNREAD),
    (True, U, False, ReleaseMode.STREAM),  # unread needs response body NONE
])
def test_choose_names_one_mode_per_protocol_and_route(
        response_sent: bool, route: RouteRelease | None, duplex: bool, mode: ReleaseMode) -> None:
    assert ReleaseMode.choose(response_sent, route, duplex) is mode


def _protocol(response_body: int, request_body: int = pm.ProcessingMode.BUFFERED) -> pb.ProtocolConfiguration:
    return pb.ProtocolConfiguration(request_body_mode=request_body, response_body_mode=response_body)


@pytest.mark.parametrize(("release", "response_body", "mode"), [
    ("stream_and_log", pm.ProcessingMode.STREAMED, ReleaseMode.STREAM_AND_LOG),  # envoy.yaml
    ("stream_and_log", pm.ProcessingMode.NONE, ReleaseMode.OBSERVED_AND_LOG),  # envoy-observe
    ("access_log", pm.ProcessingMode.NONE, ReleaseMode.ACCESS_LOG),  # envoy-access-log
    ("unread", pm.ProcessingMode.NONE, ReleaseMode.UNREAD),  # envoy-reservation
    (None, pm.ProcessingMode.NONE, ReleaseMode.OBSERVED),  # an operator's file without the key
])
def test_a_request_names_its_mode_at_admission(release: str | None, response_body: int,
                                                 mode: ReleaseMode) -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    meta = route_metadata(pool="default", **({"release": release} if release else {}))
    asyncio.run(ex.request_body(body_msg(chat(max_tokens=20)), None, attrs(), meta,
                                _protocol(response_body)))
    assert ex.ending.mode is mode
    assert (ex.ending.link is not None) is (mode is not ReleaseMode.STREAM)
    ex.response_headers(response_headers_msg())
    assert ex.ending.mode is mode  # named once: the response's headers never rename it


def test_the_inference_pool_shape_is_released_by_its_stream() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    duplex = _protocol(pm.ProcessingMode.FULL_DUPLEX_STREAMED, pm.ProcessingMode.FULL_DUPLEX_STREAMED)
    meta = route_metadata(pool="default", release="stream_and_log")
    assert ex.request_headers(headers_msg(), meta, duplex) is None  # answered with the body
    asyncio.run(ex.request_body(body_msg(chat(max_tokens=20)), None, None, meta))
    assert ex.ending.mode is ReleaseMode.STREAM and ex.ending.link is None


@pytest.mark.parametrize(("headers", "cause"), [(True, Outcome.ENDED), (False, Outcome.CLIENT_DISCONNECT)])
def test_an_unread_request_ends_by_its_stream_with_the_cause_its_headers_allow(
        headers: bool, cause: Outcome) -> None:
    """deploy/envoy-reservation.yaml: a stream that ends after the response headers ends a
    response kvgate never reads (``ended``); one that ends before them was cut short."""
    rig = Rig()
    ex = Stream(rig.gate)
    asyncio.run(ex.request_body(body_msg(chat(max_tokens=20)), None, attrs(),
                                route_metadata(pool="default", release="unread"),
                                _protocol(pm.ProcessingMode.NONE)))
    if headers:
        ex.response_headers(response_headers_msg())
    assert ex.finish() is cause and rig.inflight() == 0


@pytest.mark.parametrize(("mode", "facts", "cause"), [
    (ReleaseMode.STREAM, {"upstream_error": True, "response_done": True}, Outcome.UPSTREAM_ERROR),
    (ReleaseMode.STREAM, {"response_done": True, "gave_up": True}, Outcome.COMPLETED),
    (ReleaseMode.STREAM, {"gave_up": True}, Outcome.TIMEOUT),
    (ReleaseMode.UNREAD, {"gave_up": True}, Outcome.TIMEOUT),
    (ReleaseMode.UNREAD, {}, Outcome.ENDED),
    (ReleaseMode.UNREAD, {"cut_by_upstream": True}, Outcome.ENDED),
    (ReleaseMode.STREAM_AND_LOG, {"cut_by_upstream": True}, Outcome.UPSTREAM_ERROR),
    (ReleaseMode.STREAM_AND_LOG, {"cut_by_upstream": False}, Outcome.CLIENT_DISCONNECT),
    (ReleaseMode.OBSERVED, {}, Outcome.CLIENT_DISCONNECT),
    (ReleaseMode.ACCESS_LOG, {}, Outcome.CLIENT_DISCONNECT),
])
def test_the_cause_table(mode: ReleaseMode, facts: dict[str, bool], cause: Outcome) -> None:
    seen = {"upstream_error": False, "response_done": False, "gave_up": False,
            "cut_by_upstream": None, **facts}
    assert cause_of(mode, **seen) is cause


def test_a_response_never_seen_is_charged_its_whole_reservation_only_off_the_stream() -> None:
    cut = Outcome.CLIENT_DISCONNECT
    for mode in (ReleaseMode.OBSERVED, ReleaseMode.OBSERVED_AND_LOG, ReleaseMode.UNREAD,
                 ReleaseMode.ACCESS_LOG):
        assert charged_completion(mode, cut, None, True, None) is None
    # On the stream, a streamed request cut before its response began generated nothing.
    assert charged_completion(ReleaseMode.STREAM, cut, None, True, None) == 0
    assert charged_completion(ReleaseMode.STREAM, Outcome.COMPLETED, None, True, None) is None


def test_the_registry_holds_each_mode_where_its_end_comes_from() -> None:
    rig = Rig({"pools": {"default": {**BASE_CONFIG["pools"]["default"], "max_concurrency": 4}}})
    changed: list[int] = []
    reg = Endings(rig.clock, rig.metrics, lambda: changed.append(1))
    admitted, handed_over = {}, {}
    for release, response_body in (("access_log", pm.ProcessingMode.NONE),
                                   ("stream_and_log", pm.ProcessingMode.NONE),
                                   ("stream_and_log", pm.ProcessingMode.STREAMED),
                                   ("stream", pm.ProcessingMode.STREAMED)):
        ex = Stream(rig.gate)
        asyncio.run(ex.request_body(body_msg(chat(max_tokens=20)), None, attrs(),
                                    route_metadata(pool="default", release=release),
                                    _protocol(response_body)))
        assert ex.ending is not None
        handed_over[ex.ending.mode] = reg.admitted(ex.ending)
        admitted[ex.ending.mode] = ex.ending
    parked, observed = admitted[ReleaseMode.ACCESS_LOG], admitted[ReleaseMode.OBSERVED_AND_LOG]
    logged = admitted[ReleaseMode.STREAM_AND_LOG]
    assert set(reg.parked) == {parked.link}
    assert set(reg.links) == {observed.link}
    assert set(reg.causes) == {observed.link, logged.link}
    assert handed_over == {ReleaseMode.ACCESS_LOG: True, ReleaseMode.OBSERVED_AND_LOG: False,
                           ReleaseMode.STREAM_AND_LOG: False, ReleaseMode.STREAM: False}
    assert reg.stream_ended(observed, False) is reg.links[observed.link]  # settled later
    assert reg.stream_ended(admitted[ReleaseMode.STREAM], False) is None  # released now
    assert admitted[ReleaseMode.STREAM].outcome is Outcome.CLIENT_DISCONNECT
    assert reg.give_up() == 1 and changed == [] and not reg.parked
    assert parked.outcome is Outcome.TIMEOUT
    assert reg.stream_ended(observed, False) is None and observed.outcome is Outcome.TIMEOUT
    assert rig.inflight() == 1  # the stream_and_log request's stream has not ended yet


def test_a_parked_request_whose_stream_ended_before_its_answer_was_written_waits_for_its_entry(
        ) -> None:
    # A fast JSON answer can end the request, and Envoy its ext_proc stream, before kvgate's
    # write of the admitted body answer returns: the entry still tells the end and the usage.
    rig = Rig({"pools": {"default": {**BASE_CONFIG["pools"]["default"], "max_concurrency": 4}}})
    reg = Endings(rig.clock, rig.metrics, lambda: None)
    told, lost = [], []
    for ex_list in (told, lost):
        ex = Stream(rig.gate)
        asyncio.run(ex.request_body(body_msg(chat(max_tokens=20)), None, attrs(),
                                    route_metadata(pool="default", release="access_log"),
                                    _protocol(pm.ProcessingMode.NONE)))
        reg.admitted(ex.ending)
        ex_list.append(ex)
    (a,), (b,) = told, lost
    at = rig.clock.now()
    assert reg.stream_ended(a.ending, False) is None and reg.stream_ended(b.ending, False) is None
    assert rig.inflight() == 2 and a.ending.outcome is None and b.ending.outcome is None
    assert reg.logged(entry(a.ending.link)) == "released" and a.ending.outcome is Outcome.COMPLETED
    # No entry names b: its answer never reached Envoy; held no longer than CAUSE_WAIT_S.
    assert reg.sweep_parked(at + CAUSE_WAIT_S - 0.01, 900.0) == 0 and b.ending.outcome is None
    assert reg.sweep_parked(at + CAUSE_WAIT_S, 900.0) == 1
    assert b.ending.outcome is Outcome.CLIENT_DISCONNECT
    assert not reg.parked and not reg.unsure and rig.inflight() == 0


def test_the_module_doc_names_every_mode() -> None:
    doc = endings.__doc__ or ""
    for mode in ReleaseMode:
        assert mode.name in doc, mode
