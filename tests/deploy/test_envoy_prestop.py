"""Envoy's preStop hook (deploy/k8s/envoy-config.yaml), run against the real Envoy binary.

The pod's own bootstrap and Envoy flags are used, with loopback ports; the ext_proc filter
is left out (these tests are about draining Envoy, and kvgate is not running here). The
upstream holds its answer until the test lets it go, so nothing waits for time to pass.
"""

from __future__ import annotations

import http.client
import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import K8S, container, envoy_binary, envoy_bootstrap, flag, http_filters, one, resources
from kvgate_testkit.procs import Proc, free_port, wait_until

pytestmark = pytest.mark.e2e


class HeldUpstream:
    """HeldUpstream answers each request with one chunk, then waits for ``release``."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/plain")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                self.wfile.write(b"6\r\nfirst\n\r\n")
                self.wfile.flush()
                outer.started.set()
                outer.release.wait(30)
                self.wfile.write(b"5\r\nlast\n\r\n0\r\n\r\n")
                self.wfile.flush()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class Router:
    """Router is the pod's Envoy on loopback ports, with its preStop script at hand."""

    def __init__(self, tmp: Path, upstream_port: int) -> None:
        objs = resources(K8S)
        spec = one(objs, "Deployment")["spec"]["template"]["spec"]
        self.envoy_ctr = container(spec, "envoy")
        boot = envoy_bootstrap()
        self.listen, self.admin = free_port(), free_port()
        boot["admin"]["address"]["socket_address"]["port_value"] = self.admin
        boot["static_resources"]["listeners"][0]["address"]["socket_address"] = {
            "address": "127.0.0.1", "port_value": self.listen}
        filters = http_filters(boot)
        filters[:] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
        for cluster in boot["static_resources"]["clusters"]:
            if cluster["name"] != "kvgate":  # without kvgate, nothing names a node: a fixed one
                cluster.pop("original_dst_lb_config", None)
                cluster.update(type="STATIC", lb_policy="ROUND_ROBIN", load_assignment={
                    "cluster_name": cluster["name"], "endpoints": [{"lb_endpoints": [{"endpoint": {
                        "address": {"socket_address": {"address": "127.0.0.1",
                                                       "port_value": upstream_port}}}}]}]})
        path = tmp / "envoy.yaml"
        path.write_text(yaml.safe_dump(boot))
        self.prestop = tmp / "prestop.sh"
        self.prestop.write_text(one(objs, "ConfigMap", "llm-router-envoy")["data"]["prestop.sh"])
        args = list(self.envoy_ctr["args"])
        args[args.index(flag(args, "--config-path"))] = str(path)
        self.proc = Proc([envoy_binary(), *args, "--concurrency", "1"], tmp / "envoy.log")
        self.proc.wait_port(self.admin)
        self.proc.wait_port(self.listen)

    def ready_status(self) -> int | None:
        """ready_status is the answer to the readiness probe's path (None: refused)."""
        path = self.envoy_ctr["readinessProbe"]["httpGet"]["path"]
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.listen, timeout=5)
            conn.request("GET", path)
            status = conn.getresponse().status
            conn.close()
            return status
        except OSError:
            return None

    def run_prestop(self, log: Path, **env: str) -> subprocess.Popen[bytes]:
        """run_prestop starts the hook with the pod's environment, overridden by ``env``."""
        full = dict(os.environ)
        full.update({e["name"]: e["value"] for e in self.envoy_ctr["env"]})
        full.update({"ENVOY_ADMIN_PORT": str(self.admin), "ENVOY_PRESTOP_DELAY_S": "0",
                     "ENVOY_DRAIN_POLL_S": "0.05"})
        full.update(env)
        command = self.envoy_ctr["lifecycle"]["preStop"]["exec"]["command"]
        return subprocess.Popen([command[0], str(self.prestop)], env=full,
                                stdout=log.open("wb"), stderr=subprocess.STDOUT)


class Client:
    """Client sends one GET through Envoy on a thread and keeps the answer."""

    def __init__(self, port: int) -> None:
        self.status: int | None = None
        self.body = b""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(port,), daemon=True)
        self.thread.start()

    def _run(self, port: int) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/v1/chat/completions")
            resp = conn.getresponse()
            self.status, self.body = resp.status, resp.read()
            conn.close()
        except BaseException as exc:
            self.error = exc


@pytest.fixture
def upstream() -> Iterator[HeldUpstream]:
    up = HeldUpstream()
    yield up
    up.close()


@pytest.fixture
def router(tmp_path: Path, upstream: HeldUpstream) -> Iterator[Router]:
    r = Router(tmp_path, upstream.port)
    yield r
    r.proc.stop()


def test_prestop_drains_and_waits_for_the_request_in_flight(router: Router, upstream: HeldUpstream,
                                                           tmp_path: Path) -> None:
    assert router.ready_status() == 200
    client = Client(router.listen)
    assert upstream.started.wait(15), "the request did not reach the upstream"
    log = tmp_path / "prestop.log"
    hook = router.run_prestop(log)
    try:
        # The hook keeps polling while the request is in flight...
        wait_until(lambda: log.read_text().count("waiting for 1 in-flight") >= 3, timeout=15,
                   what="the hook to wait on the request in flight")
        assert hook.poll() is None
        # ...and Envoy no longer reports ready (503, or refused once the listener stopped).
        assert router.ready_status() != 200
        upstream.release.set()
        client.thread.join(15)
        assert client.error is None and client.status == 200
        assert client.body == b"first\nlast\n", "the request in flight was cut"
        assert hook.wait(15) == 0
    finally:
        if hook.poll() is None:
            hook.kill()
    assert "no request in flight" in log.read_text()
    assert router.proc.alive(), "the hook must not stop Envoy: the kubelet's SIGTERM does"


def test_prestop_gives_up_after_its_limit(router: Router, upstream: HeldUpstream, tmp_path: Path) -> None:
    client = Client(router.listen)
    assert upstream.started.wait(15)
    log = tmp_path / "prestop.log"
    hook = router.run_prestop(log, ENVOY_DRAIN_MAX_S="0")
    assert hook.wait(15) == 0
    assert "gave up after 0s with 1 in flight" in log.read_text()
    upstream.release.set()
    client.thread.join(15)


def test_prestop_without_a_reachable_envoy_ends_at_once(router: Router, tmp_path: Path) -> None:
    log = tmp_path / "prestop.log"
    hook = router.run_prestop(log, ENVOY_ADMIN_PORT=str(free_port()))
    assert hook.wait(15) == 0
    assert "unreachable" in log.read_text()
