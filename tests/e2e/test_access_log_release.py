"""End to end: the operator option deploy/envoy-access-log.yaml.

kvgate answers the request body and ends its ext_proc stream there: an in-flight request
holds no gRPC stream in kvgate. The request's end comes by Envoy's gRPC access log, whose
entry carries the link kvgate wrote into the request's dynamic metadata; the response
status and flags tell completed, cut short and upstream error apart. The completion count
comes with the entry, from the file's Lua usage filter (test_access_log_usage.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.e2e.options import (MESSAGES, bucket_drop, disconnect_released, hold_streams,  # noqa: F401
                               let_go, module_stack, no_leak, refused_for_concurrency,
                               upstream_error_released, wait_released)
from kvgate_testkit.stack import Stack, metadata_route, released
from kvgate_testkit.stack import openai_client as client
from kvgate_testkit.procs import LOOPBACK, ROOT, wait_until

pytestmark = pytest.mark.e2e

TPM = 6000  # refills 100 tokens a second: small beside the 300 a refund would give back
CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 2, "tpm": TPM, "context_window": 4096,
                          "default_max_tokens": 256, "tokenizer": "cl100k_base"},
              "wide": {"max_concurrency": 10000, "context_window": 4096, "default_max_tokens": 16}},
    "limits": {"max_body_bytes": 262144},
    "server": {"drain_s": 0, "grace_s": 1},
}
stack = module_stack("access-log", ROOT / "deploy" / "envoy-access-log.yaml", CONFIG,
                     routes=[metadata_route(("x-pool", "wide"), {"pool": "wide", "release": "access_log"})])


def entries(stack: Stack, result: str) -> float:
    return stack.metric("kvgate_access_log_entries_total", result=result)


def test_a_non_streamed_answer_is_released_completed_with_its_headers(stack: Stack) -> None:
    before, logged = released(stack, "completed"), entries(stack, "released")
    raw = client(stack).chat.completions.with_raw_response.create(
        model="fake", messages=MESSAGES, max_tokens=4)
    assert raw.parse().usage.completion_tokens == 4
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < TPM
    wait_released(stack, "completed", before + 1)
    assert entries(stack, "released") == logged + 1


def test_a_held_stream_keeps_its_slot_with_no_ext_proc_stream_open(stack: Stack) -> None:
    """The point of the option: the lease outlives kvgate's stream, until the log entry."""
    before = released(stack, "completed")
    held = []
    try:
        held = hold_streams(stack, 2)
        assert stack.inflight() == 2
        wait_until(lambda: stack.metric("kvgate_streams_active") == 0, timeout=15,
                   what="kvgate's ext_proc streams closed")
        refused_for_concurrency(stack)
    finally:
        let_go(stack, 2)
    for s in held:
        assert "".join(c.choices[0].delta.content or "" for c in s) == "tok1 tok2 "
    wait_until(lambda: released(stack, "completed") == before + 2, timeout=15, what="two completed releases")


def test_a_disconnect_releases_its_slot_once(stack: Stack) -> None:
    disconnect_released(stack, "client_disconnect")


def test_the_unused_reservation_is_refunded(stack: Stack) -> None:
    """The file's usage filter brings the count (test_access_log_usage.py: how exactly)."""
    drop, refill = bucket_drop(stack, TPM, max_tokens=300, generated=2)
    assert drop < 300 - refill, (drop, refill)


def test_an_upstream_error_and_a_refusal_are_told_apart(stack: Stack) -> None:
    no_lease = entries(stack, "no_lease")
    upstream_error_released(stack)
    with pytest.raises(openai.BadRequestError):  # refused by kvgate: no lease, no link
        client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=5000)
    wait_until(lambda: entries(stack, "no_lease") == no_lease + 1, timeout=15,
               what="the refusal's entry")


def test_an_upstream_that_dies_mid_stream_is_released_as_upstream_error(stack: Stack) -> None:
    errors, gone = released(stack, "upstream_error"), released(stack, "client_disconnect")
    stream = client(stack).chat.completions.create(
        model="fake", messages=MESSAGES, max_tokens=8, stream=True,
        extra_headers={"x-fake-die-after": "2", "x-fake-delay-ms": "50"})
    with pytest.raises(Exception):
        for _ in stream:
            pass
    wait_until(lambda: released(stack, "upstream_error") == errors + 1, timeout=15,
               what="an upstream_error release")
    assert released(stack, "client_disconnect") == gone


async def _hold_streams(port: int, count: int) -> list[asyncio.StreamWriter]:
    """count streamed chats on their own connections, each held by the upstream after its
    first chunk; returns the connections once every first chunk has arrived."""
    body = b'{"model":"fake","stream":true,"max_tokens":3,"messages":[{"role":"user","content":"hi"}]}'

    async def one(i: int) -> asyncio.StreamWriter:
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                     b"x-pool: wide\r\nx-fake-hold: burst-%d\r\ncontent-length: %d\r\n\r\n%s"
                     % (i, len(body), body))
        await reader.readuntil(b"tok0")
        return writer

    writers: list[asyncio.StreamWriter] = []
    for start in range(0, count, 100):  # a listen backlog's worth at a time: no SYN retries
        writers += await asyncio.wait_for(
            asyncio.gather(*(one(i) for i in range(start, min(count, start + 100)))), 30)
    return writers


def test_a_burst_of_disconnects_loses_no_log_entry(stack: Stack) -> None:
    """Hundreds of streams cut at once are all released, each as a disconnect. (Envoy
    buffers entries while kvgate reads the previous batch and drops what exceeds the
    file's buffer_size_bytes: `make bench-overhead` cuts ~10,000 at once, where 64 KiB
    lost a third of them; this many fit even Envoy's 16 KiB default.)"""
    count = 600

    async def burst() -> None:
        writers = await _hold_streams(stack.envoy_port, count)
        assert stack.inflight() == count
        for w in writers:
            w.transport.abort()

    before = released(stack, "client_disconnect")
    asyncio.run(burst())
    wait_until(lambda: stack.inflight() == 0, timeout=10, interval=0.05, what="every slot back")
    assert released(stack, "client_disconnect") == before + count
