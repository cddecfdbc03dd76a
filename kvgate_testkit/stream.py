"""stream: one ext_proc stream's messages fed to kvgate's request stages in-process, without gRPC.

``Stream`` is the tests' seam on one request: each method wraps one of Envoy's messages in
the ``ProcessingRequest`` Envoy sends and feeds it through the service's own dispatch
(``extproc.service.answer``) to the stage the stream is in (the request's ``Arrival``, then
its ``Ending``), as ``ExtProcService.Process`` does, and returns the answer to write. What a
test reads of the request is what the stages return: ``admitted`` (``Admitted``: its
``lease``, its ``ending`` and the ending's ``outcome``), and what ``finish`` returns. An
answer is returned as Envoy reads it: one kvgate writes as wire bytes (``extproc.encoded``)
is parsed into the ``ProcessingResponse`` it encodes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.admission import Outcome
from extproc.gate import Gate
from extproc.request.admit import Admitted
from extproc.request.arrival import Arrival
from extproc.request.ending import Ending
from extproc.request.registry import Endings
from extproc.service import answer

__all__ = ["Stream"]

Send = Callable[[pb.ProcessingResponse], Awaitable[None]]


class Stream:
    """Stream is one ext_proc stream of ``gate``'s service, fed message by message.

    ``endings``: the registry an admitted request is handed to as the service hands it
    (None: none; the request's end then comes only by ``finish``). ``admitted`` is the
    admission once made (None before, and for a request refused or passed through);
    ``handed_over``: the registry took the request for its access log entry (its stream may
    end with the lease held).
    """

    def __init__(self, gate: Gate, endings: Endings | None = None) -> None:
        self.arrival = Arrival(gate)
        self.endings = endings
        self.admitted: Admitted | None = None
        self.handed_over = False

    @property
    def ending(self) -> Ending | None:
        """ending is the admitted request's ending (None: not admitted)."""
        return None if self.admitted is None else self.admitted.ending

    async def feed(self, req: pb.ProcessingRequest, send: Send | None = None) -> Any:
        """feed hands one whole ProcessingRequest to the stream's stage, as the service does,
        and returns the answer (an admission's answer in place of ``Admitted``)."""
        resp = await answer(self.arrival, self.ending, req, send)
        if type(resp) is Admitted:
            self.admitted = resp
            if self.endings is not None:
                self.handed_over = self.endings.admitted(resp.ending)
            resp = resp.answer
        if type(resp) is list:
            return [_as_read(one) for one in resp]
        return _as_read(resp)

    def request_headers(self, msg: pb.HttpHeaders, metadata: Any = None,
                        protocol: Any = None) -> pb.ProcessingResponse | None:
        """request_headers feeds the request headers (with the stream's route ``metadata`` and
        ProtocolConfiguration ``protocol``, where Envoy sends them)."""
        return _now(self.feed(_request(request_headers=msg, metadata=metadata, protocol=protocol)))

    async def request_body(self, msg: pb.HttpBody, send: Send | None = None, attributes: Any = None,
                           metadata: Any = None, protocol: Any = None) -> Any:
        """request_body feeds one request body message (``attributes``, ``metadata`` and
        ``protocol`` as Envoy sends them with a stream's first message); ``send`` writes at
        once (None: nothing can be)."""
        return await self.feed(_request(request_body=msg, attributes=attributes, metadata=metadata,
                                        protocol=protocol), send)

    def response_headers(self, msg: pb.HttpHeaders, *, attributes: Any = None,
                         metadata: Any = None) -> pb.ProcessingResponse:
        """response_headers feeds the response headers."""
        return _now(self.feed(_request(response_headers=msg, attributes=attributes, metadata=metadata)))

    def response_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        """response_body feeds one response chunk."""
        return _now(self.feed(pb.ProcessingRequest(response_body=msg)))

    def request_trailers(self) -> pb.ProcessingResponse:
        """request_trailers feeds (empty) request trailers."""
        return _now(self.feed(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())))

    def finish(self, *, gave_up: bool = False) -> Outcome | None:
        """finish is the stream's end as a stream without a registry ends (``gave_up``: kvgate
        ends it, a timeout): the ending releases the lease if still held, and the cause is
        returned (None: nothing to release)."""
        ending = self.ending
        return None if ending is None else ending.finish(gave_up)


def _request(*, metadata: Any = None, protocol: Any = None, attributes: Any = None,
             **message: Any) -> pb.ProcessingRequest:
    """_request is the ProcessingRequest Envoy sends with ``message`` (one field)."""
    req = pb.ProcessingRequest(**message)
    if metadata is not None:
        req.metadata_context.CopyFrom(metadata)
    if protocol is not None:
        req.protocol_config.CopyFrom(protocol)
    for key, value in (attributes or {}).items():
        req.attributes[key].CopyFrom(value)
    return req


def _as_read(resp: Any) -> Any:
    """_as_read is an answer as Envoy reads it: wire bytes parsed, a message as it is."""
    return pb.ProcessingResponse.FromString(resp) if type(resp) is bytes else resp


def _now(step: Awaitable[Any]) -> Any:
    """_now runs a step that never waits (every message but the request body's) to its end."""
    gen = step.__await__()
    try:
        gen.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("a message other than the request body waited")
