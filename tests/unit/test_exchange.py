"""Unit tests of one request's stages (extproc.request: arrival, admission, ending),
fed as the service feeds them (kvgate_testkit.stream), without gRPC.

The stages get the protobuf messages Envoy sends and answers as Envoy expects; the
admission core, tokenizer and OpenAI parsing are the real ones, time is a ManualClock.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.admission import Admission
from extproc.clock import ManualClock
from extproc.configparse import parse_config
from extproc.answers import PASS_THROUGH
from kvgate_testkit.stream import Stream
from extproc.gate import ANONYMOUS_TENANT, Gate
from extproc.metrics import Metrics
from extproc.tokens import load_tokenizer

API_KEY = "sk-test-key-of-tenant-gold"

BASE_CONFIG: dict[str, Any] = {
    "pools": {
        "default": {"max_concurrency": 2, "tpm": 1_000_000, "context_window": 4096,
                    "default_max_tokens": 256, "tokenizer": "cl100k_base"},
        "small": {"max_concurrency": 1, "context_window": 1024, "default_max_tokens": 64},
    },
    "limits": {"max_body_bytes": 65536},
    "tenants": {
        "header": "x-tenant-id",
        "default_class": "standard",
        "classes": {"standard": {"priority": 0}, "gold": {"priority": 10},
                    "patient": {"max_wait_s": 2.0}},
        "tenants": {
            "acme": {"class": "standard"},
            "gold-1": {"class": "gold",
                       "api_key_sha256": [hashlib.sha256(API_KEY.encode()).hexdigest()]},
        },
    },
}


class Rig:
    """Rig is a gate with a real admission core on a manual clock and fresh metrics."""

    def __init__(self, overrides: dict[str, Any] | None = None) -> None:
        data = orjson.loads(orjson.dumps(BASE_CONFIG))
        for k, v in (overrides or {}).items():
            data[k] = v
        self.config = parse_config(data)
        self.clock = ManualClock(1000.0)
        self.admission = Admission(self.config, self.clock)
        self.metrics = Metrics(CollectorRegistry())
        self.metrics.attach(self.admission, tuple(self.config.tenants.classes))
        self.gate = Gate(self.config, self.admission, self.metrics, self.clock)

    def inflight(self, pool: str = "default") -> int:
        return self.admission.snapshot(pool).inflight

    def count(self, name: str, **labels: str) -> float:
        total = 0.0
        for family in self.metrics.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


def tpm(rig: Rig, pool: str = "default") -> float:
    """tpm is the pool's token bucket now (tokens): a settle refunds what was reserved and not
    used."""
    return rig.admission.snapshot(pool).tpm_available


def headers_msg(path: str = "/v1/chat/completions", *, method: str = "POST",
                extra: list[tuple[str, str]] = (), content_length: int | None = None,
                end_of_stream: bool = False) -> pb.HttpHeaders:
    hs = [(":path", path), (":method", method), (":scheme", "http"), (":authority", "gw"),
          ("content-type", "application/json"), *extra]
    if content_length is not None:
        hs.append(("content-length", str(content_length)))
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]),
        end_of_stream=end_of_stream)


def response_headers_msg(status: int = 200, content_type: str = "application/json",
                         end_of_stream: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
        base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode())]),
        end_of_stream=end_of_stream)


def body_msg(data: bytes, eos: bool = True) -> pb.HttpBody:
    return pb.HttpBody(body=data, end_of_stream=eos)


def chat(content: str = "Hello there", **fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **fields})


def route_metadata(**values: Any) -> base_pb2.Metadata:
    s = struct_pb2.Struct()
    s.update(values)
    md = base_pb2.Metadata()
    md.filter_metadata["kvgate"].CopyFrom(s)
    return md


def set_headers(resp: pb.CommonResponse | pb.ImmediateResponse) -> dict[str, str]:
    mutation = resp.headers if isinstance(resp, pb.ImmediateResponse) else resp.header_mutation
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}


def sse(*events: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def token_chunk(i: int) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}]}


USAGE_CHUNK = {"id": "c", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}


async def admit(rig: Rig, body: bytes = b"", *, extra: list[tuple[str, str]] = (),
                metadata: Any = None) -> tuple[Stream, pb.ProcessingResponse]:
    ex = Stream(rig.gate)
    first = ex.request_headers(headers_msg(extra=extra), metadata)
    assert first.WhichOneof("response") == "request_headers", first
    resp = await ex.request_body(body_msg(body or chat()))
    return ex, resp


# --- the happy paths -----------------------------------------------------------------

async def test_non_streamed_chat_is_admitted_and_released_as_completed_with_reported_usage() -> None:
    rig = Rig()
    ex, resp = await admit(rig, chat(max_tokens=100))
    assert resp.WhichOneof("response") == "request_body"
    assert not resp.request_body.response.HasField("body_mutation")
    assert rig.inflight() == 1
    assert rig.admission.snapshot("default").kv_inflight == ex.admitted.lease.demand.tokens
    assert ex.admitted.lease.demand.reserved_completion == 100
    assert ex.admitted.lease.demand.tenant == ANONYMOUS_TENANT

    rh = ex.response_headers(response_headers_msg())
    hs = set_headers(rh.response_headers.response)
    assert hs["x-ratelimit-limit-requests"] == "2"
    assert hs["x-ratelimit-remaining-requests"] == "1"
    assert hs["x-ratelimit-limit-tokens"] == "1000000"
    tpm_before = rig.admission.snapshot("default").tpm_available
    payload = orjson.dumps({"choices": [{"message": {"content": "hi"}}],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}})
    rb = ex.response_body(body_msg(payload[:10], eos=False))
    assert rb == pb.ProcessingResponse(response_body=pb.BodyResponse())
    ex.response_body(body_msg(payload[10:], eos=True))
    # released at the response's end of stream, before the stream closes
    assert rig.inflight() == 0
    assert ex.admitted.lease.released and ex.ending.outcome.value == "completed"
    # refund: the reservation (100 completion) is settled at the reported 7
    assert rig.admission.snapshot("default").tpm_available == pytest.approx(tpm_before + 93, abs=1)
    assert ex.finish() is None  # the stream's end changes nothing more
    assert rig.count("kvgate_releases_total", pool="default", cause="completed") == 1
    assert rig.count("kvgate_requests_total", outcome="admitted") == 1
    assert rig.count("kvgate_decision_seconds_count") == 1


async def test_stream_without_usage_gets_usage_upstream_and_the_client_never_sees_it() -> None:
    rig = Rig()
    ex, resp = await admit(rig, chat(stream=True, max_tokens=50))
    common = resp.request_body.response
    new_body = common.body_mutation.body
    assert orjson.loads(new_body)["stream_options"] == {"include_usage": True}
    assert set_headers(common)["content-length"] == str(len(new_body))

    rh = ex.response_headers(response_headers_msg(content_type="text/event-stream"))
    assert "content-length" in rh.response_headers.response.header_mutation.remove_headers
    first = sse(token_chunk(0), token_chunk(1), done=False)
    assert ex.response_body(body_msg(first, eos=False)) == pb.ProcessingResponse(
        response_body=pb.BodyResponse())
    tail = sse(token_chunk(2), USAGE_CHUNK)
    out = ex.response_body(body_msg(tail, eos=False))
    replaced = out.response_body.response.body_mutation.body
    assert replaced == sse(token_chunk(2))
    assert b"usage" not in replaced
    assert rig.inflight() == 1
    before = tpm(rig)
    ex.response_body(body_msg(b"", eos=True))
    assert rig.inflight() == 0
    assert tpm(rig) == pytest.approx(before + 50 - 3, abs=1)  # settled at the hidden usage


async def test_stream_that_asks_for_usage_is_left_alone() -> None:
    rig = Rig()
    ex, resp = await admit(rig, chat(stream=True, stream_options={"include_usage": True}))
    assert not resp.request_body.response.HasField("body_mutation")
    ex.response_headers(response_headers_msg(content_type="text/event-stream"))
    out = ex.response_body(body_msg(sse(token_chunk(0), USAGE_CHUNK), eos=True))
    assert out == pb.ProcessingResponse(response_body=pb.BodyResponse())
    assert ex.ending.outcome.value == "completed"


@pytest.mark.parametrize("path,method,unknown,body", [
    ("/v1/models", "GET", "refuse", False), ("/health", "HEAD", "refuse", False),
    ("/v1/models/m?x=1", "GET", "refuse", False),
    ("/v1/chat/completions", "GET", "pass", True), ("/v2/other", "POST", "pass", True),
    ("/v1/models", "DELETE", "pass", True)])
async def test_other_paths_and_methods_pass_through_without_admission(path: str, method: str,
                                                                        unknown: str, body: bool) -> None:
    rig = Rig({"limits": {"max_body_bytes": 65536, "unknown_paths": unknown}})
    ex = Stream(rig.gate)
    assert ex.request_headers(headers_msg(path, method=method, end_of_stream=not body)) is PASS_THROUGH
    if body:  # Envoy without allow_mode_override still sends the rest: answered with CONTINUE.
        assert (await ex.request_body(body_msg(b"{}"))).WhichOneof("response") == "request_body"
    assert ex.response_headers(response_headers_msg()).WhichOneof("response") == "response_headers"
    assert ex.finish() is None
    # Counted as let through, and nothing taken.
    assert rig.count("kvgate_requests_total") == rig.count("kvgate_requests_total", outcome="passed",
                                                           pool="default", **{"class": "standard"}) == 1
    assert rig.inflight() == 0


@pytest.mark.parametrize("path,method", [("/v1/models", "POST"), ("/health", "PUT"),
                                         ("/v1/models/m", "DELETE"), ("/version", "OPTIONS")])
async def test_a_pass_path_takes_get_and_head_only(path: str, method: str) -> None:
    rig = Rig()
    for body in (False, True):
        ex = Stream(rig.gate)
        imm = ex.request_headers(headers_msg(path, method=method, end_of_stream=not body)).immediate_response
        assert imm.status.code == 405
        assert orjson.loads(imm.body)["error"]["code"] == "method_not_allowed"
        assert set_headers(imm)["allow"] == "GET, HEAD"
        assert set_headers(imm)["x-kvgate-reason"] == "path"
        assert ex.finish() is None
    assert rig.count("kvgate_requests_total", outcome="rejected_path") == 2
    assert rig.count("kvgate_requests_total", outcome="passed") == 0


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_a_pass_path_takes_no_body(method: str) -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    imm = ex.request_headers(headers_msg("/v1/models", method=method, content_length=2)).immediate_response
    assert imm.status.code == 400
    err = orjson.loads(imm.body)["error"]
    assert err["code"] == "body_not_allowed" and err["type"] == "invalid_request_error"
    assert set_headers(imm)["x-kvgate-reason"] == "invalid"
    assert rig.count("kvgate_requests_total", outcome="rejected_invalid") == 1
    # A declared length of 0 is no body, though its end comes in a frame of its own.
    ex = Stream(rig.gate)
    assert ex.request_headers(headers_msg("/v1/models", method=method, content_length=0)) is PASS_THROUGH
    assert rig.count("kvgate_requests_total", outcome="passed") == 1


async def test_an_admitted_paths_405_names_post() -> None:
    rig = Rig()
    imm = Stream(rig.gate).request_headers(headers_msg(method="GET", end_of_stream=True)).immediate_response
    assert imm.status.code == 405 and set_headers(imm)["allow"] == "POST"


@pytest.mark.parametrize("path,method,status", [
    ("/V1/chat/completions", "POST", 404), ("/generate", "POST", 404), ("/invocations", "POST", 404),
    ("/v1/chat/completions", "PUT", 405), ("/v1/responses", "GET", 405), ("/tokenize", "POST", 404)])
async def test_unknown_paths_and_methods_are_refused_by_default(path: str, method: str,
                                                                 status: int) -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    imm = ex.request_headers(headers_msg(path, method=method)).immediate_response
    assert imm.status.code == status
    err = orjson.loads(imm.body)["error"]
    assert err["code"] == ("unknown_url" if status == 404 else "method_not_allowed")
    assert set_headers(imm)["x-kvgate-reason"] == "path"
    ex.finish()
    assert rig.count("kvgate_requests_total", outcome="rejected_path") == 1
    assert rig.inflight() == 0


async def test_the_responses_api_is_admitted_like_chat_and_settled_from_its_usage() -> None:
    pools = orjson.loads(orjson.dumps(BASE_CONFIG["pools"]))
    pools["default"]["enforce_max_tokens"] = True
    rig = Rig({"pools": pools})
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg("/v1/responses"))
    body = orjson.dumps({"model": "m", "instructions": "Be brief.",
                         "input": [{"role": "user", "content": [{"type": "input_text",
                                                                  "text": "word " * 200}]}]})
    resp = await ex.request_body(body_msg(body))
    assert rig.inflight() == 1
    demand = ex.admitted.lease.demand
    assert demand.prompt_tokens >= 200
    # no cap given, the pool enforces one: the reservation goes upstream as max_output_tokens
    sent = orjson.loads(resp.request_body.response.body_mutation.body)
    assert sent["max_output_tokens"] == 256 and "max_tokens" not in sent
    ex.response_headers(response_headers_msg())
    before = tpm(rig)
    ex.response_body(body_msg(orjson.dumps({"object": "response", "output": [],
                                            "usage": {"input_tokens": 210, "output_tokens": 7,
                                                      "total_tokens": 217}})))
    assert rig.inflight() == 0
    assert tpm(rig) == pytest.approx(before + 256 - 7, abs=1)  # settled at output_tokens


async def test_a_streamed_response_reads_usage_from_response_completed() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg("/v1/responses"))
    await ex.request_body(body_msg(orjson.dumps({"input": "hi", "stream": True,
                                                 "max_output_tokens": 50})))
    ex.response_headers(response_headers_msg(content_type="text/event-stream"))
    events = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"x"}\n\n'
              b'event: response.completed\ndata: {"type":"response.completed","response":'
              b'{"usage":{"input_tokens":3,"output_tokens":4,"total_tokens":7}}}\n\n')
    before = tpm(rig)
    ex.response_body(body_msg(events))
    assert rig.inflight() == 0
    assert tpm(rig) == pytest.approx(before + 50 - 4, abs=1)  # settled at output_tokens


@pytest.mark.parametrize("body,param", [({"model": "m"}, "input"), ({"input": 5}, "input"),
                                        ({"input": []}, "input"),
                                        ({"input": "x", "instructions": 1}, "instructions"),
                                        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens")])
async def test_a_bad_responses_body_is_a_400_naming_the_field(body: dict, param: str) -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg("/v1/responses"))
    imm = (await ex.request_body(body_msg(orjson.dumps(body)))).immediate_response
    assert imm.status.code == 400 and orjson.loads(imm.body)["error"]["param"] == param


# --- refusals ------------------------------------------------------------------------------

async def test_declared_content_length_over_the_cap_is_413_before_any_body() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    resp = ex.request_headers(headers_msg(content_length=65537))
    imm = resp.immediate_response
    assert imm.status.code == 413
    assert orjson.loads(imm.body)["error"]["type"] == "invalid_request_error"
    assert set_headers(imm)["x-should-retry"] == "false"
    assert rig.count("kvgate_requests_total", outcome="rejected_body_too_large") == 1


class CountingTokenizer:
    """CountingTokenizer wraps the real tokenizer and counts calls (to prove none happen)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls = 0

    def count(self, text: str) -> int:
        self.calls += 1
        return self.inner.count(text)


