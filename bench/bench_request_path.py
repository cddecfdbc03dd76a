"""bench_request_path: kvgate's own CPU per admitted request, without gRPC, Envoy or the network.

``ExtProcService.Process`` is driven in one process by a stand-in for grpc.aio's stream
context that hands it, for every request, the ext_proc messages Envoy sends in the
recommended file (deploy/envoy.yaml: the request body first, with its request attributes
and the route's ``kvgate`` metadata; the response headers; the JSON response body with its
end of stream) and takes its answers, serialized as grpc.aio would send them. The figure
is the process's CPU time (``time.process_time``) per request: what kvgate's Python adds
to any processor's floor (grpc.aio and the event loop, which ``bench_cpu`` measures with
the rest), steady enough on a loaded machine to weigh small levers.

``--file access-log`` or ``--file endpoint-picker-log`` drives the messages of those files
instead (the body with its attributes, or the request headers and then the body; the stream
ends once the body is answered) and then hands the access log receiver Envoy's final entry
of the request (``kvgate_testkit.held.final_message``, a batch of one, as bytes, the link
written into a serialized copy so that building it costs next to nothing): in the
picker-log file a node of two is picked for every request.

Every body is a different ~2 KB chat (``httpload.ChatBodies``), so every prompt is
tokenized in the first round (later rounds meet tokens.py's count cache: this bench weighs the
rest of the path). ``--profile`` runs one more pass under cProfile and prints the functions
with the most own time. ``--baseline REF`` runs this tree and ``extproc`` as it is at git
revision REF in two worker processes, round for round in turn, and reports the median of
the paired ratios: on a shared machine only a paired figure resolves a lever of a few
microseconds.

    python bench/bench_request_path.py [--requests 5000] [--rounds 5] [--profile]
    python bench/bench_request_path.py --baseline main --rounds 20 --requests 1000 [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from prometheus_client import CollectorRegistry

from extproc.admission import Admission
from extproc.clock import Clock, MonotonicClock
from kvgate_testkit import reports
from kvgate_testkit.httpload import ChatBodies
from kvgate_testkit.revision import Workers, checked_out
from kvgate_testkit.variants import BENCH_CONFIG
try:
    from extproc.configparse import parse_config
except ImportError:  # a --baseline revision from before configparse.py
    from extproc.config import parse_config  # type: ignore[no-redef]
from extproc.gate import Gate
from extproc.metrics import Metrics
from extproc.request_facts import ATTR_CONTENT_TYPE, ATTR_METHOD, ATTR_PATH
try:
    from extproc.request.accesslog import AccessLogReceiver
except ImportError:  # a --baseline revision from before extproc/request/
    from extproc.endings import AccessLogReceiver  # type: ignore[no-redef]
from extproc.service import ExtProcService, decode_request
try:
    from extproc.service import encode_response
except ImportError:  # a --baseline revision whose answers were all messages
    def encode_response(resp: Any) -> bytes:
        return resp.SerializeToString()  # type: ignore[no-any-return]
from kvgate_testkit import held

ROOT = Path(__file__).resolve().parents[1]

FILES = ("recommended", *held.FILES)
# What kvgate is sent for one request, by file.
MESSAGES = {
    "recommended": "request body with its attributes, response headers, JSON response body",
    "access-log": "request body with its attributes; the final access log entry",
    "endpoint-picker-log": "request headers, request body, a node picked; the final access log entry",
}

RESPONSE = orjson.dumps({"id": "cmpl-1", "object": "chat.completion", "model": "fake",
                         "choices": [{"index": 0, "finish_reason": "length", "message": {
                             "role": "assistant", "content": "word " * 16}}],
                         "usage": {"prompt_tokens": 420, "completion_tokens": 16,
                                   "total_tokens": 436}})


def _first_message(body: bytes) -> bytes:
    """_first_message is the serialized request-body message of deploy/envoy.yaml: the body,
    the request attributes it lists, the route's kvgate metadata and the protocol config."""
    req = pb.ProcessingRequest()
    req.request_body.body = body
    req.request_body.end_of_stream = True
    attrs = struct_pb2.Struct()
    # Absent headers (authorization, the tenant header) are left out, as Envoy does.
    attrs.update({ATTR_PATH: "/v1/chat/completions", ATTR_METHOD: "POST",
                  ATTR_CONTENT_TYPE: "application/json"})
    req.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    route = struct_pb2.Struct()
    route.update({"pool": "default", "release": "stream_and_log"})
    req.metadata_context.filter_metadata["kvgate"].CopyFrom(route)
    req.protocol_config.request_body_mode = ProcessingMode.BUFFERED
    req.protocol_config.response_body_mode = ProcessingMode.STREAMED
    return req.SerializeToString()


