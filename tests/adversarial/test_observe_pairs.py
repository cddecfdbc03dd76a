"""Observe mode (deploy/envoy-observe.yaml): a request's two ext_proc streams in any order.

With the response sent to an observability-mode filter, one request has an admission
stream (request body only) and an observing stream (the response, never answered) that
finds the admitted exchange by the ``link`` kvgate put in the request's dynamic metadata.
Hypothesis interleaves the two streams' events at will: the observing stream early, late,
never, twice, with a made-up link, cut short; the admission stream ended cleanly or
cancelled at any point. After every example nothing is held, every admission has been
released exactly once, nothing was logged as an internal error, and the link table is
empty.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.adversarial.support import (TOKEN, Rig, chat, kind, prompt_tokens, request_body,
                                       response_body, response_headers, sse, usage_json)

EXT_PROC = "envoy.filters.http.ext_proc"
NONE = processing_mode_pb2.ProcessingMode.NONE


def admission_message(body: bytes) -> pb.ProcessingRequest:
    """admission_message is the first (and only) message of an admission stream."""
    msg = request_body(body)
    msg.attributes[EXT_PROC].update({"request.path": "/v1/chat/completions", "request.method": "POST"})
    msg.protocol_config.response_body_mode = NONE
    return msg


def observed(link: str | None, msg: pb.ProcessingRequest) -> pb.ProcessingRequest:
    """observed marks a message as sent on an observing stream carrying ``link``."""
    msg.observability_mode = True
    if link is not None:
        msg.metadata_context.filter_metadata["kvgate"].update({"link": link})
    return msg


class Pair:
    """Pair is one request's two streams, driven step by step."""

    def __init__(self, rig: Rig, body: bytes) -> None:
        self.rig = rig
        self.body = body
        self.admission: Any = None
        self.link: str | None = None
        self.refused = False
        self.observers: list[Any] = []

    async def admit(self) -> None:
        self.admission = self.rig.stub.Process()
        await self.admission.write(admission_message(self.body))
        answer = await self.admission.read()
        fields = answer.dynamic_metadata.fields
        if "kvgate" in fields and "link" in fields["kvgate"].struct_value.fields:
            self.link = fields["kvgate"].struct_value.fields["link"].string_value
        self.refused = kind(answer) != "request_body"

    async def end_admission(self, how: str) -> None:
        if self.admission is None:
            return
        call, self.admission = self.admission, None
        if how == "cancel":
            call.cancel()
            return
        await call.done_writing()
        while await call.read() != grpc.aio.EOF:
            pass

    async def observe(self, link_kind: str, events: list[str], end: str) -> None:
        """observe opens an observing stream and sends ``events`` on it (nothing is answered)."""
        link = {"own": self.link, "made_up": "ffffffffffff-1", "none": None}[link_kind]
        call = self.rig.stub.Process()
        self.observers.append(call)
        streamed = "sse" in events
        first = True
        for ev in events:
            if ev in ("headers", "sse"):
                m = response_headers(200, "text/event-stream" if streamed else "application/json")
            elif ev == "chunk":
                m = response_body(sse(TOKEN) if streamed else b'{"usage": {"completion_')
            elif ev == "usage":
                m = response_body(sse({"choices": [], "usage": {"completion_tokens": 2}}) if streamed
                                  else usage_json(2))
            else:  # "eos"
                m = response_body(b"", eos=True)
            await call.write(observed(link, m) if first else m)
            first = False
        if end == "cancel":
            call.cancel()
        else:
            await call.done_writing()
            try:
                while await call.read() != grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError:
                pass  # an observing stream with no message at all: nothing to read


# Mostly what Envoy sends (headers first, maybe chunks, maybe the end), sometimes nonsense.
EVENTS = st.one_of(
    st.builds(lambda first, middle, end: [first, *middle, *end], st.sampled_from(["headers", "sse"]),
              st.lists(st.sampled_from(["chunk", "usage"]), max_size=3), st.sampled_from([[], ["eos"], ["eos"]])),
    st.lists(st.sampled_from(["headers", "sse", "chunk", "usage", "eos"]), min_size=1, max_size=5))
