"""End to end, issue 17: exact completion counts in deploy/envoy-access-log.yaml.

kvgate sees no response in that file; the Envoy Lua filter it writes (extproc/usage_log.py)
reads the response as it passes and the access log entry brings its findings, with which
kvgate settles the lease. What a request was charged is read from the pool's TPM bucket
(``kvgate_tpm_available_tokens``): two requests that differ only in the completion count
the upstream reports must differ by exactly that much, within what the bucket refilled
meanwhile (measured). Without the filter every one of them is charged its reservation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from tests.e2e.options import MESSAGES, module_stack, no_leak  # noqa: F401
from kvgate_testkit.stack import Stack, released
from kvgate_testkit.stack import openai_client as client
from kvgate_testkit.procs import ROOT, wait_until

pytestmark = pytest.mark.e2e

TPM = 60_000  # 1,000 tokens a second refilled: small beside the differences measured
MAX_TOKENS = 3000
CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 8, "tpm": TPM, "context_window": 8192,
                          "default_max_tokens": 256, "tokenizer": "cl100k_base"}},
    "limits": {"max_body_bytes": 262144},
    "server": {"drain_s": 0, "grace_s": 1},
}
stack = module_stack("access-log-usage", ROOT / "deploy" / "envoy-access-log.yaml", CONFIG)


@pytest.fixture(scope="module", autouse=True)
def warm(stack: Stack) -> None:
    """warm sends a first request, whose one-off costs (the client's import, the first
    connections) would otherwise widen the first measurement's refill allowance. It waits
    for its release: its entry, coming later, would be counted in the first test's figures."""
    stream(stack, "1")
    stack.wait_inflight(0, timeout=15)


def usage_counted(stack: Stack, result: str) -> float:
    return stack.metric("kvgate_logged_usage_total", result=result)


def charged(stack: Stack, send: Callable[[], None]) -> tuple[float, float]:
    """charged runs ``send`` (one request, to its end) and waits for its release; returns what
    the TPM bucket lost meanwhile as read, and the most it can have refilled in that time:
    the request was charged between the two."""
    before, t0 = stack.metric("kvgate_tpm_available_tokens", pool="default"), time.monotonic()
    send()
    stack.wait_inflight(0, timeout=15)
    after = stack.metric("kvgate_tpm_available_tokens", pool="default")
    return before - after, (time.monotonic() - t0) * TPM / 60


def assert_charged_more(first: tuple[float, float], second: tuple[float, float], more: int) -> None:
    """assert_charged_more: the second request was charged ``more`` tokens than the first."""
    (a, slack_a), (b, slack_b) = first, second
    assert more - slack_b <= b - a <= more + slack_a, (a, b, slack_a, slack_b)


def stream(stack: Stack, reported: str | None = None, *, usage: bool = False,
           headers: dict[str, str] | None = None) -> list[Any]:
    """stream is a streamed chat of 3 chunks (``MAX_TOKENS`` reserved) whose usage chunk,
    when there is one, reports ``reported`` completion tokens; returns the client's chunks."""
    extra = dict(headers or {})
    extra["x-fake-tokens"] = "3"
    if reported is not None:
        extra["x-fake-usage"] = reported
    options = {"stream_options": {"include_usage": True}} if usage else {}
    return list(client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, stream=True, max_tokens=MAX_TOKENS, extra_headers=extra,
        **options))


def text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_stream_that_did_not_ask_for_usage_is_charged_its_reported_count_and_sees_no_usage(
        stack: Stack) -> None:
    reported = usage_counted(stack, "reported")
    seen: list[list[Any]] = []
    few = charged(stack, lambda: seen.append(stream(stack, "100")))
    many = charged(stack, lambda: seen.append(stream(stack, "2100")))
    assert_charged_more(few, many, 2000)
    for chunks in seen:
        assert text(chunks) == "tok0 tok1 tok2 "
        assert all(c.choices and c.usage is None for c in chunks)  # kvgate's usage chunk hidden
    forwarded = orjson.loads(stack.upstream_json("/_fake/requests")[-1]["body"])
    assert forwarded["stream_options"] == {"include_usage": True}
    assert usage_counted(stack, "reported") == reported + 2


