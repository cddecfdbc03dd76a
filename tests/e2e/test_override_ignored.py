"""End to end with the real Envoy: a class whose wait exceeds Envoy's max_message_timeout.

Envoy ignores kvgate's override_message_timeout above max_message_timeout and resets the
waiting request's stream at the base message_timeout: the client gets a 504. check-config
--envoy names the key beforehand; at run time kvgate counts it and says it once.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import yaml

from extproc.configparse import parse_config
from extproc.envoycheck import check_envoy
from extproc.envoyconf import envoy_bootstrap
from kvgate_testkit.stack import Stack, openai_client
from kvgate_testkit.procs import wait_until

pytestmark = pytest.mark.e2e

BASE_TIMEOUT_S = 0.5
CONFIG = {
    "pools": {"default": {"max_concurrency": 1, "tokenizer": "cl100k_base"}},
    "tenants": {"classes": {"standard": {}, "patient": {"max_wait_s": 5.0}},
                "tenants": {"slow": {"class": "patient"}}},
    "server": {"drain_s": 0, "grace_s": 1, "envoy_message_timeout_s": BASE_TIMEOUT_S},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("override")
    envoy = envoy_bootstrap(parse_config(CONFIG))
    ext = next(f["typed_config"] for f in
               envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
               if f["name"] == "envoy.filters.http.ext_proc")
    ext["max_message_timeout"] = "2s"  # below the 6 s the patient class asks for: the mistake
    (workdir / "envoy-template.yaml").write_text(yaml.safe_dump(envoy, sort_keys=False))
    found = check_envoy(parse_config(CONFIG), envoy)
    assert [d.key for d in found] == ["tenants.classes.patient.max_wait_s"]  # said beforehand
    # The written file strips the client's tenant header; the test sends it as a verified
    # source in front would.
    s = Stack(workdir / "stack", CONFIG, envoy_template=workdir / "envoy-template.yaml",
              tenant_header_from_client=True)
    s.start()
    yield s
    s.stop()


def post_waiting(stack: Stack) -> int:
    """post_waiting sends one request of the patient class and returns its HTTP status."""
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "wait"}]}).encode()
    req = urllib.request.Request(f"{stack.base_url}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-tenant-id": "slow"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_wait_cut_by_envoy_is_a_504_that_kvgate_counts_and_says_once(stack: Stack) -> None:
    holder = openai_client(stack).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hold"}], stream=True, max_tokens=3,
        extra_headers={"x-fake-hold": "slot"})
    assert next(iter(holder)).choices[0].delta.content  # the only slot is taken
    stack.wait_inflight(1)
    try:
        for _ in range(2):
            t0 = time.monotonic()
            assert post_waiting(stack) == 504
            elapsed = time.monotonic() - t0
            assert elapsed < 5.0  # the base timeout, not the class's 5 s wait
        wait_until(lambda: stack.metric("kvgate_envoy_override_ignored_total", **{"class": "patient"}) == 2,
                   timeout=10, what="both cut waits counted")
        said = [line for line in stack.log("kvgate").splitlines() if "ignored kvgate's message-timeout override" in line]
        assert len(said) == 1
    finally:
        stack.upstream_post("/_fake/release/slot")
        holder.close()
    stack.wait_inflight(0)
