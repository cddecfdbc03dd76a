"""End to end: what differs between the two Envoy files behaves the same.

deploy/envoy.yaml skips request headers (kvgate learns the request from attributes sent
with the body, and Envoy itself answers what must be answered before a body arrives);
deploy/envoy-four-message.yaml sends them. Each test here runs against both (the
``start_stack`` fixture is parametrized over the files).
"""

from __future__ import annotations

import hashlib
import http.client
import socket
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from kvgate_testkit.stack import Stack
from kvgate_testkit.procs import LOOPBACK

pytestmark = pytest.mark.e2e

ACME_KEY = "sk-acme-e2e"
CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 4, "context_window": 4096, "default_max_tokens": 64,
                          "tokenizer": "cl100k_base"}},
    "limits": {"max_body_bytes": 65536},
    "tenants": {"header": "x-tenant-id", "default_class": "standard",
                "classes": {"standard": {}, "gold": {}},
                "tenants": {"acme": {"class": "gold",
                                     "api_key_sha256": [hashlib.sha256(ACME_KEY.encode()).hexdigest()]}}},
    "server": {"drain_s": 0, "grace_s": 1},
}
# Above Envoy's per_connection_buffer_limit_bytes (4 MiB) in both files.
ABOVE_ENVOYS_BUFFER = 5 * 1024 * 1024


@pytest.fixture(scope="module")
def stack(start_stack: Any) -> Stack:
    return start_stack(CONFIG)


@pytest.fixture(autouse=True)
def no_leak(stack: Stack) -> Iterator[None]:
    yield
    stack.wait_inflight(0, timeout=5)


def post(stack: Stack, body: bytes | Any, headers: dict[str, str], chunked: bool = False) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy_port, timeout=20)
    try:
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"content-type": "application/json", **headers}, encode_chunked=chunked)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_a_body_above_envoys_own_buffer_gets_kvgates_413(stack: Stack) -> None:
    refused = stack.metric("kvgate_requests_total", outcome="rejected_body_too_large")
    piece = b"a" * (1024 * 1024)
    body = iter([b'{"messages": [{"role": "user", "content": "', *[piece] * 5, b'"}]}'])
    status, hs, payload = post(stack, body, {}, chunked=True)
    assert status == 413
    err = orjson.loads(payload)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    assert hs["x-should-retry"] == "false"
    assert stack.metric("kvgate_requests_total", outcome="rejected_body_too_large") == refused + 1


def test_the_api_key_decides_the_class_and_the_clients_tenant_header_does_not(stack: Stack) -> None:
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    gold = {"class": "gold", "outcome": "admitted"}
    before = stack.metric("kvgate_requests_total", **gold)
    status, _, _ = post(stack, body, {"x-tenant-id": "acme"})   # stripped by Envoy
    assert status == 200
    assert stack.metric("kvgate_requests_total", **gold) == before
    status, _, _ = post(stack, body, {"authorization": f"Bearer {ACME_KEY}"})
    assert status == 200
    assert stack.metric("kvgate_requests_total", **gold) == before + 1


def test_a_declared_length_above_the_cap_is_refused_before_the_body(stack: Stack) -> None:
    with socket.create_connection((LOOPBACK, stack.envoy_port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                  b"content-type: application/json\r\ncontent-length: 65537\r\n\r\n")
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    _, _, payload = head.partition(b"\r\n\r\n")
    assert b'"code":"request_too_large"' in payload
    # at the cap exactly, the body is awaited and read
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    status, _, _ = post(stack, body + b" " * (65536 - len(body)), {})
    assert status == 200
