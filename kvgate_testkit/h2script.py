"""h2script: an HTTP/2 (h2c) upstream that answers with given chunks, one DATA frame each.

Over HTTP/1 a proxy reads what has arrived, so two chunks written a few milliseconds apart
reach its filters as one whenever the proxy is slow to read (a loaded machine): a test of
how a filter takes a split cannot choose the split. Envoy hands its filters each HTTP/2
DATA frame on its own, however many arrive in one read, so this server writes every
chunk of a script as a frame of its own, all at once, and the split is the one written.

``ScriptServer`` runs in a thread of the test process, on a free loopback port. A request
names its answer with the ``key_header`` request header; the ``Script`` under that key
gives the status, the response headers, the chunks and whether the stream is then reset
(``cut``: as an upstream that breaks off) instead of ended.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.exceptions
import h2.events

from kvgate_testkit.procs import LOOPBACK, free_port


@dataclass(frozen=True)
class Script:
    """Script is one scripted answer: ``chunks`` are written as one DATA frame each (empty
    ones are skipped), then the stream ends, or is reset when ``cut``."""

    chunks: tuple[bytes, ...]
    headers: tuple[tuple[str, str], ...] = (("content-type", "text/event-stream"),)
    status: int = 200
    cut: bool = False


class _Connection(asyncio.Protocol):
    """_Connection is one h2c connection from Envoy."""

    def __init__(self, scripts: Mapping[str, Script], key_header: bytes) -> None:
        self.scripts = scripts
        self.key_header = key_header
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.transport: asyncio.Transport | None = None
        self.requests: dict[int, dict[bytes, bytes]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.h2.initiate_connection()
        self._flush()

    def _flush(self) -> None:
        assert self.transport is not None
        self.transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self._flush()
            assert self.transport is not None
            self.transport.close()
            return
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                self.requests[event.stream_id] = dict(event.headers)
            elif isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                self._answer(event.stream_id, self.requests.pop(event.stream_id, {}))
        self._flush()

    def _answer(self, stream_id: int, headers: dict[bytes, bytes]) -> None:
        key = headers.get(self.key_header, b"").decode("latin-1")
        script = self.scripts.get(key)
        if script is None:
            self.h2.send_headers(stream_id, [(b":status", b"404")], end_stream=True)
            return
        self.h2.send_headers(stream_id, [(b":status", str(script.status).encode())]
                             + [(k.encode(), v.encode()) for k, v in script.headers])
        for chunk in script.chunks:
            if chunk:
                self.h2.send_data(stream_id, chunk)
        if script.cut:
            self.h2.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
        else:
            self.h2.end_stream(stream_id)


class ScriptServer:
    """ScriptServer serves ``scripts`` over h2c on 127.0.0.1:``port`` from a thread."""

    def __init__(self, scripts: Mapping[str, Script], key_header: str) -> None:
        self.scripts = scripts
        self.key_header = key_header.lower().encode()
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="h2script", daemon=True)
        self._server: Any = None

    def start(self) -> ScriptServer:
        """start listens, and returns once the port accepts connections."""
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._loop.create_server(
            lambda: _Connection(self.scripts, self.key_header), LOOPBACK, self.port), self._loop).result(10)
        return self

    def stop(self) -> None:
        """stop closes the server and its connections, and ends the thread."""
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
            self._server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def cluster(self, name: str) -> dict[str, Any]:
        """cluster is the Envoy cluster (HTTP/2 without TLS) that reaches this server."""
        return {"name": name, "type": "STATIC", "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}}},
                "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": LOOPBACK,
                                                                 "port_value": self.port}}}}]}]}}
