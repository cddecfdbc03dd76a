"""End to end: a running ``kvgate serve`` follows a vLLM node's KV usage.

A fake vLLM metrics endpoint (a real HTTP server on 127.0.0.1 serving the vLLM V1
exposition sample with a settable usage) is the pool's only backend. Moving its usage
from 0.5 to 0.9 must bring ``kvgate_admission_scale`` to min_scale (0.6) and shrink
``kvgate_concurrency_limit`` in kvgate's own ``/metrics`` within 2 polls of the
endpoint (counted as requests it served, not as time); usage back below the low
watermark (0.70) must bring the limit back to base.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvgate_testkit import EXPOSITIONS
from kvgate_testkit.procs import LOOPBACK, VENV_BIN, Proc, free_port, wait_until

pytestmark = pytest.mark.e2e

SAMPLE = EXPOSITIONS / "vllm_v1.prom"
BASE_LIMIT = 50
MIN_SCALE = 0.6


class FakeVllm(ThreadingHTTPServer):
    """FakeVllm serves vLLM's /metrics with a usage the test sets, counting requests."""

    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__((LOOPBACK, 0), _Handler)
        self.usage = 0.5
        self.hits = 0
        self.lock = threading.Lock()
        self.template = SAMPLE.read_text()
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def body(self) -> bytes:
        lines = [f"{l.rsplit(' ', 1)[0]} {self.usage}" if l.startswith("vllm:kv_cache_usage_perc{") else l
                 for l in self.template.splitlines()]
        return ("\n".join(lines) + "\n").encode()

    def set_usage(self, usage: float) -> int:
        """set_usage changes the usage served from now on; returns the requests served before."""
        with self.lock:
            self.usage = usage
            return self.hits

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: FakeVllm

    def do_GET(self) -> None:  # noqa: N802
        with self.server.lock:
            self.server.hits += 1
            body = self.server.body()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def node() -> Iterator[FakeVllm]:
    n = FakeVllm()
    yield n
    n.stop()


@pytest.fixture
def kvgate(node: FakeVllm, tmp_path: Path) -> Iterator[int]:
    """kvgate runs ``kvgate serve`` with the fake node as its pool's backend; yields the admin port."""
    admin, grpc = free_port(), free_port()
    config = {
        "pools": {"default": {
            "max_concurrency": BASE_LIMIT,
            "backends": [{"name": "vllm-0", "engine": "vllm",
                          "metrics_url": f"http://{LOOPBACK}:{node.server_address[1]}/metrics"}],
        }},
        # fast polls and recovery keep the test short; the rules are the production ones
        "adaptive": {"poll_interval_s": 0.25, "scrape_timeout_s": 0.2, "stale_after_s": 2.0,
                     "min_scale": MIN_SCALE, "recovery_per_s": 2.0},
        "server": {"grpc_listen": f"{LOOPBACK}:{grpc}", "admin_listen": f"{LOOPBACK}:{admin}",
                   "drain_s": 0, "grace_s": 1},
    }
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = Proc([str(VENV_BIN / "python"), "-m", "extproc", "serve", "--config", str(path)],
                tmp_path / "kvgate.log")
    try:
        proc.wait_port(admin)
        yield admin
    finally:
        proc.stop()


def metrics(admin: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{LOOPBACK}:{admin}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def pool_metric(admin: int, name: str) -> float:
    return metrics(admin)[(name, (("pool", "default"),))]


def test_kv_usage_drives_the_concurrency_limit(node: FakeVllm, kvgate: int):
    wait_until(lambda: pool_metric(kvgate, "kvgate_admission_scale") == 1.0, timeout=20,
               what="scale 1.0 at usage 0.5")
    assert pool_metric(kvgate, "kvgate_concurrency_limit") == BASE_LIMIT
    backend = (("backend", "vllm-0"), ("pool", "default"))
    m = metrics(kvgate)
    assert m[("kvgate_backend_kv_cache_usage_ratio", backend)] == 0.5
    assert m[("kvgate_backend_up", backend)] == 1.0

    before = node.set_usage(0.9)
    wait_until(lambda: pool_metric(kvgate, "kvgate_concurrency_limit") < BASE_LIMIT, timeout=10,
               what="the limit to shrink at usage 0.9")
    polls = node.hits - before
    assert polls <= 2, f"the limit shrank only after {polls} polls"
    wait_until(lambda: pool_metric(kvgate, "kvgate_admission_scale") == pytest.approx(MIN_SCALE),
               timeout=10, what="scale 0.6")
    assert pool_metric(kvgate, "kvgate_concurrency_limit") == int(BASE_LIMIT * MIN_SCALE)
    assert metrics(kvgate)[("kvgate_backend_kv_cache_usage_ratio", backend)] == 0.9

    node.set_usage(0.65)  # below the low watermark: back to base, smoothly
    wait_until(lambda: pool_metric(kvgate, "kvgate_concurrency_limit") == BASE_LIMIT, timeout=10,
               what="the limit back to base at usage 0.65")
    assert pool_metric(kvgate, "kvgate_admission_scale") == 1.0
