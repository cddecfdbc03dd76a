"""Broken backends: metrics endpoints that hang after one answer, or flip between idle and full.

The real scraper polls real sockets on 127.0.0.1 and feeds the real admission core; the
clock that decides staleness and recovery is a ManualClock moved one poll interval per
round, so the only real waits are the scraper's own socket timeouts.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from extproc.admission import Admission
from extproc.clock import ManualClock
from extproc.configparse import parse_config
from extproc.signals import Scraper
from kvgate_testkit.procs import LOOPBACK

TIMEOUT_S = 0.2
BASE_LIMIT = 10


def vllm(usage: float) -> bytes:
    return (b"# TYPE vllm:kv_cache_usage_perc gauge\n"
            b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} ' + str(usage).encode() + b"\n"
            b"# TYPE vllm:num_requests_waiting gauge\n"
            b'vllm:num_requests_waiting{engine="0",model_name="m"} 0\n')


def http(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


class RawServer:
    """RawServer answers the n-th connection with ``script(n)``: bytes to send (then close),
    "hang" (read nothing, answer nothing, keep it open), or "headers" (a status line and
    headers, then silence)."""

    def __init__(self, script: Any) -> None:
        self.script = script
        self.sock = socket.create_server((LOOPBACK, 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.held: list[socket.socket] = []
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            n = self.connections
            self.connections += 1
            what = self.script(n)
            if what == "hang":
                self.held.append(conn)
                continue
            try:
                conn.recv(65536)
                if what == "headers":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\n")
                    self.held.append(conn)
                    continue
                conn.sendall(what)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def servers() -> Iterator[list[RawServer]]:
    made: list[RawServer] = []
    yield made
    for s in made:
        s.close()


def rig(port: int, **adaptive: Any) -> tuple[Admission, Scraper, ManualClock]:
    cfg = parse_config({
        "pools": {"default": {"max_concurrency": BASE_LIMIT, "backends": [
            {"name": "n1", "metrics_url": f"http://{LOOPBACK}:{port}/metrics", "engine": "vllm"}]}},
        "adaptive": {"scrape_timeout_s": TIMEOUT_S, "stale_after_s": 3.0, "poll_interval_s": 1.0,
                     **adaptive}})
    clock = ManualClock(0.0)
    admission = Admission(cfg, clock)

    class Quiet:
        def __getattr__(self, name: str) -> Any:
            return lambda *a: None
    scraper = Scraper(cfg, admission.update_signals, Quiet(), clock)
    return admission, scraper, clock


@pytest.mark.parametrize("after", ["hang", "headers"])
def test_a_backend_that_answers_once_then_hangs_goes_stale_and_shrinks_the_pool(
        servers: list[RawServer], after: str) -> None:
    srv = RawServer(lambda n: http(vllm(0.1)) if n == 0 else after)
    servers.append(srv)
    admission, scraper, clock = rig(srv.port)
    try:
        scraper.poll_once()
        snap = admission.snapshot("default")
        assert snap.alarm is False and snap.scale == 0.6  # fresh, but recovering from the start
        clock.advance(2.0)
        assert admission.snapshot("default").concurrency_limit == 8  # 0.6 + 2 s x 0.1
        for _ in range(4):  # the node hangs: its 0.1 counts until it is 3 s old
            t0 = time.monotonic()
            scraper.poll_once()
            assert time.monotonic() - t0 < TIMEOUT_S + 1.0  # a hung node does not hang the round
            clock.advance(1.0)
        snap = admission.snapshot("default")
        assert snap.alarm is True and snap.scale == 0.6 and snap.concurrency_limit == 6
        assert srv.connections >= 3  # it kept being asked, one connection per round
        assert threading.active_count() < 40  # hung sockets did not pile up threads
    finally:
        scraper.stop()


def test_a_backend_flipping_between_idle_and_full_cannot_make_the_limit_oscillate(
        servers: list[RawServer]) -> None:
    srv = RawServer(lambda n: http(vllm(1.0 if n % 2 else 0.0)))
    servers.append(srv)
    admission, scraper, clock = rig(srv.port, recovery_per_s=0.1, min_scale=0.6)
    scales, limits = [], []
    try:
        for _ in range(12):
            scraper.poll_once()
            for dt in (0.0, 0.5, 0.49):  # right after the round, then up to just before the next
                clock.advance(dt)
                snap = admission.snapshot("default")
                scales.append((clock.now(), snap.scale))
                limits.append(snap.concurrency_limit)
            clock.advance(0.01)
    finally:
        scraper.stop()
    assert srv.connections == 12
    for (t0, before), (t1, now) in zip(scales, scales[1:]):
        assert now - before <= 0.1 * (t1 - t0) + 1e-9  # recovery_per_s at most
    assert min(s for _, s in scales) == 0.6 and max(s for _, s in scales) <= 0.7 + 1e-9
    assert set(limits) <= {6}  # never rises a whole slot while it keeps flipping
