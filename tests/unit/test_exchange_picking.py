"""A request in a pool that picks nodes: the answer names the node the way the endpoint
picker protocol does, the stream's tokens reach the node's ledger, and a request that
arrives without its headers (Envoy routed it already) is refused, not admitted blind."""

from __future__ import annotations

from typing import Any

from extproc.admission.types import NodeReport
from kvgate_testkit.stream import Stream
from extproc.picker_protocol import DESTINATION_KEY as DESTINATION_HEADER
from extproc.picker_protocol import LB_NAMESPACE
from tests.unit.test_exchange import (Rig, body_msg, chat, headers_msg, response_headers_msg,
                                      set_headers, sse, token_chunk)

NODES: dict[str, Any] = {
    "default": {"max_concurrency": 8, "context_window": 4096, "default_max_tokens": 256,
                "backends": [{"name": f"n{i}", "metrics_url": f"http://127.0.0.1:9/{i}",
                              "address": f"127.0.0.1:{7000 + i}", "kv_capacity_tokens": 10_000}
                             for i in range(2)],
                "picking": {"growth": "worst_case", "reserve_fraction": 0.0}},
}


def picking_rig(usage: tuple[float, float] = (0.0, 0.0), **overrides: Any) -> Rig:
    rig = Rig({"pools": NODES, **overrides})
    for i, u in enumerate(usage):
        rig.admission.report_node("default", f"n{i}", NodeReport(kv_usage=u, capacity_tokens=None,
                                                                 at=rig.clock.now()))
    return rig


def node_of(resp: Any) -> tuple[str, str, bool]:
    common = resp.request_body.response
    md = resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER]
    return set_headers(common)[DESTINATION_HEADER], md.string_value, common.clear_route_cache


async def test_an_admitted_request_is_sent_to_the_node_with_room():
    rig = picking_rig(usage=(0.9, 0.1))
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg())
    resp = await ex.request_body(body_msg(chat(max_tokens=100)))
    assert node_of(resp) == ("127.0.0.1:7001", "127.0.0.1:7001", True)
    (_, n1) = rig.admission.nodes("default")
    assert n1.requests == 1 and n1.picks == 1


async def test_the_streamed_tokens_tell_the_node_how_far_the_request_has_got():
    rig = picking_rig()
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg())
    await ex.request_body(body_msg(chat(max_tokens=100, stream=True)))
    ex.response_headers(response_headers_msg(content_type="text/event-stream"))
    before = sum(n.inflight_tokens for n in rig.admission.nodes("default"))
    ex.response_body(body_msg(sse(token_chunk(1), token_chunk(2), token_chunk(3), done=False), eos=False))
    after = sum(n.inflight_tokens for n in rig.admission.nodes("default"))
    assert after == before + 3
    ex.response_body(body_msg(b"", eos=True))
    assert sum(n.requests for n in rig.admission.nodes("default")) == 0


async def test_no_node_with_room_is_a_429_and_takes_nothing():
    rig = picking_rig(usage=(0.99, 0.99))
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg())
    resp = await ex.request_body(body_msg(chat(max_tokens=500)))
    imm = resp.immediate_response
    assert imm.status.code == 429 and "No node of pool" in imm.body.decode()
    assert rig.inflight() == 0 and all(n.requests == 0 for n in rig.admission.nodes("default"))


async def test_a_request_whose_headers_envoy_skipped_is_refused_in_a_picking_pool():
    from google.protobuf import struct_pb2
    rig = picking_rig()
    attrs = struct_pb2.Struct()
    attrs.update({"request.path": "/v1/chat/completions", "request.method": "POST"})
    ex = Stream(rig.gate)
    resp = await ex.request_body(body_msg(chat()), attributes={"envoy.filters.http.ext_proc": attrs})
    assert resp.immediate_response.status.code == 500
    assert rig.inflight() == 0
    assert rig.count("kvgate_internal_errors_total") == 1


async def test_a_path_kvgate_does_not_admit_still_goes_to_an_up_node_uncharged():
    rig = picking_rig()
    ex = Stream(rig.gate)
    resp = ex.request_headers(headers_msg("/v1/models", method="GET", end_of_stream=True))
    headers = set_headers(resp.request_headers.response)
    assert headers[DESTINATION_HEADER] in ("127.0.0.1:7000", "127.0.0.1:7001")
    assert resp.request_headers.response.clear_route_cache
    assert all(n.picks == 0 for n in rig.admission.nodes("default"))
    # ... and with no node up, a 503 instead of a request Envoy cannot route.
    rig.clock.advance(10.0)
    ex = Stream(rig.gate)
    resp = ex.request_headers(headers_msg("/v1/models", method="GET", end_of_stream=True))
    assert resp.immediate_response.status.code == 503