async def test_chunked_body_over_the_cap_is_413_and_never_tokenized() -> None:
    rig = Rig()
    pool = rig.gate.pools["default"]
    spy = CountingTokenizer(pool.tokenizer)
    rig.gate.pools["default"] = type(pool)(pool.config, spy, pool.template)
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg())  # no content-length: chunked
    big = chat("x " * 40000)
    resp = await ex.request_body(body_msg(big))
    assert resp.immediate_response.status.code == 413
    assert spy.calls == 0
    assert rig.inflight() == 0
    # a body that fits is counted with the same tokenizer
    await admit(rig)
    assert spy.calls > 0


async def test_a_body_sent_in_parts_is_collected_and_capped() -> None:
    """A non-BUFFERED Envoy config sends the body in parts: decide on the whole of it."""
    rig = Rig()
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg())
    payload = chat(max_tokens=5)
    first = await ex.request_body(body_msg(payload[:10], eos=False))
    assert first == pb.ProcessingResponse(request_body=pb.BodyResponse())
    assert ex.ending is None
    await ex.request_body(body_msg(payload[10:], eos=True))
    assert ex.ending is not None and ex.admitted.lease.demand.reserved_completion == 5
    ex.finish()
    big = Stream(rig.gate)
    big.request_headers(headers_msg())
    assert (await big.request_body(body_msg(b"x" * 40000, eos=False))).WhichOneof("response") == "request_body"
    resp = await big.request_body(body_msg(b"x" * 40000, eos=False))
    assert resp.immediate_response.status.code == 413
    assert rig.inflight() == 0


