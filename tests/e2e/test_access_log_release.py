"""End to end, issue 7: the operator option deploy/envoy-access-log.yaml.

kvgate answers the request body and ends its ext_proc stream there: an in-flight request
holds no gRPC stream in kvgate. The request's end comes by Envoy's gRPC access log, whose
entry carries the link kvgate wrote into the request's dynamic metadata; the response
status and flags tell completed, cut short and upstream error apart. The completion is
charged at its reservation.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.stack import Stack, released
from tests.e2e.stack import openai_client as client
from tests.support.procs import ROOT, wait_until

pytestmark = pytest.mark.e2e

TPM = 6000  # refills 100 tokens a second: small beside the 300 a refund would give back
CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 2, "tpm": TPM, "context_window": 4096,
                          "default_max_tokens": 256, "tokenizer": "cl100k_base"}},
    "limits": {"max_body_bytes": 262144},
    "server": {"drain_s": 0, "grace_s": 1},
}
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("access-log"), CONFIG,
              envoy_template=ROOT / "deploy" / "envoy-access-log.yaml")
    s.start()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def no_leak(stack: Stack) -> Iterator[None]:
    yield
    try:
        stack.wait_inflight(0, timeout=5)
    finally:
        stack.upstream_post("/_fake/reset")


def entries(stack: Stack, result: str) -> float:
    return stack.metric("kvgate_access_log_entries_total", result=result)


def test_a_non_streamed_answer_is_released_completed_with_its_headers(stack: Stack) -> None:
    before, logged = released(stack, "completed"), entries(stack, "released")
    raw = client(stack).chat.completions.with_raw_response.create(
        model="fake", messages=MESSAGES, max_tokens=4)
    assert raw.parse().usage.completion_tokens == 4
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < TPM
    wait_until(lambda: released(stack, "completed") == before + 1, timeout=5, what="a completed release")
    assert entries(stack, "released") == logged + 1


def test_a_held_stream_keeps_its_slot_with_no_ext_proc_stream_open(stack: Stack) -> None:
    """The point of the option: the lease outlives kvgate's stream, until the log entry."""
    held = []
    try:
        for i in range(2):
            s = client(stack).chat.completions.create(
                model="fake", messages=MESSAGES, stream=True, max_tokens=3,
                extra_headers={"x-fake-hold": f"full-{i}"})
            assert next(iter(s)).choices[0].delta.content == "tok0 "
            held.append(s)
        assert stack.inflight() == 2
        wait_until(lambda: stack.metric("kvgate_streams_active") == 0, timeout=5,
                   what="kvgate's ext_proc streams closed")
        with pytest.raises(openai.RateLimitError) as exc:
            client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=3)
        assert exc.value.response.headers["x-kvgate-reason"] == "concurrency"
    finally:
        for i in range(2):
            stack.upstream_post(f"/_fake/release/full-{i}")
    before = released(stack, "completed")
    for s in held:
        assert "".join(c.choices[0].delta.content or "" for c in s) == "tok1 tok2 "
    wait_until(lambda: released(stack, "completed") == before + 2, timeout=5, what="two completed releases")


def test_a_disconnect_is_released_as_one_within_100ms(stack: Stack) -> None:
    stream = client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, stream=True, max_tokens=3,
        extra_headers={"x-fake-hold": "gone"})
    assert next(iter(stream)).choices[0].delta.content == "tok0 "
    stack.wait_inflight(1)
    before = released(stack, "client_disconnect")
    t0 = time.monotonic()
    stream.close()
    wait_until(lambda: stack.inflight() == 0, timeout=2, interval=0.002, what="in-flight 0")
    elapsed = time.monotonic() - t0
    assert elapsed < 0.1, f"slot freed after {elapsed * 1000:.0f} ms"
    assert released(stack, "client_disconnect") == before + 1


def test_the_whole_reservation_is_charged(stack: Stack) -> None:
    def remaining() -> int:
        raw = client(stack).chat.completions.with_raw_response.create(
            model="fake", messages=MESSAGES, max_tokens=1)
        return int(raw.headers["x-ratelimit-remaining-tokens"])

    first = remaining()
    t0 = time.monotonic()
    client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, max_tokens=300, extra_headers={"x-fake-tokens": "2"})
    stack.wait_inflight(0)
    second = remaining()
    refill = (time.monotonic() - t0) * TPM / 60
    assert first - second >= 300 - refill, (first, second, refill)


def test_an_upstream_error_and_a_refusal_are_told_apart(stack: Stack) -> None:
    before, no_lease = released(stack, "upstream_error"), entries(stack, "no_lease")
    with pytest.raises(openai.InternalServerError):
        client(stack).chat.completions.create(
            model="fake", messages=MESSAGES, max_tokens=3, extra_headers={"x-fake-status": "503"})
    wait_until(lambda: released(stack, "upstream_error") == before + 1, timeout=5,
               what="an upstream_error release")
    with pytest.raises(openai.BadRequestError):  # refused by kvgate: no lease, no link
        client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=5000)
    wait_until(lambda: entries(stack, "no_lease") == no_lease + 1, timeout=5,
               what="the refusal's entry")
