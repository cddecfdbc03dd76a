"""A reload that adds the first backends starts following them (no restart needed)."""

from __future__ import annotations

import asyncio
import http.server
import threading
from pathlib import Path

from extproc.configparse import parse_config
from extproc.metrics import Metrics
from extproc.server import Server
from prometheus_client import CollectorRegistry
from kvgate_testkit import EXPOSITIONS
from kvgate_testkit.procs import LOOPBACK

SAMPLE = (EXPOSITIONS / "vllm_v1.prom").read_text()
BASE = {"pools": {"default": {"max_concurrency": 10}},
        "adaptive": {"poll_interval_s": 0.05, "scrape_timeout_s": 0.05, "stale_after_s": 1.0}}


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = SAMPLE.replace("} 0.5\n", "} 0.95\n", 1).encode()  # usage above the high watermark

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


async def test_reload_adding_backends_starts_the_scraper() -> None:
    assert "vllm:kv_cache_usage_perc" in _Metrics.body.decode() and b"} 0.95\n" in _Metrics.body
    httpd = http.server.ThreadingHTTPServer((LOOPBACK, 0), _Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    registry = CollectorRegistry()
    srv = Server(parse_config(BASE), grpc_listen=f"{LOOPBACK}:0", admin_listen=f"{LOOPBACK}:0",
                 metrics=Metrics(registry))
    up = {"pool": "default", "backend": "n0"}
    try:
        await srv.start()
        assert srv.admission.snapshot("default").concurrency_limit == 10
        with_backend = {**BASE, "pools": {"default": {"max_concurrency": 10, "backends": [
            {"name": "n0", "metrics_url": f"http://{LOOPBACK}:{httpd.server_port}/metrics"}]}}}
        srv.apply_config(parse_config(with_backend))
        for _ in range(200):  # bounded: each round is one poll of the local server
            if registry.get_sample_value("kvgate_backend_up", up) == 1.0:
                break
            await asyncio.sleep(0.05)
        assert registry.get_sample_value("kvgate_backend_up", up) == 1.0
        assert registry.get_sample_value("kvgate_backend_kv_cache_usage_ratio", up) == 0.95
        snap = srv.admission.snapshot("default")
        assert snap.scale == 0.6 and snap.concurrency_limit == 6
    finally:
        await srv.close()
        httpd.shutdown()


async def test_a_tokenizer_that_cannot_load_refuses_the_reload_and_keeps_the_old_config(
        tmp_path: Path) -> None:
    registry = CollectorRegistry()
    srv = Server(parse_config(BASE), grpc_listen=f"{LOOPBACK}:0", admin_listen=f"{LOOPBACK}:0",
                 metrics=Metrics(registry))
    try:
        await srv.start()
        before = srv.config
        broken = {**BASE, "pools": {"default": {"max_concurrency": 3,
                                                "tokenizer": f"tiktoken:{tmp_path / 'missing.model'}"}}}
        srv.apply_config(parse_config(broken))  # loads in a worker thread: returns at once
        for _ in range(200):
            if registry.get_sample_value("kvgate_config_reload_errors_total"):
                break
            await asyncio.sleep(0.01)
        assert registry.get_sample_value("kvgate_config_reload_errors_total") == 1.0
        assert srv.config is before
        assert srv.admission.snapshot("default").concurrency_limit == 10
        # A later good reload still applies, at once (its tokenizer is loaded already).
        srv.apply_config(parse_config({**BASE, "pools": {"default": {"max_concurrency": 4}}}))
        assert srv.admission.snapshot("default").concurrency_limit == 4
    finally:
        await srv.close()


async def test_a_reload_applies_server_timing_and_names_only_what_waits_for_a_restart(caplog) -> None:
    srv = Server(parse_config(BASE), grpc_listen=f"{LOOPBACK}:0", admin_listen=f"{LOOPBACK}:0",
                 metrics=Metrics(CollectorRegistry()), scrape=False)
    try:
        await srv.start()
        with caplog.at_level("WARNING", logger="kvgate.server"):
            srv.apply_config(parse_config({**BASE, "server": {"drain_s": 0.5, "grace_s": 2.0}}))
            assert srv.config.server.drain_s == 0.5 and srv.config.server.grace_s == 2.0
            assert not [r for r in caplog.records if "restart" in r.getMessage()]
            srv.apply_config(parse_config({**BASE, "server": {"grpc_listen": "127.0.0.1:1", "drain_s": 0.25},
                                           "store": {"redis": {"url": "redis://127.0.0.1:1/0"}}}))
        (said,) = [r.getMessage() for r in caplog.records if "restart" in r.getMessage()]
        assert said.startswith("store, server.grpc_listen change only with a restart")
        assert srv.config.server.drain_s == 0.25
    finally:
        await srv.shutdown()


KEYED = {**BASE, "pools": {"default": {"max_concurrency": 10}, "small": {"max_concurrency": 2}},
         "tenants": {"classes": {"gold": {"priority": 10}, "standard": {}},
                     "tenants": {"acme": {"class": "gold", "api_key_sha256": ["a" * 64, "b" * 64]}}}}


async def test_a_destructive_reload_is_refused_counted_and_logged_with_what_would_change(caplog) -> None:
    registry = CollectorRegistry()
    srv = Server(parse_config(KEYED), grpc_listen=f"{LOOPBACK}:0", admin_listen=f"{LOOPBACK}:0",
                 metrics=Metrics(registry), scrape=False)
    try:
        await srv.start()
        before = srv.config
        cut = {"pools": {"default": {"max_concurrency": 4}}}  # the file cut before its tenants
        with caplog.at_level("INFO", logger="kvgate.server"):
            srv.apply_config(parse_config(cut))
        (line,) = [r for r in caplog.records if "not reloaded" in r.getMessage()]
        said = line.getMessage()
        assert line.levelname == "ERROR"
        assert "remove pool 'small'" in said and "remove tenant 'acme' and its 2 API keys" in said
        assert "pools.default.max_concurrency 10 -> 4" in said and "a" * 64 not in said
        assert registry.get_sample_value("kvgate_config_reload_errors_total") == 1.0
        assert srv.config is before and srv.admission.snapshot("default").concurrency_limit == 10
        assert not [r for r in caplog.records if "configuration reloaded" in r.getMessage()]
        caplog.clear()
        # An ordinary reload: applied, and its line says what changed.
        with caplog.at_level("INFO", logger="kvgate.server"):
            srv.apply_config(parse_config({**KEYED, "pools": {**KEYED["pools"], "default": {"max_concurrency": 6}}}))
        (line,) = [r for r in caplog.records if "configuration reloaded" in r.getMessage()]
        assert line.levelname == "INFO"
        assert line.getMessage() == "configuration reloaded: pools.default.max_concurrency 10 -> 6"
        assert srv.admission.snapshot("default").concurrency_limit == 6
        caplog.clear()
        # Meant: the file says so; applied, at warning level, with what it removed.
        with caplog.at_level("INFO", logger="kvgate.server"):
            srv.apply_config(parse_config({**cut, "allow_destructive_reload": True}))
        (line,) = [r for r in caplog.records if "configuration reloaded" in r.getMessage()]
        assert line.levelname == "WARNING" and "allow_destructive_reload" in line.getMessage()
        assert "remove tenant 'acme'" in line.getMessage()
        assert set(srv.config.pools) == {"default"} and srv.config.tenants.tenants == {}
        assert registry.get_sample_value("kvgate_config_reload_errors_total") == 1.0
        assert registry.get_sample_value("kvgate_config_reload_total") == 3.0  # start + 2 applied
    finally:
        await srv.close()