async def test_context_window_overflow_is_400_context_length_exceeded_before_any_budget() -> None:
    rig = Rig()
    tpm_before = rig.admission.snapshot("default").tpm_available
    ex, resp = await admit(rig, chat("word " * 3000, max_tokens=2000))
    imm = resp.immediate_response
    assert imm.status.code == 400
    err = orjson.loads(imm.body)["error"]
    assert err["code"] == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in err["message"]
    assert set_headers(imm)["x-should-retry"] == "false"
    assert rig.admission.snapshot("default").tpm_available == tpm_before
    assert rig.count("kvgate_requests_total", outcome="rejected_context_length") == 1
    assert ex.finish() is None


async def test_full_slots_give_429_with_openai_headers_then_a_freed_slot_admits() -> None:
    rig = Rig()
    a, _ = await admit(rig)
    b, _ = await admit(rig)
    c, resp = await admit(rig)
    imm = resp.immediate_response
    assert imm.status.code == 429
    hs = set_headers(imm)
    assert hs["x-kvgate-reason"] == "concurrency"
    assert int(hs["retry-after"]) >= 1
    assert int(hs["retry-after-ms"]) >= 1
    assert hs["x-ratelimit-limit-requests"] == "2"
    assert hs["x-ratelimit-remaining-requests"] == "0"
    assert "x-should-retry" not in hs
    err = orjson.loads(imm.body)["error"]
    assert err["code"] == "rate_limit_exceeded" and "concurrency" in err["message"]
    assert rig.count("kvgate_requests_total", outcome="rejected_concurrency") == 1
    assert c.finish() is None
    a.finish()  # the client went away
    assert a.ending.outcome.value == "client_disconnect"
    d, resp = await admit(rig)
    assert resp.WhichOneof("response") == "request_body"
    for ex in (b, d):
        ex.finish()
    assert rig.inflight() == 0


