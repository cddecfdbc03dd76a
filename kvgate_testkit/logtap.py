"""logtap: a gRPC access log receiver of the test's own, beside kvgate's.

``LogTap`` serves Envoy's AccessLogService on a free loopback port and keeps every HTTP
entry it receives, by the value of one request header (``key_header``), which the
access logger must log (``access_logger`` writes that logger's configuration). A test
that adds it beside kvgate's access logger (``Stack(envoy_edit=tap.add_to)``) reads the
very entries, dynamic metadata included, that Envoy sends kvgate.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from kvgate_testkit.procs import LOOPBACK, free_port

CLUSTER = "log_tap"


class LogTap(als_pb2_grpc.AccessLogServiceServicer):
    """LogTap keeps the HTTP access log entries Envoy sends it, by ``key_header``'s value."""

    def __init__(self, key_header: str) -> None:
        self.key_header = key_header
        self.port = free_port()
        self.entries: dict[str, Any] = {}
        self._changed = threading.Condition()
        self._server: grpc.Server | None = None

    def start(self) -> LogTap:
        """start serves the tap on 127.0.0.1:``port``."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self, server)
        server.add_insecure_port(f"{LOOPBACK}:{self.port}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        """stop ends the server, its open streams with it."""
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None

    def StreamAccessLogs(self, request_iterator: Any, context: Any) -> als_pb2.StreamAccessLogsResponse:  # noqa: N802
        for message in request_iterator:
            for entry in message.http_logs.log_entry:
                key = entry.request.request_headers.get(self.key_header)
                if key is None:
                    continue
                with self._changed:
                    self.entries[key] = entry
                    self._changed.notify_all()
        return als_pb2.StreamAccessLogsResponse()

    def wait(self, key: str, timeout: float = 10.0) -> Any:
        """wait returns the entry of the request whose ``key_header`` was ``key``, once it
        has come (TimeoutError after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while key not in self.entries:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no access log entry for {self.key_header}: {key} in {timeout}s")
                self._changed.wait(left)
            return self.entries[key]

    def add_to(self, cfg: dict[str, Any]) -> None:
        """add_to adds the tap to a rendered Envoy configuration: its cluster, and its access
        logger beside the others of the (first) listener's HTTP connection manager."""
        listener = cfg["static_resources"]["listeners"][0]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        hcm.setdefault("access_log", []).append(self.access_logger())
        cfg["static_resources"]["clusters"].append({
            "name": CLUSTER, "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": LOOPBACK,
                                                             "port_value": self.port}}}}]}]}})

    def access_logger(self) -> dict[str, Any]:
        """access_logger is the Envoy access logger that sends every entry to the tap."""
        return {"name": "envoy.access_loggers.http_grpc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {"log_name": "tap", "transport_api_version": "V3",
                              "grpc_service": {"envoy_grpc": {"cluster_name": CLUSTER}},
                              "buffer_flush_interval": "0.005s"},
            "additional_request_headers_to_log": [self.key_header]}}
