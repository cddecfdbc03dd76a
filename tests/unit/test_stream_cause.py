"""Unit tests of ``release: stream_and_log`` without gRPC: the real
``ExtProcService.Process`` loop reads Envoy's messages from an in-memory context. A stream
cut short is released when it ends; the cause of the release is counted when Envoy's access
log entry of the request tells it (or after ``CAUSE_WAIT_S`` without one)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.request.registry import CAUSE_WAIT_S, LINK_KEY
from extproc.gate import METADATA_NAMESPACE
from extproc.request.profile import STREAM_AND_LOG
from extproc.service import ExtProcService, encode_response
from tests.unit.test_access_log import entry as log_entry
from tests.unit.test_exchange import (Rig, body_msg, chat, response_headers_msg, route_metadata,
                                      sse, token_chunk)
from tests.unit.test_exchange_attributes import attrs

SSE = "text/event-stream"


class Context:
    """Context is the two calls of a grpc.aio servicer context that ``Process`` makes: it
    hands out ``messages`` in turn, then the end of the stream, and keeps what is written
    (as Envoy reads it: encoded by the method's serializer, parsed)."""

    def __init__(self, messages: Sequence[pb.ProcessingRequest]) -> None:
        self._messages = list(messages)
        self.written: list[pb.ProcessingResponse] = []

    async def read(self) -> Any:
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    async def write(self, resp: Any) -> None:
        self.written.append(pb.ProcessingResponse.FromString(encode_response(resp)))


def messages(*chunks: bytes, release: str = STREAM_AND_LOG, end: bool = False) -> list[pb.ProcessingRequest]:
    """messages is a streamed chat on a route with ``release``: the body, the response headers
    and ``chunks`` (the last with end_of_stream when ``end``)."""
    meta = route_metadata(pool="default", release=release)
    out = [pb.ProcessingRequest(request_body=body_msg(chat(max_tokens=50, stream=True)),
                                attributes=attrs(), metadata_context=meta),
           pb.ProcessingRequest(response_headers=response_headers_msg(200, SSE))]
    out += [pb.ProcessingRequest(response_body=body_msg(c, eos=end and i == len(chunks) - 1))
            for i, c in enumerate(chunks)]
    return out


def link_of(ctx: Context) -> str:
    """link_of is the link kvgate wrote into the request's dynamic metadata."""
    answer = ctx.written[0]
    return answer.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields[LINK_KEY].string_value


def entry(link: str, *, cut_short: bool = True, **flags: bool) -> accesslog_pb2.HTTPAccessLogEntry:
    e = log_entry(link, upstream_done=not cut_short, **flags)
    space = e.common_properties.metadata.filter_metadata[METADATA_NAMESPACE]
    space.fields["release"].string_value = STREAM_AND_LOG  # set_metadata's, merged with kvgate's
    return e


def serve(service: ExtProcService, ctx: Context) -> None:
    asyncio.run(service.Process(None, ctx))


def two_tokens() -> list[bytes]:
    return [sse(token_chunk(0), done=False), sse(token_chunk(1), done=False)]


def rig_and_service() -> tuple[Rig, ExtProcService]:
    rig = Rig()
    return rig, ExtProcService(rig.gate, rig.metrics)


@pytest.mark.parametrize(("flags", "cause"), [
    ({"upstream_protocol_error": True}, "upstream_error"),   # a chunked body broken off
    ({"upstream_remote_reset": True}, "upstream_error"),
    ({"upstream_connection_termination": True}, "upstream_error"),
    ({"downstream_connection_termination": True}, "client_disconnect"),
    ({"downstream_remote_reset": True}, "client_disconnect"),  # an HTTP/2 client's RST_STREAM
])
def test_a_stream_cut_short_is_released_at_its_end_and_counted_when_the_entry_tells_why(
        flags: dict[str, bool], cause: str) -> None:
    rig, service = rig_and_service()
    ctx = Context(messages(*two_tokens()))
    serve(service, ctx)
    assert rig.inflight() == 0  # released at the stream's end, before any entry
    assert rig.count("kvgate_releases_total") == 0
    assert service.endings.logged(entry(link_of(ctx), **flags)) == "cause"
    assert rig.count("kvgate_releases_total") == 1
    assert rig.count("kvgate_releases_total", cause=cause) == 1
    assert not service.endings.causes
    assert service.endings.logged(entry(link_of(ctx), **flags)) == "unmatched"  # a second changes nothing
    assert rig.count("kvgate_releases_total") == 1


def test_an_entry_before_the_streams_end_is_kept_for_it() -> None:
    rig, service = rig_and_service()
    msgs = messages(*two_tokens())
    ctx = Context(msgs[:3])
    asyncio.run(_admit_then_log(service, ctx, msgs[3:], upstream_protocol_error=True))
    assert rig.inflight() == 0
    assert rig.count("kvgate_releases_total", cause="upstream_error") == 1
    assert rig.count("kvgate_releases_total") == 1
    assert not service.endings.causes


async def _admit_then_log(service: ExtProcService, ctx: Context, rest: list[pb.ProcessingRequest],
                          **flags: bool) -> None:
    """_admit_then_log runs a stream that waits after its first messages while the entry comes."""
    gate = asyncio.Event()
    read = ctx.read

    async def held_read() -> Any:
        if not ctx._messages and rest:
            await gate.wait()
            ctx._messages.extend(rest)
            rest.clear()
        return await read()

    ctx.read = held_read  # type: ignore[method-assign]
    task = asyncio.create_task(service.Process(None, ctx))
    while not ctx.written:
        await asyncio.sleep(0)
    assert service.endings.logged(entry(link_of(ctx), **flags)) == "cause"
    gate.set()
    await task


def test_the_upstream_cut_charges_what_was_delivered_like_a_disconnect() -> None:
    """The bucket is charged the same whichever comes first, the entry or the stream's end."""
    charged = []
    for entry_first in (False, True):
        rig, service = rig_and_service()
        before = rig.admission.snapshot("default").tpm_available
        msgs = messages(*two_tokens())
        if entry_first:
            asyncio.run(_admit_then_log(service, Context(msgs[:3]), msgs[3:],
                                        upstream_remote_reset=True))
        else:
            ctx = Context(msgs)
            serve(service, ctx)
            service.endings.logged(entry(link_of(ctx), upstream_remote_reset=True))
        assert rig.count("kvgate_releases_total", cause="upstream_error") == 1
        charged.append(before - rig.admission.snapshot("default").tpm_available)
    assert charged[0] == charged[1]
    assert charged[0] < 40  # the prompt and two tokens, not the 50 reserved


def test_without_an_entry_the_release_is_counted_client_disconnect_after_the_wait(
        caplog: pytest.LogCaptureFixture) -> None:
    rig, service = rig_and_service()
    serve(service, Context(messages(*two_tokens())))
    assert rig.inflight() == 0
    rig.clock.advance(CAUSE_WAIT_S - 0.01)
    assert service.endings.settle_causes(rig.clock.now()) == 0
    assert rig.count("kvgate_releases_total") == 0
    rig.clock.advance(0.01)
    assert service.endings.settle_causes(rig.clock.now()) == 1
    assert rig.count("kvgate_releases_total", cause="client_disconnect") == 1
    assert not service.endings.causes
    assert "never came" in caplog.text


def test_a_complete_stream_is_counted_at_once_and_a_later_entry_is_complete() -> None:
    rig, service = rig_and_service()
    ctx = Context(messages(sse(token_chunk(0)), end=True))
    serve(service, ctx)
    assert rig.count("kvgate_releases_total", cause="completed") == 1
    assert not service.endings.causes
    # The client closed on the last byte: Envoy set a flag and wrote an entry.
    done = entry(link_of(ctx), cut_short=False, downstream_connection_termination=True)
    assert service.endings.logged(done) == "complete"
    assert rig.count("kvgate_releases_total") == 1


def test_a_route_that_releases_by_the_stream_alone_counts_a_cut_stream_at_once() -> None:
    rig, service = rig_and_service()
    ctx = Context(messages(*two_tokens(), release="stream"))
    serve(service, ctx)
    assert rig.count("kvgate_releases_total", cause="client_disconnect") == 1
    assert not ctx.written[0].HasField("dynamic_metadata")  # no link written: nothing to log
    assert not service.endings.causes


def test_give_up_counts_the_causes_still_waiting() -> None:
    rig, service = rig_and_service()
    serve(service, Context(messages(*two_tokens())))
    service.give_up()
    assert rig.count("kvgate_releases_total", cause="client_disconnect") == 1
    assert not service.endings.causes
