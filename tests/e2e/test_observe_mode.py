"""End to end: the operator option deploy/envoy-observe.yaml.

The response goes to a second ext_proc filter in observability mode (no blocking message
per streamed chunk); kvgate ties it to the admission stream by a link in the request's
dynamic metadata. Admission, refusals, usage, release causes and the x-ratelimit-* headers
must work as with deploy/envoy.yaml; the documented differences are checked too: kvgate
does not rewrite the request to ask for stream usage, and a disconnect frees the slot
after Envoy's deferred close (20 ms), well within 100 ms.
"""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest

from tests.e2e.options import (MESSAGES, client_usage_arrives, disconnect_released,  # noqa: F401
                               hold_streams, let_go, module_stack, no_leak, refused_for_concurrency,
                               stream_passes_untouched, upstream_error_released)
from kvgate_testkit.stack import Stack, released
from kvgate_testkit.stack import openai_client as client
from kvgate_testkit.procs import ROOT, wait_until

pytestmark = pytest.mark.e2e

CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 2, "tpm": 1_000_000, "context_window": 4096,
                          "default_max_tokens": 256, "tokenizer": "cl100k_base",
                          "enforce_max_tokens": True}},
    "limits": {"max_body_bytes": 262144},
    "server": {"drain_s": 0, "grace_s": 1},
}
stack = module_stack("observe", ROOT / "deploy" / "envoy-observe.yaml", CONFIG)


def test_enforce_max_tokens_caps_the_body_without_asking_for_stream_usage(stack: Stack) -> None:
    list(client(stack).chat.completions.create(model="fake", messages=MESSAGES, stream=True))
    forwarded = orjson.loads(stack.upstream_json("/_fake/requests")[-1]["body"])
    assert forwarded["max_tokens"] == 256
    assert "stream_options" not in forwarded


def test_a_stream_is_admitted_observed_and_released_completed(stack: Stack) -> None:
    stream_passes_untouched(stack, "completed")


def test_usage_the_client_asked_for_reaches_it(stack: Stack) -> None:
    client_usage_arrives(stack)


def test_non_streamed_answer_carries_ratelimit_headers_from_metadata(stack: Stack) -> None:
    before = released(stack, "completed")
    raw = client(stack).chat.completions.with_raw_response.create(
        model="fake", messages=MESSAGES, max_tokens=4)
    assert raw.parse().usage.completion_tokens == 4
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 1_000_000
    assert raw.headers["x-ratelimit-reset-tokens"].endswith("s")
    wait_until(lambda: released(stack, "completed") == before + 1, timeout=15, what="a completed release")


def test_a_disconnect_frees_the_slot_at_once(stack: Stack) -> None:
    disconnect_released(stack, "client_disconnect")


def test_full_slots_refuse_with_429_and_its_headers(stack: Stack) -> None:
    held = []
    try:
        held = hold_streams(stack, 2)
        hs = refused_for_concurrency(stack)
        assert hs["x-ratelimit-remaining-requests"] == "0"  # kvgate's own, not doubled
        assert "," not in hs["x-ratelimit-limit-requests"]
    finally:
        let_go(stack, 2)
        for s in held:
            list(s)


def test_refusals_and_upstream_errors(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=5000)
    assert exc.value.code == "context_length_exceeded"
    upstream_error_released(stack)


def test_other_paths_pass_through(stack: Stack) -> None:
    assert [m.id for m in client(stack).models.list().data] == ["fake"]


def test_nothing_left_behind(stack: Stack) -> None:
    assert stack.inflight() == 0
    assert stack.metric("kvgate_kv_inflight_tokens") == 0
    assert stack.metric("kvgate_releases_total") == stack.metric("kvgate_requests_total", outcome="admitted")
    assert stack.metric("kvgate_internal_errors_total") == 0