async def test_a_request_that_can_never_fit_says_do_not_retry() -> None:
    rig = Rig({"pools": {"default": {"max_concurrency": 4, "tpm": 1000, "context_window": 4096,
                                     "default_max_tokens": 256}}})
    ex, resp = await admit(rig, chat(max_tokens=2000))
    imm = resp.immediate_response
    assert imm.status.code == 429
    hs = set_headers(imm)
    assert hs["x-kvgate-reason"] == "tpm"
    assert hs["x-should-retry"] == "false"


BAD_BODIES = [
    (b"{not json", "application/json", 400),
    (b"[1, 2]", "application/json", 400),
    (b'"a string"', "application/json", 400),
    (b"{}", "application/json", 400),                                    # no messages
    (orjson.dumps({"messages": "hi"}), "application/json", 400),          # wrong type
    (orjson.dumps({"messages": []}), "application/json", 400),            # empty
    (chat(max_tokens=-5), "application/json", 400),
    (chat(max_tokens=10**12), "application/json", 400),
    (chat(max_tokens="many"), "application/json", 400),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "application/json", 400),
    (chat(), "text/plain", 415),
    (b"", "application/json", 400),
]


@pytest.mark.parametrize("body,content_type,status", BAD_BODIES)
async def test_bad_bodies_get_an_openai_shaped_4xx_and_hold_nothing(body: bytes, content_type: str,
                                                                     status: int) -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    hs = headers_msg()
    for h in hs.headers.headers:
        if h.key == "content-type":
            h.raw_value = content_type.encode()
    ex.request_headers(hs)
    resp = await ex.request_body(body_msg(body))
    imm = resp.immediate_response
    assert imm.status.code == status
    err = orjson.loads(imm.body)["error"]
    assert err["message"] and err["type"]
    assert set_headers(imm)["x-should-retry"] == "false"
    assert ex.finish() is None
    assert rig.inflight() == 0
    assert rig.count("kvgate_requests_total", outcome="rejected_invalid") == 1


