"""Unit tests of each kind of ending (extproc.request.ending) fed its events alone, without an
exchange: each releases its lease once, with the cause its events allow, and counts that
cause once."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from envoy.config.core.v3 import base_pb2

from extproc.admission import Demand, Lease, Outcome
from extproc.request.ending import (Ending, Observed, ObservedAndLog, OnStream, OnStreamAndLog, Parked,
                                    Unread, of_mode, response_facts)
from extproc.request.profile import ReleaseMode
from tests.unit.test_exchange import Rig, response_headers_msg, sse, token_chunk


def _lease(rig: Rig, completion: int = 100) -> Lease:
    got = asyncio.run(rig.admission.acquire(Demand(pool="default", tenant="t", class_name="standard",
                                                   prompt_tokens=10, reserved_completion=completion)))
    assert isinstance(got, Lease)
    return got


def _ending(rig: Rig, kind: type[Ending], streamed: bool = True) -> Ending:
    return kind(rig.gate, "default", _lease(rig), "link-1", streamed, False)


def _released(rig: Rig) -> dict[str, float]:
    return {cause.value: rig.count("kvgate_releases_total", cause=cause.value) for cause in Outcome
            if rig.count("kvgate_releases_total", cause=cause.value)}


def test_every_mode_has_its_kind() -> None:
    kinds = {mode: of_mode(mode) for mode in ReleaseMode}
    assert len(set(kinds.values())) == len(ReleaseMode)
    assert all(kind.mode is mode for mode, kind in kinds.items())


def test_on_stream_releases_at_the_responses_end_once() -> None:
    rig = Rig()
    ending = _ending(rig, OnStream)
    ending.response_headers(200, "text/event-stream", False)
    ending.response_chunk(sse(token_chunk(0), token_chunk(1), done=False), False)
    assert ending.outcome is None and rig.inflight() == 1
    ending.response_chunk(b"", True)
    assert ending.outcome is Outcome.COMPLETED and rig.inflight() == 0
    assert ending.finish(gave_up=True) is None  # released once: later events change nothing
    assert _released(rig) == {"completed": 1}


def test_on_stream_cut_short_charges_the_chunks_delivered() -> None:
    rig = Rig()
    ending = _ending(rig, OnStream)
    ending.response_headers(200, "text/event-stream", False)
    ending.response_chunk(sse(token_chunk(0), token_chunk(1), done=False), False)
    assert ending.finish() is Outcome.CLIENT_DISCONNECT
    assert ending.lease.outcome is Outcome.CLIENT_DISCONNECT and _released(rig) == {"client_disconnect": 1}


@pytest.mark.parametrize(("cut_by_upstream", "cause"), [(True, Outcome.UPSTREAM_ERROR),
                                                        (False, Outcome.CLIENT_DISCONNECT)])
def test_on_stream_and_log_counts_a_cut_short_stream_when_its_entry_tells(
        cut_by_upstream: bool, cause: Outcome) -> None:
    rig = Rig()
    ending = _ending(rig, OnStreamAndLog)
    assert isinstance(ending, OnStreamAndLog)
    ending.response_headers(200, "text/event-stream", False)
    assert ending.finish() is Outcome.CLIENT_DISCONNECT  # released at once
    assert rig.inflight() == 0 and ending.cause_pending and _released(rig) == {}
    assert ending.told(cut_by_upstream) is cause
    assert ending.outcome is cause and ending.lease.outcome is cause
    assert ending.told(not cut_by_upstream) is None  # counted once
    assert _released(rig) == {cause.value: 1}


def test_on_stream_and_log_told_before_its_release_uses_it() -> None:
    rig = Rig()
    ending = _ending(rig, OnStreamAndLog)
    assert isinstance(ending, OnStreamAndLog)
    assert ending.told(True) is None
    assert ending.finish() is Outcome.UPSTREAM_ERROR and not ending.cause_pending
    assert _released(rig) == {"upstream_error": 1}


@pytest.mark.parametrize(("headers", "cause"), [(True, Outcome.ENDED), (False, Outcome.CLIENT_DISCONNECT)])
def test_unread_is_ended_after_its_headers_and_cut_short_before(headers: bool, cause: Outcome) -> None:
    rig = Rig()
    ending = _ending(rig, Unread)
    if headers:
        assert ending.response_headers(200, "text/event-stream", True) is False
        assert ending.outcome is None  # no body follows; its stream's end releases it
    assert ending.finish() is cause
    assert _released(rig) == {cause.value: 1}


def test_observed_follows_only_the_observing_streams_headers() -> None:
    rig = Rig()
    ending = _ending(rig, Observed, streamed=False)
    assert isinstance(ending, Observed)
    ending.response_headers(200, "application/json", False)  # the admission stream's: not followed
    assert ending.tracker is None
    ending.observed_headers(200, "application/json", False)
    usage = {"usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}
    ending.response_chunk(orjson.dumps({"choices": [], **usage}), True)
    assert ending.outcome is Outcome.COMPLETED and _released(rig) == {"completed": 1}


def test_observed_and_log_waits_for_its_cause() -> None:
    rig = Rig()
    ending = _ending(rig, ObservedAndLog)
    assert isinstance(ending, ObservedAndLog)
    assert ending.finish() is Outcome.CLIENT_DISCONNECT and ending.cause_pending
    assert ending.told(True) is Outcome.UPSTREAM_ERROR and _released(rig) == {"upstream_error": 1}


def test_parked_is_ended_by_its_entry_and_only_by_it() -> None:
    rig = Rig()
    ending = _ending(rig, Parked)
    assert isinstance(ending, Parked)
    assert ending.response_headers(200, "text/event-stream", True) is False and ending.outcome is None
    assert ending.progressed(4, None) and ending.outcome is None  # no node: nothing to tell
    assert ending.ended_by_log(200, cut_short=False) is Outcome.COMPLETED
    assert ending.ended_by_log(200, cut_short=True) is None
    assert _released(rig) == {"completed": 1}


def test_parked_cut_by_the_upstream_is_an_upstream_error() -> None:
    rig = Rig()
    ending = _ending(rig, Parked)
    assert isinstance(ending, Parked)
    assert ending.ended_by_log(200, cut_short=True, upstream_failed=True) is Outcome.UPSTREAM_ERROR


def test_response_facts_reads_status_and_type() -> None:
    assert response_facts(response_headers_msg(503, "text/event-stream").headers.headers) == (
        503, "text/event-stream")
    assert response_facts([]) == (0, "")


def test_response_facts_reads_the_first_of_each() -> None:
    entries = [base_pb2.HeaderValue(key=k, raw_value=v) for k, v in (
        ("content-type", b"text/event-stream"), ("x-a", b"1"), (":status", b"200"),
        ("content-type", b"application/json"), (":status", b"500"))]
    assert response_facts(entries) == (200, "text/event-stream")
    assert response_facts(entries[2:]) == (200, "application/json")
    assert response_facts([base_pb2.HeaderValue(key=":status", raw_value=b"x2")]) == (0, "")
