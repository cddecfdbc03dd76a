"""End to end: the openai client -> the real Envoy (deploy/envoy.yaml) -> kvgate -> a fake vLLM.

One stack for the module. Pool ``default`` has two slots; a second route (header
``x-route: small``) carries per-route settings: pool ``small`` (one slot, 1024-token
window) and a 4 KiB body cap. After every test kvgate must hold nothing.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
from openai import OpenAI

from kvgate_testkit.stack import Stack, metadata_route
from kvgate_testkit.procs import LOOPBACK, ROOT, VENV_BIN, wait_until

pytestmark = pytest.mark.e2e

CONFIG: dict[str, Any] = {
    "pools": {
        "default": {"max_concurrency": 2, "tpm": 1_000_000, "context_window": 4096,
                    "default_max_tokens": 256, "tokenizer": "cl100k_base"},
        "small": {"max_concurrency": 1, "context_window": 1024, "default_max_tokens": 64,
                  "tokenizer": "cl100k_base", "enforce_max_tokens": True},
    },
    "limits": {"max_body_bytes": 262144},
    "tenants": {"header": "x-tenant-id", "default_class": "standard",
                "classes": {"standard": {"priority": 0}}, "tenants": {"acme": {"class": "standard"}}},
    "server": {"drain_s": 0, "grace_s": 1},
}
SMALL_ROUTE = metadata_route(("x-route", "small"), {"pool": "small", "max_body_bytes": 4096})
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def stack(start_stack: Any) -> Stack:
    return start_stack(CONFIG, routes=[SMALL_ROUTE])


@pytest.fixture(autouse=True)
def no_leak(stack: Stack) -> Iterator[None]:
    yield
    try:
        stack.wait_inflight(0, timeout=5)
    finally:
        stack.upstream_post("/_fake/reset")


def client(stack: Stack, retries: int = 0, **kw: Any) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=retries, **kw)


def raw_post(stack: Stack, body: bytes, headers: dict[str, str] | None = None,
             path: str = "/v1/chat/completions") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy_port, timeout=10)
    try:
        hs = {"content-type": "application/json", **(headers or {})}
        conn.request("POST", path, body=body, headers=hs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


# --- admitted ------------------------------------------------------------------------------

def test_stream_admitted_and_completed_and_the_client_sees_exactly_its_stream(stack: Stack) -> None:
    before = stack.metric("kvgate_releases_total", cause="completed")
    chunks = list(client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, stream=True, max_tokens=5))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "tok0 tok1 tok2 tok3 tok4 "
    assert all(c.choices for c in chunks)  # the usage chunk kvgate asked for is gone
    assert all(getattr(c, "usage", None) is None for c in chunks)
    forwarded = orjson.loads(stack.upstream_json("/_fake/requests")[-1]["body"])
    assert forwarded["stream_options"] == {"include_usage": True}
    assert stack.metric("kvgate_releases_total", cause="completed") == before + 1


def test_stream_that_asks_for_usage_gets_it(stack: Stack) -> None:
    chunks = list(client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, stream=True, max_tokens=3,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_non_streamed_chat_carries_ratelimit_headers(stack: Stack) -> None:
    raw = client(stack).chat.completions.with_raw_response.create(
        model="fake", messages=MESSAGES, max_tokens=4)
    reply = raw.parse()
    assert reply.usage.completion_tokens == 4
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 1_000_000
    assert raw.headers["x-ratelimit-reset-tokens"].endswith("s")


def test_embeddings_and_completions_are_admitted(stack: Stack) -> None:
    before = stack.metric("kvgate_requests_total", outcome="admitted")
    emb = client(stack).embeddings.create(model="fake", input=["one", "two"])
    assert len(emb.data) == 2
    comp = client(stack).completions.create(model="fake", prompt="Once upon", max_tokens=3)
    assert comp.usage.completion_tokens == 3
    assert stack.metric("kvgate_requests_total", outcome="admitted") == before + 2


def hold_stream(stack: Stack, key: str) -> Any:
    """hold_stream opens a stream the upstream holds after its first chunk (a busy slot)."""
    stream = client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, stream=True, max_tokens=3,
        extra_headers={"x-fake-hold": key})
    first = next(iter(stream))
    assert first.choices[0].delta.content == "tok0 "
    return stream


def test_other_paths_pass_through_unadmitted_while_the_pool_is_full(stack: Stack) -> None:
    """A pass path (the model list) takes no slot: with both slots held, a chat request is
    refused and the model list still answers."""
    held = [hold_stream(stack, f"pass-{i}") for i in range(2)]
    try:
        with pytest.raises(openai.RateLimitError):
            client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=3)
        models = client(stack).models.list()
        assert [m.id for m in models.data] == ["fake"]
        assert stack.inflight() == 2
    finally:
        stack.upstream_post("/_fake/release/pass-0")
        stack.upstream_post("/_fake/release/pass-1")
        for s in held:
            list(s)


# --- refused -------------------------------------------------------------------------------


def test_full_slots_429_with_headers_then_the_clients_retry_succeeds(stack: Stack) -> None:
    held = [hold_stream(stack, f"full-{i}") for i in range(2)]
    try:
        with pytest.raises(openai.RateLimitError) as exc:
            client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=3)
        err = exc.value
        hs = err.response.headers
        assert err.status_code == 429 and err.code == "rate_limit_exceeded"
        assert "concurrency" in err.message
        assert hs["x-kvgate-reason"] == "concurrency"
        assert int(hs["retry-after"]) >= 1 and int(hs["retry-after-ms"]) >= 1
        assert hs["x-ratelimit-limit-requests"] == "2"
        assert hs["x-ratelimit-remaining-requests"] == "0"
        assert "x-should-retry" not in hs

        # The client's own retry (retry-after-ms) succeeds once a slot frees.
        rejected = stack.metric("kvgate_requests_total", outcome="rejected_concurrency")

        def free_a_slot() -> None:
            wait_until(lambda: stack.metric("kvgate_requests_total", outcome="rejected_concurrency")
                       > rejected, timeout=10, what="a 429")
            stack.upstream_post("/_fake/release/full-0")
        helper = threading.Thread(target=free_a_slot)
        helper.start()
        reply = client(stack, retries=5).chat.completions.create(
            model="fake", messages=MESSAGES, max_tokens=3)
        helper.join()
        assert reply.usage.completion_tokens == 3
    finally:
        stack.upstream_post("/_fake/release/full-0")
        stack.upstream_post("/_fake/release/full-1")
        for s in held:
            list(s)


def test_client_disconnect_mid_stream_frees_the_slot_at_once(stack: Stack) -> None:
    """Only the disconnect frees the slot within the wait (no timer is that short); how fast
    is measured by `make bench-overhead`, not asserted on a shared machine."""
    stream = hold_stream(stack, "gone")
    stack.wait_inflight(1)
    disconnects = stack.metric("kvgate_releases_total", cause="client_disconnect")
    stream.close()  # the client closes its connection mid-stream
    wait_until(lambda: stack.inflight() == 0, timeout=15, interval=0.002, what="in-flight 0")
    # Counted when Envoy's access log entry tells the cause, milliseconds after the release.
    wait_until(lambda: stack.metric("kvgate_releases_total", cause="client_disconnect") == disconnects + 1,
               timeout=15, what="a client_disconnect release")


def test_context_length_exceeded(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=5000)
    err = exc.value
    assert err.code == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in err.message
    assert err.response.headers["x-should-retry"] == "false"


def test_a_large_body_is_counted_off_the_loop_within_envoys_message_timeout(stack: Stack) -> None:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    text = " ".join(words[(i * 7) % len(words)] + str(i % 97) for i in range(30000))  # ~230 KB
    status, hs, payload = raw_post(stack, orjson.dumps({"messages": [{"role": "user", "content": text}]}))
    assert status == 400, payload[:300]  # counted (tens of thousands of tokens), not timed out (504)
    assert orjson.loads(payload)["error"]["code"] == "context_length_exceeded"


def test_deploy_envoy_yaml_validates() -> None:
    res = subprocess.run([str(VENV_BIN / "envoy"), "--mode", "validate", "-c",
                          str(ROOT / "deploy" / "envoy.yaml")], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "OK" in res.stdout + res.stderr


def test_413_on_a_large_content_length_before_the_body(stack: Stack) -> None:
    # Declare 1 MiB but send nothing: the answer comes from the headers alone.
    with socket.create_connection((LOOPBACK, stack.envoy_port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                  b"content-type: application/json\r\ncontent-length: 1048576\r\n\r\n")
        head = s.recv(65536).decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head[:200]
    assert '"type":"invalid_request_error"' in head


def test_413_on_a_large_chunked_body(stack: Stack) -> None:
    big = orjson.dumps({"model": "fake", "messages": [{"role": "user", "content": "z " * 150000}]})
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy_port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=iter([big[:100000], big[100000:]]),
                     headers={"content-type": "application/json"}, encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 413
        assert orjson.loads(resp.read())["error"]["type"] == "invalid_request_error"
    finally:
        conn.close()


def test_route_settings_give_a_second_route_its_own_pool_and_limits(stack: Stack) -> None:
    small = client(stack, default_headers={"x-route": "small"})
    reply = small.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=3)
    assert reply.usage.completion_tokens == 3
    assert stack.metric("kvgate_requests_total", pool="small", outcome="admitted") >= 1
    # ~1500 tokens in ~3 KB: fine on the default route (4096), too long for this one (1024)
    long_prompt = [{"role": "user", "content": " ".join(str(i % 10) for i in range(1500))}]
    client(stack).chat.completions.create(model="fake", messages=long_prompt, max_tokens=3)
    with pytest.raises(openai.BadRequestError) as exc:
        small.chat.completions.create(model="fake", messages=long_prompt, max_tokens=3)
    assert exc.value.code == "context_length_exceeded"
    assert "maximum context length is 1024 tokens" in exc.value.message
    # the small route's body cap is 4 KiB
    status, _, body = raw_post(stack, orjson.dumps({"messages": [{"role": "user", "content": "a " * 3000}]}),
                               {"x-route": "small"})
    assert status == 413
    # one slot on the small pool, two on the default one
    stream = small.chat.completions.create(model="fake", messages=MESSAGES, stream=True, max_tokens=3,
                                           extra_headers={"x-fake-hold": "small-0"})
    next(iter(stream))
    try:
        with pytest.raises(openai.RateLimitError):
            small.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=3)
        assert client(stack).chat.completions.create(model="fake", messages=MESSAGES,
                                                     max_tokens=2).usage.completion_tokens == 2
    finally:
        stack.upstream_post("/_fake/release/small-0")
        list(stream)


def test_enforce_max_tokens_sends_the_reservation_upstream(stack: Stack) -> None:
    small = client(stack, default_headers={"x-route": "small"})
    small.chat.completions.create(model="fake", messages=MESSAGES)  # no max_tokens
    forwarded = orjson.loads(stack.upstream_json("/_fake/requests")[-1]["body"])
    assert forwarded["max_tokens"] == 64  # the small pool's default_max_tokens, reserved
    client(stack).chat.completions.create(model="fake", messages=MESSAGES)  # default pool: off
    forwarded = orjson.loads(stack.upstream_json("/_fake/requests")[-1]["body"])
    assert "max_tokens" not in forwarded


def test_upstream_5xx_is_passed_on_and_released_as_upstream_error(stack: Stack) -> None:
    before = stack.metric("kvgate_releases_total", cause="upstream_error")
    with pytest.raises(openai.InternalServerError):
        client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=3,
                                              extra_headers={"x-fake-status": "503"})
    assert stack.metric("kvgate_releases_total", cause="upstream_error") == before + 1


# --- bad input -------------------------------------------------------------------------------

IMAGE_PARTS = [{"role": "user", "content": [
    {"type": "text", "text": "What is in this image?"},
    {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png", "detail": "low"}}]}]

BAD_INPUTS: list[tuple[str, bytes, dict[str, str], int]] = [
    ("malformed json", b'{"messages": [', {}, 400),
    ("array", b"[1, 2, 3]", {}, 400),
    ("string", b'"hello"', {}, 400),
    ("missing messages", b'{"model": "fake"}', {}, 400),
    ("messages wrong type", b'{"messages": {"role": "user"}}', {}, 400),
    ("content wrong type", b'{"messages": [{"role": "user", "content": 42}]}', {}, 400),
    ("negative max_tokens", orjson.dumps({"messages": MESSAGES, "max_tokens": -1}), {}, 400),
    ("absurd max_tokens", orjson.dumps({"messages": MESSAGES, "max_tokens": 10**15}), {}, 400),
    ("max_tokens string", orjson.dumps({"messages": MESSAGES, "max_tokens": "ten"}), {}, 400),
    ("empty messages", b'{"messages": []}', {}, 400),
    ("non-utf8", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', {}, 400),
    ("wrong content-type", orjson.dumps({"messages": MESSAGES}), {"content-type": "text/plain"}, 415),
    ("128k spaces", orjson.dumps({"messages": [{"role": "user", "content": " " * 131072}],
                                  "max_tokens": 3500}), {}, 400),
    ("empty body", b"", {}, 400),
]


@pytest.mark.parametrize("name,body,headers,status", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_an_openai_shaped_4xx(stack: Stack, name: str, body: bytes,
                                            headers: dict[str, str], status: int) -> None:
    got, hs, payload = raw_post(stack, body, headers)
    assert got == status, payload[:300]
    err = orjson.loads(payload)["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert hs["x-should-retry"] == "false"


def test_client_sent_tenant_headers_are_removed_before_kvgate_even_repeated(stack: Stack) -> None:
    # The shipped files strip the client's tenant header (kvgate would refuse a repeated
    # one with a 400 naming it, as the unit tests check): the request is admitted.
    before = stack.metric("kvgate_requests_total", **{"class": "standard", "outcome": "admitted"})
    with socket.create_connection((LOOPBACK, stack.envoy_port), timeout=5) as s:
        body = orjson.dumps({"messages": MESSAGES})
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                  b"x-tenant-id: acme\r\nx-tenant-id: other\r\n"
                  b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    after = stack.metric("kvgate_requests_total", **{"class": "standard", "outcome": "admitted"})
    assert after == before + 1


def test_multi_part_content_is_counted_and_admitted(stack: Stack) -> None:
    reply = client(stack).chat.completions.create(model="fake", messages=IMAGE_PARTS, max_tokens=2)
    assert reply.usage.completion_tokens == 2


def test_no_request_left_anything_behind(stack: Stack) -> None:
    assert stack.inflight() == 0
    assert stack.metric("kvgate_kv_inflight_tokens") == 0
    admitted = stack.metric("kvgate_requests_total", outcome="admitted")
    assert stack.metric("kvgate_releases_total") == admitted
    assert stack.metric("kvgate_internal_errors_total") == 0
