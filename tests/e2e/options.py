"""Helpers shared by the end-to-end modules of the Envoy options (observe, reservation,
access-log): one stack per module on the option's file, the leak check after each test,
and the two measurements every option is held to."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvgate_testkit.stack import Stack, openai_client, released
from kvgate_testkit.procs import wait_until

MESSAGES = [{"role": "user", "content": "Say hello"}]


def module_stack(name: str, envoy_file: Path, config: dict[str, Any],
                 routes: Sequence[dict[str, Any]] = ()) -> Callable[..., Iterator[Stack]]:
    """module_stack is a module-scoped ``stack`` fixture: ``config`` behind ``envoy_file``."""

    @pytest.fixture(scope="module")
    def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
        s = Stack(tmp_path_factory.mktemp(name), config, envoy_template=envoy_file, routes=routes)
        s.start()
        yield s
        s.stop()

    return stack


@pytest.fixture(autouse=True)
def no_leak(stack: Stack) -> Iterator[None]:
    """no_leak checks after each test that kvgate holds nothing, then resets the upstream."""
    yield
    try:
        stack.wait_inflight(0, timeout=5)
    finally:
        stack.upstream_post("/_fake/reset")


def wait_released(stack: Stack, cause: str, count: float, timeout: float = 15) -> None:
    """wait_released waits until kvgate has released ``count`` leases with ``cause``; if it
    never does, the failure says what the access log brought (entries by result), the
    releases by cause and the end of kvgate's and Envoy's logs."""
    try:
        wait_until(lambda: released(stack, cause) == count, timeout=timeout, what=f"{count:g} {cause} releases")
    except TimeoutError as exc:
        entries = {r: stack.metric("kvgate_access_log_entries_total", result=r)
                   for r in ("released", "no_lease", "unmatched", "cause", "complete")}
        causes = {c: released(stack, c)
                  for c in ("completed", "client_disconnect", "upstream_error", "timeout", "ended")}
        raise AssertionError(f"{exc}; access log entries {entries}; releases {causes}\n"
                             f"kvgate: {stack.log('kvgate')[-2000:]}\nenvoy: {stack.log('envoy')[-2000:]}") from exc


def disconnect_released(stack: Stack, cause: str) -> None:
    """disconnect_released cuts a held stream after its first chunk and waits for its slot
    to be free; the release must be counted once with ``cause``. Only the disconnect can
    free it within the wait: every timer that could (the grace period, the access log's
    TTL, a lease's) is longer. How fast it is freed is measured by `make bench-overhead`
    (release p99), not here: a timed assertion fails on a loaded machine."""
    stream = openai_client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, stream=True, max_tokens=3,
        extra_headers={"x-fake-hold": "gone"})
    assert next(iter(stream)).choices[0].delta.content == "tok0 "
    stack.wait_inflight(1)
    before = released(stack, cause)
    stream.close()
    wait_until(lambda: stack.inflight() == 0, timeout=15, interval=0.002, what="in-flight 0")
    # Counted when Envoy's access log entry tells the cause, milliseconds after the release.
    wait_until(lambda: released(stack, cause) == before + 1, timeout=15, what=f"a {cause} release")


def bucket_drop(stack: Stack, tpm: int, max_tokens: int, generated: int) -> tuple[int, float]:
    """bucket_drop sends a request reserving ``max_tokens`` of which the upstream generates
    ``generated``, and returns what the pool's TPM bucket lost meanwhile (read from the
    x-ratelimit-remaining-tokens of a request before and one after) and the most the
    bucket can have refilled between the two readings (``tpm``/60 a second, measured)."""

    def remaining() -> int:
        raw = openai_client(stack).chat.completions.with_raw_response.create(
            model="fake", messages=MESSAGES, max_tokens=1)
        return int(raw.headers["x-ratelimit-remaining-tokens"])

    first = remaining()
    t0 = time.monotonic()
    done = openai_client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, max_tokens=max_tokens,
        extra_headers={"x-fake-tokens": str(generated)})
    assert done.usage.completion_tokens == generated
    stack.wait_inflight(0)
    second = remaining()
    return first - second, (time.monotonic() - t0) * tpm / 60


def stream_passes_untouched(stack: Stack, cause: str) -> None:
    """stream_passes_untouched streams a 5-token answer and checks that the client got it
    whole, that the request went upstream without stream_options (no option can hide a
    usage chunk it would ask for), and that the lease is released once with ``cause``."""
    import orjson

    before = released(stack, cause)
    chunks = list(openai_client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, stream=True, max_tokens=5))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "tok0 tok1 tok2 tok3 tok4 "
    forwarded = orjson.loads(stack.upstream_json("/_fake/requests")[-1]["body"])
    assert "stream_options" not in forwarded
    wait_until(lambda: released(stack, cause) == before + 1, timeout=15, what=f"a {cause} release")


def client_usage_arrives(stack: Stack) -> None:
    """client_usage_arrives checks that a usage chunk the client asked for reaches it."""
    chunks = list(openai_client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, stream=True, max_tokens=3,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def hold_streams(stack: Stack, count: int, key: str = "full") -> list[Any]:
    """hold_streams opens ``count`` streams the upstream holds after their first chunk
    (``x-fake-hold: {key}-{i}``); ``let_go`` lets them finish."""
    streams = []
    for i in range(count):
        s = openai_client(stack).chat.completions.create(
            model="fake", messages=MESSAGES, stream=True, max_tokens=3,
            extra_headers={"x-fake-hold": f"{key}-{i}"})
        assert next(iter(s)).choices[0].delta.content == "tok0 "
        streams.append(s)
    return streams


def let_go(stack: Stack, count: int, key: str = "full") -> None:
    """let_go releases the streams ``hold_streams`` opened at the upstream."""
    for i in range(count):
        stack.upstream_post(f"/_fake/release/{key}-{i}")


def refused_for_concurrency(stack: Stack) -> Any:
    """refused_for_concurrency sends a request that must be refused with 429 for want of a
    slot and returns the refusal's headers."""
    import openai

    with pytest.raises(openai.RateLimitError) as exc:
        openai_client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=3)
    headers = exc.value.response.headers
    assert headers["x-kvgate-reason"] == "concurrency"
    return headers


def upstream_error_released(stack: Stack) -> None:
    """upstream_error_released sends a request the upstream answers 503 and waits for its
    release with cause ``upstream_error``."""
    import openai

    before = released(stack, "upstream_error")
    with pytest.raises(openai.InternalServerError):
        openai_client(stack).chat.completions.create(
            model="fake", messages=MESSAGES, max_tokens=3, extra_headers={"x-fake-status": "503"})
    wait_released(stack, "upstream_error", before + 1)
