"""server: one kvgate process, wired together, started and stopped in order.

The ext_proc streams are served by ``service.ExtProcService``; how an admitted request
ends, in every release mode, is ``endings``.

``Server`` wires a process together: config, admission core, metrics, gate, the gRPC
server with the standard health service, the admin HTTP server, the backend scraper and
the config watcher, and the SIGTERM sequence:

1. ``/readyz`` and gRPC health (every name but ``liveness``) go NOT_SERVING at once;
2. new streams are still served for ``server.drain_s`` seconds (load balancers notice);
3. the gRPC server stops accepting; streams in flight get ``server.grace_s`` seconds;
4. streams still open then are given up: their leases released with cause ``timeout``;
5. everything stops; the process exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from extproc.admin import AdminServer, Readiness
from extproc.admission import Admission, UnknownPoolError
from extproc.clock import Clock, MonotonicClock
from extproc.config import Config
from extproc.configdiff import ConfigChange, guard
from extproc.countpool import CountPool
from extproc.request.accesslog import AccessLogReceiver
from extproc.errors import ConfigError
from extproc.gate import Gate
from extproc.heap import HeapTrimmer, pin_mmap_threshold
from extproc.metrics import Metrics
from extproc.service import ExtProcService, decode_request, encode_response
from extproc.tokens import BpeOpenAITokenizer, load_tokenizer, use_count_pool

log = logging.getLogger("kvgate.server")

# gRPC messages carry whole request bodies (BUFFERED): room for the largest configurable
# body plus protobuf framing.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
TOKENIZE_THREADS = 2


# The ext_proc service's full name: where Envoy's streams come, and one of the gRPC health names.
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# gRPC health (grpc.health.v1) names. The endpoint picker protocol asks a picker for three:
# ``liveness`` answers SERVING while the process answers at all (draining included);
# ``readiness`` and the ext_proc service's name follow kvgate's readiness (``/readyz``), as
# does "", the whole server by gRPC's convention (kvgate's own probes ask it).
LIVENESS = "liveness"
READINESS_NAMES = ("", "readiness", EXT_PROC_SERVICE)

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

    def mark(self, mark: int, only: Collection[tuple[str, str]] | None = None) -> bool:
        from extproc.signals.scraper import MARK_TIMEOUT_S
        done = threading.Event()

        def take() -> None:
            self._admission.mark_nodes(mark, only)
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
        # The file's configuration in force (self.config adds the backends found in DNS): a
        # reload is compared with it (configdiff).
        self._file_config = config
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
        # Long prompt stretches without word breaks are counted in a worker process (the
        # GIL of this one stays free), started at the first such count (counted here until
        # it is up: a server that never meets one never starts it). A tokenizing
        # thread waits in the pool while it counts: the pool's capacity is added to the
        # threads, so those waits never take a thread from other counts.
        self.count_pool = CountPool(tuple(sorted(_bpe_specs(config))), start=False)
        use_count_pool(self.count_pool)
        self.executor = ThreadPoolExecutor(max_workers=TOKENIZE_THREADS + self.count_pool.capacity,
                                           thread_name_prefix="kvgate-tokenize")
        self.gate = Gate(config, self.admission, self.metrics, self.clock, self.executor)
        self._tokenizers_ready = {pc.tokenizer for pc in config.pools.values()}
        self._reload_generation = 0
        self._reload_tasks: set[asyncio.Task[None]] = set()
        # Every request in flight is charged the heap's high-water mark otherwise (``heap``).
        self.heap = HeapTrimmer()
        self.metrics.attach(self.admission, tuple(config.tenants.classes))
        self.service: ExtProcService | None = None
        self.health: HealthServicer | None = None
        self._grpc: grpc.aio.Server | None = None
        self._admin: AdminServer | None = None
        self._scraper: Any = None
        self._kv_events: Any = None  # signals.kv_events.KvEvents, once a pool reads KV events
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
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._ready_health(False)
        self._grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Two kvgates on one port would split Envoy's streams between them silently.
            ("grpc.so_reuseport", 0),
        ])
        # The generated registration, with a decoder that survives hostile header bytes and
        # an encoder that writes answers already encoded as they are.
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            EXT_PROC_SERVICE, {
                "Process": grpc.stream_stream_rpc_method_handler(
                    self.service.Process, request_deserializer=decode_request,
                    response_serializer=encode_response)}),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        # The access log's batches as raw bytes: the receiver parses them entry by entry.
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "envoy.service.accesslog.v3.AccessLogService", {
                "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                    AccessLogReceiver(self.service.endings, self.metrics).StreamAccessLogs,
                    request_deserializer=None,
                    response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString)}),))
        self.grpc_port = self._grpc.add_insecure_port(self._grpc_listen)
        if self.grpc_port == 0:
            raise OSError(f"cannot listen for gRPC on {self._grpc_listen}")
        host, port = _split_hostport(self._admin_listen)
        self._admin = AdminServer(self.metrics, self.readiness, host, port,
                                  None if self.store is None else self.store.replica_id)
        await self._admin.start()
        self.admin_port = self._admin.port
        if self.store is not None:
            # where the other replicas ask whether this one still runs (its heartbeat gone)
            self.store.advertise = f"{_advertised_host(host)}:{self.admin_port}"
            self.store.know_pools(self.config.pools)
            await self.store.start()  # degrades (loudly) rather than fails when Redis is away
        await self._grpc.start()
        self._sweeper = loop.create_task(self._sweep_parked())
        pin_mmap_threshold()
        self.heap.start()
        self._ensure_scraper(self.config)
        self._follow_kv_events(self.config)
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
        self.readiness.set_ready()
        await self._ready_health(True)
        self.metrics.ready.set(1)
        log.info("kvgate serving ext_proc on %s (port %d), admin on %s (port %d)",
                 self._grpc_listen, self.grpc_port, self._admin_listen, self.admin_port)

    async def _ready_health(self, ready: bool) -> None:
        """_ready_health sets the gRPC health names that follow readiness (READINESS_NAMES) to
        SERVING or NOT_SERVING; ``liveness`` is never touched (not even while draining: the
        process still answers)."""
        if self.health is None:
            return
        status = (health_pb2.HealthCheckResponse.SERVING if ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in READINESS_NAMES:
            await self.health.set(name, status)

    # --- reload --------------------------------------------------------------------------

    def apply_config(self, config: Config) -> None:
        """apply_config switches to a new configuration (on the loop thread).

        Tokenizers load first: a config that cannot load them is refused whole, and the
        old one stays in force. A tokenizer not loaded yet is read and parsed in a worker
        thread (hundreds of ms for a Llama 3 rank file, unbounded on a slow volume), so
        streams keep being served meanwhile; the configuration applies once it is loaded,
        unless a newer one was applied in between. Granted leases are untouched.

        A reload that would remove a pool, every backend of a pool or a keyed tenant's keys,
        or flip a pool's picking, is refused first (``configdiff.guard``) unless the new file
        sets ``allow_destructive_reload``: a file cut short while being written looks so.
        """
        change, refusal = guard(self._file_config, config)
        if refusal is not None:  # before the generation: a refused file cancels no pending one
            self._reload_refused(refusal)
            return
        self._reload_generation += 1
        generation = self._reload_generation
        missing = sorted({pc.tokenizer for pc in config.pools.values()} - self._tokenizers_ready)
        if not missing:
            self._apply_now(config, change)
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
                self._apply_now(config, change)
            else:
                log.info("a newer configuration arrived while tokenizers loaded; skipping this one")

        task = loop.create_task(load_then_apply())
        self._reload_tasks.add(task)
        task.add_done_callback(self._reload_tasks.discard)

    def _apply_now(self, config: Config, change: ConfigChange) -> None:
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
        self._file_config = config
        config = self._with_discovered(config)
        self._apply_nodes(config)
        self.metrics.set_classes(tuple(config.tenants.classes))
        self.config = config
        if self.store is not None:
            self.store.know_pools(config.pools)
        self.metrics.reload_ok(time.time())
        if change.destructive:  # allowed by the file: said louder, and it should not stay there
            log.warning("configuration reloaded (allow_destructive_reload): %s", change.summary())
        else:
            log.info("configuration reloaded: %s", change.summary())

    def _apply_nodes(self, config: Config) -> None:
        """_apply_nodes hands a configuration's pools and nodes to the admission core and scraper."""
        self.admission.reconfigure(config)
        if self._scraper is not None:
            self._scraper.reconfigure(config)
        else:
            self._ensure_scraper(config)  # a reload (or discovery) may add the first backends
        self._follow_kv_events(config)

    def _follow_kv_events(self, config: Config) -> None:
        """_follow_kv_events starts, changes or stops the KV events subscribers to follow
        ``config`` (the first pool that reads them starts them; pyzmq is imported only then)."""
        if self._kv_events is None:
            if not self._scrape or not any(p.picking.kv_events is not None for p in config.pools.values()):
                return
            from extproc.signals.kv_events import KvEvents
            self._kv_events = KvEvents()
            self.admission.node_events = self._kv_events.view
            self.metrics.attach_kv_events(self._kv_events)
        self._kv_events.reconfigure(config)

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
        # A released request its node's last report subtracted is counted twice until the
        # next report: the scraper fetches that one early (extproc.signals.scraper).
        admission.poke_node = self._scraper.poke
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
        await self._ready_health(False)
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
                endings = self.service.endings
                endings.sweep_parked(self.clock.now(), self.config.server.access_log_ttl_s)
                endings.settle_causes(self.clock.now())

    async def close(self) -> None:
        """close stops the helpers and listeners without draining (tests, failed starts)."""
        for task in list(self._reload_tasks):
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        await asyncio.get_running_loop().run_in_executor(None, self.heap.stop)
        if self._watcher is not None:
            loop = asyncio.get_running_loop()
            self._watcher.remove_sighup(loop)
            await loop.run_in_executor(None, self._watcher.stop)
            self._watcher = None
        if self._discovery is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._discovery.stop)
            self._discovery = None
        if self._scraper is not None:
            self.admission.poke_node = None
            # stop joins the thread, which may be inside a scrape: keep the loop free meanwhile
            await asyncio.get_running_loop().run_in_executor(None, self._scraper.stop)
            self._scraper = None
        if self._kv_events is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._kv_events.stop)
            self._kv_events = None
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
        use_count_pool(None, only_if=self.count_pool)
        self.count_pool.close()


def _bpe_specs(config: Config) -> set[str]:
    """_bpe_specs are the specs of ``config`` that bpe-openai counts (what the count
    pool's workers load when they start); the others' tokenizers release the GIL."""
    specs = set()
    for pc in config.pools.values():
        try:
            if isinstance(load_tokenizer(pc.tokenizer), BpeOpenAITokenizer):
                specs.add(pc.tokenizer)
        except ConfigError:
            pass  # the gate reports it
    return specs


def _advertised_host(host: str) -> str:
    """_advertised_host is the address the other replicas reach a listener on ``host`` by: the
    host itself, or for a wildcard this machine's name as it resolves (a pod's IP)."""
    if host not in ("", "0.0.0.0", "::", "[::]"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


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