def _response_messages() -> list[bytes]:
    headers = pb.ProcessingRequest()
    for key, value in ((":status", b"200"), ("content-type", b"application/json"),
                       ("content-length", str(len(RESPONSE)).encode()), ("server", b"fake")):
        headers.response_headers.headers.headers.append(base_pb2.HeaderValue(key=key, raw_value=value))
    body = pb.ProcessingRequest()
    body.response_body.body = RESPONSE
    body.response_body.end_of_stream = True
    return [headers.SerializeToString(), body.SerializeToString()]


def streams(file: str, requests: int) -> list[list[bytes]]:
    """streams are the serialized messages Envoy sends kvgate for ``requests`` admitted
    requests in ``file``, a list per request, each with a different ~2 KB chat."""
    bodies = ChatBodies(seed=3)
    # The HTTP request bytes end with the JSON body: cut it out.
    chats = [bodies().split(b"\r\n\r\n", 1)[1] for _ in range(requests)]
    if file == "recommended":
        rest = _response_messages()
        return [[_first_message(body), *rest] for body in chats]
    return [[m.SerializeToString() for m in held.messages(file, body)] for body in chats]


class StreamContext:
    """StreamContext stands in for grpc.aio's servicer context of one stream: ``read`` decodes the
    next message with ``decode`` (kvgate's registered deserializer unless told), ``write``
    serializes the answer with ``encode`` (kvgate's registered serializer unless told)."""

    __slots__ = ("_messages", "_at", "_decode", "_encode", "written")

    def __init__(self, messages: list[bytes], decode: Callable[[bytes], Any] = decode_request,
                 encode: Callable[[Any], bytes] = encode_response) -> None:
        self._messages = messages
        self._at = 0
        self._decode = decode
        self._encode = encode
        self.written = 0

    async def read(self) -> Any:
        if self._at == len(self._messages):
            return grpc.aio.EOF
        data = self._messages[self._at]
        self._at += 1
        return self._decode(data)

    async def write(self, resp: Any) -> None:
        self.written += len(self._encode(resp))


class _FinalEntries:
    """_FinalEntries are Envoy's final access log batches of one entry as bytes
    (``held.final_message``, 16 completion tokens), by link: one is serialized per link
    length and the link written into a copy, so that the entry costs next to nothing beside
    what kvgate does with it. ``refused`` is the entry of a request kvgate linked to nothing
    (a 429)."""

    __slots__ = ("_cuts", "refused")

    def __init__(self) -> None:
        self._cuts: dict[int, tuple[bytes, bytes]] = {}
        msg = held.final_message(None, 0)
        msg.http_logs.log_entry[0].response.response_code.value = 429
        self.refused = msg.SerializeToString()

    def __call__(self, link: str) -> bytes:
        raw = link.encode()
        cut = self._cuts.get(len(raw))
        if cut is None:
            mark = b"\x01" * len(raw)
            head, tail = held.final_message(mark.decode(), 16).SerializeToString().split(mark)
            cut = self._cuts[len(raw)] = (head, tail)
        return cut[0] + raw + cut[1]


class RequestPath:
    """RequestPath is one file's request path in one process: the service, its inputs, and a round
    of them (``run``: kvgate's CPU seconds per request). The clock is the monotonic one
    unless told; ``max_concurrency`` replaces the pool's (1: every request beside one held
    is refused)."""

    def __init__(self, file: str, requests: int, clock: Clock | None = None,
                 max_concurrency: int | None = None) -> None:
        raw = orjson.loads(orjson.dumps(held.config_for(file) if file != "recommended" else BENCH_CONFIG))
        if max_concurrency is not None:
            raw["pools"]["default"]["max_concurrency"] = max_concurrency
        config = parse_config(raw)
        self.clock = clock if clock is not None else MonotonicClock()
        self.admission = Admission(config, self.clock)
        self.metrics = metrics = Metrics(CollectorRegistry())
        metrics.attach(self.admission, tuple(config.tenants.classes))
        self.service = ExtProcService(Gate(config, self.admission, metrics, self.clock), metrics)
        self.receiver = AccessLogReceiver(self.service.endings, metrics)
        self.file = file
        self.entries = _FinalEntries() if file != "recommended" else None
        self.streams = streams(file, requests)
        self._sent = 0

    async def request(self, messages: list[bytes]) -> None:
        """request sends one request's stream and, in the log files, Envoy's final access log
        entry of it (kvgate linked it: the entry of its link; refused: an entry without one).
        In the picker-log file the nodes are reported idle every 200 requests (the scraper)."""
        if self.file == "endpoint-picker-log" and self._sent % 200 == 0:
            held.nodes_up(self.admission, self.clock.now())
        self._sent += 1
        if self.entries is None:
            await self.service.Process(None, StreamContext(messages))
            return
        parked = self.service.endings.parked
        before = len(parked)
        await self.service.Process(None, StreamContext(messages))
        self.receiver.batch(self.entries(next(reversed(parked))) if len(parked) > before
                            else self.entries.refused)

    async def _round(self, streams: list[list[bytes]]) -> float:
        spent = 0.0
        for messages in streams:
            t0 = time.process_time()
            await self.request(messages)
            spent += time.process_time() - t0
        return spent / len(streams)

    def run(self, loop: asyncio.AbstractEventLoop, count: int | None = None) -> float:
        """run sends the round's requests (the first ``count`` of them) and settles each."""
        per = loop.run_until_complete(self._round(self.streams[:count]))
        assert self.admission.snapshot("default").inflight == 0, "a lease was left held"
        return per


