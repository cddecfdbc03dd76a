"""accesslog: Envoy's gRPC access log, read entry by entry for the registry of endings.

``AccessLogReceiver`` is the access log service (deploy/envoy-access-log.yaml, and the entries
of the ``*_AND_LOG`` files): each HTTP entry goes to ``Endings.logged``
(``extproc.request.registry``). ``is_final``, ``cut_short_by`` and ``upstream_address`` read
what an entry tells of its request's end.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf.message import DecodeError

from extproc import logwire
from extproc.metrics import Metrics
from extproc.outcomes import LogResult

log = logging.getLogger("kvgate.server")

__all__ = ["AccessLogReceiver", "cut_short_by", "is_final", "upstream_address"]

# The entries that tell a request's end: written when its stream ends (DownstreamEnd), or by an
# Envoy that does not name the type (NotSet). Any other (a periodic entry of a stream in flight,
# one at the request's start) never releases.
_FINAL_TYPES = (accesslog_pb2.AccessLogType.NotSet, accesslog_pb2.AccessLogType.DownstreamEnd)


class Taker(Protocol):
    """Taker takes one access log entry and says what it did (``registry.Endings``)."""

    def logged(self, entry: Any) -> LogResult: ...


def is_final(common: Any) -> bool:
    """is_final: an entry's common properties (``common``) tell the end of its stream."""
    return common.access_log_type in _FINAL_TYPES and not common.intermediate_log_entry


def upstream_address(entry: Any) -> str | None:
    """upstream_address is the upstream host an access log entry names (``HOST:PORT``, an
    IPv6 host in brackets): the node Envoy connected to; None when none is named yet."""
    sock = entry.common_properties.upstream_remote_address.socket_address
    if not sock.address or not sock.port_value:
        return None
    host = f"[{sock.address}]" if ":" in sock.address else sock.address
    return f"{host}:{sock.port_value}"


def cut_short_by(entry: Any) -> tuple[bool, bool]:
    """cut_short_by reads an access log entry: was the response cut short, and did the upstream
    fail (reset, closed its connection, broke its response off)?"""
    # Cut short: the upstream's response never ended (the client went away, a timeout),
    # so the generation was aborted. Not Envoy's downstream-termination flag: a client
    # that closes on the last event of a complete stream sets it too, at random.
    common = entry.common_properties
    cut_short = not common.HasField("time_to_last_upstream_rx_byte")
    flags = common.response_flags
    # The upstream went away mid-response (it crashed, its connection broke): not the
    # client's doing, though the client's stream ends cut short the same way
    # (a chunked HTTP/1 body broken off reads as a protocol error).
    upstream_failed = (flags.upstream_remote_reset or flags.upstream_connection_termination
                       or flags.upstream_connection_failure or flags.upstream_protocol_error)
    return cut_short, bool(upstream_failed)


class AccessLogReceiver:
    """AccessLogReceiver takes Envoy's gRPC access log (deploy/envoy-access-log.yaml and the
    entries of the ``*_AND_LOG`` files): each HTTP entry goes to ``Endings.logged``.

    The method is registered with the raw bytes of each batch (``server``; the generated
    servicer's handler would parse a whole batch into one arena): ``logwire`` finds the
    entries in them, and each is parsed alone, once it is its turn. A batch whose framing is
    broken is refused whole and an entry that does not parse alone (bad UTF-8 in a string
    field, a broken submessage), and each counts one ``malformed``: the stream goes on.
    """

    def __init__(self, endings: Taker, metrics: Metrics) -> None:
        self._endings = endings
        self._metrics = metrics

    async def StreamAccessLogs(self, request_iterator: Any, context: Any) -> als_pb2.StreamAccessLogsResponse:  # noqa: N802
        """StreamAccessLogs reads one access log stream of Envoy's: each message the bytes of
        a ``StreamAccessLogsMessage``, handled before the next is read."""
        async for data in request_iterator:
            self.batch(data)
        return als_pb2.StreamAccessLogsResponse()

    def batch(self, data: bytes) -> None:
        """batch handles the HTTP entries of one serialized ``StreamAccessLogsMessage``."""
        logged, count = self._endings.logged, self._metrics.access_log_entry
        try:
            spans = logwire.http_entry_spans(data)
        except DecodeError as err:
            count(LogResult.MALFORMED)
            log.error("refused an access log batch of %d bytes whose framing is broken (%s): "
                      "its entries are lost; the requests they would release are released by "
                      "server.access_log_ttl_s", len(data), err)
            return
        view = memoryview(data)
        parse = accesslog_pb2.HTTPAccessLogEntry.FromString
        bad = 0
        for i in range(0, len(spans), 2):
            try:
                entry = parse(view[spans[i]:spans[i + 1]])
            except DecodeError:
                bad += 1
                count(LogResult.MALFORMED)
                continue
            count(logged(entry))
        if bad:
            log.error("refused %d access log entries of %d in a batch: they do not parse",
                      bad, len(spans) // 2)
