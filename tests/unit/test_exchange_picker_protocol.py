"""A request's stages as an InferencePool's endpoint picker: both bodies FULL_DUPLEX_STREAMED (the
headers' answer comes with the body's decision, every body byte goes back as streamed
chunks), the proxy's subset hint, the protocol's 503, and the node charge following the
endpoint that served. Nothing is held after any of it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc import picker_protocol as epp
from kvgate_testkit.stream import Stream
from tests.unit.test_exchange import (body_msg, chat, headers_msg, response_headers_msg,
                                      set_headers, sse, token_chunk)
from tests.unit.test_exchange_picking import picking_rig

N0, N1 = "127.0.0.1:7000", "127.0.0.1:7001"
DUPLEX = pb.ProtocolConfiguration(
    request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
    response_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED)


def metadata(namespace: str, key: str, value: Any) -> base_pb2.Metadata:
    md = base_pb2.Metadata()
    s = struct_pb2.Struct()
    s.update({key: value})
    md.filter_metadata[namespace].CopyFrom(s)
    return md


def hint(value: Any) -> base_pb2.Metadata:
    return metadata(epp.SUBSET_NAMESPACE, epp.SUBSET_KEY, value)


def served(address: Any) -> base_pb2.Metadata:
    return metadata(epp.LB_NAMESPACE, epp.SERVED_KEY, address)


def streamed(resp: pb.ProcessingResponse, kind: str) -> tuple[bytes, bool]:
    s = getattr(resp, kind).response.body_mutation.streamed_response
    return s.body, s.end_of_stream


async def admit(rig: Any, body: bytes, md: base_pb2.Metadata | None = None,
                parts: int = 1) -> tuple[Stream, list[pb.ProcessingResponse]]:
    """admit sends headers and ``body`` in ``parts`` chunks, as Envoy does in FULL_DUPLEX_STREAMED."""
    ex = Stream(rig.gate)
    assert ex.request_headers(headers_msg(), md, DUPLEX) is None  # owed until the body's end
    step = -(-len(body) // parts)
    for at in range(0, len(body) - step, step):
        assert await ex.request_body(body_msg(body[at:at + step], eos=False)) is None
    last = await ex.request_body(body_msg(body[(parts - 1) * step:], eos=True))
    return ex, last if isinstance(last, list) else [last]


def destination(head: pb.ProcessingResponse) -> tuple[str, str, bool]:
    common = head.request_headers.response
    md = head.dynamic_metadata.fields[epp.LB_NAMESPACE].struct_value.fields[epp.DESTINATION_KEY]
    return set_headers(common)[epp.DESTINATION_KEY], md.string_value, common.clear_route_cache


def held(rig: Any) -> dict[str, int]:
    return {n.address: n.requests for n in rig.admission.nodes("default")}


@pytest.mark.parametrize("parts", [1, 3, 7])
async def test_the_headers_answer_comes_first_then_every_body_byte_as_streamed_chunks(parts):
    rig = picking_rig(usage=(0.9, 0.1))
    body = chat("a prompt cut into parts " * 20, max_tokens=100)
    ex, answers = await admit(rig, body, parts=parts)
    head, *chunks = answers
    assert head.WhichOneof("response") == "request_headers"
    assert destination(head) == (N1, N1, True)
    sent = b"".join(streamed(c, "request_body")[0] for c in chunks)
    assert [streamed(c, "request_body")[1] for c in chunks][-1] is True
    assert json.loads(sent) == json.loads(body)  # max_tokens within the reservation: as sent
    assert held(rig) == {N0: 0, N1: 1}
    ex.finish()
    assert held(rig) == {N0: 0, N1: 0} and rig.inflight() == 0


async def test_a_replaced_body_goes_back_whole_with_its_content_length():
    rig = picking_rig()
    body = chat(max_tokens=100, stream=True)
    ex, (head, *chunks) = await admit(rig, body, parts=2)
    sent = b"".join(streamed(c, "request_body")[0] for c in chunks)
    assert json.loads(sent)["stream_options"] == {"include_usage": True}
    assert set_headers(head.request_headers.response)["content-length"] == str(len(sent))
    ex.finish()
    assert rig.inflight() == 0


def test_a_long_body_is_sent_back_in_chunks_the_protocol_allows():
    body = bytes(range(256)) * 1000  # 256,000 bytes
    chunks = epp.streamed_body("request_body", body, True)
    parts = [streamed(c, "request_body") for c in chunks]
    assert all(len(p) <= epp.CHUNK_BYTES for p, _ in parts)
    assert b"".join(p for p, _ in parts) == body
    assert [e for _, e in parts] == [False] * (len(parts) - 1) + [True]
    assert [streamed(c, "request_body") for c in epp.streamed_body("request_body", b"", True)] == [(b"", True)]


@pytest.mark.parametrize("value", [[N0], N0, f"{N0}, 10.9.9.9:1", ["127.0.0.1"]])
async def test_the_pick_stays_within_the_subset_hint(value):
    # n1 has far more room, but the proxy allows n0 only (a bare host allows its every port,
    # so that one allows both: n1 wins it).
    rig = picking_rig(usage=(0.5, 0.0))
    ex, (head, *_) = await admit(rig, chat(max_tokens=100), hint(value))
    expected = N1 if value == ["127.0.0.1"] else N0
    assert destination(head)[0] == expected
    ex.finish()
    assert held(rig) == {N0: 0, N1: 0}


@pytest.mark.parametrize("value", [[], "", ["10.0.0.1:8000"], " , ,", [1.0], {"a": N0},
                                   True, "x" * (epp.MAX_HINT_BYTES + 1),
                                   [N0] * (epp.MAX_HINT_ENTRIES + 1), f"{N0}\x00", "http://127.0.0.1:7000"])
async def test_a_hint_that_allows_no_node_is_a_503_and_takes_nothing(value):
    rig = picking_rig()
    ex, answers = await admit(rig, chat(max_tokens=100), hint(value))
    (resp,) = answers
    imm = resp.immediate_response
    assert imm.status.code == 503
    assert json.loads(imm.body)["error"]["code"] == "no_eligible_endpoint"
    # It names no node of the pool: the same request would be refused again.
    assert set_headers(imm)["x-should-retry"] == "false" and "retry-after" not in set_headers(imm)
    assert rig.inflight() == 0 and held(rig) == {N0: 0, N1: 0}
    assert rig.count("kvgate_requests_total", outcome="rejected_no_endpoint") == 1
    assert ex.finish() is None


async def test_a_hinted_node_that_is_not_up_is_not_eligible():
    rig = picking_rig()
    rig.clock.advance(10.0)  # both reports stale
    from extproc.admission.types import NodeReport
    rig.admission.report_node("default", "n1", NodeReport(kv_usage=0.0, capacity_tokens=None,
                                                          at=rig.clock.now()))
    _, (resp,) = await admit(rig, chat(max_tokens=100), hint([N0]))
    assert resp.immediate_response.status.code == 503
    # n0 may report again: a retry may pass.
    assert set_headers(resp.immediate_response)["x-should-retry"] == "true"
    assert set_headers(resp.immediate_response)["retry-after"] == "1"
    ex, (head, *_) = await admit(rig, chat(max_tokens=100), hint([N0, N1]))
    assert destination(head)[0] == N1
    ex.finish()


async def test_hinted_nodes_without_room_are_a_429_not_a_503():
    rig = picking_rig(usage=(0.99, 0.0))
    _, (resp,) = await admit(rig, chat(max_tokens=500), hint([N0]))
    assert resp.immediate_response.status.code == 429
    assert rig.inflight() == 0 and held(rig) == {N0: 0, N1: 0}


async def test_the_node_that_served_is_charged_when_the_proxy_fell_back_to_it():
    rig = picking_rig(usage=(0.0, 0.5))
    ex, (head, *_) = await admit(rig, chat(max_tokens=100, stream=True))
    assert destination(head)[0] == N0
    ex.response_headers(response_headers_msg(content_type="text/event-stream"), metadata=served(N1))
    assert held(rig) == {N0: 0, N1: 1}
    ex.response_body(body_msg(sse(token_chunk(1), token_chunk(2), done=False), eos=False))
    inflight = {n.address: n.inflight_tokens for n in rig.admission.nodes("default")}
    assert inflight[N0] == 0 and inflight[N1] > 0
    ex.response_body(body_msg(b"", eos=True))
    assert held(rig) == {N0: 0, N1: 0} and rig.inflight() == 0


@pytest.mark.parametrize("value", ["10.0.0.1:8000", "not an address", 7000.0, "", ":7000"])
async def test_a_served_endpoint_kvgate_does_not_know_leaves_the_charge_where_it_was(value):
    rig = picking_rig(usage=(0.0, 0.5))
    ex, _ = await admit(rig, chat(max_tokens=100))
    ex.response_headers(response_headers_msg(), metadata=served(value))
    assert held(rig) == {N0: 1, N1: 0}
    known = value == "10.0.0.1:8000"  # a well-formed address of no node: counted and logged
    assert rig.count("kvgate_served_unknown_endpoint_total", pool="default") == (1 if known else 0)
    ex.response_body(body_msg(b'{"usage": {"completion_tokens": 3}}', eos=True))
    assert held(rig) == {N0: 0, N1: 0} and rig.inflight() == 0


async def test_response_chunks_go_back_at_once_as_they_came_and_the_end_releases():
    rig = picking_rig()
    ex, _ = await admit(rig, chat(max_tokens=100, stream=True,
                                  stream_options={"include_usage": True}))
    ex.response_headers(response_headers_msg(content_type="text/event-stream"), metadata=served(N0))
    first = sse(token_chunk(1), done=False)
    resp = ex.response_body(body_msg(first, eos=False))
    assert streamed(resp, "response_body") == (first, False)
    assert rig.inflight() == 1
    usage = sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1,
                                          "total_tokens": 6}})
    resp = ex.response_body(body_msg(usage, eos=True))
    assert streamed(resp, "response_body") == (usage, True)
    assert rig.inflight() == 0
    assert rig.count("kvgate_releases_total", cause="completed") == 1


async def test_the_usage_chunk_kvgate_asked_for_is_hidden_from_the_client():
    rig = picking_rig()
    ex, _ = await admit(rig, chat(max_tokens=100, stream=True))
    ex.response_headers(response_headers_msg(content_type="text/event-stream"))
    ex.response_body(body_msg(sse(token_chunk(1), done=False), eos=False))
    usage = sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1,
                                          "total_tokens": 6}})
    body, end = streamed(ex.response_body(body_msg(usage, eos=True)), "response_body")
    assert end and b"usage" not in body and b"[DONE]" in body
    assert rig.inflight() == 0


async def test_a_stream_that_ends_mid_body_holds_nothing():
    rig = picking_rig()
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg(), hint([N0]), DUPLEX)
    assert await ex.request_body(body_msg(chat()[:10], eos=False)) is None
    assert ex.finish() is None
    assert rig.inflight() == 0 and held(rig) == {N0: 0, N1: 0}


async def test_malformed_or_oversized_bodies_are_refused_whole_and_take_nothing():
    rig = picking_rig()
    _, (resp,) = await admit(rig, b'{"model": "m", "messages": [', parts=2)
    assert resp.immediate_response.status.code == 400
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg(), None, DUPLEX)
    resp = None
    for _ in range(2000):  # chunks until past limits.max_body_bytes, without an end
        resp = await ex.request_body(body_msg(b" " * 4096, eos=False))
        if resp is not None:
            break
    assert resp is not None and resp.immediate_response.status.code == 413
    assert rig.inflight() == 0 and held(rig) == {N0: 0, N1: 0}


async def test_request_trailers_before_the_body_ends_are_refused():
    rig = picking_rig()
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg(), None, DUPLEX)
    await ex.request_body(body_msg(chat(), eos=False))
    assert ex.request_trailers().immediate_response.status.code == 400
    assert rig.inflight() == 0 and ex.finish() is None


async def test_a_path_kvgate_does_not_admit_is_routed_and_its_bodies_passed_back():
    rig = picking_rig()
    ex = Stream(rig.gate)
    resp = ex.request_headers(headers_msg("/v1/models", method="GET", end_of_stream=True), hint([N1]), DUPLEX)
    assert not resp.HasField("mode_override")  # not allowed with FULL_DUPLEX_STREAMED bodies
    assert set_headers(resp.request_headers.response)[epp.DESTINATION_KEY] == N1
    ex.response_headers(response_headers_msg())
    assert streamed(ex.response_body(body_msg(b"[]", eos=True)), "response_body") == (b"[]", True)
    assert rig.count("kvgate_requests_total", outcome="passed") == 1
    # With unknown_paths: pass a request body may come too, passed back as it came.
    rig = picking_rig(limits={"max_body_bytes": 65536, "unknown_paths": "pass"})
    ex = Stream(rig.gate)
    assert ex.request_headers(headers_msg("/v2/other", method="PUT"), hint([N1]), DUPLEX).HasField("request_headers")
    assert streamed(await ex.request_body(body_msg(b"{}", eos=True)), "request_body") == (b"{}", True)
    assert all(n.picks == 0 for n in rig.admission.nodes("default"))
    assert rig.count("kvgate_requests_total", outcome="passed") == 1
    ex = Stream(rig.gate)
    resp = ex.request_headers(headers_msg("/v1/models", method="GET"), hint(["10.1.1.1:1"]), DUPLEX)
    assert resp.immediate_response.status.code == 503


async def test_the_hint_holds_with_a_buffered_body_too():
    # deploy/envoy-endpoint-picker.yaml (body BUFFERED) under a gateway that sets a hint.
    from tests.unit.test_exchange_picking import node_of
    rig = picking_rig(usage=(0.5, 0.0))
    ex = Stream(rig.gate)
    assert ex.request_headers(headers_msg(), hint([N0])).HasField("request_headers")
    resp = await ex.request_body(body_msg(chat(max_tokens=100)))
    assert node_of(resp)[0] == N0
    ex.finish()
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg(), hint([]))
    resp = await ex.request_body(body_msg(chat(max_tokens=100)))
    assert resp.immediate_response.status.code == 503 and rig.inflight() == 0


# --- invariant -------------------------------------------------------------------------------


_HINTS = st.one_of(st.none(), st.lists(st.sampled_from([N0, N1, "127.0.0.1", "10.0.0.1:1", "", "x:y"]),
                                       max_size=3))
_STEPS = st.lists(st.sampled_from(["chunk", "last", "trailers", "rh", "rh_moved", "rh_unknown",
                                   "sse", "eos", "finish"]), max_size=10)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_HINTS, st.integers(min_value=1, max_value=6), _STEPS)
def test_in_full_duplex_every_stream_ends_with_nothing_held(hint_value, parts, steps):
    """Whatever the hint, the chunking and the order of what follows (even nonsense), after
    finish no node holds a charge, nothing is in flight, and a released lease stays released."""

    async def run() -> None:
        rig = picking_rig(usage=(0.1, 0.2))  # n0 is picked unless the hint leaves it out
        body = chat("split me " * 10, max_tokens=50, stream=True)
        step = -(-len(body) // parts)
        pieces = [body[at:at + step] for at in range(0, len(body), step)]
        ex = Stream(rig.gate)
        ex.request_headers(headers_msg(), None if hint_value is None else hint(hint_value), DUPLEX)
        for s in steps:
            if s == "chunk" and pieces:
                await ex.request_body(body_msg(pieces.pop(0), eos=False))
            elif s == "last":
                await ex.request_body(body_msg(b"".join(pieces), eos=True))
                pieces = []
            elif s == "trailers":
                ex.request_trailers()
            elif s.startswith("rh"):
                md = {"rh": None, "rh_moved": served(N1), "rh_unknown": served("10.0.0.9:9")}[s]
                ex.response_headers(response_headers_msg(content_type="text/event-stream"), metadata=md)
            elif s == "sse":
                ex.response_body(body_msg(sse(token_chunk(1), done=False), eos=False))
            elif s == "eos":
                ex.response_body(body_msg(b"", eos=True))
            elif s == "finish":
                ex.finish()
        ex.finish()
        assert ex.finish() is None
        assert rig.inflight() == 0
        assert all(n.requests == 0 and n.inflight_tokens == 0 for n in rig.admission.nodes("default"))

    asyncio.run(run())
