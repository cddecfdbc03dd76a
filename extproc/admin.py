"""admin: kvgate's admin HTTP endpoint: ``/metrics``, ``/healthz``, ``/readyz``.

It runs on the service's event loop (aiohttp), so reading the admission core's state for
``/metrics`` needs no locks. ``/healthz`` answers 200 while the process runs;
``/readyz`` answers 200 while kvgate takes traffic and 503 once it drains (SIGTERM).
"""

from __future__ import annotations

from aiohttp import web

from extproc.admission.store.base import REPLICA_HEADER
from extproc.metrics import Metrics


class Readiness:
    """Readiness is the one switch that says whether kvgate should get new traffic."""

    __slots__ = ("ready", "reason")

    def __init__(self) -> None:
        self.ready = False
        self.reason = "starting"

    def set_ready(self) -> None:
        self.ready = True
        self.reason = "ready"

    def set_draining(self) -> None:
        self.ready = False
        self.reason = "draining"


class AdminServer:
    """AdminServer serves the admin endpoints on ``host:port`` until stopped."""

    def __init__(self, metrics: Metrics, readiness: Readiness, host: str, port: int,
                 replica_id: str | None = None) -> None:
        self._metrics = metrics
        self._replica_id = replica_id
        self._readiness = readiness
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.port = port

    def app(self) -> web.Application:
        """app builds the aiohttp application (exposed for tests)."""
        app = web.Application()
        app.router.add_get("/metrics", self._get_metrics)
        app.router.add_get("/healthz", self._get_healthz)
        app.router.add_get("/readyz", self._get_readyz)
        return app

    async def start(self) -> None:
        """start binds the listener; ``port`` holds the bound port afterwards (0 picks one)."""
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        addresses = self._runner.addresses  # the bound socket tells the real port when 0 was asked
        if addresses:
            self.port = int(addresses[0][1])

    async def stop(self) -> None:
        """stop closes the listener and open connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _get_metrics(self, request: web.Request) -> web.Response:
        body, content_type = self._metrics.render()
        return _raw_response(body, content_type)

    async def _get_healthz(self, request: web.Request) -> web.Response:
        # The shared store's replica id: a peer that finds this replica's heartbeat gone
        # asks here whether the same process still runs (see store.redis).
        headers = {REPLICA_HEADER: self._replica_id} if self._replica_id else None
        return web.Response(text="ok\n", headers=headers)

    async def _get_readyz(self, request: web.Request) -> web.Response:
        if self._readiness.ready:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"{self._readiness.reason}\n")


def _raw_response(body: bytes, content_type: str) -> web.Response:
    """_raw_response answers ``body`` with the exact content type Prometheus expects."""
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = content_type
    return resp
