"""bench_scrape: the cost of one scrape round over 16 backends, against the poll interval.

Sixteen real HTTP servers on 127.0.0.1 (in a separate process, so their work does not
share this process's GIL) each serve a realistic vLLM V1 exposition (the ~200-line
sample the tests use: gauges, counters, histograms, cache_config_info, process metrics).
The benchmark times ``Scraper.poll_once()`` — concurrent GETs, parse, extract,
aggregate, publish — and reports median, p99 and max wall time per round, the CPU time
the round costs this process (what competes with the gRPC event loop for the GIL), and
the pure read cost of one body (parse + extract). Goal: a round well under
``poll_interval_s`` (1 s).

    python bench/bench_scrape.py [--backends 16] [--rounds 300]

Writes bench/results/scrape.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from the repository root
    sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402

from bench.reports import machine, pct  # noqa: E402
from extproc.admission.types import PoolSignals  # noqa: E402
from extproc.clock import MonotonicClock  # noqa: E402
from extproc.configparse import parse_config  # noqa: E402
from extproc.signals import UnobservedScrape, Scraper, read  # noqa: E402
from kvgate_testkit import EXPOSITIONS  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SAMPLE = EXPOSITIONS / "vllm_v1.prom"
LOOPBACK = "127.0.0.1"
POLL_INTERVAL_S = 1.0


def _serve(body: bytes, count: int, ports: mp.Queue, stop: mp.Event) -> None:
    """_serve runs ``count`` metrics servers in this (child) process until ``stop``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    servers = []
    for _ in range(count):
        srv = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        ports.put(srv.server_address[1])
    stop.wait()
    for srv in servers:
        srv.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", type=Path, default=RESULTS / "scrape.md", help="where to write the report")
    args = ap.parse_args()

    body = SAMPLE.read_bytes()
    ctx = mp.get_context("spawn")
    ports_q, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve, args=(body, args.backends, ports_q, stop), daemon=True)
    child.start()
    try:
        ports = [ports_q.get(timeout=30) for _ in range(args.backends)]
        cfg = parse_config({
            "pools": {"default": {"backends": [
                {"name": f"vllm-{i}", "metrics_url": f"http://{LOOPBACK}:{p}/metrics", "engine": "vllm"}
                for i, p in enumerate(ports)]}},
            "adaptive": {"poll_interval_s": POLL_INTERVAL_S, "scrape_timeout_s": 0.5, "stale_after_s": 3.0},
        })
        published: list[PoolSignals] = []
        scraper = Scraper(cfg, lambda pool, s: published.append(s), UnobservedScrape(), MonotonicClock())
        for _ in range(args.warmup):
            scraper.poll_once()
        walls, cpus = [], []
        for _ in range(args.rounds):
            c0, t0 = time.process_time(), time.perf_counter()
            out = scraper.poll_once()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            if out["default"].stale or out["default"].kv_usage is None:
                raise SystemExit(f"a round failed to read its backends: {out}")
        scraper.stop()
        reads = []
        for _ in range(500):
            t0 = time.perf_counter()
            read("vllm", body)
            reads.append(time.perf_counter() - t0)
    finally:
        stop.set()
        child.join(10)

    ms = [w * 1e3 for w in walls]
    cpu_ms = [c * 1e3 for c in cpus]
    read_us = statistics.median(reads) * 1e6
    lines = sum(1 for _ in body.splitlines())
    p50, p99 = statistics.median(ms), pct(ms, 0.99)
    report = f"""# Scrape cost: one round over {args.backends} backends

Command: `make bench-scrape` (`python bench/bench_scrape.py --backends {args.backends} --rounds {args.rounds}`)

Each backend is a real HTTP server on 127.0.0.1 (in a child process) serving a vLLM V1
exposition of {lines} lines ({len(body)} bytes). One round is `Scraper.poll_once()`:
{args.backends} concurrent GETs, parse with prometheus_client, extract, aggregate, publish.

| measure | value |
|---|---|
| round wall time, median | {p50:.1f} ms |
| round wall time, p99 | {p99:.1f} ms |
| round wall time, max | {max(ms):.1f} ms |
| CPU time of this process per round, median | {statistics.median(cpu_ms):.1f} ms |
| read (parse + extract) of one body, median | {read_us:.0f} µs |
| poll interval | {POLL_INTERVAL_S * 1e3:.0f} ms |
| p99 round / poll interval | {p99 / (POLL_INTERVAL_S * 1e3) * 100:.1f} % |

Goal: a round well under the poll interval: {"met" if p99 < 0.25 * POLL_INTERVAL_S * 1e3 else "NOT met"}
(p99 below a quarter of the interval).

Machine: {machine()}, shared with other work while it ran: figures are upper bounds.
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report, encoding="utf-8")
    print(report)


if __name__ == "__main__":
    main()
