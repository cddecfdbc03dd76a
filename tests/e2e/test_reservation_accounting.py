"""End to end: the operator option deploy/envoy-reservation.yaml.

The response body mode is NONE: kvgate answers the request body and the response headers,
and no streamed chunk waits for the processor. The ext_proc stream still ends with the
HTTP stream, so the lease is released on time; what is given up is the refund (the TPM bucket keeps the whole reservation, prompt +
``max_tokens``, instead of prompt + the completion the upstream reported) and the release
cause (``ended``: kvgate cannot tell a complete response from one cut short).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.options import (MESSAGES, bucket_drop, client_usage_arrives,  # noqa: F401
                               disconnect_released, hold_streams, let_go, module_stack, no_leak,
                               refused_for_concurrency, stream_passes_untouched,
                               upstream_error_released)
from kvgate_testkit.stack import Stack, released
from kvgate_testkit.stack import openai_client as client
from kvgate_testkit.procs import ROOT, wait_until

pytestmark = pytest.mark.e2e

TPM = 6000  # refills 100 tokens a second: small beside the 300 a refund would give back
CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 2, "tpm": TPM, "context_window": 4096,
                          "default_max_tokens": 256, "tokenizer": "cl100k_base"}},
    "limits": {"max_body_bytes": 262144},
    "server": {"drain_s": 0, "grace_s": 1},
}
stack = module_stack("reservation", ROOT / "deploy" / "envoy-reservation.yaml", CONFIG)


def test_a_stream_reaches_the_client_whole_and_is_released_as_ended(stack: Stack) -> None:
    stream_passes_untouched(stack, "ended")


def test_usage_the_client_asked_for_reaches_it_untouched(stack: Stack) -> None:
    client_usage_arrives(stack)


def test_the_whole_reservation_is_charged_not_the_reported_completion(stack: Stack) -> None:
    """A 300-token reservation of which the upstream generates 2: the bucket keeps 300
    (with the refund of the usage accounting it would drop ~298 tokens less)."""
    drop, refill = bucket_drop(stack, TPM, max_tokens=300, generated=2)
    assert drop >= 300 - refill, (drop, refill)


def test_non_streamed_answer_carries_the_ratelimit_headers(stack: Stack) -> None:
    before = released(stack, "ended")
    raw = client(stack).chat.completions.with_raw_response.create(
        model="fake", messages=MESSAGES, max_tokens=4)
    assert raw.parse().usage.completion_tokens == 4
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < TPM
    wait_until(lambda: released(stack, "ended") == before + 1, timeout=15, what="an ended release")


def test_a_disconnect_frees_the_slot_at_once(stack: Stack) -> None:
    """Released as ``ended``: Envoy ends the stream of a cut response as it ends a complete one."""
    disconnect_released(stack, "ended")


def test_a_held_stream_keeps_its_slot_until_it_ends(stack: Stack) -> None:
    """The lease is not released when the response headers pass: the ext_proc stream stays
    open for as long as the HTTP stream, body unread."""
    held = []
    try:
        held = hold_streams(stack, 2)
        assert stack.inflight() == 2
        refused_for_concurrency(stack)
    finally:
        let_go(stack, 2)
        for s in held:
            list(s)


def test_an_upstream_error_is_released_as_one(stack: Stack) -> None:
    upstream_error_released(stack)
