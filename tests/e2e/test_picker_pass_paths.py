"""A request without a body through each Envoy file in which kvgate picks the node
(deploy/envoy-endpoint-picker.yaml, -endpoint-picker-log.yaml, -inference-pool.yaml), with
the real Envoy and two simulated nodes: a GET or HEAD of the model list goes to an up node,
uncharged, and is counted ``passed``; another method or a body is refused by kvgate before
any node sees it."""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import orjson
import pytest

from kvgate_testkit.nodes_stack import MODEL, NodesStack
from kvgate_testkit.procs import LOOPBACK, ROOT, wait_until

pytestmark = pytest.mark.e2e

PICKER_FILES = ["envoy-endpoint-picker.yaml", "envoy-endpoint-picker-log.yaml", "envoy-inference-pool.yaml"]


@pytest.fixture(scope="module", params=PICKER_FILES)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodesStack]:
    s = NodesStack(tmp_path_factory.mktemp("picker-pass"), nodes=2, kv_capacity_tokens=100_000,
                   envoy_template=ROOT / "deploy" / request.param).start()
    try:
        wait_until(lambda: sum(s.per_node("kvgate_backend_pickable").values()) == 2, timeout=15,
                   what="two nodes up")
        yield s
    finally:
        s.stop()


def send(stack: NodesStack, method: str, path: str,
         body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy_port, timeout=10)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_a_header_only_get_and_head_go_to_a_node_uncharged_and_are_counted(stack: NodesStack) -> None:
    picks = sum(stack.per_node("kvgate_backend_picks_total").values())
    passed = stack.metric("kvgate_requests_total", outcome="passed")
    status, _, body = send(stack, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in orjson.loads(body)["data"]] == [MODEL]
    status, _, body = send(stack, "HEAD", "/v1/models")
    assert status == 200 and body == b""
    status, _, _ = send(stack, "GET", "/health")
    assert status == 200
    assert stack.metric("kvgate_requests_total", outcome="passed") == passed + 3
    assert sum(stack.per_node("kvgate_backend_picks_total").values()) == picks
    assert stack.metric("kvgate_inflight_requests") == 0
    assert sum(stack.per_node("kvgate_backend_kv_inflight_tokens").values()) == 0


def test_another_method_or_a_body_is_refused_before_a_node_sees_it(stack: NodesStack) -> None:
    passed = stack.metric("kvgate_requests_total", outcome="passed")
    status, headers, body = send(stack, "POST", "/v1/models", b'{"model": "x"}')
    assert status == 405 and headers["allow"] == "GET, HEAD"
    assert orjson.loads(body)["error"]["code"] == "method_not_allowed"   # the node's own 405 has no such body
    status, headers, body = send(stack, "GET", "/v1/models", b"{}")
    assert status == 400 and orjson.loads(body)["error"]["code"] == "body_not_allowed"
    assert stack.metric("kvgate_requests_total", outcome="passed") == passed
    assert stack.metric("kvgate_inflight_requests") == 0
