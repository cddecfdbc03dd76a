"""What the token buckets are charged, however a request ends, through a real grpc kvgate.

The server's clock is a ManualClock, so the buckets never refill: the tokens a request
took from the pool's bucket and from its tenant's bucket are exactly what it was charged
(prompt + reported completion, or the whole reservation when the completion is unknown).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import orjson
import pytest

from tests.adversarial.support import (TOKEN, Rig, chat, kind, prompt_tokens, request_body,
                                       request_headers, response_body, response_headers, sse)


def tokens(rig: Rig) -> tuple[float, float]:
    """tokens is (pool bucket, tenant bucket of anonymous requests) now, in tokens."""
    now = rig.clock.now()
    store = rig.server.admission.store
    pool = store.bucket_state("default", "pool", now)
    tenant = store.bucket_state("default", "tenant:_anonymous", now)
    return (pool[0] if pool else 1e9), (tenant[0] if tenant else 5e8)


@dataclass(frozen=True)
class Charge:
    """Charge is what one request took from the pool's bucket, in tokens: ``reserved`` at
    admission (prompt + the completion reserved), ``debit`` once settled; ``prompt`` is its
    prompt as kvgate counts it (the pools' tokenizer and the default chat template)."""

    debit: float
    reserved: float
    prompt: int


def charged(rig: Rig, body: bytes, response: list[Any], end: str = "close") -> Charge:
    """charged runs one admitted request with ``response`` messages and returns what the pool
    bucket was charged; the tenant bucket must agree, and nothing may be held after."""
    async def go() -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
        before = tokens(rig)
        call = rig.stub.Process()
        await call.write(request_headers())
        await call.read()
        await call.write(request_body(body))
        answer = await call.read()
        assert kind(answer) == "request_body", answer
        admitted = tokens(rig)
        for m in response:
            await call.write(m)
            await call.read()
        if end == "cancel":
            call.cancel()
        else:
            await call.done_writing()
            while await call.read() != grpc.aio.EOF:
                pass
        await rig.settle()
        return before, admitted, tokens(rig)
    before, admitted, after = rig.run(go())
    assert before[0] - after[0] == before[1] - after[1]
    assert before[0] - admitted[0] == before[1] - admitted[1]
    assert rig.nothing_held()
    return Charge(debit=before[0] - after[0], reserved=before[0] - admitted[0], prompt=prompt_tokens(body))


def json_reply(usage: Any) -> list[Any]:
    return [response_headers(200), response_body(orjson.dumps({"choices": [], "usage": usage}), eos=True)]


def test_reported_usage_is_what_is_charged(rig: Rig) -> None:
    c = charged(rig, chat(max_tokens=50), json_reply({"prompt_tokens": 1, "completion_tokens": 7}))
    assert c.reserved == c.prompt + 50
    assert c.debit == c.prompt + 7


def test_streamed_usage_is_charged_and_the_injected_usage_chunk_is_hidden(rig: Rig) -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    c = charged(rig, chat(stream=True, max_tokens=50), [
        response_headers(200, "text/event-stream"), response_body(sse(TOKEN) + sse(TOKEN)),
        response_body(sse(usage) + b"data: [DONE]\n\n"), response_body(b"", eos=True)])
    assert c.debit == c.prompt + 2


def test_a_stream_cut_short_is_charged_its_delivered_chunks(rig: Rig) -> None:
    disconnects = rig.count("kvgate_releases_total", cause="client_disconnect")
    c = charged(rig, chat(stream=True, max_tokens=50), [
        response_headers(200, "text/event-stream"), response_body(sse(TOKEN) * 3)], end="cancel")
    assert c.debit == c.prompt + 3
    assert rig.count("kvgate_releases_total", cause="client_disconnect") == disconnects + 1


@pytest.mark.parametrize("usage", [None, {"completion_tokens": -1}, {"completion_tokens": "7"},
                                   {"completion_tokens": 7.0}, {"completion_tokens": True}, "garbage"])
def test_unknown_or_hostile_usage_charges_the_whole_reservation(rig: Rig, usage: Any) -> None:
    c = charged(rig, chat(max_tokens=50), json_reply(usage))
    assert c.debit == c.reserved == c.prompt + 50


def test_an_absurd_usage_is_capped(rig: Rig) -> None:
    c = charged(rig, chat(max_tokens=50), json_reply({"completion_tokens": 10**12}))
    assert c.debit == c.prompt + 4096  # the pool's context window


def test_n_choices_are_charged_their_reported_completion(rig: Rig) -> None:
    """n choices reserve (and generate) up to n x max_tokens, so a reported completion is
    capped at the larger of the context window and the reservation: n=8 x 900 tokens are
    charged 7,200, not one window's 4,096."""
    c = charged(rig, chat(n=8, max_tokens=900), json_reply({"prompt_tokens": 9, "completion_tokens": 7200}))
    assert c.reserved == c.prompt + 7200
    assert c.debit == c.prompt + 7200