async def test_post_without_a_body_is_refused_at_the_headers() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    resp = ex.request_headers(headers_msg(end_of_stream=True))
    assert resp.immediate_response.status.code == 400


async def test_duplicate_tenant_headers_are_refused() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    resp = ex.request_headers(headers_msg(extra=[("x-tenant-id", "acme"), ("x-tenant-id", "gold-1")]))
    imm = resp.immediate_response
    assert imm.status.code == 400
    assert orjson.loads(imm.body)["error"]["param"] == "x-tenant-id"
    assert rig.count("kvgate_requests_total", outcome="rejected_invalid") == 1


# --- identity and per-route settings ----------------------------------------------------------

async def test_tenant_from_header_and_from_hashed_api_key() -> None:
    rig = Rig()
    by_header, _ = await admit(rig, extra=[("x-tenant-id", "acme")])
    assert by_header.admitted.lease.demand.tenant == "acme"
    assert by_header.admitted.lease.demand.class_name == "standard"
    # the key is a credential: it wins over a header claiming another tenant
    by_key, _ = await admit(rig, extra=[("authorization", f"Bearer {API_KEY}"),
                                        ("x-tenant-id", "acme")])
    assert by_key.admitted.lease.demand.tenant == "gold-1"
    assert by_key.admitted.lease.demand.class_name == "gold"
    assert rig.admission.snapshot("default").inflight_by_class.get("gold") == 1
    by_key.finish()
    unknown, _ = await admit(rig, extra=[("authorization", "Bearer nope"),
                                         ("x-tenant-id", "someone-else")])
    assert unknown.admitted.lease.demand.tenant == ANONYMOUS_TENANT
    for ex in (by_header, unknown):
        ex.finish()


