"""A real ``kvgate serve`` whose configuration file is left cut short (a writer that died
mid-write, an editor's half save): each cut is valid YAML and a valid configuration, and each
is refused by the reload guard, logged with what it would have changed, counted in
``kvgate_config_reload_errors_total``; the old configuration keeps serving (the keyed tenant
keeps its class). SIGHUP does not get past the guard; ``allow_destructive_reload: true`` in
the file does."""

from __future__ import annotations

import hashlib
import signal
import sys
import urllib.request
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvgate_testkit.procs import LOOPBACK, Proc, free_port, wait_until
from tests.integration.test_server import body, chat, headers, metric

KEY = "sk-acme-reload"
DIGEST = hashlib.sha256(KEY.encode()).hexdigest()
FULL = f"""\
pools:
  small:
    max_concurrency: 2
    backends:
      - {{name: s0, metrics_url: "http://{LOOPBACK}:9/metrics"}}
  default:
    max_concurrency: 4
    context_window: 4096
    default_max_tokens: 64
default_pool: default
server: {{drain_s: 0, grace_s: 1}}
tenants:
  classes:
    gold: {{priority: 10}}
    standard: {{}}
  tenants:
    acme: {{class: gold, api_key_sha256: ["{DIGEST}"]}}
"""


def cut_after(text: str, line: str) -> str:
    return text[: text.index(line) + len(line)]


def gold_decisions(port: int) -> float:
    return metric(port, "kvgate_requests_total", **{"class": "gold"})


def errors(port: int) -> float:
    return metric(port, "kvgate_config_reload_errors_total")


async def keyed_request(port: int) -> str:
    """keyed_request sends one chat request with acme's key; returns the kind of the decision."""
    async with grpc.aio.insecure_channel(f"{LOOPBACK}:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers(extra=[("authorization", f"Bearer {KEY}")]))
        await call.read()
        await call.write(body(chat(max_tokens=8)))
        kind = (await call.read()).WhichOneof("response")
        call.cancel()
        return str(kind)


def ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://{LOOPBACK}:{port}/readyz", timeout=5).status == 200
    except OSError:
        return False


async def test_a_file_left_cut_short_is_refused_and_the_old_config_keeps_serving(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(FULL)
    grpc_port, admin = free_port(), free_port()
    proc = Proc([sys.executable, "-m", "extproc", "serve", "--config", str(path),
                 "--grpc-listen", f"{LOOPBACK}:{grpc_port}", "--admin-listen", f"{LOOPBACK}:{admin}"],
                tmp_path / "kvgate.log")
    try:
        proc.wait_port(admin, timeout=60)
        # Ready once the watcher has its baseline: a file changed before is the startup one.
        wait_until(lambda: ready(admin), timeout=60, what="kvgate ready")
        assert await keyed_request(grpc_port) == "request_body"
        assert gold_decisions(admin) == 1

        # Cut after `backends:` (the file watch finds it): no backend, no default pool, no tenant.
        path.write_text(cut_after(FULL, "    backends:\n"))
        wait_until(lambda: errors(admin) == 1, timeout=20, what="the cut file refused")
        log = proc.output()
        assert "configuration not reloaded, the previous one stays in force" in log
        assert "remove every backend of pool 'small' (1)" in log and "remove pool 'default'" in log
        assert "remove tenant 'acme' and its 1 API key" in log and DIGEST not in log
        assert metric(admin, "kvgate_concurrency_limit", pool="default") == 4
        assert await keyed_request(grpc_port) == "request_body"
        assert gold_decisions(admin) == 2  # still acme's class: the old tenants serve

        # An edit (max_concurrency 4 -> 5) cut before the tenant keys; then SIGHUP forces a re-read.
        edited = FULL.replace("max_concurrency: 4", "max_concurrency: 5")
        before_keys = cut_after(edited, "  tenants:\n")
        path.write_text(before_keys)
        wait_until(lambda: errors(admin) == 2, timeout=20, what="the second cut refused")
        proc.signal(signal.SIGHUP)
        wait_until(lambda: errors(admin) == 3, timeout=20, what="the forced re-read refused too")
        assert metric(admin, "kvgate_concurrency_limit", pool="default") == 4
        assert "pools.default.max_concurrency 4 -> 5" in proc.output()  # the rest of the change, said
        assert await keyed_request(grpc_port) == "request_body"
        assert gold_decisions(admin) == 3
        assert "configuration reloaded" not in proc.output()

        # The operator means it: the same cut with the flag applies, loudly.
        path.write_text(before_keys + "allow_destructive_reload: true\n")
        wait_until(lambda: metric(admin, "kvgate_concurrency_limit", pool="default") == 5,
                   timeout=20, what="the meant reload applied")
        assert "configuration reloaded (allow_destructive_reload): " in proc.output()
        assert await keyed_request(grpc_port) == "request_body"
        assert gold_decisions(admin) == 3  # acme is gone: its key now buys no class of its own
        assert errors(admin) == 3
    finally:
        assert proc.stop() == 0