OBSERVE = st.tuples(st.just("observe"), st.sampled_from(["own", "own", "made_up", "none"]), EVENTS,
                    st.sampled_from(["close", "cancel"]))
STEP = st.one_of(
    OBSERVE, OBSERVE,
    st.tuples(st.just("end"), st.sampled_from(["close", "cancel"])),
    st.tuples(st.just("yield"), st.integers(0, 3)),
)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(plans=st.lists(st.tuples(st.sampled_from([chat(max_tokens=5), chat(max_tokens=5, stream=True)] * 3
                                                + [b"{", chat(max_tokens=10**6)]),
                                st.lists(STEP, max_size=5)),
                      min_size=1, max_size=3))
def test_observe_mode_streams_in_any_order_end_with_nothing_held(rig: Rig, plans: list[Any]) -> None:
    errors = rig.count("kvgate_internal_errors_total")

    async def one(body: bytes, steps: list[Any]) -> None:
        pair = Pair(rig, body)
        await pair.admit()
        for step in steps:
            if step[0] == "observe":
                await pair.observe(*step[1:])
            elif step[0] == "end":
                await pair.end_admission(step[1])
            else:
                for _ in range(step[1]):
                    await asyncio.sleep(0)  # let kvgate's side run in between
        await pair.end_admission("close")

    async def go() -> None:
        await asyncio.gather(*(one(body, steps) for body, steps in plans))
        await rig.settle(timeout=15)  # a settle waits at most OBSERVE_CAP_S for its response
    rig.run(go())
    assert rig.nothing_held(), rig.held()
    assert rig.count("kvgate_internal_errors_total") == errors
    assert rig.count("kvgate_releases_total") == rig.count("kvgate_requests_total", outcome="admitted")
    assert rig.server.service.endings.links == {}


def pool_tokens(rig: Rig) -> float:
    state = rig.server.admission.store.bucket_state("default", "pool", rig.clock.now())
    return state[0] if state else 1e9


@pytest.mark.parametrize("order, cause, completion", [
    # (steps, release cause, completion tokens charged; None: the whole reservation)
    ([("observe", ["headers", "usage", "eos"]), ("end",)], "completed", 2),
    ([("end",), ("observe", ["headers", "usage", "eos"])], "completed", 2),
    ([("observe", ["sse", "chunk", "chunk"]), ("end",)], "client_disconnect", 2),
    ([("end",)], "client_disconnect", None),
    ([("observe", ["headers"]), ("observe", ["headers", "usage", "eos"]), ("end",)], "completed", 2),
])
def test_observe_mode_charges_what_the_observed_response_shows(rig: Rig, order: list[Any], cause: str,
                                                               completion: int | None) -> None:
    """Each order of the two streams, and what the buckets are charged for it."""
    before = rig.count("kvgate_releases_total", cause=cause)
    tokens = pool_tokens(rig)

    body = chat(max_tokens=50, stream=any("sse" in s[1] for s in order if len(s) > 1))

    async def go() -> float:
        pair = Pair(rig, body)
        await pair.admit()
        reserved = tokens - pool_tokens(rig)
        for step in order:
            if step[0] == "end":
                await pair.end_admission("close")
            else:
                await pair.observe("own", step[1], "close")
        await pair.end_admission("close")
        await rig.settle()
        return reserved
    reserved = rig.run(go())
    assert rig.count("kvgate_releases_total", cause=cause) == before + 1
    prompt = prompt_tokens(body)
    assert reserved == prompt + 50
    assert tokens - pool_tokens(rig) == (reserved if completion is None else prompt + completion)
    assert rig.nothing_held() and rig.server.service.endings.links == {}
