"""End to end: Envoy's own answers in the shipped files, and a dead node of a pool-level pool.

Through the real Envoy with the files of deploy/: a chunked body past the listener's buffer
(no length for the 413 route to see) gets OpenAI's 413 from the recommended picker file and
from the pool-level one; no node to send a request to is OpenAI's 503; and a node killed
behind deploy/envoy.yaml (Envoy's own round robin) gets at most two requests
(``EJECT_AFTER_FAILURES``), each retried on another node, so that no client sees it fail.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from extproc.envoyclusters import EJECT_AFTER_FAILURES
from extproc.envoyconf import HCM_TYPE, local_reply
from kvgate_testkit.nodes_stack import MODEL, NodesStack
from kvgate_testkit.procs import LOOPBACK, ROOT, VENV_BIN, Proc, free_port, wait_until
from kvgate_testkit.stack import Stack

pytestmark = pytest.mark.e2e

PICKER_LOG_ENVOY = ROOT / "deploy" / "envoy-endpoint-picker-log.yaml"
POOL_ENVOY = ROOT / "deploy" / "envoy.yaml"
CHUNK = b"x" * 65536
BIG = 6 * 1024 * 1024  # past the 4 MiB listener buffer of every shipped file


def chunked_post(port: int, size: int, chunked: bool = True) -> tuple[int, dict[str, str], bytes]:
    """chunked_post sends a POST of ``size`` bytes with no content-length (chunked; or with one,
    ``chunked`` False), reading the answer while it sends: Envoy (or kvgate, at a declared
    length) answers a body past the limit before the body has ended, and closes the connection
    behind the answer."""
    sock = socket.create_connection((LOOPBACK, port), timeout=30)
    framing = b"transfer-encoding: chunked" if chunked else b"content-length: %d" % (len(CHUNK) * (size // len(CHUNK)))

    def send() -> None:
        try:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         + framing + b"\r\n\r\n")
            for _ in range(size // len(CHUNK)):
                sock.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK) if chunked else CHUNK)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # Envoy has answered and closed: the rest of the body is not wanted
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    answer = b""
    try:
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    finally:
        sock.close()
        sender.join(timeout=10)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, want: int, code: str) -> None:
    assert status == want, (status, body[:300])
    assert headers["content-type"] == "application/json", headers
    err = orjson.loads(body)["error"]
    assert err["code"] == code and err["message"] and err["type"], err


class AdminNodesStack(NodesStack):
    """AdminNodesStack is the nodes stack with Envoy's admin interface on ``envoy_admin_port``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.envoy_admin_port = free_port()

    def envoy_config(self) -> dict[str, Any]:
        cfg = super().envoy_config()
        cfg["admin"] = {"address": {"socket_address": {"address": LOOPBACK, "port_value": self.envoy_admin_port}}}
        return cfg

    def envoy_stat(self, name: str) -> int:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.envoy_admin_port}/stats?filter=^{name}$",
                                    timeout=5) as resp:
            line = resp.read().decode().strip()
        return int(line.rsplit(":", 1)[1]) if line else 0


def finished(s: NodesStack, node: int) -> int:
    """finished is how many requests node ``node`` has finished, whatever their ending."""
    return sum(s.node_state(node)["finished"].values())


@pytest.fixture(scope="module")
def picker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodesStack]:
    s = NodesStack(tmp_path_factory.mktemp("whole-picker"), nodes=1, envoy_template=PICKER_LOG_ENVOY).start()
    wait_until(lambda: sum(s.per_node("kvgate_backend_pickable").values()) == 1, timeout=15, what="node up")
    yield s
    s.stop()


def test_a_chunked_body_past_the_buffer_gets_openais_413_from_the_picker_file(picker: NodesStack) -> None:
    status, headers, body = chunked_post(picker.envoy_port, BIG)
    assert_openai_error(status, headers, body, 413, "request_too_large")
    assert picker.metric("kvgate_inflight_requests") == 0
    # The same body with a declared length: refused by kvgate itself, also in OpenAI's shape.
    status, headers, body = chunked_post(picker.envoy_port, BIG, chunked=False)
    assert_openai_error(status, headers, body, 413, "request_too_large")


