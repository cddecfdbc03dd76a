"""bare: the bare processor, the floor of any Python ext_proc processor: it answers CONTINUE to
every message and reads nothing else (same grpc.aio, same event loop as kvgate). In the Envoy
files that send their access log to the processor's cluster it also takes that log (bytes
read and dropped), as any processor attached to them must.

    python kvgate_testkit/bare.py --port PORT [--destination HOST:PORT] [--raw | --grpclib] [--asyncio] [--no-log-sink]

Levers (each an extra bare setup in bench_overhead and bench_cpu): ``--raw`` reads and writes
bytes (no protobuf at all), ``--grpclib`` serves gRPC with grpclib (pure Python on the loop)
instead of grpcio, ``--asyncio`` runs on asyncio's own loop instead of uvloop,
``--no-log-sink`` refuses the access log (UNIMPLEMENTED) instead of taking it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from kvgate_testkit.httpload import run
from kvgate_testkit.procs import LOOPBACK

ROOT = Path(__file__).resolve().parents[1]

PICKER_HEADER = "x-gateway-destination-endpoint"
# The command of a bare processor for kvgate_testkit's Stack (which fills in {port}).
COMMAND = [sys.executable, str(ROOT / "kvgate_testkit" / "bare.py"), "--port", "{port}"]
LEVERS = ("raw", "asyncio", "grpclib", "no-log-sink")


def _continue_answers() -> dict[str, Any]:
    """_continue_answers maps each ext_proc message kind to its plain CONTINUE answer."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    return {kind: pb.ProcessingResponse(**{kind: answer()}) for kind, answer in (
        ("request_headers", pb.HeadersResponse), ("request_body", pb.BodyResponse),
        ("response_headers", pb.HeadersResponse), ("response_body", pb.BodyResponse),
        ("request_trailers", pb.TrailersResponse), ("response_trailers", pb.TrailersResponse))}


class BareProcessor:
    """BareProcessor answers CONTINUE to every ext_proc message, reading nothing else: the
    floor of any Python processor, served by ``_serve_bare`` and driven in-process by
    bench_instructions with the messages kvgate is sent.

    With ``destination`` (HOST:PORT) the answer to the request body names that node, as
    deploy/envoy-endpoint-picker.yaml needs (the destination header and a cleared route
    cache): one answer built once, the least a picker can send.

    In observability mode it answers nothing (Envoy expects nothing); a FULL_DUPLEX_STREAMED
    response body is sent back chunk by chunk, which is that mode's CONTINUE.
    """

    def __init__(self, destination: str | None = None) -> None:
        import grpc
        from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        self._answers = answers = _continue_answers()
        if destination is not None:
            from envoy.config.core.v3 import base_pb2
            picked = pb.ProcessingResponse()
            common = picked.request_body.response
            common.header_mutation.set_headers.add(header=base_pb2.HeaderValue(
                key=PICKER_HEADER, raw_value=destination.encode()))
            common.clear_route_cache = True
            answers["request_body"] = picked
        self._duplex = pm.ProcessingMode.FULL_DUPLEX_STREAMED
        self._response = pb.ProcessingResponse
        self._eof = grpc.aio.EOF

    async def Process(self, request_iterator: Any, context: Any) -> None:  # noqa: N802
        read, write, eof = context.read, context.write, self._eof
        answers, duplex = self._answers, self._duplex
        echo = False
        while True:
            req = await read()
            if req is eof:
                return
            if req.observability_mode:
                continue
            if req.HasField("protocol_config"):
                echo = req.protocol_config.response_body_mode == duplex
            kind = req.WhichOneof("request")
            if echo and kind == "response_body":
                resp = self._response()
                streamed = resp.response_body.response.body_mutation.streamed_response
                streamed.body = req.response_body.body
                streamed.end_of_stream = req.response_body.end_of_stream
                await write(resp)
            else:
                await write(answers[kind])


async def _serve_bare(port: int, destination: str | None = None, log_sink: bool = True) -> None:
    """_serve_bare serves a BareProcessor (``destination``: its node) on ``port``.

    With ``log_sink`` it also takes the gRPC access log that the access-log and picker-log
    files send to the processor's cluster, each batch read as bytes and dropped: the least a
    processor attached to those files must do. Without it (the ``no-log-sink`` lever) Envoy's
    log stream is refused (UNIMPLEMENTED) and opened again for the next entries.
    """
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(BareProcessor(destination), server)
    if log_sink:
        server.add_generic_rpc_handlers((_log_sink(),))
    server.add_insecure_port(f"{LOOPBACK}:{port}")
    await server.start()
    await server.wait_for_termination()


