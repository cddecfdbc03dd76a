"""The paths kvgate lets through without admission (``limits.pass_paths``: the model list,
health, version) through the real Envoy, with each of the two Envoy files of the e2e stack
(deploy/envoy.yaml skips the request headers, deploy/envoy-four-message.yaml sends them):
a GET or HEAD without a body passes and is counted (``passed``), taking nothing; another
method gets kvgate's 405, a body its 400, before anything reaches the upstream."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from kvgate_testkit.procs import LOOPBACK
from kvgate_testkit.stack import Stack

pytestmark = pytest.mark.e2e

CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 1, "context_window": 4096, "default_max_tokens": 64}},
    "server": {"drain_s": 0, "grace_s": 1},
}


@pytest.fixture(scope="module")
def stack(start_stack: Any) -> Stack:
    return start_stack(CONFIG)


@pytest.fixture(autouse=True)
def no_leak(stack: Stack) -> Iterator[None]:
    yield
    stack.wait_inflight(0, timeout=5)
    assert stack.metric("kvgate_kv_inflight_tokens") == 0


def send(stack: Stack, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """send is one HTTP/1.1 request through Envoy: status, headers (lower-case), body."""
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy_port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def passed(stack: Stack) -> float:
    return stack.metric("kvgate_requests_total", outcome="passed")


def test_a_get_and_a_head_of_the_model_list_pass_and_are_counted(stack: Stack) -> None:
    before = passed(stack)
    status, _, body = send(stack, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in orjson.loads(body)["data"]] == ["fake"]
    status, _, body = send(stack, "HEAD", "/v1/models")
    assert status == 200 and body == b""
    # A declared length of 0 is no body.
    status, _, _ = send(stack, "GET", "/v1/models", headers={"content-length": "0"})
    assert status == 200
    assert passed(stack) == before + 3
    assert stack.metric("kvgate_requests_total", outcome="admitted") == 0


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/models", b'{"model": "fake"}'),
    ("POST", "/v1/models", None),
    ("DELETE", "/v1/models/fake", None),
    ("PUT", "/health", b"{}"),
])
def test_a_pass_path_with_another_method_is_kvgates_405(stack: Stack, method: str, path: str,
                                                        body: bytes | None) -> None:
    before = stack.metric("kvgate_requests_total", outcome="rejected_path")
    passes = passed(stack)
    status, headers, payload = send(stack, method, path, body)
    assert status == 405
    assert orjson.loads(payload)["error"]["code"] == "method_not_allowed"   # kvgate's, not the upstream's
    assert headers["allow"] == "GET, HEAD" and headers["x-kvgate-reason"] == "path"
    assert stack.metric("kvgate_requests_total", outcome="rejected_path") == before + 1
    assert passed(stack) == passes


def test_a_get_with_a_body_is_kvgates_400(stack: Stack) -> None:
    before = stack.metric("kvgate_requests_total", outcome="rejected_invalid")
    passes = passed(stack)
    status, headers, payload = send(stack, "GET", "/v1/models", b'{"a": 1}')
    assert status == 400
    assert orjson.loads(payload)["error"]["code"] == "body_not_allowed"
    assert headers["x-kvgate-reason"] == "invalid" and headers["x-should-retry"] == "false"
    assert stack.metric("kvgate_requests_total", outcome="rejected_invalid") == before + 1
    assert passed(stack) == passes


def test_a_get_of_a_path_kvgate_does_not_know_is_refused_even_without_a_body(stack: Stack) -> None:
    """With request headers skipped, a request without a body used to reach the upstream
    unseen: the Envoy file now sends kvgate the headers of such requests."""
    status, headers, payload = send(stack, "GET", "/generate")
    assert status == 404 and headers["x-kvgate-reason"] == "path"
    assert orjson.loads(payload)["error"]["code"] == "unknown_url"