async def test_a_tenant_with_keys_is_not_reachable_by_its_name_alone() -> None:
    rig = Rig()
    for extra in ([("x-tenant-id", "gold-1")],
                  [("x-tenant-id", "gold-1"), ("authorization", "Bearer wrong-key")]):
        ex = Stream(rig.gate)
        resp = ex.request_headers(headers_msg(extra=extra))
        imm = resp.immediate_response
        assert imm.status.code == 401, extra
        assert orjson.loads(imm.body)["error"]["code"] == "invalid_api_key"
        assert set_headers(imm)["x-kvgate-reason"] == "unauthenticated"
        ex.finish()
    assert rig.count("kvgate_requests_total", outcome="rejected_unauthenticated") == 2
    assert rig.inflight() == 0
    # with its key the claim is the tenant's; a keyless tenant's name is still enough
    ok, _ = await admit(rig, extra=[("x-tenant-id", "gold-1"),
                                    ("authorization", f"Bearer {API_KEY}")])
    assert ok.admitted.lease.demand.class_name == "gold"
    plain, _ = await admit(rig, extra=[("x-tenant-id", "acme")])
    assert plain.admitted.lease.demand.tenant == "acme"
    for ex in (ok, plain):
        ex.finish()


async def test_route_metadata_picks_pool_class_and_context_window() -> None:
    rig = Rig()
    md = route_metadata(pool="small", tenant_class="gold", context_window=512.0)
    ex, resp = await admit(rig, chat(max_tokens=10), metadata=md)
    assert ex.admitted.lease.demand.pool == "small"
    assert ex.admitted.lease.demand.class_name == "gold"
    assert rig.inflight("small") == 1 and rig.inflight("default") == 0
    # 600 tokens fit the file's 1024 window of pool small, not the route's 512
    _, resp = await admit(rig, chat("word " * 600, max_tokens=10), metadata=md)
    assert orjson.loads(resp.immediate_response.body)["error"]["code"] == "context_length_exceeded"
    ex.finish()
    assert rig.count("kvgate_route_metadata_errors_total") == 0


async def test_route_max_body_bytes_applies_to_content_length() -> None:
    rig = Rig()
    ex = Stream(rig.gate)
    resp = ex.request_headers(headers_msg(content_length=2000), route_metadata(max_body_bytes=1024.0))
    assert resp.immediate_response.status.code == 413


