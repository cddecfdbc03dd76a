"""endings: the requests whose end comes from elsewhere than their own ext_proc stream, and
the access log that tells it.

A lease is granted at the request body and released once, with a cause
(``extproc.request.causes``). How the request's end reaches kvgate is its ``ReleaseMode``,
named once, at admission, from the Envoy file's profile (``extproc.request.profile``):

==================  ==================================================================
mode                the lease is released
==================  ==================================================================
STREAM_AND_LOG      at the response's end of stream, or the stream's end; the access log
                    entry tells the cause of a stream cut short
STREAM              the same; a stream cut short is a client_disconnect
OBSERVED_AND_LOG    when the observability-mode stream shows the response's end, or ends;
                    the entry tells the cause
OBSERVED            the same, without the entry
UNREAD              when the admission stream ends (cause ``ended``, the completion charged
                    at its reservation)
ACCESS_LOG          when the access log entry comes (parked until then, at most
                    ``server.access_log_ttl_s``)
==================  ==================================================================

``Endings`` is the one registry of requests whose end comes from elsewhere than their own
ext_proc stream: the observed requests by link (``Link``, with the observing stream's
progress), the parked requests of ACCESS_LOG routes, and the requests of the ``*_AND_LOG``
modes whose cause waits for their entry. Envoy ends an ext_proc stream alike whether the
client left or the upstream died, so a stream cut short is released at once and only the
counting of its cause waits for the entry (written only for requests with a response flag),
at most ``CAUSE_WAIT_S``: then it is counted ``client_disconnect`` (the fallback, logged).
``Endings.logged`` is where each entry of Envoy's access log is handled; the entry's
``_cut_short`` reading says whether the response was cut short and by whom. Only an entry
of a stream's end settles anything: a periodic entry of a stream in flight (the
endpoint-picker-log file's ``access_log_flush_interval``) tells a parked request's node
ledger its tokens so far and the node that serves it (``Exchange.progressed``), and nothing
else.

"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf.message import DecodeError

from extproc import logwire, usage_log
from extproc.admission import Outcome
from extproc.clock import Clock
from extproc.gate import METADATA_NAMESPACE
from extproc.metrics import Metrics
from extproc.outcomes import LogResult
from extproc.request.profile import STREAM_AND_LOG, ReleaseMode

if TYPE_CHECKING:
    from extproc.exchange import Exchange

log = logging.getLogger("kvgate.server")

# Dynamic metadata key (namespace ``kvgate``) of the token that ties a request's response,
# seen on an observability-mode stream or in an access log entry, to the exchange that
# admitted it.
LINK_KEY = "link"
# How long an ended admission stream waits for its observing stream to begin (seconds):
# Envoy sent the response's first message before ending the request, but a new gRPC stream
# can be read after an old one's end.
LINK_GRACE_S = 0.05
# The most an ended admission stream waits for its observing stream to end (seconds),
# whatever deferred_close_timeout Envoy is given.
OBSERVE_CAP_S = 10.0
# The entries that tell a request's end: written when its stream ends (DownstreamEnd), or by an
# Envoy that does not name the type (NotSet). Any other (a periodic entry of a stream in flight,
# one at the request's start) never releases.
_FINAL_TYPES = (accesslog_pb2.AccessLogType.NotSet, accesslog_pb2.AccessLogType.DownstreamEnd)
# How long the cause of a stream cut short waits for its access log entry (seconds): the
# entry comes within milliseconds (buffer_flush_interval 5 ms); past this it was lost.
CAUSE_WAIT_S = 5.0


class Link:
    """Link ties an admitted exchange to the observability-mode stream of its response.

    ``observed`` is set when that stream begins, ``ended`` when it ends.
    """

    __slots__ = ("exchange", "observed", "ended")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.observed = asyncio.Event()
        self.ended = asyncio.Event()


class Endings:
    """Endings holds, by link, every admitted request whose end comes from elsewhere than its
    own ext_proc stream (module doc), and settles each when that end comes.

    ``links``: the OBSERVED* requests, with their observing stream's progress. ``parked``:
    the ACCESS_LOG requests whose stream has ended (their time to live runs from their
    lease's ``admitted_at``, on the clock the admission core shares with this one). ``causes``:
    the ``*_AND_LOG`` requests until the cause of their end is known, with when they were
    admitted or, once their release waits for the cause, released. ``changed`` is called
    when a parked request is released (the service may have become idle).
    """

    def __init__(self, clock: Clock, metrics: Metrics, changed: Callable[[], None]) -> None:
        self._clock = clock
        self._metrics = metrics
        self._changed = changed
        self.links: dict[str, Link] = {}
        # The exchange alone, not (exchange, instant): one request parked is one dict entry,
        # and thousands of them stream at once.
        self.parked: dict[str, Exchange] = {}
        self.causes: dict[str, tuple[Exchange, float]] = {}
        # Parked requests whose stream ended before the write of their answer returned, and
        # when: kept for their log entry at most CAUSE_WAIT_S (``stream_ended``).
        self.unsure: dict[str, float] = {}
        # Set by give_up: every release from then on is a timeout.
        self.given_up = False

    # --- the admission stream ----------------------------------------------------------

    def admitted(self, ex: Exchange) -> None:
        """admitted registers a request just admitted, before Envoy can send its response
        or log its end: an ACCESS_LOG request is parked (its stream may end now), an
        OBSERVED* one linked, and a ``*_AND_LOG`` one kept for its cause."""
        mode, link = ex.mode, ex.link
        if mode is None or link is None:
            return
        if mode is ReleaseMode.ACCESS_LOG:
            self.parked[link] = ex
        elif mode.observed:
            self.links[link] = Link(ex)
        if mode.cause_from_log:
            self.causes[link] = (ex, self._clock.now())

    def handed_over(self, ex: Exchange) -> bool:
        """handed_over: the request's end comes by the access log; its stream may end with
        the lease held."""
        return ex.link is not None and ex.link in self.parked

    def stream_ended(self, ex: Exchange, handed_over: bool) -> Link | None:
        """stream_ended follows the end of a request's admission stream, however it ended.

        A request handed over to the access log stays parked; so does, for at most
        CAUSE_WAIT_S, a parked one whose stream ended before the write of its answer
        returned (``unsure``). An observed request whose response has not been seen to end
        is returned: ``settle`` releases it once the observing stream shows its end. Any
        other is released now (``Exchange.finish``).
        """
        if handed_over:
            return None
        link_key = ex.link
        if (link_key is not None and link_key in self.parked and ex.outcome is None
                and not self.given_up):
            # Parked, but the stream ended before the write of its answer returned: a fast
            # answer (JSON) can finish the request that soon, and its log entry then tells its
            # end and usage. If the answer never reached Envoy, no entry will name the link:
            # ``sweep_parked`` releases it CAUSE_WAIT_S after this.
            self.unsure.setdefault(link_key, self._clock.now())
            return None
        link = self.links.get(link_key) if link_key is not None else None
        if link is not None and ex.outcome is None and not self.given_up:
            return link
        self._release(ex)
        return None

    async def settle(self, link: Link) -> None:
        """settle releases an observed exchange whose admission stream ended before its
        response was seen to end: once the observing stream has shown it, or ended, or never
        began within LINK_GRACE_S (the response never started); at most OBSERVE_CAP_S."""
        ex = link.exchange
        try:
            if not link.observed.is_set():
                await asyncio.wait_for(link.observed.wait(), LINK_GRACE_S)
            if ex.outcome is None:
                await asyncio.wait_for(link.ended.wait(), OBSERVE_CAP_S)
        except TimeoutError:
            pass
        finally:
            self._release(ex)

    def _release(self, ex: Exchange) -> None:
        """_release finishes an exchange (if not already) and forgets its link; a release
        whose cause awaits the access log entry stays in ``causes``, from now."""
        ex.finish(gave_up=self.given_up)
        link = ex.link
        if link is None:
            return
        self.links.pop(link, None)
        if link in self.causes:
            if ex.cause_pending:
                self.causes[link] = (ex, self._clock.now())
            else:
                del self.causes[link]

    # --- the observing stream ------------------------------------------------------------

    async def observe(self, req: Any, read: Callable[[], Any]) -> None:
        """observe follows an observability-mode stream (its first message ``req``, the next
        by ``read``): the response of a request admitted on another stream. Nothing is
        answered (Envoy waits for nothing)."""
        link = None
        space = req.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
        if space is not None and LINK_KEY in space.fields:
            link = self.links.get(space.fields[LINK_KEY].string_value)
        eof = grpc.aio.EOF
        if link is None:  # not admitted here (refused, passed through, another process)
            while req is not eof:
                req = await read()
            return
        link.observed.set()
        ex = link.exchange
        try:
            while req is not eof:
                kind = req.WhichOneof("request")
                if kind == "response_body":
                    ex.response_body(req.response_body)
                elif kind == "response_headers":
                    ex.response_headers(req.response_headers, observed=True)
                req = await read()
        except asyncio.CancelledError:
            raise
        except Exception:
            self._metrics.internal_errors.inc()
            log.exception("observing stream failed; its request is released as it stands")
        finally:
            link.ended.set()

    # --- the access log ------------------------------------------------------------------

    def logged(self, entry: Any) -> LogResult:
        """logged handles one entry of Envoy's access log (an ``HTTPAccessLogEntry``): it
        releases the parked request it tells the end of, or tells the cause of a request
        released by its stream (``causes``); a periodic entry only tells a parked request's
        progress (``_progressed``). Returns what it did (``LogResult``)."""
        common = entry.common_properties
        space = common.metadata.filter_metadata.get(METADATA_NAMESPACE)
        final = common.access_log_type in _FINAL_TYPES and not common.intermediate_log_entry
        if space is None or LINK_KEY not in space.fields:
            return LogResult.NO_LEASE if final else LogResult.PERIODIC
        link = space.fields[LINK_KEY].string_value
        if not final:
            return self._progressed(link, entry)
        cut_short, upstream_failed = _cut_short(entry)
        parked = self.parked.pop(link, None)
        self.unsure.pop(link, None)
        if parked is not None:
            parked.ended_by_log(entry.response.response_code.value, cut_short, upstream_failed,
                                usage_log.from_entry(entry))
            self._changed()
            return LogResult.RELEASED
        told = self.causes.get(link)
        if told is None:
            release = space.fields.get("release")
            if release is not None and release.string_value == STREAM_AND_LOG and not cut_short:
                return LogResult.COMPLETE  # a flag such as the client's close on the last byte
            return LogResult.UNMATCHED
        ex = told[0]
        ex.told_by_log(cut_short and upstream_failed)
        if ex.outcome is not None:  # finished: nothing more to learn of it
            del self.causes[link]
        return LogResult.CAUSE

    def _progressed(self, link: str, entry: Any) -> LogResult:
        """_progressed applies a periodic entry (a stream still in flight) to the parked request
        it names: its tokens so far and the node that serves it (``Exchange.progressed``).
        Nothing is released, settled or unparked, whatever the entry says."""
        parked = self.parked.get(link)
        if parked is None:
            return LogResult.PERIODIC
        if parked.progressed(usage_log.events_so_far(entry), upstream_address(entry)):
            return LogResult.PROGRESS
        return LogResult.PROGRESS_INVALID

    def settle_causes(self, now: float, wait_s: float = CAUSE_WAIT_S) -> int:
        """settle_causes counts as ``client_disconnect`` the releases whose cause has waited
        ``wait_s`` seconds or more for an access log entry that never came (Envoy's buffer
        overflowed, the log stream broke); returns how many."""
        late = [link for link, (ex, at) in self.causes.items()
                if ex.cause_pending and now - at >= wait_s]
        for link in late:
            self.causes.pop(link)[0].told_by_log(False)
        if late:
            log.warning("counted %d releases as client_disconnect: their access log entry, which "
                        "would tell an upstream failure, never came within %.0f s", len(late), wait_s)
        return len(late)

    def sweep_parked(self, now: float, ttl_s: float) -> int:
        """sweep_parked releases, with cause ``timeout``, the requests parked for longer than
        ``ttl_s`` seconds (their log entry was lost: Envoy's buffer overflowed, the log stream
        broke); returns how many."""
        stale = [link for link, ex in self.parked.items() if now - _admitted_at(ex) >= ttl_s]
        for link in stale:
            self.unsure.pop(link, None)
            self.parked.pop(link).finish(gave_up=True)
        unsure = [link for link, at in self.unsure.items() if now - at >= CAUSE_WAIT_S]
        for link in unsure:
            del self.unsure[link]
            self.parked.pop(link).finish()  # the answer never reached Envoy: as a disconnect
        if stale:
            log.warning("released %d requests whose access log entry never came within %.0f s",
                        len(stale), ttl_s)
        if stale or unsure:
            self._changed()
        return len(stale) + len(unsure)

    def give_up(self) -> int:
        """give_up releases every parked request with cause ``timeout`` and counts every cause
        still awaited as ``client_disconnect``; every later release is a timeout. Returns
        how many requests were parked."""
        self.given_up = True
        parked = list(self.parked.values())
        self.parked.clear()
        self.unsure.clear()
        for ex in parked:
            ex.finish(gave_up=True)
        self.settle_causes(float("inf"), 0.0)
        return len(parked)


def _admitted_at(ex: Exchange) -> float:
    """_admitted_at is the instant a parked exchange's lease was granted (seconds, the
    admission core's clock): a request is parked just after, within the same message."""
    lease = ex.lease
    assert lease is not None  # only an admitted request is parked
    return lease.admitted_at


def upstream_address(entry: Any) -> str | None:
    """upstream_address is the upstream host an access log entry names (``HOST:PORT``, an
    IPv6 host in brackets): the node Envoy connected to; None when none is named yet."""
    sock = entry.common_properties.upstream_remote_address.socket_address
    if not sock.address or not sock.port_value:
        return None
    host = f"[{sock.address}]" if ":" in sock.address else sock.address
    return f"{host}:{sock.port_value}"


def _cut_short(entry: Any) -> tuple[bool, bool]:
    """_cut_short reads an access log entry: was the response cut short, and did the upstream
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

    def __init__(self, endings: Endings, metrics: Metrics) -> None:
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