def test_a_stream_that_asked_for_usage_gets_it_and_is_charged_by_it(stack: Stack) -> None:
    seen: list[list[Any]] = []
    few = charged(stack, lambda: seen.append(stream(stack, "100", usage=True)))
    many = charged(stack, lambda: seen.append(stream(stack, "2100", usage=True)))
    assert_charged_more(few, many, 2000)
    assert [chunks[-1].usage.completion_tokens for chunks in seen] == [100, 2100]
    assert all(chunks[-1].choices == [] for chunks in seen)


@pytest.mark.parametrize("asked", [False, True])
def test_a_usage_event_split_across_two_chunks_is_read_whole(stack: Stack, asked: bool) -> None:
    split = {"x-fake-split-usage": "1"}
    seen: list[list[Any]] = []
    few = charged(stack, lambda: seen.append(stream(stack, "100", usage=asked, headers=split)))
    many = charged(stack, lambda: seen.append(stream(stack, "2100", usage=asked, headers=split)))
    assert_charged_more(few, many, 2000)
    for chunks in seen:
        assert text(chunks) == "tok0 tok1 tok2 "
        assert (chunks[-1].choices == []) is asked
    if asked:
        assert [chunks[-1].usage.completion_tokens for chunks in seen] == [100, 2100]


@pytest.mark.parametrize("split", [False, True])
def test_a_json_answer_is_charged_its_usage(stack: Stack, split: bool) -> None:
    def ask(reported: str) -> Callable[[], None]:
        headers = {"x-fake-tokens": "3", "x-fake-usage": reported}
        if split:
            headers["x-fake-split-usage"] = "1"
        return lambda: client(stack).chat.completions.create(
            model="fake", messages=MESSAGES, max_tokens=MAX_TOKENS, extra_headers=headers)

    assert_charged_more(charged(stack, ask("100")), charged(stack, ask("2100")), 2000)


def test_a_client_that_leaves_mid_stream_is_charged_the_events_it_got(stack: Stack) -> None:
    def leave() -> None:
        s = client(stack).chat.completions.create(
            model="fake", messages=MESSAGES, stream=True, max_tokens=MAX_TOKENS,
            extra_headers={"x-fake-hold": "leaving"})
        assert next(iter(s)).choices[0].delta.content == "tok0 "
        stack.wait_inflight(1)
        s.close()

    gone = released(stack, "client_disconnect")
    one_event = charged(stack, leave)
    assert released(stack, "client_disconnect") == gone + 1
    # The same charge as a completed answer reporting 1 token, the reservation less 1 below
    # one whose count is unknown.
    assert_charged_more(charged(stack, lambda: stream(stack, "1")), one_event, 0)
    assert_charged_more(one_event, charged(stack, lambda: stream(stack, "null")), MAX_TOKENS - 1)


def test_an_upstream_that_dies_mid_stream_is_charged_the_events_sent(stack: Stack) -> None:
    def die() -> None:
        s = client(stack).chat.completions.create(
            model="fake", messages=MESSAGES, stream=True, max_tokens=MAX_TOKENS,
            extra_headers={"x-fake-die-after": "2", "x-fake-delay-ms": "20"})
        with pytest.raises(Exception):
            for _ in s:
                pass

    errors = released(stack, "upstream_error")
    two_events = charged(stack, die)
    wait_until(lambda: released(stack, "upstream_error") == errors + 1, timeout=15,
               what="an upstream_error release")
    assert_charged_more(charged(stack, lambda: stream(stack, "2")), two_events, 0)
    assert_charged_more(two_events, charged(stack, lambda: stream(stack, "null")), MAX_TOKENS - 2)


@pytest.mark.parametrize("reported", ["-5", "1e30", '"7"', "99999999999999999999", "7.5", "null"])
def test_a_hostile_count_is_refused_and_the_reservation_charged(stack: Stack, reported: str) -> None:
    invalid = usage_counted(stack, "invalid")
    hostile = charged(stack, lambda: stream(stack, reported))
    assert usage_counted(stack, "invalid") == invalid + 1
    honest = charged(stack, lambda: stream(stack, "100"))
    assert_charged_more(honest, hostile, MAX_TOKENS - 100)


def test_a_count_above_the_reservation_is_charged_at_most_the_context_window(stack: Stack) -> None:
    huge = charged(stack, lambda: stream(stack, str(1 << 39)))
    honest = charged(stack, lambda: stream(stack, "100"))
    assert_charged_more(honest, huge, 8192 - 100)
