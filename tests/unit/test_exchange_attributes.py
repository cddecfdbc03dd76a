"""Unit tests of a request's arrival when Envoy skips request headers (deploy/envoy.yaml).

The stream's first message is then the request body, and the request facts kvgate needs
come with it as request attributes (``request.path``, ``request.method``, a few headers).
Every decision must be the one the same request gets when its headers are sent.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.answers import PASS_THROUGH_BODY, PASS_THROUGH_RESPONSE
from extproc.request.ending import Observed
from extproc.request.profile import ReleaseMode
from kvgate_testkit.stream import Stream
from extproc.request_facts import (ATTR_AUTHORIZATION, ATTR_CONTENT_TYPE, ATTR_METHOD, ATTR_PATH,
                                   request_attributes, tenant_attribute)
from tests.unit.test_exchange import API_KEY, Rig, body_msg, chat, headers_msg, \
    response_headers_msg, route_metadata


def attrs(path: str = "/v1/chat/completions", method: str = "POST", *,
          content_type: str | None = "application/json", tenant: str | None = None,
          authorization: str | None = None, **extra: str) -> dict[str, struct_pb2.Struct]:
    """attrs is ProcessingRequest.attributes as Envoy fills it (absent headers left out)."""
    values = {ATTR_PATH: path, ATTR_METHOD: method, **extra}
    if content_type is not None:
        values[ATTR_CONTENT_TYPE] = content_type
    if tenant is not None:
        values[tenant_attribute("x-tenant-id")] = tenant
    if authorization is not None:
        values[ATTR_AUTHORIZATION] = authorization
    s = struct_pb2.Struct()
    s.update(values)
    req = pb.ProcessingRequest()
    req.attributes["envoy.filters.http.ext_proc"].CopyFrom(s)
    return req.attributes  # the real protobuf map type


def body_first(rig: Rig, body: bytes, attributes: Any, metadata: Any = None) -> tuple[Stream, pb.ProcessingResponse]:
    ex = Stream(rig.gate)
    resp = asyncio.run(ex.request_body(body_msg(body), None, attributes, metadata))
    return ex, resp


def with_headers(rig: Rig, body: bytes, extra: list[tuple[str, str]] = (),
                 metadata: Any = None) -> pb.ProcessingResponse:
    ex = Stream(rig.gate)
    first = ex.request_headers(headers_msg(extra=extra), metadata)
    if first.WhichOneof("response") != "request_headers":
        return first
    return asyncio.run(ex.request_body(body_msg(body)))


def status_of(resp: pb.ProcessingResponse) -> int:
    return resp.immediate_response.status.code if resp.HasField("immediate_response") else 0


def test_the_attribute_list_names_the_configured_tenant_header() -> None:
    assert request_attributes("x-org") == [ATTR_PATH, ATTR_METHOD, ATTR_CONTENT_TYPE,
                                           ATTR_AUTHORIZATION, "request.headers['x-org']"]


def test_a_body_first_request_is_admitted_and_released_like_one_with_headers() -> None:
    rig = Rig()
    ex, resp = body_first(rig, chat(max_tokens=5), attrs(tenant="acme"))
    assert resp.WhichOneof("response") == "request_body" and not resp.HasField("immediate_response")
    assert rig.inflight() == 1 and ex.admitted.lease.demand.tenant == "acme"
    ex.response_headers(response_headers_msg())
    ex.response_body(body_msg(orjson.dumps({"usage": {"completion_tokens": 5}})))
    assert rig.inflight() == 0
    assert rig.count("kvgate_releases_total", cause="completed") == 1


def test_api_key_and_tenant_header_decide_as_with_headers() -> None:
    rig = Rig()
    ex, _ = body_first(rig, chat(), attrs(tenant="acme", authorization=f"Bearer {API_KEY}"))
    assert ex.admitted.lease.demand.tenant == "gold-1"  # the key wins over the header claim
    ex.finish()
    ex, _ = body_first(rig, chat(), attrs(tenant="nobody-known"))
    assert ex.admitted.lease.demand.tenant == "_anonymous"
    ex.finish()
    assert rig.inflight() == 0


def test_repeated_tenant_headers_joined_by_envoy_are_refused() -> None:
    rig = Rig()
    _, resp = body_first(rig, chat(), attrs(tenant="acme,other"))
    assert status_of(resp) == 400
    assert orjson.loads(resp.immediate_response.body)["error"]["param"] == "x-tenant-id"
    same = with_headers(rig, chat(), [("x-tenant-id", "acme"), ("x-tenant-id", "other")])
    assert status_of(same) == 400
    assert rig.inflight() == 0


def test_refusals_match_the_headers_configuration() -> None:
    cases = [
        (chat(max_tokens=10_000), {}, 400),                        # context window
        (b'{"messages": [', {}, 400),                               # malformed
        (chat(), {"content_type": "text/plain"}, 415),             # wrong content type
        (chat("x" * 70_000), {}, 413),                              # above max_body_bytes
        (b"", {}, 400),                                             # chunked, empty
    ]
    for body, kw, status in cases:
        rig = Rig()
        _, resp = body_first(rig, body, attrs(**kw))
        extra = [("content-type", kw["content_type"])] if "content_type" in kw else []
        assert status_of(resp) == status, (body[:40], kw)
        if body:
            # With headers sent, the content-type header is replaced by the one given.
            ex = Stream(rig.gate)
            msg = headers_msg()
            if extra:
                for h in msg.headers.headers:
                    if h.key == "content-type":
                        h.raw_value = extra[0][1].encode()
            assert ex.request_headers(msg).WhichOneof("response") == "request_headers"
            assert status_of(asyncio.run(ex.request_body(body_msg(body)))) == status
        assert rig.inflight() == 0


def test_route_settings_come_with_the_body() -> None:
    rig = Rig()
    ex, resp = body_first(rig, chat(), attrs(), route_metadata(pool="small"))
    assert ex.admitted.lease.demand.pool == "small" and rig.inflight("small") == 1
    ex.finish()
    assert rig.inflight("small") == 0


def test_paths_not_admitted_are_decided_at_the_body() -> None:
    rig = Rig()
    # A pass path's GET whose (empty) end of stream came as a body message of its own.
    ex, resp = body_first(rig, b"", attrs("/version", "GET"))
    assert resp == PASS_THROUGH_BODY
    assert ex.response_headers(response_headers_msg()).WhichOneof("response") == "response_headers"
    assert rig.count("kvgate_requests_total") == rig.count("kvgate_requests_total", outcome="passed") == 1
    # A pass path with a body or another method than GET and HEAD, and what kvgate does not
    # know, are refused, as with request headers.
    for path, method, status in (("/v1/models", "POST", 405), ("/version", "GET", 400),
                                 ("/v1/chat/completions", "PUT", 405), ("/tokenize", "POST", 404)):
        _, resp = body_first(rig, b"{}", attrs(path, method))
        assert status_of(resp) == status, (path, method)
    assert rig.count("kvgate_requests_total", outcome="rejected_path") == 3
    assert rig.count("kvgate_requests_total", outcome="rejected_invalid") == 1
    assert rig.inflight() == 0


def test_without_request_path_kvgate_refuses_and_says_why(caplog: Any) -> None:
    rig = Rig()
    method_only = attrs()
    del method_only["envoy.filters.http.ext_proc"].fields[ATTR_PATH]
    for attributes in (None, method_only):
        _, resp = body_first(rig, chat(), attributes)
        assert status_of(resp) == 500
        assert orjson.loads(resp.immediate_response.body)["error"]["code"] == "gateway_misconfigured"
    assert rig.count("kvgate_internal_errors_total") == 2
    assert rig.inflight() == 0
    assert "request_attributes" in caplog.text
    assert caplog.text.count("refusing requests") == 1  # logged once a minute, counted always


def test_a_stream_that_starts_with_response_headers_passes_through() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    assert ex.response_headers(response_headers_msg()) == PASS_THROUGH_RESPONSE
    assert ex.response_body(body_msg(b"{}")).WhichOneof("response") == "response_body"
    assert ex.finish() is None


def test_envoys_own_413_gets_kvgates_shape_before_or_after_request_headers() -> None:
    rig = Rig()
    skipped = Stream(rig.gate)                 # deploy/envoy.yaml: nothing seen yet
    four_message = Stream(rig.gate)            # headers seen, waiting for the body
    four_message.request_headers(headers_msg())
    for ex in (skipped, four_message):
        resp = ex.response_headers(response_headers_msg(413, "text/plain"))
        assert status_of(resp) == 413
        err = orjson.loads(resp.immediate_response.body)["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    assert rig.count("kvgate_requests_total", outcome="rejected_body_too_large") == 2
    assert rig.inflight() == 0


def test_envoys_own_413_is_counted_under_the_tenants_class() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    resp = ex.response_headers(response_headers_msg(413, "text/plain"),
                               attributes=attrs(authorization=f"Bearer {API_KEY}"))
    assert status_of(resp) == 413
    assert rig.count("kvgate_requests_total", outcome="rejected_body_too_large",
                     **{"class": "gold"}) == 1
    assert rig.count("kvgate_requests_total", outcome="rejected_body_too_large",
                     **{"class": "standard"}) == 0


def test_attributes_on_later_messages_change_nothing() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg(extra=[("x-tenant-id", "acme")]))
    asyncio.run(ex.request_body(body_msg(chat()), None, attrs(tenant="other"), None))
    assert ex.admitted.lease.demand.tenant == "acme" and rig.inflight() == 1
    ex.finish()
    assert rig.inflight() == 0


def test_header_values_beyond_latin1_are_read_as_their_utf8_bytes() -> None:
    rig = Rig()
    ex, resp = body_first(rig, chat(), attrs(tenant="caf\u00e9\u2603", authorization="Bearer \u2603"))
    assert not resp.HasField("immediate_response") and ex.admitted.lease.demand.tenant == "_anonymous"
    ex.finish()
    same = Stream(rig.gate)
    same.request_headers(headers_msg(extra=[("x-tenant-id", "caf\u00e9\u2603")]))
    asyncio.run(same.request_body(body_msg(chat())))
    assert same.admitted.lease.demand.tenant == ex.admitted.lease.demand.tenant
    same.finish()
    assert rig.inflight() == 0


def test_attributes_that_were_not_utf8_are_refused_with_a_400() -> None:
    from extproc.service import decode_request

    req = pb.ProcessingRequest()
    req.request_body.body = chat().encode() if isinstance(chat(), str) else chat()
    req.request_body.end_of_stream = True
    req.attributes["envoy.filters.http.ext_proc"].update({ATTR_PATH: "/v1/chat/completions",
                                                          ATTR_METHOD: "POST",
                                                          tenant_attribute("x-tenant-id"): "cafe"})
    wire = req.SerializeToString()
    assert wire.count(b"cafe") == 1
    hostile = wire.replace(b"cafe", b"caf\xe9")  # a latin-1 byte, as Envoy copies it
    try:
        pb.ProcessingRequest.FromString(hostile)
        raise AssertionError("protobuf accepted a string that is not UTF-8")
    except Exception as err:  # the generated parser refuses the whole message
        assert "DecodeError" in type(err).__name__
    decoded = decode_request(hostile)
    assert decoded.request_body.body == req.request_body.body and decoded.request_body.end_of_stream
    rig = Rig()
    ex = Stream(rig.gate)
    resp = asyncio.run(ex.request_body(decoded.request_body, None, decoded.attributes, None))
    assert status_of(resp) == 400 and rig.inflight() == 0
    assert decode_request(wire) == req  # a good message is untouched


# --- deploy/envoy-reservation.yaml: response headers on the stream, no response body ------

# deploy/envoy-reservation.yaml's routes: the response body never comes to kvgate.
_UNREAD = route_metadata(pool="default", release="unread")


def _no_response_body() -> pb.ProtocolConfiguration:
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
    return pb.ProtocolConfiguration(request_body_mode=pm.ProcessingMode.BUFFERED,
                                    response_body_mode=pm.ProcessingMode.NONE)


def _charged(rig: Rig, ex: Stream, before: float) -> float:
    """what the pool bucket kept for a released request (the manual clock never moves)"""
    assert rig.inflight() == 0
    available = rig.admission.snapshot("default").tpm_available
    assert available is not None
    return before - available


def test_response_headers_on_a_stream_without_a_body_charge_the_whole_reservation() -> None:
    rig = Rig()
    before = rig.admission.snapshot("default").tpm_available
    assert before is not None
    ex = Stream(rig.gate)
    asyncio.run(ex.request_body(body_msg(chat(max_tokens=300)), None, attrs(), _UNREAD, _no_response_body()))
    assert ex.ending.mode is ReleaseMode.UNREAD and rig.inflight() == 1
    resp = ex.response_headers(response_headers_msg(200, "text/event-stream"))
    names = {h.header.key for h in resp.response_headers.response.header_mutation.set_headers}
    assert "x-ratelimit-remaining-tokens" in names
    assert not resp.HasField("mode_override")  # Envoy would close the stream at once
    assert ex.ending.mode is ReleaseMode.UNREAD and rig.inflight() == 1
    assert ex.finish().value == "ended"
    assert rig.count("kvgate_releases_total", cause="ended") == 1
    assert _charged(rig, ex, before) >= 300


def test_the_same_headers_from_an_observing_stream_are_followed_and_refunded() -> None:
    rig = Rig()
    before = rig.admission.snapshot("default").tpm_available
    assert before is not None
    ex = Stream(rig.gate)
    asyncio.run(ex.request_body(body_msg(chat(max_tokens=300)), None, attrs(), None, _no_response_body()))
    ending = ex.ending
    assert isinstance(ending, Observed)
    ending.observed_headers(200, "application/json", False)  # as the observing stream feeds it
    assert ending.mode is ReleaseMode.OBSERVED
    usage = {"usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}
    ending.response_chunk(orjson.dumps({"choices": [], **usage}), True)
    assert ex.ending.outcome is not None and ex.ending.outcome.value == "completed"
    assert _charged(rig, ex, before) < 100  # prompt + 2, not the 300 reserved


def test_an_upstream_error_without_a_body_is_an_upstream_error() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    asyncio.run(ex.request_body(body_msg(chat(max_tokens=30)), None, attrs(), _UNREAD, _no_response_body()))
    ex.response_headers(response_headers_msg(503))
    assert ex.finish().value == "upstream_error"


def test_a_tenant_attribute_under_another_name_is_counted_and_logged(caplog) -> None:
    rig = Rig({"tenants": {"header": "x-org", "default_class": "standard",
                           "classes": {"standard": {}, "gold": {}},
                           "tenants": {"acme": {"class": "gold"}}}})
    for _ in range(3):
        ex, _ = body_first(rig, chat(max_tokens=2), attrs(tenant="acme"))  # request.headers['x-tenant-id']
        assert ex.admitted.lease.demand.class_name == "standard"
        ex.finish()
    assert rig.count("kvgate_tenant_header_unseen_total", reason="other_header") == 3
    lines = [r for r in caplog.records if "does not read" in r.getMessage()]
    assert len(lines) == 1 and "x-org" in lines[0].getMessage()


def test_a_tenant_header_never_seen_is_said_once_when_only_it_names_tenants(caplog) -> None:
    from extproc.gate import TENANT_HEADER_UNSEEN_AFTER

    rig = Rig()  # acme has no key: only the header can name it
    for _ in range(TENANT_HEADER_UNSEEN_AFTER + 5):
        ex, _ = body_first(rig, chat(max_tokens=1), attrs())
        ex.finish()
    assert rig.count("kvgate_tenant_header_unseen_total", reason="absent") == TENANT_HEADER_UNSEEN_AFTER + 5
    lines = [r for r in caplog.records if "carried the tenant header" in r.getMessage()]
    assert len(lines) == 1
    # Once a request carries it, the warning has no reason to come back.
    ex, _ = body_first(rig, chat(max_tokens=1), attrs(tenant="acme"))
    ex.finish()
    rig.clock.advance(3600)
    for _ in range(TENANT_HEADER_UNSEEN_AFTER + 5):
        ex, _ = body_first(rig, chat(max_tokens=1), attrs())
        ex.finish()
    assert len([r for r in caplog.records if "carried the tenant header" in r.getMessage()]) == 1


def test_without_header_only_tenants_a_missing_header_is_the_norm(caplog) -> None:
    rig = Rig({"tenants": {"header": "x-tenant-id", "default_class": "standard",
                           "classes": {"standard": {}, "gold": {}},
                           "tenants": {"gold-1": {"class": "gold", "api_key_sha256": [
                               __import__("hashlib").sha256(API_KEY.encode()).hexdigest()]}}}})
    for _ in range(150):
        ex, _ = body_first(rig, chat(max_tokens=1), attrs())
        ex.finish()
    assert rig.count("kvgate_tenant_header_unseen_total") == 0
    assert not [r for r in caplog.records if "tenant header" in r.getMessage()]