def _log_sink() -> Any:
    """_log_sink is a handler of Envoy's access log service that reads each batch's bytes
    (no parsing) and drops them."""
    import grpc
    from envoy.service.accesslog.v3 import als_pb2

    async def stream_access_logs(request_iterator: Any, context: Any) -> Any:
        async for _ in request_iterator:
            pass
        return als_pb2.StreamAccessLogsResponse()

    return grpc.method_handlers_generic_handler("envoy.service.accesslog.v3.AccessLogService", {
        "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
            stream_access_logs, request_deserializer=None,
            response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString)})


async def _serve_bare_raw(port: int) -> None:
    """_serve_bare_raw is _serve_bare without protobuf: messages stay bytes, the kind is read
    off the first tag byte (Envoy writes fields in number order, the oneof first) and the
    answers are serialized once. The lever "raw-bytes handlers, prebuilt answers" at its limit."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    answers = {tag: pb.ProcessingResponse(**{kind: msg}).SerializeToString() for tag, kind, msg in (
        (0x12, "request_headers", pb.HeadersResponse()), (0x1a, "response_headers", pb.HeadersResponse()),
        (0x22, "request_body", pb.BodyResponse()), (0x2a, "response_body", pb.BodyResponse()),
        (0x32, "request_trailers", pb.TrailersResponse()),
        (0x3a, "response_trailers", pb.TrailersResponse()))}

    async def process(request_iterator: Any, context: Any) -> None:
        read, write, eof = context.read, context.write, grpc.aio.EOF
        while True:
            req = await read()
            if req is eof:
                return
            await write(answers[req[0]])

    handler = grpc.method_handlers_generic_handler("envoy.service.ext_proc.v3.ExternalProcessor", {
        "Process": grpc.stream_stream_rpc_method_handler(process)})
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"{LOOPBACK}:{port}")
    await server.start()
    await server.wait_for_termination()


def _unlimited_streams(server: Any) -> None:
    """_unlimited_streams lifts the h2 default of 100 concurrent streams per connection
    (grpclib keeps it; Envoy multiplexes every ext_proc stream of a worker on one)."""
    from h2.settings import SettingCodes

    factory = server._protocol_factory

    def protocol() -> Any:
        proto = factory()
        made = proto.connection_made

        def connection_made(transport: Any) -> None:
            made(transport)
            proto.connection._connection.update_settings(
                {SettingCodes.MAX_CONCURRENT_STREAMS: 2**31 - 1})
            proto.connection.flush()
        proto.connection_made = connection_made
        return proto
    server._protocol_factory = protocol


async def _serve_bare_grpclib(port: int) -> None:
    """_serve_bare_grpclib is _serve_bare on grpclib (gRPC in Python over the h2 state
    machine, on the event loop) instead of grpcio's C core and its poller thread. The lever
    "another gRPC server"."""
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    answers = _continue_answers()

    async def process(stream: Any) -> None:
        recv, send = stream.recv_message, stream.send_message
        while (req := await recv()) is not None:
            if not req.observability_mode:
                await send(answers[req.WhichOneof("request")])

    class Bare:
        def __mapping__(self) -> dict[str, Any]:  # noqa: PLW3201 (grpclib's protocol)
            return {"/envoy.service.ext_proc.v3.ExternalProcessor/Process": Handler(
                process, Cardinality.STREAM_STREAM, pb.ProcessingRequest, pb.ProcessingResponse)}

    server = Server([Bare()])
    _unlimited_streams(server)
    await server.start(LOOPBACK, port)
    await server.wait_closed()


def main(argv: list[str] | None = None) -> int:
    """main serves the bare processor until it is stopped."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--destination", metavar="HOST:PORT",
                    help="the node the answer to the request body names (the endpoint-picker files)")
    for lever in LEVERS:
        ap.add_argument(f"--{lever}", action="store_true")
    args = ap.parse_args(argv)
    serve = (_serve_bare_raw(args.port) if args.raw
             else _serve_bare_grpclib(args.port) if args.grpclib
             else _serve_bare(args.port, args.destination, log_sink=not args.no_log_sink))
    if args.asyncio:
        asyncio.run(serve)
    else:
        run(serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
