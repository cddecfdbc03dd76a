"""scraper: the thread that polls every backend and publishes each pool's signals.

One round (``poll_once``): GET every backend's metrics endpoint concurrently on a small
thread pool (one slow node delays nobody beyond ``scrape_timeout_s``), read each body
into a ``NodeSample``, update each node's last usable sample, then aggregate each pool
and call ``publish(pool, signals)`` once per pool that has backends, stale pools
included, so the admission core can shrink. Rounds repeat every ``poll_interval_s`` on a
dedicated thread that never touches the event loop: the server's ``publish`` hands the
signals over with ``loop.call_soon_threadsafe``.

Pools that pick nodes also get each node's own result (``NodeSink.report``), and a round
that scrapes them begins with ``NodeSink.mark`` (see ``extproc.admission.nodes``): the
mark must be taken before any node renders the metrics this round reads, so the round
waits for it (at most ``MARK_TIMEOUT_S``; a mark not taken in time is not claimed by the
round's reports).

Early rounds. A report that subtracted one of kvgate's requests keeps counting it after
kvgate releases it, until the node's next report (``extproc.admission.node``, ``Node.kept``):
twice, where the node held it, for half a poll interval on average. ``poke`` (any thread,
never blocks) asks for that next report sooner: the thread wakes and scrapes the nodes
poked, those alone, once ``early_scrape_gap_s`` has passed since each one's last report.
A node is poked at most once per usable report (the admission core pokes when its ``kept``
turns non-zero, and only a report with a sample clears it: a node that stops answering is
poked once), and pokes meanwhile are one: early scrapes of a node come no more than one
per gap, however many requests end. A node whose scrape still runs (it does not answer)
is not scraped early; its poke lapses with that scrape's report. An early round marks the
nodes it scrapes (those alone), scrapes and reports them like a round, but publishes no
pool signals (the adaptive scale keeps its poll interval's pace), and its reports say they
are early (``NodeReport.early``): the ledger reads no rise of foreign KV over them.

Nothing a backend sends can stop the thread: every failure is counted by reason through
the observer and logged at most once per ``log_every_s`` per backend.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from typing import Protocol
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from extproc.admission.types import NodeReport, PoolSignals
from extproc.clock import Clock
from extproc.config import BackendConfig, Config
from extproc.signals.aggregate import NodeReading, aggregate
from extproc.signals.engines import read
from extproc.signals.observer import ScrapeObserver
from extproc.signals.poll import fetch
from extproc.signals.sample import NodeSample, ScrapeError, ScrapeFailure

log = logging.getLogger(__name__)

Publish = Callable[[str, PoolSignals], None]

# One body is read (parsed, extracted) at a time, by whichever worker holds this lock; the
# fetches stay concurrent. Reading is pure Python and regex work under the GIL
# (milliseconds for a vLLM exposition): sixteen workers reading at once each take the GIL in
# turn, and the event loop thread, which needs it after every I/O, waits behind all of
# them. Under CPU contention that pushed the loop's lag to hundreds of milliseconds
# (bench/results/loop-lag.md): with reads serialized, the loop competes with one reader.
_READ_LOCK = threading.Lock()
# Extra wait (seconds) past scrape_timeout_s for workers to hand back their result: the
# deadline is enforced inside fetch, this only covers thread wake-up.
_GRACE_S = 0.05
_MAX_WORKERS = 128
# How long a round waits for the event loop to take its mark (seconds).
MARK_TIMEOUT_S = 0.2


class NodeSink(Protocol):
    """NodeSink receives the per-node results of pools that pick nodes (on the scraper's thread)."""

    def mark(self, mark: int, only: Collection[tuple[str, str]] | None = None) -> bool:
        """mark takes the round's mark before any scrape starts, on the (pool, backend) nodes
        ``only`` of an early round (None: every node); False when it could not in time."""
        ...

    def report(self, pool: str, backend: str, report: NodeReport) -> None:
        """report hands in one node's result of the round."""
        ...


@dataclass(frozen=True, slots=True)
class _Result:
    sample: NodeSample | None
    failure: ScrapeFailure | None
    seconds: float


class _LogGate:
    """_LogGate lets one log line through per ``every_s`` seconds and counts the others."""

    __slots__ = ("every_s", "last", "suppressed")

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.last: float | None = None
        self.suppressed = 0

    def allow(self, now: float) -> int | None:
        """allow returns the number of lines held back since the last one, or None to hold this one."""
        if self.last is not None and now - self.last < self.every_s:
            self.suppressed += 1
            return None
        held, self.last, self.suppressed = self.suppressed, now, 0
        return held


class _Node:
    """_Node is the scraper's state for one configured backend (touched only by rounds)."""

    __slots__ = ("pool", "backend", "since", "sample", "sampled_at", "reported_at", "inflight", "up", "gate")

    def __init__(self, pool: str, backend: BackendConfig, since: float, log_every_s: float) -> None:
        self.pool = pool
        self.backend = backend
        self.since = since                        # instant it was configured (seconds)
        self.sample: NodeSample | None = None     # last usable sample
        self.sampled_at: float | None = None      # instant of that sample (seconds)
        self.reported_at: float | None = None     # instant of its last round, answered or not
        self.inflight: Future[_Result] | None = None
        self.up: bool | None = None
        self.gate = _LogGate(log_every_s)

    def reading(self, now: float) -> NodeReading:
        anchor = self.sampled_at if self.sampled_at is not None else self.since
        return NodeReading(self.sample, max(0.0, now - anchor))


def _scrape(backend: BackendConfig, timeout_s: float, max_bytes: int) -> _Result:
    """_scrape runs in a worker: GET, parse, extract; every failure becomes a value."""
    t0 = time.perf_counter()
    try:
        body = fetch(backend.metrics_url, timeout_s, max_bytes)
        with _READ_LOCK:
            sample = read(backend.engine, body, backend.model_name)
        return _Result(sample, None, time.perf_counter() - t0)
    except ScrapeFailure as exc:
        return _Result(None, exc, time.perf_counter() - t0)
    except Exception as exc:  # a reader bug must not look like an idle node, nor kill the round
        log.exception("scraping %s failed unexpectedly", backend.name)
        return _Result(None, ScrapeFailure(ScrapeError.PARSE, f"unexpected {type(exc).__name__}"),
                       time.perf_counter() - t0)


class Scraper:
    """Scraper polls the backends of every pool and publishes ``PoolSignals`` per pool.

    ``publish(pool, signals)`` is called from the scraper's thread once per pool with
    backends per round; ``observer`` receives per-backend results; ``clock`` (seconds)
    dates samples, decides staleness and paces the thread, so tests drive it with
    ``poll_once`` (or ``cycle``) and a ``ManualClock``. ``log_every_s`` bounds log lines per
    backend. ``wait(seconds)`` sleeps the thread until then or a ``poke`` (None: on an event
    that ``poke`` and ``stop`` set).
    """

    def __init__(self, config: Config, publish: Publish, observer: ScrapeObserver, clock: Clock,
                 *, log_every_s: float = 60.0, nodes: NodeSink | None = None,
                 wait: Callable[[float], object] | None = None) -> None:
        self._publish = publish
        self._sink = nodes
        self._rounds = 0
        self._observer = observer
        self._clock = clock
        self._log_every_s = log_every_s
        self._lock = threading.Lock()          # guards _config and _nodes (swapped by reconfigure)
        self._round_lock = threading.Lock()    # one round at a time
        self._config = config
        self._nodes: dict[tuple[str, str], _Node] = self._build(config, {})
        self._pool_stale: dict[str, bool] = {}
        self._observer_gate = _LogGate(log_every_s)
        self._executor: ThreadPoolExecutor | None = None
        self._workers = 0
        self._stop = threading.Event()
        self._wake = threading.Event()         # set by poke and stop: ends the thread's wait
        self._wait = wait if wait is not None else self._sleep
        self._poke_lock = threading.Lock()     # guards _poked (any thread pokes)
        self._poked: dict[tuple[str, str], None] = {}
        self._thread: threading.Thread | None = None

    # --- configuration ---------------------------------------------------------------

    def _build(self, config: Config, old: dict[tuple[str, str], _Node]) -> dict[tuple[str, str], _Node]:
        now = self._clock.now()
        nodes: dict[tuple[str, str], _Node] = {}
        for pool in config.pools.values():
            for b in pool.backends:
                key = (pool.name, b.name)
                kept = old.get(key)
                # A backend whose endpoint or engine changed is a new node: its old
                # samples describe something else.
                nodes[key] = kept if kept is not None and kept.backend == b else \
                    _Node(pool.name, b, now, self._log_every_s)
        return nodes

    def reconfigure(self, config: Config) -> None:
        """reconfigure switches to a new configuration from the next round on.

        Unchanged backends keep their last sample; new or changed ones start pending
        (not counted until they answer or ``stale_after_s`` passes); removed pools are
        no longer published.
        """
        with self._lock:
            self._nodes = self._build(config, self._nodes)
            self._config = config

    # --- one round -------------------------------------------------------------------

    def _pool_executor(self, nodes: int) -> ThreadPoolExecutor:
        want = max(1, min(_MAX_WORKERS, nodes))
        if self._executor is None or want > self._workers:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
            self._executor = ThreadPoolExecutor(max_workers=want, thread_name_prefix="kvgate-scrape")
            self._workers = want
        return self._executor

    def poll_once(self, only: Collection[tuple[str, str]] | None = None) -> dict[str, PoolSignals]:
        """poll_once scrapes every backend once, publishes every pool, and returns the signals.

        Blocks at most about ``scrape_timeout_s``. A backend whose previous scrape is
        still running (a hung DNS lookup, say) is not scraped again; it counts as a timeout.
        ``only``: an early round of those (pool, backend) alone, whose scrapes are not
        running: reported, nothing published (module doc).
        """
        with self._round_lock:
            with self._lock:
                config, every = self._config, self._nodes
            nodes = every if only is None else \
                {k: n for k, n in every.items() if k in only and n.inflight is None}
            a = config.adaptive
            executor = self._pool_executor(len(nodes))
            self._rounds += 1
            mark: int | None = None
            if self._sink is not None and any(p.picks for p in config.pools.values()):
                try:
                    mark = self._rounds if self._sink.mark(self._rounds, only) else None
                except Exception:
                    log.exception("taking the round's mark failed")
            fresh: set[int] = set()
            for node in nodes.values():
                if node.inflight is None:
                    node.inflight = executor.submit(_scrape, node.backend, a.scrape_timeout_s,
                                                    a.max_scrape_bytes)
                    fresh.add(id(node))
            pending = [n.inflight for n in nodes.values() if n.inflight is not None]
            wait(pending, timeout=a.scrape_timeout_s + _GRACE_S)
            now = self._clock.now()
            for node in nodes.values():
                fut = node.inflight
                if fut is not None and fut.done() and id(node) in fresh:
                    node.inflight = None
                    result = fut.result()
                else:
                    # Still running, or finished late after overrunning an earlier round:
                    # either way it missed its deadline, and a late answer must not be
                    # dated now.
                    if fut is not None and fut.done():
                        node.inflight = None
                    result = _Result(None, ScrapeFailure(ScrapeError.TIMEOUT, "scrape overran its deadline"),
                                     a.scrape_timeout_s)
                self._record(node, result, now)
                node.reported_at = now
                with self._poke_lock:  # this report ends the double count a poke was for
                    self._poked.pop((node.pool, node.backend.name), None)
                if self._sink is not None:
                    pc = config.pools.get(node.pool)
                    if pc is not None and pc.picks:
                        self._report_node(node, result, now, mark, only is not None)
            out: dict[str, PoolSignals] = {}
            for pool in config.pools.values() if only is None else ():
                if not pool.backends:
                    continue  # pools without backends keep scale 1.0: nothing to publish
                signals = aggregate((nodes[(pool.name, b.name)].reading(now) for b in pool.backends),
                                    pool.signals, a.stale_after_s, now)
                out[pool.name] = signals
                self._report_pool(pool.name, signals, a.stale_after_s)
                with self._lock:
                    current = self._config.pools.get(pool.name)
                if current is None or not current.backends:
                    continue  # removed by a reload during this round
                try:
                    self._publish(pool.name, signals)
                except Exception:
                    log.exception("publishing signals of pool %s failed", pool.name)
            return out

    def _record(self, node: _Node, result: _Result, now: float) -> None:
        pool, name = node.pool, node.backend.name
        sample = result.sample
        usable = sample if sample is not None and sample.usable else None
        ok = usable is not None
        self._observe("scrape_done", pool, name, result.seconds, ok)
        problems: list[tuple[ScrapeError, str]] = []
        if result.failure is not None:
            problems.append((result.failure.reason, result.failure.detail))
        if sample is not None:
            problems.extend((p.reason, p.detail) for p in sample.problems)
        # One count per reason per scrape: three missing names are one broken scrape.
        for reason in dict.fromkeys(r for r, _ in problems):
            self._observe("scrape_error", pool, name, reason.value)
        if usable is not None:
            node.sample, node.sampled_at = usable, now
        self._observe("backend_state", pool, name, ok,
                      usable.kv_usage if usable is not None else None,
                      usable.waiting if usable is not None else None)
        if usable is not None and usable.prefix_hits is not None and usable.prefix_queries is not None:
            self._observe("prefix_cache", pool, name, usable.prefix_hits, usable.prefix_queries)
        if problems:
            held = node.gate.allow(now)
            if held is not None:
                what = "; ".join(f"{r.value}: {d}" for r, d in problems[:4])
                more = f" ({held} similar lines held back)" if held else ""
                level = logging.INFO if ok else logging.WARNING
                log.log(level, "backend %s/%s (%s): %s%s", pool, name, node.backend.engine, what, more)
        if node.up is not None and ok != node.up:
            if ok:
                log.info("backend %s/%s answers again", pool, name)
            elif node.sampled_at is not None:
                log.warning("backend %s/%s stopped answering; its last sample counts until it is "
                            "stale", pool, name)
        node.up = ok

    def _report_node(self, node: _Node, result: _Result, now: float, mark: int | None, early: bool) -> None:
        sink = self._sink
        if sink is None:  # no picking pool: nothing takes node reports
            return
        sample = result.sample
        usable = sample if sample is not None and sample.usable else None
        failure = result.failure
        report = NodeReport(kv_usage=usable.kv_usage if usable is not None else None,
                            capacity_tokens=usable.kv_capacity_tokens if usable is not None else None,
                            at=now, refused=failure is not None and failure.reason is ScrapeError.CONNECT,
                            mark=mark, waiting=usable.waiting if usable is not None else None,
                            running=usable.running if usable is not None else None,
                            block_tokens=usable.block_tokens if usable is not None else None, early=early)
        try:
            sink.report(node.pool, node.backend.name, report)
        except Exception:
            log.exception("reporting node %s/%s failed", node.pool, node.backend.name)

    def _report_pool(self, pool: str, signals: PoolSignals, stale_after_s: float) -> None:
        self._observe("pool_stale", pool, signals.stale)
        was = self._pool_stale.get(pool)
        if signals.stale and was is not True:
            log.warning("pool %s: no backend gave usable metrics for %.1fs: signals are stale, "
                        "the pool runs at min_scale", pool, stale_after_s)
        elif not signals.stale and was:
            log.info("pool %s: fresh signals again (kv_usage=%.3f)", pool, signals.kv_usage or 0.0)
        self._pool_stale[pool] = signals.stale

    def _observe(self, method: str, *args: object) -> None:
        # The observer is the service's code; its failure must not stop scraping.
        try:
            getattr(self._observer, method)(*args)
        except Exception:
            if self._observer_gate.allow(self._clock.now()) is not None:
                log.exception("scrape observer %s failed", method)

    # --- the thread ------------------------------------------------------------------

    def start(self) -> None:
        """start runs rounds every ``poll_interval_s`` on a daemon thread until ``stop``."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvgate-scraper", daemon=True)
        self._thread.start()

    def poke(self, pool: str, backend: str) -> None:
        """poke asks for an early scrape of one node (module doc); from any thread, at once."""
        with self._poke_lock:
            self._poked[(pool, backend)] = None
        self._wake.set()

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        # Cleared after the wait, before the next cycle reads the pokes: a poke after this
        # is read by that cycle or sets the event again.
        self._wake.clear()

    def _run(self) -> None:
        next_at = self._clock.now()
        while not self._stop.is_set():
            next_at = self.cycle(next_at)

    def cycle(self, next_at: float) -> float:
        """cycle runs what is due on the clock: the round when ``next_at`` has come (the next
        one then due ``poll_interval_s`` later, not caught up after an overrun), else an early
        round of the nodes poked whose gap has passed; then waits until the next of these is
        due or a poke. Returns the next round's instant."""
        try:
            if self._clock.now() >= next_at:
                self.poll_once()
                with self._lock:
                    interval = self._config.adaptive.poll_interval_s
                next_at = max(next_at + interval, self._clock.now())
            else:
                due, _ = self._early(self._clock.now())
                if due:
                    self.poll_once(due)
        except Exception:
            log.exception("scrape round failed")
            with self._poke_lock:  # left to the rounds: a round that fails again must not spin
                self._poked.clear()
        now = self._clock.now()
        due, later = self._early(now)
        if not self._stop.is_set():
            self._wait(0.0 if due else max(0.0, min(next_at, later) - now))
        return next_at

    def _early(self, now: float) -> tuple[list[tuple[str, str]], float]:
        """_early is the poked nodes due an early scrape at ``now``, and the instant the
        first of the others will be (inf: none). A node whose scrape still runs is left to
        its round; pokes for nodes gone (a reload), or with no early scrape at all
        (``early_scrape_gap_s`` 0), are dropped."""
        with self._lock:
            gap_s, nodes = self._config.adaptive.early_scrape_gap_s, self._nodes
        with self._poke_lock:
            for key in [k for k in self._poked if gap_s <= 0 or k not in nodes]:
                del self._poked[key]
            poked = [nodes[k] for k in self._poked]
        due: list[tuple[str, str]] = []
        later = math.inf
        for n in poked:
            if n.inflight is not None:
                continue
            at = n.reported_at + gap_s if n.reported_at is not None else now
            if at <= now:
                due.append((n.pool, n.backend.name))
            else:
                later = min(later, at)
        return due, later

    def stop(self, timeout_s: float | None = None) -> None:
        """stop ends the thread (within about ``scrape_timeout_s``) and its worker pool."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            with self._lock:
                limit = self._config.adaptive.scrape_timeout_s + 2.0
            thread.join(timeout_s if timeout_s is not None else limit)
        with self._round_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
                self._workers = 0

    @property
    def running(self) -> bool:
        """running is True while the polling thread is alive."""
        return self._thread is not None and self._thread.is_alive()
