"""observer: how the scraper reports what it sees, without importing prometheus_client.

The service implements ``ScrapeObserver`` on top of ``extproc/metrics.py`` (metric names:
``kvgate_backend_scrape_seconds``, ``kvgate_backend_scrape_errors_total{reason}``,
``kvgate_backend_up``, ``kvgate_backend_kv_cache_usage_ratio``,
``kvgate_backend_requests_waiting``, and the pool's stale flag). Every method is called
on the scraper's thread; ``pool`` and ``backend`` are configured names, ``reason`` a
``ScrapeError`` value, so labels stay bounded.
"""

from __future__ import annotations

from typing import Protocol


class ScrapeObserver(Protocol):
    """ScrapeObserver receives the scraper's per-backend and per-pool observations."""

    def scrape_done(self, pool: str, backend: str, seconds: float, ok: bool) -> None:
        """scrape_done reports one scrape: its duration (seconds) and whether it gave a usable sample."""
        ...

    def scrape_error(self, pool: str, backend: str, reason: str) -> None:
        """scrape_error counts one problem of a scrape under its ``ScrapeError`` reason."""
        ...

    def backend_state(self, pool: str, backend: str, up: bool, kv_usage: float | None,
                      waiting: int | None) -> None:
        """backend_state reports a backend after a scrape: up (usable sample), usage ratio, queue."""
        ...

    def prefix_cache(self, pool: str, backend: str, hits: int, queries: int) -> None:
        """prefix_cache reports a backend's prefix cache counters (tokens), where it has them."""
        ...

    def pool_stale(self, pool: str, stale: bool) -> None:
        """pool_stale reports, every round, whether no backend of the pool has fresh signals."""
        ...


class UnobservedScrape:
    """UnobservedScrape is the scraper's observer that ignores every observation: for tools
    and tests that do not look."""

    __slots__ = ()

    def scrape_done(self, pool: str, backend: str, seconds: float, ok: bool) -> None:
        pass

    def scrape_error(self, pool: str, backend: str, reason: str) -> None:
        pass

    def backend_state(self, pool: str, backend: str, up: bool, kv_usage: float | None,
                      waiting: int | None) -> None:
        pass

    def prefix_cache(self, pool: str, backend: str, hits: int, queries: int) -> None:
        pass

    def pool_stale(self, pool: str, stale: bool) -> None:
        pass