def test_a_chunked_body_past_the_buffer_and_no_upstream_get_openais_answers_from_the_pool_file(
        tmp_path: Path) -> None:
    s = Stack(tmp_path, {"pools": {"default": {"max_concurrency": 4, "tokenizer": "cl100k_base"}}},
              envoy_template=POOL_ENVOY).start()
    try:
        status, headers, body = chunked_post(s.envoy_port, BIG)
        assert_openai_error(status, headers, body, 413, "request_too_large")
        s.procs["upstream"].kill()  # the only node gone: every try is refused
        conn = http.client.HTTPConnection(LOOPBACK, s.envoy_port, timeout=30)
        conn.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                     body=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}))
        resp = conn.getresponse()
        assert_openai_error(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read(), 503,
                            "upstream_unavailable")
        conn.close()
        wait_until(lambda: s.inflight() == 0, timeout=10, what="the refused request released")
    finally:
        s.stop()


def test_a_killed_node_gets_at_most_two_requests_and_no_client_sees_it_fail(tmp_path: Path) -> None:
    from openai import OpenAI
    s = AdminNodesStack(tmp_path, nodes=3, picking=False, envoy_template=POOL_ENVOY).start()
    try:
        client = OpenAI(base_url=f"{s.base_url}/v1", api_key="x", max_retries=0, timeout=30)

        def ask() -> None:
            client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        for _ in range(6):  # every node has served: Envoy holds a connection to each
            ask()
        served = sum(finished(s, i) for i in range(2))
        s.procs[s.node_name(2)].kill()
        failed_before = s.envoy_stat("cluster.inference.upstream_cx_connect_fail")
        for _ in range(30):
            ask()  # raises on any refusal: a request sent to the dead node was retried elsewhere
        tries_on_dead = s.envoy_stat("cluster.inference.upstream_cx_connect_fail") - failed_before
        assert tries_on_dead <= EJECT_AFTER_FAILURES, tries_on_dead
        assert s.envoy_stat("cluster.inference.outlier_detection.ejections_active") == 1
        assert sum(finished(s, i) for i in range(2)) - served == 30
    finally:
        s.stop()


def test_a_cluster_with_no_host_is_openais_503(tmp_path: Path) -> None:
    """``no_healthy_upstream`` (an empty cluster, every host ejected, a picker cluster that
    finds no destination): the files' local_reply_config, alone in front of plain Envoy."""
    port = free_port()
    hcm = {"@type": HCM_TYPE, "stat_prefix": "t", "local_reply_config": local_reply(),
           "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
           "route_config": {"virtual_hosts": [{"name": "t", "domains": ["*"], "routes": [
               {"match": {"prefix": "/"}, "route": {"cluster": "empty"}}]}]}}
    cfg = {"static_resources": {
        "listeners": [{"name": "t", "address": {"socket_address": {"address": LOOPBACK, "port_value": port}},
                       "filter_chains": [{"filters": [{"name": "hcm", "typed_config": hcm}]}]}],
        "clusters": [{"name": "empty", "type": "STATIC", "load_assignment": {"cluster_name": "empty"}}]}}
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(cfg))
    envoy = Proc([str(VENV_BIN / "envoy"), "-c", str(tmp_path / "envoy.yaml"), "--log-level", "warn",
                  "--disable-hot-restart", "--concurrency", "1"], tmp_path / "envoy.log")
    try:
        envoy.wait_port(port)
        conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
        conn.request("GET", "/v1/models")
        resp = conn.getresponse()
        assert_openai_error(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read(), 503,
                            "upstream_unavailable")
        conn.close()
    finally:
        envoy.stop()