def _worker(file: str, requests: int) -> None:
    """_worker serves rounds on demand: one line on stdin runs a round, the CPU per request
    (seconds) is written back as one line; it ends at the end of stdin."""
    path = RequestPath(file, requests)
    loop = asyncio.new_event_loop()
    path.run(loop, 200)  # warm-up
    for _ in sys.stdin:
        print(path.run(loop), flush=True)


def _paired(source: Path, label: str, file: str, requests: int, rounds: int) -> list[str]:
    """_paired runs this tree's request path and ``source``'s (a directory holding another
    ``extproc``) in two worker processes, round for round in turn, so that both meet the
    same machine; returns the report lines (medians and the median of the paired ratios)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--requests", str(requests),
            "--file", file]
    got: dict[str, list[float]] = {"this tree": [], label: []}
    with Workers(argv, {"this tree": ROOT, label: source}) as workers:
        for _ in range(rounds):
            for name, answer in workers.ask("go").items():
                got[name].append(float(answer))
    ratios = [a / b for a, b in zip(got["this tree"], got[label])]
    return [f"| {name} | {statistics.median(v) * 1e6:.1f} | {min(v) * 1e6:.1f} |" for name, v in got.items()] + [
        "", f"this tree / {label}, median of {rounds} paired rounds: {statistics.median(ratios):.3f} "
        f"(spread {min(ratios):.3f} to {max(ratios):.3f})"]


def main(argv: list[str] | None = None) -> int:
    """main runs the rounds and prints CPU per request (median and spread over rounds)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000, help="requests per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="one more round under cProfile")
    ap.add_argument("--baseline", metavar="REF",
                    help="compare with extproc as it is at this git revision, round for round")
    ap.add_argument("--out", type=Path, help="with --baseline: also write the table to this file")
    ap.add_argument("--file", default="recommended", choices=FILES,
                    help="the Envoy file whose messages kvgate is sent (deploy/envoy.yaml: recommended)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.file, args.requests)
        return 0
    if args.baseline:
        load = os.getloadavg()
        with checked_out(args.baseline) as source:
            lines = _paired(source, args.baseline, args.file, args.requests, args.rounds)
        command = reports.command("bench/bench_request_path.py", ap, args)
        text = "\n".join([
            "# kvgate's own request path, this tree against a git revision", "",
            f"Command: `{command}`", "",
            f"Python {platform.python_version()}; load average at the start {load[0]:.2f} "
            f"{load[1]:.2f} {load[2]:.2f}. One admitted ~2 KB chat per request ({MESSAGES[args.file]}), "
            "no gRPC, in two worker processes run round for round in turn; CPU time of the "
            "worker per request.", "",
            "| extproc | us CPU per request, median | min |", "|---|---:|---:|", *lines, ""])
        if args.out is not None:
            return reports.publish(args.out, text)
        print(text)
        return 0
    path = RequestPath(args.file, args.requests)
    loop = asyncio.new_event_loop()
    path.run(loop, 200)  # warm-up
    per = [path.run(loop) for _ in range(args.rounds)]
    print(f"kvgate request path ({args.file}): {statistics.median(per) * 1e6:.1f} us CPU per request "
          f"(median of {args.rounds} rounds of {args.requests}; min {min(per) * 1e6:.1f}, "
          f"max {max(per) * 1e6:.1f})")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        path.run(loop)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
        print(out.getvalue())
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
