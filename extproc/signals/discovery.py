"""discovery: the thread that finds the nodes of pools with ``discovery`` in DNS.

Every ``interval_s`` it resolves each such pool's name (a Kubernetes headless Service has
one A record per ready pod) and, when the set of addresses changed, calls
``changed(pool, backends)`` with the pool's new backends (``DiscoveryConfig.backends``).
The service applies them like a reload of that pool alone: a new node starts pending (not
picked until it reports), a vanished one is no longer picked or scraped, and requests
already on it finish on their own.

A failed lookup (no such name, a DNS timeout) keeps the last set: an outage of the
resolver is not an outage of the nodes. A name that resolves to nothing keeps the last set
too, with a warning: a Service with no ready pod is said once, and a pool that never
found a node stays without (every request waits, then gets a 429).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from extproc.config import BackendConfig, Config, DiscoveryConfig

log = logging.getLogger(__name__)

Resolve = Callable[[str, int], list[str]]
Changed = Callable[[str, tuple[BackendConfig, ...]], None]


def resolve_a(name: str, port: int) -> list[str]:
    """resolve_a returns the IPv4 and IPv6 addresses ``name`` resolves to (raises OSError)."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class Discovery:
    """Discovery resolves the DNS names of discovery pools on its own thread.

    ``resolve`` is injectable (``resolve_a`` by default); ``poll_once`` runs one round
    synchronously, for tests.
    """

    def __init__(self, config: Config, changed: Changed, resolve: Resolve = resolve_a) -> None:
        self._changed = changed
        self._resolve = resolve
        self._lock = threading.Lock()
        self._config = config
        self._known: dict[str, tuple[str, ...]] = {}
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def reconfigure(self, config: Config) -> None:
        """reconfigure follows a reload: pools whose discovery changed are resolved afresh."""
        with self._lock:
            old = self._config
            self._config = config
            for name in list(self._known):
                was = old.pools.get(name)
                now = config.pools.get(name)
                if now is None or was is None or now.discovery != was.discovery:
                    del self._known[name]

    def pools(self) -> dict[str, DiscoveryConfig]:
        """pools maps each discovery pool to its settings."""
        with self._lock:
            return {n: p.discovery for n, p in self._config.pools.items() if p.discovery is not None}

    def poll_once(self) -> dict[str, tuple[BackendConfig, ...]]:
        """poll_once resolves every discovery pool once; returns the pools whose nodes changed."""
        out: dict[str, tuple[BackendConfig, ...]] = {}
        for pool, d in self.pools().items():
            try:
                ips = tuple(sorted(set(self._resolve(d.dns, d.port))))  # DNS rotates its order
            except OSError as err:
                if pool not in self._warned:
                    log.warning("pool %s: cannot resolve %s (%s); keeping its %d known nodes",
                                pool, d.dns, err, len(self._known.get(pool, ())))
                    self._warned.add(pool)
                continue
            if not ips:
                if pool not in self._warned:
                    log.warning("pool %s: %s has no address; keeping its %d known nodes",
                                pool, d.dns, len(self._known.get(pool, ())))
                    self._warned.add(pool)
                continue
            self._warned.discard(pool)
            if self._known.get(pool) == ips:
                continue
            before = set(self._known.get(pool, ()))
            self._known[pool] = ips
            backends = d.backends(list(ips))
            log.info("pool %s: %s resolves to %d nodes (%d new, %d gone)", pool, d.dns, len(ips),
                     len(set(ips) - before), len(before - set(ips)))
            out[pool] = backends
            try:
                self._changed(pool, backends)
            except Exception:
                log.exception("applying the nodes discovered for pool %s failed", pool)
        return out

    def start(self) -> None:
        """start resolves at once, then every pool's ``interval_s`` (the shortest), on a daemon thread."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvgate-discovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:
                log.exception("discovery round failed")
            intervals = [d.interval_s for d in self.pools().values()]
            self._stop.wait(min(intervals) if intervals else 5.0)

    def stop(self) -> None:
        """stop ends the thread (within one lookup)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(5.0)
