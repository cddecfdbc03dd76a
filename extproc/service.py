"""service: the grpc.aio ext_proc service, one request's stages per stream.

``ExtProcService.Process`` is one ext_proc stream (one HTTP request): it reads Envoy's
messages and feeds each, by ``answer``, to the stage the stream is in, and writes the
answers. A stream begins as the request's ``Arrival`` (``extproc.request.arrival``:
identified, its body collected, admitted or refused); the admission returns ``Admitted``, and
from then on the response goes to its ``Ending`` (``extproc.request.ending``), which holds the
lease. The service holds which stage the stream is in and reads nothing else of them. However
the stream ends (response end of stream, a clean end after a client disconnect,
``CancelledError``, an error in kvgate, shutdown), its end goes to the service's ``Endings``
in ``finally``, which releases the lease exactly once or keeps it for the end that comes
from elsewhere (the observing stream, the access log: ``extproc.request.registry``). A stream whose
first message is in observability mode is such an observing stream, followed by
``Endings.observe``.

``decode_request`` parses Envoy's messages so that a client's bad header byte cannot fail
the stream; ``encode_response`` writes the answers, some of which are wire bytes already.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError

from extproc import logwire
from extproc.encoded import CONTINUE_RESPONSE_TRAILERS
from extproc.gate import Gate
from extproc.request.admit import Admitted
from extproc.request.arrival import Arrival
from extproc.request.ending import Ending, Observed
from extproc.request.registry import Endings
from extproc.metrics import Metrics
from extproc.request_facts import UNDECODABLE_ATTRIBUTES

log = logging.getLogger("kvgate.server")

# ProcessingRequest.attributes (map<string, Struct>), field number 9.
_ATTRIBUTES_FIELD = 9


def _without_field(data: bytes, number: int) -> bytes:
    """_without_field is a serialized message with every top-level ``number`` field cut out
    (DecodeError when its framing is broken)."""
    return b"".join(data[start:stop] for n, start, _, stop in logwire.fields(data, 0, len(data))
                    if n != number)


def decode_request(data: bytes) -> pb.ProcessingRequest:
    """decode_request parses one ext_proc message from Envoy.

    Envoy copies request header bytes into request attributes, which are protobuf strings:
    a header that is not UTF-8 makes the whole message undecodable. Rather than fail the
    stream (a 500 for a client's bad byte), the attributes are dropped and marked
    (UNDECODABLE_ATTRIBUTES) so that the arrival refuses the request with a 400.
    """
    try:
        return pb.ProcessingRequest.FromString(data)
    except DecodeError:
        req = pb.ProcessingRequest.FromString(_without_field(data, _ATTRIBUTES_FIELD))
        req.attributes[UNDECODABLE_ATTRIBUTES].SetInParent()
        return req


def encode_response(resp: Any) -> bytes:
    """encode_response is one answer to Envoy as grpc writes it (the ext_proc method's
    response serializer): wire bytes as they are (``extproc.encoded``), a
    ``ProcessingResponse`` serialized."""
    return resp if type(resp) is bytes else resp.SerializeToString()


def _protocol(req: Any) -> Any:
    """_protocol is the stream's ProtocolConfiguration when this message carries it (None)."""
    return req.protocol_config if req.HasField("protocol_config") else None


async def answer(arrival: Arrival, ending: Ending | None, req: Any, send: Any) -> Any:
    """answer feeds one of Envoy's messages ``req`` to the stage its stream is in and returns
    what to write (None: nothing; a list: several, in order; ``Admitted``: the request was
    admitted, write its ``answer`` and feed its ``ending`` from now on).

    The request side is the ``arrival``'s; the response is the ``ending``'s once the request is
    admitted (None: not admitted), the arrival's before. ``send`` writes a message at once
    (a longer message timeout before waiting in a queue).
    """
    kind = req.WhichOneof("request")
    if kind == "response_body":  # the most frequent: one per upstream chunk
        if ending is not None:
            return ending.answer_chunk(req.response_body)
        return arrival.response_body(req.response_body)
    if kind == "request_headers":
        return arrival.request_headers(req.request_headers, req.metadata_context, _protocol(req))
    if kind == "request_body":
        return await arrival.request_body(req.request_body, send, req.attributes,
                                          req.metadata_context, _protocol(req))
    if kind == "response_headers":
        if ending is not None:
            return ending.answer_headers(req.response_headers, req.metadata_context)
        return arrival.response_headers(req.response_headers, req.attributes, req.metadata_context)
    if kind == "request_trailers":
        return arrival.request_trailers()
    if kind == "response_trailers":
        return CONTINUE_RESPONSE_TRAILERS
    return None  # a newer Envoy's message kind: nothing to do with it


class ExtProcService(pb_grpc.ExternalProcessorServicer):
    """ExtProcService serves Envoy's ext_proc streams, one request's stages per stream.

    ``active`` maps each open stream's task to its request's ending once admitted (None
    before), and each observed request's settling task to its ending, for shutdown.
    ``endings`` holds the requests whose end comes from elsewhere than their stream.
    """

    def __init__(self, gate: Gate, metrics: Metrics) -> None:
        self._gate = gate
        self._metrics = metrics
        self.active: dict[asyncio.Task[Any], Ending | None] = {}
        self.endings = Endings(gate.clock, metrics, self._maybe_idle)
        self._idle = asyncio.Event()
        self._idle.set()

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        read = context.read
        req = await read()
        if req is grpc.aio.EOF:
            return
        if req.observability_mode:
            await self.endings.observe(req, read)
            return
        arrival = Arrival(self._gate)
        ending: Ending | None = None  # the stage after the arrival: the admitted request's
        task = asyncio.current_task()
        assert task is not None
        active = self.active
        active[task] = None
        self._idle.clear()
        write = context.write
        eof = grpc.aio.EOF
        # Handed over to the access log: the stream ends, the lease stays; once the answer
        # is written (a stream that ends before leaves it ``unsure``, Endings.stream_ended).
        parked = handed_over = False
        try:
            while True:
                resp = await answer(arrival, ending, req, write)
                if type(resp) is Admitted:
                    ending = resp.ending
                    active[task] = ending
                    # Before Envoy can send the response, or log the request's end.
                    parked = self.endings.admitted(ending)
                    resp = resp.answer
                if type(resp) is list:  # FULL_DUPLEX_STREAMED: headers, then the body's chunks
                    for one in resp:
                        await write(one)
                elif resp is not None:
                    await write(resp)
                resp = None
                if parked:
                    handed_over = True
                    return
                # Not held while waiting: the body message carries the whole prompt.
                req = None
                req = await read()
                if req is eof:
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            self._metrics.internal_errors.inc()
            log.exception("ext_proc stream failed; ending it (Envoy answers the client 500)")
            raise
        finally:
            del active[task]
            observed = self.endings.stream_ended(ending, handed_over)
            if observed is not None:
                settle = asyncio.get_running_loop().create_task(self._settle(observed))
                active[settle] = observed
            self._maybe_idle()

    async def _settle(self, observed: Observed) -> None:
        try:
            await self.endings.settle(observed)
        finally:
            task = asyncio.current_task()
            if task is not None:
                self.active.pop(task, None)
            self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self.active and not self.endings.parked:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """wait_idle waits up to ``timeout`` seconds for every stream to end (and every parked
        request's log entry to come); True if they did."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def give_up(self) -> int:
        """give_up releases every open stream's lease with cause ``timeout`` and cancels it,
        and every parked request's (``Endings.give_up``).

        Returns how many streams were open and requests parked.
        """
        open_streams = list(self.active.items())
        for task, ending in open_streams:
            if ending is not None:
                ending.finish(gave_up=True)
            task.cancel()
        parked = self.endings.give_up()
        self._maybe_idle()
        return len(open_streams) + parked
