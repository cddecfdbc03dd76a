"""held: requests parked in kvgate for their access log entry, driven in-process.

In deploy/envoy-access-log.yaml and deploy/envoy-endpoint-picker-log.yaml a request's ext_proc
stream ends with its body, and the request lives on in kvgate only as a parked request until
Envoy's access log entry for it comes. ``hold`` sends requests through the service's own
stream loop (``ExtProcService.Process``) with the messages Envoy sends in each file, without
gRPC, so that what a parked request keeps can be counted exactly (tests/unit/test_held_memory.py,
bench/bench_memory.py); ``periodic_message`` is Envoy's batch of periodic entries for them.
"""

from __future__ import annotations

from typing import Any

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc import usage_log
from extproc.admission.types import NodeReport
try:
    from extproc.request.registry import LINK_KEY
except ImportError:  # bench/bench_request_path.py --baseline: a revision from before extproc/request/
    from extproc.endings import LINK_KEY  # type: ignore[no-redef]
from extproc.gate import METADATA_NAMESPACE
from extproc.request_facts import ATTR_CONTENT_TYPE, ATTR_METHOD, ATTR_PATH

FILES = ("access-log", "endpoint-picker-log")
# What Envoy sends with the stream's first message in both files: the body BUFFERED, no response.
NO_RESPONSE = pb.ProtocolConfiguration(request_body_mode=pm.ProcessingMode.BUFFERED,
                                       response_body_mode=pm.ProcessingMode.NONE)
POOL: dict[str, Any] = {"max_concurrency": 1_000_000, "tpm": 10**13, "context_window": 32768,
                        "default_max_tokens": 1024, "tokenizer": "cl100k_base"}
# The picker-log file's pool: two nodes, room for everything held here.
NODES = [{"name": f"n{i}", "metrics_url": f"http://127.0.0.1:9/{i}",
          "address": f"127.0.0.1:{7000 + i}", "kv_capacity_tokens": 10**9} for i in range(2)]


def config_for(file: str) -> dict[str, Any]:
    """config_for is the kvgate configuration (``pools`` and ``limits``) that admits every
    request held here; in the picker-log file the pool picks one of two nodes."""
    pool = dict(POOL, backends=NODES) if file == "endpoint-picker-log" else POOL
    return {"pools": {"default": pool}, "limits": {"max_body_bytes": 1 << 20}}


def nodes_up(admission: Any, now: float) -> None:
    """nodes_up reports the picker-log pool's nodes idle at ``now`` (pickable)."""
    for node in NODES:
        admission.report_node("default", node["name"], NodeReport(kv_usage=0.0, capacity_tokens=None, at=now))


class Stream:
    """Stream is the grpc.aio context of one ext_proc stream: Envoy's messages, then its end."""

    def __init__(self, messages: list[Any]) -> None:
        self._messages = messages

    async def read(self) -> Any:
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    async def write(self, resp: Any) -> None:
        pass


def chat(prompt_chars: int) -> bytes:
    """chat is a streamed chat body whose prompt is about ``prompt_chars`` characters."""
    return orjson.dumps({"model": "m", "max_tokens": 64, "stream": True,
                         "messages": [{"role": "user", "content": "word " * (prompt_chars // 5)}]})


def messages(file: str, body: bytes) -> list[Any]:
    """messages are what Envoy sends kvgate for one request in ``file``: the body with the
    request attributes (access-log: request headers skipped), or the headers and then the
    body (endpoint-picker-log); each with the route's metadata and the usage filter's mark."""
    meta = base_pb2.Metadata()
    route = struct_pb2.Struct()
    route.update({"pool": "default", "release": "access_log"})
    meta.filter_metadata[METADATA_NAMESPACE].CopyFrom(route)
    meta.filter_metadata[usage_log.NAMESPACE].fields[usage_log.FILTER_KEY].number_value = 1
    if file == "access-log":
        req = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True),
                                   protocol_config=NO_RESPONSE, metadata_context=meta)
        req.attributes["envoy.filters.http.ext_proc"].update(
            {ATTR_PATH: "/v1/chat/completions", ATTR_METHOD: "POST", ATTR_CONTENT_TYPE: "application/json"})
        return [req]
    headers = [(":path", "/v1/chat/completions"), (":method", "POST"), (":scheme", "http"),
               (":authority", "gw"), ("content-type", "application/json"),
               ("content-length", str(len(body)))]
    return [pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])),
                protocol_config=NO_RESPONSE, metadata_context=meta),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True),
                                 metadata_context=meta)]


async def hold(service: Any, file: str, body: bytes, count: int) -> None:
    """hold sends ``count`` requests through ``service``'s stream loop (an ``ExtProcService``);
    each stream ends after the body's answer, its request parked for its access log entry."""
    for _ in range(count):
        await service.Process(None, Stream(messages(file, body)))


def _entry(msg: als_pb2.StreamAccessLogsMessage, kind: int, link: str | None, usage: dict[str, int],
           upstream: str) -> Any:
    """_entry adds to ``msg`` an entry of ``kind`` for ``link`` (None: a request kvgate linked
    to nothing, one it refused): the usage filter's findings ``usage``, a 200 from node 0 at
    ``upstream``."""
    e = msg.http_logs.log_entry.add()
    common = e.common_properties
    common.access_log_type = kind
    if link is not None:
        common.metadata.filter_metadata[METADATA_NAMESPACE].fields[LINK_KEY].string_value = link
    common.metadata.filter_metadata[usage_log.NAMESPACE].update({usage_log.FILTER_KEY: 1, **usage})
    sock = common.upstream_remote_address.socket_address
    sock.address, sock.port_value = upstream, 7000
    e.response.response_code.value = 200
    return e


def periodic_message(links: list[str], events: int, upstream: str = "127.0.0.1") -> als_pb2.StreamAccessLogsMessage:
    """periodic_message is one batch of Envoy's periodic entries, one per link: the usage
    filter has counted ``events`` so far, the upstream is node 0."""
    msg = als_pb2.StreamAccessLogsMessage()
    for link in links:
        _entry(msg, accesslog_pb2.AccessLogType.DownstreamPeriodic, link,
               {usage_log.EVENTS_KEY: events}, upstream)
    return msg


def final_message(link: str | None, completion_tokens: int,
                  upstream: str = "127.0.0.1") -> als_pb2.StreamAccessLogsMessage:
    """final_message is Envoy's batch of one final entry for ``link`` (None: a request kvgate
    did not link): the stream completed (200, the upstream's last byte read) and the usage
    filter read ``completion_tokens`` from it; the upstream is node 0."""
    msg = als_pb2.StreamAccessLogsMessage()
    e = _entry(msg, accesslog_pb2.AccessLogType.DownstreamEnd, link,
               {usage_log.COMPLETION_KEY: completion_tokens}, upstream)
    e.common_properties.time_to_last_upstream_rx_byte.nanos = 5_000_000
    return msg
