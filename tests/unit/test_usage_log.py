"""Unit tests of the access log's usage filter protocol (extproc/usage_log.py) without Envoy:
what kvgate asks for when the filter announces itself, and how it reads the filter's
findings, hostile ones included, into the lease's settlement (on a manual clock, so the
TPM bucket shows the exact charge). The Lua side runs in tests/e2e/test_access_log_usage.py."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc import usage_log
from extproc.request.registry import LINK_KEY
from extproc.request.profile import ReleaseMode
from kvgate_testkit.stream import Stream
from extproc.gate import METADATA_NAMESPACE
from extproc.server import ExtProcService
from tests.unit.test_access_log import NO_RESPONSE
from tests.unit.test_access_log import entry as log_entry
from tests.unit.test_exchange import Rig, body_msg, chat, route_metadata
from tests.unit.test_exchange_attributes import attrs

MAX_TOKENS = 500


def admit(rig: Rig, service: ExtProcService, *, announced: bool = True, **fields: Any) -> tuple[Stream, Any]:
    """admit admits a chat on an access-log route, handed to the service's endings as the
    Process loop hands it;
    ``announced``: the usage filter's mark is in the request's metadata."""
    meta = route_metadata(pool="default", release="access_log")
    if announced:
        meta.filter_metadata[usage_log.NAMESPACE].fields[usage_log.FILTER_KEY].number_value = 1
    ex = Stream(rig.gate, service.endings)
    resp = asyncio.run(ex.request_body(body_msg(chat(max_tokens=MAX_TOKENS, **fields)), None, attrs(),
                                       meta, NO_RESPONSE))
    assert ex.ending.link is not None and ex.ending.mode is ReleaseMode.ACCESS_LOG
    assert ex.handed_over
    return ex, resp


def entry(link: str, found: dict[str, Any] | None, *, cut_short: bool = False,
          **flags: bool) -> accesslog_pb2.HTTPAccessLogEntry:
    """entry is Envoy's log entry of a request whose usage filter wrote ``found`` (None: no
    filter on the path)."""
    e = log_entry(link, upstream_done=not cut_short, **flags)
    if found is not None:
        space = e.common_properties.metadata.filter_metadata[usage_log.NAMESPACE]
        space.update({usage_log.FILTER_KEY: 1, **found})
    return e


def tpm(rig: Rig) -> float:
    available = rig.admission.snapshot("default").tpm_available
    assert available is not None
    return available


def test_an_announced_filter_gets_stream_usage_asked_for_and_its_chunk_hidden() -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    _, resp = admit(rig, service, stream=True)
    sent = orjson.loads(resp.request_body.response.body_mutation.body)
    assert sent["stream_options"] == {"include_usage": True}
    gate = resp.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    assert gate[usage_log.STRIP_KEY].bool_value is True and LINK_KEY in gate


def test_a_client_that_asked_for_usage_keeps_its_chunk() -> None:
    rig = Rig()
    _, resp = admit(rig, ExtProcService(rig.gate, rig.metrics), stream=True,
                    stream_options={"include_usage": True})
    gate = resp.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    assert usage_log.STRIP_KEY not in gate


def test_without_the_filter_nothing_is_asked_for() -> None:
    """Nobody would hide the usage chunk from the client."""
    rig = Rig()
    _, resp = admit(rig, ExtProcService(rig.gate, rig.metrics), announced=False, stream=True)
    assert not resp.request_body.response.HasField("body_mutation")
    gate = resp.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    assert usage_log.STRIP_KEY not in gate


@pytest.mark.parametrize(("found", "cut_short", "flags", "completion", "result"), [
    ({usage_log.COMPLETION_KEY: "42", usage_log.EVENTS_KEY: 3}, False, {}, 42, "reported"),
    ({usage_log.COMPLETION_KEY: " 0 "}, False, {}, 0, "reported"),
    # cut short: the events the client got, as a response read by kvgate itself
    ({usage_log.EVENTS_KEY: 3}, True, {"downstream_connection_termination": True}, 3, "none"),
    ({}, True, {}, 0, "none"),
    # the upstream broke the stream off: the events it sent
    ({usage_log.EVENTS_KEY: 2}, True, {"upstream_remote_reset": True}, 2, "none"),
    # complete but no count: the reservation
    ({usage_log.EVENTS_KEY: 3}, False, {}, MAX_TOKENS, "none"),
])
def test_a_stream_is_settled_with_what_the_filter_saw(found: dict[str, Any], cut_short: bool,
                                                       flags: dict[str, bool], completion: int,
                                                       result: str) -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    before = tpm(rig)
    ex, _ = admit(rig, service, stream=True)
    prompt = before - tpm(rig) - MAX_TOKENS
    assert service.endings.logged(entry(ex.ending.link or "", found, cut_short=cut_short, **flags)) == "released"
    assert before - tpm(rig) == prompt + completion
    assert rig.count("kvgate_logged_usage_total", result=result) == 1


HOSTILE_COUNTS = ["-5", "1e30", '"7"', "7.5", "null", "", "99999999999999999999", "007",
                  str(1 << 40), -1.0, 2.5, float("inf"), True]
HOSTILE_EVENTS = [-1.0, float("nan"), 1e300, "3.0", False]


@pytest.mark.parametrize("found,cut_short", [
    *(({usage_log.COMPLETION_KEY: v, usage_log.EVENTS_KEY: 3}, False) for v in HOSTILE_COUNTS),
    *(({usage_log.EVENTS_KEY: v}, True) for v in HOSTILE_EVENTS)])
def test_a_hostile_count_charges_the_reservation_and_is_counted(found: dict[str, Any], cut_short: bool) -> None:
    # A completion count, or for a stream cut short the events delivered, that is no count.
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    before = tpm(rig)
    ex, _ = admit(rig, service, stream=True)
    charged = before - tpm(rig)
    service.endings.logged(entry(ex.ending.link or "", found, cut_short=cut_short))
    assert before - tpm(rig) == charged  # the reservation: nothing refunded
    assert rig.count("kvgate_logged_usage_total", result="invalid") == 1


def test_a_count_above_the_reservation_is_capped_by_the_core() -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    before = tpm(rig)
    ex, _ = admit(rig, service, stream=True)
    prompt = before - tpm(rig) - MAX_TOKENS
    service.endings.logged(entry(ex.ending.link or "", {usage_log.COMPLETION_KEY: str(1 << 39)}))
    assert before - tpm(rig) == prompt + 4096  # the pool's context window


def test_done_seen_by_the_filter_is_a_completion_even_if_the_client_closed_first() -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    ex, _ = admit(rig, service, stream=True)
    service.endings.logged(entry(ex.ending.link or "", {usage_log.DONE_KEY: 1, usage_log.COMPLETION_KEY: "3"},
                         cut_short=True, downstream_connection_termination=True))
    assert rig.count("kvgate_releases_total", cause="completed") == 1


def test_without_the_filter_the_reservation_is_charged_as_before() -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    before = tpm(rig)
    ex, _ = admit(rig, service, announced=False, stream=True)
    charged = before - tpm(rig)
    service.endings.logged(entry(ex.ending.link or "", None, cut_short=True))
    assert before - tpm(rig) == charged
    assert rig.count("kvgate_logged_usage_total") == 0


_VALUES = st.one_of(st.integers(-5, 2**41), st.floats(allow_nan=True), st.text(max_size=8),
                    st.sampled_from(["12", " 7 ", "1e3", "-1", "0x10", "", "99999999999999"]),
                    st.booleans(), st.none())


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.dictionaries(
    st.sampled_from([usage_log.FILTER_KEY, usage_log.EVENTS_KEY, usage_log.COMPLETION_KEY,
                     usage_log.DONE_KEY, "other"]), _VALUES, max_size=5)))
def test_the_periodic_read_of_the_events_agrees_with_the_whole_reading(found: dict[str, Any] | None) -> None:
    """A periodic entry reads only the events so far (``events_so_far``): what ``from_entry``
    reads of them, 0 where it reads no usage at all (nothing to progress either way)."""
    e = log_entry("k-1")
    if found is not None:
        e.common_properties.metadata.filter_metadata[usage_log.NAMESPACE].update(found)
    whole = usage_log.from_entry(e)
    assert usage_log.events_so_far(e) == (whole.events if whole is not None else 0)
