"""server: the grpc.aio ext_proc service and the process around it.

``ExtProcService.Process`` is one ext_proc stream (one HTTP request): it reads Envoy's
messages, dispatches them by kind to an ``Exchange`` and writes the answers. The lease is
released in ``finally``: however the stream ends (response end of stream, a clean end
after a client disconnect, ``CancelledError``, an error in kvgate, shutdown), exactly once.

With deploy/envoy-observe.yaml a request has two streams: the admission stream (request
body only; it ends exactly when the HTTP request ends, completed or not) and an
observability-mode stream that carries the response and is never answered. The second
finds the first's exchange by the link in its dynamic metadata (``Link``). When the
admission stream ends first, the release waits for the observing stream to show the
response's end or to end itself (Envoy closes it ``deferred_close_timeout`` after the
request), at most ``OBSERVE_CAP_S``; an observing stream that has not begun within
``LINK_GRACE_S`` never will (the response never started).

On a route with ``release: stream_and_log`` (every shipped file in which kvgate sees the
response: deploy/envoy.yaml, envoy-four-message, envoy-endpoint-picker, envoy-observe) a
stream cut short is released at once, as ever; but Envoy ends the ext_proc stream alike
whether the client left or the upstream died, so the *cause* is settled by Envoy's access
log entry of the request (written only for requests with a response flag), which tells an
upstream that reset, closed or broke its response off. An entry that comes before the
stream's end is kept for it; a release whose entry has not come within ``CAUSE_WAIT_S`` is
counted ``client_disconnect`` (the fallback, logged).

``Server`` wires a process together: config, admission core, metrics, gate, the gRPC
server with the standard health service, the admin HTTP server, the backend scraper and
the config watcher, and the SIGTERM sequence:

1. ``/readyz`` and gRPC health go NOT_SERVING at once;
2. new streams are still served for ``server.drain_s`` seconds (load balancers notice);
3. the gRPC server stops accepting; streams in flight get ``server.grace_s`` seconds;
4. streams still open then are given up: their leases released with cause ``timeout``;
5. everything stops; the process exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from extproc import usage_log
from extproc.admin import AdminServer, Readiness
from extproc.admission import Admission, UnknownPoolError
from extproc.clock import Clock, MonotonicClock
from extproc.config import Config
from extproc.errors import ConfigError
from extproc.exchange import (CONTINUE_RESPONSE_TRAILERS, LINK_KEY,
                              METADATA_NAMESPACE, STREAM_AND_LOG, UNDECODABLE_ATTRIBUTES, Exchange,
                              Gate)
from extproc.metrics import Metrics
from extproc.tokens import load_tokenizer

log = logging.getLogger("kvgate.server")

# gRPC messages carry whole request bodies (BUFFERED): room for the largest configurable
# body plus protobuf framing.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
TOKENIZE_THREADS = 2
# How long an ended admission stream waits for its observing stream to begin (seconds):
# Envoy sent the response's first message before ending the request, but a new gRPC stream
# can be read after an old one's end.
LINK_GRACE_S = 0.05
# The most an ended admission stream waits for its observing stream to end (seconds),
# whatever deferred_close_timeout Envoy is given.
OBSERVE_CAP_S = 10.0
# How long the cause of a stream cut short waits for its access log entry (seconds): the
# entry comes within milliseconds (buffer_flush_interval 5 ms); past this it was lost.
CAUSE_WAIT_S = 5.0


# ProcessingRequest.attributes (map<string, Struct>), field number 9.
_ATTRIBUTES_FIELD = 9


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _without_field(data: bytes, number: int) -> bytes:
    """_without_field is a serialized message with every top-level ``number`` field cut out."""
    kept = []
    at = 0
    while at < len(data):
        start = at
        tag, at = _varint(data, at)
        wire = tag & 7
        if wire == 0:
            _, at = _varint(data, at)
        elif wire == 1:
            at += 8
        elif wire == 2:
            size, at = _varint(data, at)
            at += size
        elif wire == 5:
            at += 4
        else:
            raise DecodeError(f"unsupported wire type {wire}")
        if tag >> 3 != number:
            kept.append(data[start:at])
    return b"".join(kept)


def decode_request(data: bytes) -> pb.ProcessingRequest:
    """decode_request parses one ext_proc message from Envoy.

    Envoy copies request header bytes into request attributes, which are protobuf strings:
    a header that is not UTF-8 makes the whole message undecodable. Rather than fail the
    stream (a 500 for a client's bad byte), the attributes are dropped and marked
    (UNDECODABLE_ATTRIBUTES) so that the exchange refuses the request with a 400.
    """
    try:
        return pb.ProcessingRequest.FromString(data)
    except DecodeError:
        req = pb.ProcessingRequest.FromString(_without_field(data, _ATTRIBUTES_FIELD))
        req.attributes[UNDECODABLE_ATTRIBUTES].SetInParent()
        return req


class Link:
    """Link ties an admitted exchange to the observability-mode stream of its response.

    ``observed`` is set when that stream begins, ``ended`` when it ends.
    """

    __slots__ = ("exchange", "observed", "ended")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.observed = asyncio.Event()
        self.ended = asyncio.Event()


class ExtProcService(pb_grpc.ExternalProcessorServicer):
    """ExtProcService serves Envoy's ext_proc streams, one ``Exchange`` per stream.

    ``active`` maps each open stream's task to its exchange, for shutdown. ``parked`` holds
    the exchanges whose stream ended with their admission and whose end comes by Envoy's
    access log (route key ``release: access_log``), by link, with when they were parked.
    ``causes`` holds, by link, the exchanges of ``release: stream_and_log`` routes until the
    cause of their end is known (module doc), with when they were admitted or, once their
    release waits for the cause, released.
    """

    def __init__(self, gate: Gate, metrics: Metrics) -> None:
        self._gate = gate
        self._metrics = metrics
        self.active: dict[asyncio.Task[Any], Exchange] = {}
        self.links: dict[str, Link] = {}
        self.parked: dict[str, tuple[Exchange, float]] = {}
        self.causes: dict[str, tuple[Exchange, float]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._given_up = False

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        read = context.read
        req = await read()
        if req is grpc.aio.EOF:
            return
        if req.observability_mode:
            await self._observe(req, read)
            return
        ex = Exchange(self._gate)
        task = asyncio.current_task()
        assert task is not None
        self.active[task] = ex
        self._idle.clear()
        write = context.write
        eof = grpc.aio.EOF
        handed_over = False  # to the access log: the stream ends, the lease stays
        try:
            while True:
                kind = req.WhichOneof("request")
                if kind == "response_body":
                    resp = ex.response_body(req.response_body)
                elif kind == "request_headers":
                    resp = ex.request_headers(
                        req.request_headers, req.metadata_context,
                        req.protocol_config if req.HasField("protocol_config") else None)
                elif kind == "request_body":
                    resp = await ex.request_body(
                        req.request_body, write, req.attributes, req.metadata_context,
                        req.protocol_config if req.HasField("protocol_config") else None)
                    if ex.link is not None and ex.link not in self.links and ex.link not in self.parked:
                        # Before Envoy can send the response, or log the request's end.
                        if ex.released_by_access_log:
                            self.parked[ex.link] = (ex, self._gate.clock.now())
                        elif ex.observe:
                            self.links[ex.link] = Link(ex)
                        if ex.route.release == STREAM_AND_LOG:
                            self.causes[ex.link] = (ex, self._gate.clock.now())
                elif kind == "response_headers":
                    resp = ex.response_headers(req.response_headers, attributes=req.attributes,
                                               metadata=req.metadata_context)
                    if ex.response_unread and ex.link is not None:
                        self.links.pop(ex.link, None)  # no observing stream will come
                elif kind == "request_trailers":
                    resp = ex.request_trailers()
                elif kind == "response_trailers":
                    resp = CONTINUE_RESPONSE_TRAILERS
                else:  # a newer Envoy's message kind: nothing to do with it
                    resp = None
                if type(resp) is list:  # FULL_DUPLEX_STREAMED: headers, then the body's chunks
                    for one in resp:
                        await write(one)
                elif resp is not None:
                    await write(resp)
                resp = None
                if ex.link is not None and ex.link in self.parked:
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
            del self.active[task]
            if not handed_over and ex.link is not None:
                self.parked.pop(ex.link, None)  # the answer may not have reached Envoy
            link = self.links.get(ex.link) if ex.link is not None else None
            if handed_over:
                pass
            elif link is not None and ex.outcome is None and not self._given_up:
                settle = asyncio.get_running_loop().create_task(self._settle(link))
                self.active[settle] = ex
            else:
                ex.finish(gave_up=self._given_up)
                if ex.link is not None:
                    self.links.pop(ex.link, None)
                    self._ended(ex)
            self._maybe_idle()

    async def _observe(self, req: Any, read: Any) -> None:
        """_observe follows an observability-mode stream: the response of a request admitted
        on another stream. Nothing is answered (Envoy waits for nothing)."""
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

    async def _settle(self, link: Link) -> None:
        """_settle releases an exchange whose admission stream ended before its response
        was seen to end: once the observing stream has shown it, or ended, or never began
        (module doc)."""
        ex = link.exchange
        try:
            if not link.observed.is_set():
                await asyncio.wait_for(link.observed.wait(), LINK_GRACE_S)
            if ex.outcome is None:
                await asyncio.wait_for(link.ended.wait(), OBSERVE_CAP_S)
        except TimeoutError:
            pass
        finally:
            ex.finish(gave_up=self._given_up)
            if ex.link is not None:
                self.links.pop(ex.link, None)
                self._ended(ex)
            task = asyncio.current_task()
            if task is not None:
                self.active.pop(task, None)
            self._maybe_idle()

    def _ended(self, ex: Exchange) -> None:
        """_ended follows a finished exchange of ``causes``: kept (from now) while the cause of
        its release awaits the access log entry, dropped otherwise."""
        link = ex.link
        if link is None or link not in self.causes:
            return
        if ex.cause_pending:
            self.causes[link] = (ex, self._gate.clock.now())
        else:
            del self.causes[link]

    def _maybe_idle(self) -> None:
        if not self.active and not self.parked:
            self._idle.set()

    def logged(self, entry: Any) -> str:
        """logged releases the parked exchange an access log entry of Envoy's tells the end
        of (an ``HTTPAccessLogEntry``), or tells the cause of a request released by its
        stream (``causes``). Returns ``released``, or ``cause``; ``no_lease`` for a request
        admitted without a link (refused, passed through); ``complete`` for a request of a
        ``stream_and_log`` route whose stream ended complete (a flag such as the client's
        close on the last byte wrote the entry); ``unmatched`` for a link known nowhere
        here (released already by the TTL, another kvgate's, or a restart's)."""
        space = entry.common_properties.metadata.filter_metadata.get(METADATA_NAMESPACE)
        if space is None or LINK_KEY not in space.fields:
            return "no_lease"
        link = space.fields[LINK_KEY].string_value
        parked = self.parked.pop(link, None)
        if parked is None:
            told = self.causes.get(link)
            if told is None:
                release = space.fields.get("release")
                if release is not None and release.string_value == STREAM_AND_LOG \
                        and not _cut_short(entry)[0]:
                    return "complete"
                return "unmatched"
            ex = told[0]
            cut_short, upstream_failed = _cut_short(entry)
            ex.told_by_log(cut_short and upstream_failed)
            if ex.outcome is not None:  # finished: nothing more to learn of it
                del self.causes[link]
            return "cause"
        cut_short, upstream_failed = _cut_short(entry)
        parked[0].ended_by_log(entry.response.response_code.value, cut_short, upstream_failed,
                               usage_log.from_entry(entry))
        self._maybe_idle()
        return "released"

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
        """sweep_parked releases, with cause ``timeout``, the exchanges parked for longer
        than ``ttl_s`` (their log entry was lost: Envoy's buffer overflowed, the log stream
        broke); returns how many."""
        stale = [link for link, (_, at) in self.parked.items() if now - at >= ttl_s]
        for link in stale:
            self.parked.pop(link)[0].finish(gave_up=True)
        if stale:
            log.warning("released %d requests whose access log entry never came within %.0f s",
                        len(stale), ttl_s)
            self._maybe_idle()
        return len(stale)

    async def wait_idle(self, timeout: float) -> bool:
        """wait_idle waits up to ``timeout`` seconds for every stream to end (and every parked
        request's log entry to come); True if they did."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def give_up(self) -> int:
        """give_up releases every open stream's lease with cause ``timeout`` and cancels it.

        Returns how many streams were open.
        """
        self._given_up = True
        open_streams = list(self.active.items())
        for task, ex in open_streams:
            ex.finish(gave_up=True)
            task.cancel()
        parked = list(self.parked.values())
        self.parked.clear()
        for ex, _ in parked:
            ex.finish(gave_up=True)
        self.settle_causes(math.inf, 0.0)
        self._maybe_idle()
        return len(open_streams) + len(parked)


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """AccessLogReceiver takes Envoy's gRPC access log (deploy/envoy-access-log.yaml): each
    HTTP entry that carries a parked request's link releases it."""

    def __init__(self, service: ExtProcService, metrics: Metrics) -> None:
        self._service = service
        self._metrics = metrics

    async def StreamAccessLogs(self, request_iterator: Any, context: Any) -> als_pb2.StreamAccessLogsResponse:  # noqa: N802
        logged, count = self._service.logged, self._metrics.access_log_entry
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                count(logged(entry))
        return als_pb2.StreamAccessLogsResponse()


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


# How often parked requests are checked against server.access_log_ttl_s (seconds).
SWEEP_EVERY_S = 1.0


def _split_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class _LoopNodeSink:
    """_LoopNodeSink hands the scraper's per-node results to the admission core on its loop.

    ``mark`` blocks the scraper's thread until the loop has taken the mark (bounded by
    the scraper's ``MARK_TIMEOUT_S``): the round's scrapes must start after it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, admission: Admission) -> None:
        self._loop = loop
        self._admission = admission

    def mark(self, mark: int) -> bool:
        from extproc.signals.scraper import MARK_TIMEOUT_S
        done = threading.Event()

        def take() -> None:
            self._admission.mark_nodes(mark)
            done.set()

        try:
            self._loop.call_soon_threadsafe(take)
        except RuntimeError:  # the loop is closed: the service is stopping
            return False
        return done.wait(MARK_TIMEOUT_S)

    def report(self, pool: str, backend: str, report: Any) -> None:
        def deliver() -> None:
            try:
                self._admission.report_node(pool, backend, report)
            except UnknownPoolError:
                pass  # removed by a reload meanwhile

        try:
            self._loop.call_soon_threadsafe(deliver)
        except RuntimeError:
            pass


class Server:
    """Server is one kvgate process: every part wired together, started and stopped in order.

    ``grpc_listen`` / ``admin_listen`` default to the config's ``server`` section; port 0
    picks a free port (``grpc_port`` / ``admin_port`` tell which after ``start``).
    ``config_path`` enables hot reload of that file (and SIGHUP); ``scrape`` starts the
    backend scraper for pools that list backends.
    """

    def __init__(self, config: Config, *, grpc_listen: str | None = None,
                 admin_listen: str | None = None, config_path: str | Path | None = None,
                 clock: Clock | None = None, metrics: Metrics | None = None,
                 scrape: bool = True) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.metrics = metrics or Metrics()
        self.readiness = Readiness()
        self._grpc_listen = grpc_listen or config.server.grpc_listen
        self._admin_listen = admin_listen or config.server.admin_listen
        self._config_path = Path(config_path) if config_path else None
        self._scrape = scrape
        self.store: Any = None
        if config.store.kind == "redis" and config.store.redis is not None:
            from extproc.admission.store.redis import RedisStore  # only with a shared store
            self.store = RedisStore(config.store.redis, observer=self.metrics)
        self.admission = Admission(config, self.clock, self.store)
        self.executor = ThreadPoolExecutor(max_workers=TOKENIZE_THREADS,
                                           thread_name_prefix="kvgate-tokenize")
        self.gate = Gate(config, self.admission, self.metrics, self.clock, self.executor)
        self._tokenizers_ready = {pc.tokenizer for pc in config.pools.values()}
        self._reload_generation = 0
        self._reload_tasks: set[asyncio.Task[None]] = set()
        self.metrics.attach(self.admission, tuple(config.tenants.classes))
        self.service: ExtProcService | None = None
        self.health: HealthServicer | None = None
        self._grpc: grpc.aio.Server | None = None
        self._admin: AdminServer | None = None
        self._scraper: Any = None
        self._discovery: Any = None
        # Backends found in DNS per discovery pool, laid over every configuration applied.
        self._discovered: dict[str, tuple[Any, ...]] = {}
        self._watcher: Any = None
        self._stop_requested: asyncio.Event | None = None
        self.grpc_port = 0
        self.admin_port = 0
        self.released_at_shutdown = 0
        self._sweeper: asyncio.Task[None] | None = None

    # --- start ---------------------------------------------------------------------------

    async def start(self) -> None:
        """start binds both listeners and starts the helpers; then kvgate is ready."""
        loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        self.service = ExtProcService(self.gate, self.metrics)
        service = self.service
        self.metrics.streams.set_function(lambda: len(service.active))  # read at scrape time
        self.health = HealthServicer()
        self._grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Two kvgates on one port would split Envoy's streams between them silently.
            ("grpc.so_reuseport", 0),
        ])
        # The generated registration, with a decoder that survives hostile header bytes.
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "envoy.service.ext_proc.v3.ExternalProcessor", {
                "Process": grpc.stream_stream_rpc_method_handler(
                    self.service.Process, request_deserializer=decode_request,
                    response_serializer=pb.ProcessingResponse.SerializeToString)}),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(
            AccessLogReceiver(self.service, self.metrics), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(self._grpc_listen)
        if self.grpc_port == 0:
            raise OSError(f"cannot listen for gRPC on {self._grpc_listen}")
        host, port = _split_hostport(self._admin_listen)
        if self.store is not None:
            await self.store.start()  # degrades (loudly) rather than fails when Redis is away
        self._admin = AdminServer(self.metrics, self.readiness, host, port)
        await self._admin.start()
        self.admin_port = self._admin.port
        await self._grpc.start()
        self._sweeper = loop.create_task(self._sweep_parked())
        self._ensure_scraper(self.config)
        self._ensure_discovery(self.config)
        if self._config_path is not None:
            from extproc.reload import ConfigWatcher
            self._watcher = ConfigWatcher(self._config_path, self.apply_config,
                                          self._reload_refused, self.clock, loop=loop)
            initial = self._watcher.load_initial()
            if initial != self.config:  # the file changed between the first read and now
                self.apply_config(initial)
            self._watcher.start()
            self._watcher.install_sighup(loop)
        self.metrics.reload_ok(time.time())
        # Everything loaded so far (modules, tokenizer tables, config) lives as long as the
        # process: keep it out of the collector's full passes, which otherwise rescan it
        # every ~70k allocations, i.e. every few hundred requests.
        gc.collect()
        gc.freeze()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.readiness.set_ready()
        self.metrics.ready.set(1)
        log.info("kvgate serving ext_proc on %s (port %d), admin on %s (port %d)",
                 self._grpc_listen, self.grpc_port, self._admin_listen, self.admin_port)

    # --- reload --------------------------------------------------------------------------

    def apply_config(self, config: Config) -> None:
        """apply_config switches to a new configuration (on the loop thread).

        Tokenizers load first: a config that cannot load them is refused whole, and the
        old one stays in force. A tokenizer not loaded yet is read and parsed in a worker
        thread (hundreds of ms for a Llama 3 rank file, unbounded on a slow volume), so
        streams keep being served meanwhile; the configuration applies once it is loaded,
        unless a newer one was applied in between. Granted leases are untouched.
        """
        self._reload_generation += 1
        generation = self._reload_generation
        missing = sorted({pc.tokenizer for pc in config.pools.values()} - self._tokenizers_ready)
        if not missing:
            self._apply_now(config)
            return
        loop = asyncio.get_running_loop()

        def load() -> None:
            for spec in missing:
                load_tokenizer(spec)  # cached per spec: the loop's later call is a lookup

        async def load_then_apply() -> None:
            try:
                await loop.run_in_executor(self.executor, load)
            except ConfigError as err:
                if generation == self._reload_generation:
                    self._reload_refused(err)
                return
            except Exception as err:  # an unreadable file must not end the reload task unseen
                if generation == self._reload_generation:
                    self._reload_refused(err)
                return
            if generation == self._reload_generation:
                self._apply_now(config)
            else:
                log.info("a newer configuration arrived while tokenizers loaded; skipping this one")

        task = loop.create_task(load_then_apply())
        self._reload_tasks.add(task)
        task.add_done_callback(self._reload_tasks.discard)

    def _apply_now(self, config: Config) -> None:
        try:
            self.gate.reconfigure(config)
        except ConfigError as err:
            self._reload_refused(err)
            return
        self._tokenizers_ready.update(pc.tokenizer for pc in config.pools.values())
        # Bound or connected at start; every other key (drain_s, grace_s, ... included) is
        # read where it is used, so it applies now.
        fixed = [key for key, old, new in (
            ("store", self.config.store, config.store),
            ("server.grpc_listen", self.config.server.grpc_listen, config.server.grpc_listen),
            ("server.admin_listen", self.config.server.admin_listen, config.server.admin_listen)) if old != new]
        if fixed:
            log.warning("%s change only with a restart; the rest of the new configuration applies now",
                        ", ".join(fixed))
        if self._discovery is not None:
            self._discovery.reconfigure(config)
        self._discovered = {p: b for p, b in self._discovered.items()
                            if p in config.pools and config.pools[p].discovery is not None}
        self._ensure_discovery(config)
        config = self._with_discovered(config)
        self._apply_nodes(config)
        self.metrics.set_classes(tuple(config.tenants.classes))
        self.config = config
        self.metrics.reload_ok(time.time())
        log.info("configuration reloaded: pools %s", ", ".join(config.pools))

    def _apply_nodes(self, config: Config) -> None:
        """_apply_nodes hands a configuration's pools and nodes to the admission core and scraper."""
        self.admission.reconfigure(config)
        if self._scraper is not None:
            self._scraper.reconfigure(config)
        else:
            self._ensure_scraper(config)  # a reload (or discovery) may add the first backends

    def _with_discovered(self, config: Config) -> Config:
        """_with_discovered is ``config`` with each discovery pool's backends as found in DNS."""
        if not self._discovered:
            return config
        import dataclasses
        pools = dict(config.pools)
        for name, backends in self._discovered.items():
            if name in pools:
                pools[name] = dataclasses.replace(pools[name], backends=backends)
        return dataclasses.replace(config, pools=pools)

    def _ensure_discovery(self, config: Config) -> None:
        """_ensure_discovery starts the DNS discovery thread once some pool discovers its nodes."""
        if self._discovery is not None or not self._scrape:
            return
        if not any(p.discovery is not None for p in config.pools.values()):
            return
        from extproc.signals.discovery import Discovery
        loop = asyncio.get_running_loop()

        def apply(pool: str, backends: tuple[Any, ...]) -> None:
            pc = self.config.pools.get(pool)
            if pc is None or pc.discovery is None:
                return  # a reload removed it meanwhile
            self._discovered[pool] = backends
            config = self._with_discovered(self.config)
            self._apply_nodes(config)
            self.config = config

        def changed(pool: str, backends: tuple[Any, ...]) -> None:
            loop.call_soon_threadsafe(apply, pool, backends)

        self._discovery = Discovery(config, changed)
        self._discovery.start()

    def _ensure_scraper(self, config: Config) -> None:
        """_ensure_scraper starts the scraper thread once some pool has backends."""
        if self._scraper is not None or not self._scrape:
            return
        if not any(p.backends for p in config.pools.values()):
            return
        from extproc.signals import Scraper  # imported only when a pool has backends
        loop = asyncio.get_running_loop()
        admission = self.admission

        def deliver(pool: str, signals: Any) -> None:
            try:
                admission.update_signals(pool, signals)
            except UnknownPoolError:
                pass  # published just before a reload removed the pool: nothing to follow

        def publish(pool: str, signals: Any) -> None:
            loop.call_soon_threadsafe(deliver, pool, signals)

        self._scraper = Scraper(config, publish, self.metrics, self.clock,
                                nodes=_LoopNodeSink(loop, admission))
        self._scraper.start()

    def _reload_refused(self, err: Exception) -> None:
        self.metrics.reload_failed()
        log.error("configuration not reloaded, the previous one stays in force: %s", err)

    # --- stop ----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """request_stop starts the shutdown sequence (what SIGTERM and SIGINT do)."""
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def serve_until_stopped(self) -> None:
        """serve_until_stopped runs until SIGTERM/SIGINT (or ``request_stop``), then shuts down."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        assert self._stop_requested is not None
        await self._stop_requested.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """shutdown drains and stops kvgate (the numbered sequence in the module doc)."""
        drain_s, grace_s = self.config.server.drain_s, self.config.server.grace_s
        self.readiness.set_draining()
        self.metrics.ready.set(0)
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        log.info("draining: not ready; still serving new streams for %.1fs", drain_s)
        if drain_s > 0:
            await asyncio.sleep(drain_s)
        assert self._grpc is not None and self.service is not None
        # Stop accepting now; grpc cancels whatever is left a little after our own deadline.
        stopping = asyncio.create_task(self._grpc.stop(grace_s + 1.0))
        open_streams = len(self.service.active)
        if open_streams:
            log.info("waiting up to %.1fs for %d streams in flight", grace_s, open_streams)
        if not await self.service.wait_idle(grace_s):
            self.released_at_shutdown = self.service.give_up()
            log.warning("grace period over: gave up %d streams (leases released, cause timeout)",
                        self.released_at_shutdown)
        await stopping
        await self.close()
        log.info("kvgate stopped")

    async def _sweep_parked(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            if self.service is not None:
                self.service.sweep_parked(self.clock.now(), self.config.server.access_log_ttl_s)
                self.service.settle_causes(self.clock.now())

    async def close(self) -> None:
        """close stops the helpers and listeners without draining (tests, failed starts)."""
        for task in list(self._reload_tasks):
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._watcher is not None:
            loop = asyncio.get_running_loop()
            self._watcher.remove_sighup(loop)
            await loop.run_in_executor(None, self._watcher.stop)
            self._watcher = None
        if self._discovery is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._discovery.stop)
            self._discovery = None
        if self._scraper is not None:
            # stop joins the thread, which may be inside a scrape: keep the loop free meanwhile
            await asyncio.get_running_loop().run_in_executor(None, self._scraper.stop)
            self._scraper = None
        if self._grpc is not None:
            await self._grpc.stop(0)
            self._grpc = None
        if self._admin is not None:
            await self._admin.stop()
            self._admin = None
        if self.store is not None:
            await self.store.close()  # queued settles go to Redis; this replica deregisters
            self.store = None
        self.executor.shutdown(wait=False, cancel_futures=True)


async def serve(config: Config, *, grpc_listen: str | None = None, admin_listen: str | None = None,
                config_path: str | Path | None = None) -> int:
    """serve runs kvgate until SIGTERM/SIGINT and returns the exit code (0 after a clean drain)."""
    server = Server(config, grpc_listen=grpc_listen, admin_listen=admin_listen,
                    config_path=config_path)
    try:
        await server.start()
    except BaseException:
        await server.close()
        raise
    await server.serve_until_stopped()
    return 0