@pytest.mark.parametrize("values,key", [
    ({"pool": "nope"}, "pool"),
    ({"pool": 3.0}, "pool"),
    ({"tenant_class": "platinum"}, "tenant_class"),
    ({"context_window": 1.5}, "context_window"),
    ({"context_window": -4.0}, "context_window"),
    ({"max_body_bytes": "big"}, "max_body_bytes"),
    ({"colour": "blue"}, "unknown"),
])
async def test_bad_route_metadata_is_counted_and_ignored(values: dict[str, Any], key: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig()
    ex, resp = await admit(rig, metadata=route_metadata(**values))
    assert resp.WhichOneof("response") == "request_body"
    assert ex.admitted.lease.demand.pool == "default"
    assert rig.count("kvgate_route_metadata_errors_total", key=key) == 1
    await admit(rig, metadata=route_metadata(**values))
    assert rig.count("kvgate_route_metadata_errors_total", key=key) == 2
    logged = [r for r in caplog.records if "per-route" in r.getMessage()]
    assert len(logged) == 1  # logged once, counted every time
    rig.clock.advance(61)
    await admit(rig, metadata=route_metadata(**values))
    assert len([r for r in caplog.records if "per-route" in r.getMessage()]) == 2


# --- ends ------------------------------------------------------------------------------------

async def test_disconnect_mid_stream_charges_the_delivered_chunks() -> None:
    rig = Rig()
    ex, _ = await admit(rig, chat(stream=True, max_tokens=200))
    ex.response_headers(response_headers_msg(content_type="text/event-stream"))
    ex.response_body(body_msg(sse(token_chunk(0), token_chunk(1), token_chunk(2), done=False), eos=False))
    tpm_before = rig.admission.snapshot("default").tpm_available
    assert ex.finish() is not None
    assert ex.ending.outcome.value == "client_disconnect"
    assert rig.inflight() == 0
    # 200 reserved, 3 delivered: 197 refunded
    assert rig.admission.snapshot("default").tpm_available == pytest.approx(tpm_before + 197, abs=1)
    assert rig.count("kvgate_releases_total", cause="client_disconnect") == 1


async def test_a_client_closing_on_done_before_the_body_ends_completed_its_stream() -> None:
    """openai-python closes the response on ``[DONE]``, often before the upstream's end of
    body reaches Envoy: the stream is complete all the same, not a disconnect."""
    rig = Rig()
    ex, _ = await admit(rig, chat(stream=True, max_tokens=200))
    ex.response_headers(response_headers_msg(content_type="text/event-stream"))
    ex.response_body(body_msg(sse(token_chunk(0), token_chunk(1), done=True), eos=False))
    assert ex.finish() is not None
    assert ex.ending.outcome.value == "completed"
    assert rig.count("kvgate_releases_total", cause="completed") == 1
    assert rig.count("kvgate_releases_total", cause="client_disconnect") == 0


async def test_upstream_error_status_releases_as_upstream_error() -> None:
    rig = Rig()
    ex, _ = await admit(rig)
    ex.response_headers(response_headers_msg(status=503))
    ex.response_body(body_msg(b'{"error": "overloaded"}', eos=True))
    assert ex.ending.outcome.value == "upstream_error"
    assert rig.inflight() == 0
    assert rig.count("kvgate_releases_total", cause="upstream_error") == 1


async def test_headers_only_response_completes() -> None:
    rig = Rig()
    ex, _ = await admit(rig)
    ex.response_headers(response_headers_msg(end_of_stream=True))
    assert ex.ending.outcome.value == "completed"


async def test_giving_up_releases_as_timeout() -> None:
    rig = Rig()
    ex, _ = await admit(rig)
    assert ex.finish(gave_up=True).value == "timeout"
    assert ex.finish() is None
    assert rig.count("kvgate_releases_total", cause="timeout") == 1


async def test_large_bodies_are_counted_off_the_loop_with_the_same_result() -> None:
    rig = Rig()
    rig.gate.offload_bytes = 4096
    text = "The quick brown fox jumps over the lazy dog. " * 300  # ~13 KB, ~3000 tokens
    on_loop = Rig()
    on_loop.gate.offload_bytes = 1 << 30
    ex1, _ = await admit(rig, chat(text, max_tokens=10))
    ex2, _ = await admit(on_loop, chat(text, max_tokens=10))
    assert ex1.admitted.lease.demand.prompt_tokens == ex2.admitted.lease.demand.prompt_tokens
    tok = load_tokenizer("cl100k_base")
    assert ex1.admitted.lease.demand.prompt_tokens >= tok.count(text) > 2000


async def test_a_waiting_class_extends_envoys_message_timeout_first() -> None:
    rig = Rig({"tenants": {**BASE_CONFIG["tenants"],
                           "tenants": {"slow": {"class": "patient"}}}})
    sent: list[pb.ProcessingResponse] = []

    async def send(resp: pb.ProcessingResponse) -> None:
        sent.append(resp)

    ex = Stream(rig.gate)
    ex.request_headers(headers_msg(extra=[("x-tenant-id", "slow")]))
    resp = await ex.request_body(body_msg(chat()), send)
    assert resp.WhichOneof("response") == "request_body"
    assert len(sent) == 1 and sent[0].override_message_timeout.seconds == 3
    ex.finish()


async def test_a_waiter_whose_stream_is_cancelled_holds_nothing() -> None:
    rig = Rig({"tenants": {**BASE_CONFIG["tenants"],
                           "tenants": {"slow": {"class": "patient"}}}})
    held = [(await admit(rig))[0] for _ in range(2)]
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg(extra=[("x-tenant-id", "slow")]))
    task = asyncio.ensure_future(ex.request_body(body_msg(chat())))
    await asyncio.sleep(0)  # let it queue (no time passes on the manual clock)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ex.finish()
    for h in held:
        h.finish()
    assert rig.inflight() == 0
    assert rig.admission.snapshot("default").kv_inflight == 0


# --- invariant -------------------------------------------------------------------------------

EVENTS = st.lists(st.sampled_from(["headers", "body", "big", "rh200", "rh500", "rh_sse", "chunk",
                                   "eos", "finish", "give_up"]), max_size=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(EVENTS, min_size=1, max_size=4))
def test_every_stream_ends_with_nothing_held_and_at_most_one_release(scripts: list[list[str]]) -> None:
    """Whatever order messages arrive in (even nonsense), after finish nothing is held and
    each request released at most once."""
    async def run() -> None:
        rig = Rig()
        streams = []
        for script in scripts:
            ex = Stream(rig.gate)
            streams.append(ex)
            for ev in script:
                if ev == "headers":
                    ex.request_headers(headers_msg())
                elif ev in ("body", "big"):
                    payload = chat(stream=True) if ev == "body" else chat("y " * 40000)
                    await ex.request_body(body_msg(payload))
                elif ev.startswith("rh"):
                    ex.response_headers(response_headers_msg(
                        500 if ev == "rh500" else 200,
                        "text/event-stream" if ev == "rh_sse" else "application/json"))
                elif ev == "chunk":
                    ex.response_body(body_msg(sse(token_chunk(0), done=False), eos=False))
                elif ev == "eos":
                    ex.response_body(body_msg(b"", eos=True))
                elif ev == "finish":
                    ex.finish()
                else:
                    ex.finish(gave_up=True)
        for ex in streams:
            ex.finish()
        assert rig.inflight() == 0
        assert rig.admission.snapshot("default").kv_inflight == 0
        admitted = rig.count("kvgate_requests_total", outcome="admitted")
        assert rig.count("kvgate_releases_total") == admitted
    asyncio.run(run())


