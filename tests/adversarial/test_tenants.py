"""Hostile tenants: thousands of made-up identities must not grow kvgate's state or metrics.

Every request gets a tenant header value (or API key, or per-route metadata) nobody
configured. Unknown identities share the anonymous tenant, so the ``/metrics`` text,
the token buckets and the memory kvgate holds must not grow with their number. Driven
through ``Stream`` with the real admission core, tokenizer and metrics (gRPC adds
nothing to identity handling).
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from typing import Any

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from prometheus_client import CollectorRegistry

from extproc.admission import Admission
from extproc.clock import ManualClock
from extproc.configparse import parse_config
from kvgate_testkit.stream import Stream
from extproc.gate import Gate
from extproc.metrics import Metrics
from tests.adversarial.support import CONFIG, chat, header_map

# Per-tenant buckets for every class, so an unknown tenant that got a bucket of its own
# would show.
TENANT_CONFIG: dict[str, Any] = {**CONFIG, "tenants": {
    "header": "x-tenant-id", "default_class": "standard",
    "classes": {"standard": {"priority": 0, "tpm": 1_000_000}, "gold": {"priority": 1, "tpm": 2_000_000}},
    "tenants": {"acme": {"class": "standard"}, "gold-1": {"class": "gold",
                                                         "api_key_sha256": ["0" * 64]}}}}


class Gateway:
    """Gateway is a Gate over the real admission core and metrics, on a manual clock."""

    def __init__(self) -> None:
        self.config = parse_config(TENANT_CONFIG)
        self.clock = ManualClock(100.0)
        self.admission = Admission(self.config, self.clock)
        self.metrics = Metrics(CollectorRegistry())
        self.metrics.attach(self.admission, tuple(self.config.tenants.classes))
        self.gate = Gate(self.config, self.admission, self.metrics, self.clock)

    async def request(self, headers: list[tuple[str, bytes]], metadata: Any = None) -> str:
        """request runs one request to completion; returns the body answer's kind."""
        ex = Stream(self.gate)
        hs = [(":path", b"/v1/chat/completions"), (":method", b"POST"),
              ("content-type", b"application/json"), *headers]
        first = ex.request_headers(pb.HttpHeaders(headers=header_map(hs)), metadata)
        if first.WhichOneof("response") == "immediate_response":
            ex.finish()
            return "refused at headers"
        resp = await ex.request_body(pb.HttpBody(body=chat(max_tokens=5), end_of_stream=True))
        answer = resp.WhichOneof("response")
        if answer == "request_body":
            ex.response_headers(pb.HttpHeaders(headers=header_map(
                [(":status", b"200"), ("content-type", b"application/json")])))
            ex.response_body(pb.HttpBody(body=orjson.dumps(
                {"usage": {"prompt_tokens": 3, "completion_tokens": 2}}), end_of_stream=True))
        ex.finish()
        return str(answer)

    def run_many(self, headers_of: Any, n: int, metadata_of: Any = None) -> list[str]:
        async def go() -> list[str]:
            return [await self.request(headers_of(i), None if metadata_of is None else metadata_of(i))
                    for i in range(n)]
        return asyncio.run(go())

    def exposition(self) -> bytes:
        return self.metrics.render()[0]


def hostile_tenant(i: int) -> list[tuple[str, bytes]]:
    return [("x-tenant-id", f"tenant-{i}-{'x' * (i % 50)}\u00e9".encode())]


def hostile_key(i: int) -> list[tuple[str, bytes]]:
    return [("authorization", f"Bearer sk-{i:08d}".encode()), ("x-tenant-id", f"claim-{i}".encode())]


def test_thousands_of_tenant_names_do_not_grow_metrics_or_buckets() -> None:
    gw = Gateway()
    assert gw.run_many(hostile_tenant, 50) == ["request_body"] * 50
    size = len(gw.exposition())
    assert gw.run_many(lambda i: hostile_tenant(50 + i), 3000).count("request_body") == 3000
    assert gw.run_many(hostile_key, 2000).count("request_body") == 2000
    text = gw.exposition()
    assert len(text) <= size + 64  # counter values grow by a few digits, nothing else
    assert b"tenant-" not in text and b"claim-" not in text and b"sk-" not in text
    now = gw.clock.now()
    store = gw.admission.store
    for i in (0, 77, 2999):
        assert store.bucket_state("default", f"tenant:tenant-{i}-{'x' * (i % 50)}\u00e9", now) is None
    # All of them shared the anonymous tenant's bucket (each charged its prompt + 2).
    tokens, capacity = store.bucket_state("default", "tenant:_anonymous", now)
    assert capacity - tokens > 5050 * 5


def test_memory_does_not_grow_with_made_up_tenants() -> None:
    gw = Gateway()
    gw.run_many(hostile_tenant, 500)  # warm every cache that is meant to fill once
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        gw.run_many(lambda i: hostile_tenant(1000 + i) + hostile_key(i), 4000)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown < 256 * 1024, f"{grown} bytes kept after 4000 made-up tenants"


def test_made_up_route_metadata_keys_are_counted_under_one_label() -> None:
    gw = Gateway()

    def metadata(i: int) -> base_pb2.Metadata:
        s = struct_pb2.Struct()
        s.update({f"hostile-{i}": i, "pool": f"nope-{i}", "context_window": -i})
        md = base_pb2.Metadata()
        md.filter_metadata["kvgate"].CopyFrom(s)
        return md
    answers = gw.run_many(lambda i: [], 1000, metadata)
    assert answers == ["request_body"] * 1000  # bad settings are ignored, not fatal
    text = gw.exposition().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("kvgate_route_metadata_errors_total{")]
    assert sorted(ln.split("}")[0] for ln in lines) == [
        'kvgate_route_metadata_errors_total{key="context_window"',
        'kvgate_route_metadata_errors_total{key="pool"',
        'kvgate_route_metadata_errors_total{key="unknown"']
    assert "hostile-" not in text and "nope-" not in text