async def test_a_shared_store_that_cannot_answer_gives_503_and_holds_nothing() -> None:
    """A Redis store set to fail closed, with nothing listening: 503, retry shortly."""
    from extproc.admission.store.redis import RedisStore
    from extproc.config import RedisStoreConfig
    from kvgate_testkit.procs import free_port

    rig = Rig()
    store = RedisStore(RedisStoreConfig(url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.05,
                                        on_unavailable="fail_closed"), observer=rig.metrics)
    rig.admission = Admission(rig.config, rig.clock, store)
    rig.gate = Gate(rig.config, rig.admission, rig.metrics, rig.clock)
    try:
        ex, resp = await admit(rig)
        imm = resp.immediate_response
        assert imm.status.code == 503
        hs = set_headers(imm)
        assert hs["x-kvgate-reason"] == "store_unavailable" and hs["retry-after"] == "1"
        assert orjson.loads(imm.body)["error"]["code"] == "store_unavailable"
        assert ex.ending is None and ex.finish() is None
        assert rig.count("kvgate_requests_total", outcome="rejected_store_unavailable") == 1
        assert rig.count("kvgate_store_mode", mode="fail_closed") == 1
        assert rig.count("kvgate_store_errors_total") >= 1
    finally:
        await store.close()


# --- enforce_max_tokens --------------------------------------------------------------

def _enforcing(**pool: Any) -> Rig:
    pools = orjson.loads(orjson.dumps(BASE_CONFIG["pools"]))
    pools["default"].update({"enforce_max_tokens": True, **pool})
    return Rig({"pools": pools})


async def test_enforce_max_tokens_caps_an_uncapped_request_at_its_reservation() -> None:
    rig = _enforcing()
    ex, resp = await admit(rig, chat())
    common = resp.request_body.response
    sent = orjson.loads(common.body_mutation.body)
    # no max_tokens: the reservation is min(window - prompt, default_max_tokens) = 256
    assert ex.admitted.lease.demand.reserved_completion == 256
    assert sent["max_tokens"] == 256
    assert "stream_options" not in sent  # not streamed: nothing else changes
    assert set_headers(common)["content-length"] == str(len(common.body_mutation.body))
    ex.finish()


async def test_enforce_max_tokens_divides_the_reservation_over_the_choices_and_keeps_stream_usage() -> None:
    rig = _enforcing()
    ex, resp = await admit(rig, chat(n=2, stream=True))
    sent = orjson.loads(resp.request_body.response.body_mutation.body)
    assert ex.admitted.lease.demand.reserved_completion == 2 * 256
    assert sent["max_tokens"] == 256 and sent["n"] == 2
    assert sent["stream_options"] == {"include_usage": True}
    # Asked for by kvgate, not by the client: hidden from it.
    ex.response_headers(response_headers_msg(content_type="text/event-stream"))
    out = ex.response_body(body_msg(sse(token_chunk(0), USAGE_CHUNK), eos=True))
    assert out.response_body.response.body_mutation.body == sse(token_chunk(0))


@pytest.mark.parametrize("cap", [{"max_tokens": 40}, {"max_completion_tokens": 40}])
async def test_enforce_max_tokens_leaves_a_client_cap_alone(cap: dict[str, int]) -> None:
    rig = _enforcing()
    ex, resp = await admit(rig, chat(**cap))
    assert not resp.request_body.response.HasField("body_mutation")
    assert ex.admitted.lease.demand.reserved_completion == 40


async def test_without_enforce_max_tokens_an_uncapped_request_goes_as_sent() -> None:
    rig = Rig()
    ex, resp = await admit(rig, chat())
    assert not resp.request_body.response.HasField("body_mutation")
    assert ex.admitted.lease.demand.reserved_completion == 256


def test_kvgates_own_503s_and_500_say_whether_a_retry_may_pass() -> None:
    from extproc.answers import misconfigured, unavailable
    again = set_headers(unavailable("store_unavailable", "Retry shortly.").immediate_response)
    assert again["x-should-retry"] == "true" and again["retry-after"] == "1"
    never = set_headers(unavailable("no_endpoint", "No.", should_retry=False).immediate_response)
    assert never["x-should-retry"] == "false" and "retry-after" not in never
    assert set_headers(misconfigured().immediate_response)["x-should-retry"] == "false"
