"""Hot reload of a real ``kvgate serve`` process, its config mounted as the kubelet mounts a
ConfigMap: new limits apply to new admissions, granted leases are untouched, a bad file is
refused with the old configuration kept, and SIGHUP reloads.

kvgate is driven over gRPC as Envoy drives it (one ext_proc stream per request), and
observed through its /metrics. Waits are bounded polls for what kvgate reports.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvgate_testkit.procs import Proc, free_port, wait_until

pytestmark = pytest.mark.e2e

BODY = b'{"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}'
ANSWER = (b'{"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": '
          b'{"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}], '
          b'"usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}')


def config_text(concurrency: int) -> str:
    # No drain at the end of a test: stopping kvgate should not wait for load balancers.
    return (f"pools:\n  default:\n    max_concurrency: {concurrency}\n    context_window: 4096\n"
            "server: {drain_s: 0, grace_s: 2}\n")


def swap(root: Path, version: int, text: str) -> None:
    """swap publishes a new ConfigMap version the kubelet's way: a new dir, then ``..data``."""
    d = root / f"..v{version}"
    d.mkdir()
    (d / "kvgate.yaml").write_text(text)
    (root / "..data_tmp").symlink_to(d.name)
    os.replace(root / "..data_tmp", root / "..data")
    if not (root / "kvgate.yaml").exists():
        (root / "kvgate.yaml").symlink_to("..data/kvgate.yaml")


def headers(*pairs: tuple[str, str], eos: bool = False) -> base_pb2.HeaderMap:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]), end_of_stream=eos)


class Stream:
    """Stream is one ext_proc stream, driven one message at a time as Envoy does."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self._q: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        self._replies = stub.Process(iter(self._q.get, None), timeout=30)

    def send(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        self._q.put(req)
        return next(self._replies)

    def close(self) -> None:
        self._q.put(None)
        for _ in self._replies:
            pass

    def request(self) -> pb.ProcessingResponse:
        """request sends a chat completion's headers and body; returns the decision."""
        self.send(pb.ProcessingRequest(request_headers=headers(
            (":method", "POST"), (":path", "/v1/chat/completions"),
            ("content-type", "application/json"), ("content-length", str(len(BODY))))))
        return self.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True)))

    def respond(self) -> None:
        """respond plays the upstream's complete answer through the stream."""
        self.send(pb.ProcessingRequest(response_headers=headers(
            (":status", "200"), ("content-type", "application/json"))))
        self.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=ANSWER, end_of_stream=True)))


class Kvgate:
    """Kvgate is ``kvgate serve`` on loopback ports, reading ``config``."""

    def __init__(self, config: Path, tmp: Path) -> None:
        self.grpc_port, self.admin_port = free_port(), free_port()
        kvgate = Path(sys.executable).parent / "kvgate"
        self.proc = Proc([str(kvgate), "serve", "--config", str(config),
                          "--grpc-listen", f"127.0.0.1:{self.grpc_port}",
                          "--admin-listen", f"127.0.0.1:{self.admin_port}"], tmp / "kvgate.log")
        self.proc.wait_port(self.admin_port, timeout=60)
        self.proc.wait_port(self.grpc_port, timeout=60)
        # Ready comes after the config watcher has taken its baseline: a file swapped
        # before that would be taken for the startup configuration.
        wait_until(self.ready, timeout=60, what="kvgate ready")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/readyz", timeout=5).status == 200
        except OSError:
            return False

    def metric(self, name: str) -> float:
        """metric reads one unlabelled-or-pool-default sample from /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=5).read().decode()
        total = 0.0
        found = False
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                if "{" in line and 'pool="default"' not in line:
                    continue
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise KeyError(name)
        return total

    def wait_metric(self, name: str, value: float) -> None:
        wait_until(lambda: self.metric(name) == value, timeout=20, what=f"{name} == {value}")

    def close(self) -> None:
        self.channel.close()
        self.proc.stop()


@pytest.fixture
def mounted(tmp_path: Path) -> Path:
    root = tmp_path / "configmap"
    root.mkdir()
    swap(root, 1, config_text(2))
    return root


@pytest.fixture
def kvgate(mounted: Path, tmp_path: Path) -> Iterator[Kvgate]:
    k = Kvgate(mounted / "kvgate.yaml", tmp_path)
    yield k
    k.close()


def admitted(reply: pb.ProcessingResponse) -> bool:
    return reply.WhichOneof("response") == "request_body"


def test_configmap_update_applies_to_new_admissions_and_spares_granted_leases(
        kvgate: Kvgate, mounted: Path) -> None:
    assert kvgate.metric("kvgate_concurrency_limit") == 2
    held = Stream(kvgate.stub)
    assert admitted(held.request())
    kvgate.wait_metric("kvgate_inflight_requests", 1)

    reloads = kvgate.metric("kvgate_config_reload_total")
    swap(mounted, 2, config_text(1))
    kvgate.wait_metric("kvgate_concurrency_limit", 1)
    assert kvgate.metric("kvgate_config_reload_total") == reloads + 1
    # The lease granted before the reload is still held...
    assert kvgate.metric("kvgate_inflight_requests") == 1
    # ...and counts against the new limit: a new request is refused.
    refused = Stream(kvgate.stub)
    reply = refused.request()
    assert reply.WhichOneof("response") == "immediate_response"
    assert reply.immediate_response.status.code == 429
    refused.close()
    # The old request ends normally and frees its slot; the next one is admitted.
    held.respond()
    held.close()
    kvgate.wait_metric("kvgate_inflight_requests", 0)
    again = Stream(kvgate.stub)
    assert admitted(again.request())
    again.respond()
    again.close()
    kvgate.wait_metric("kvgate_inflight_requests", 0)


def test_bad_configmap_is_refused_and_the_old_config_stays(kvgate: Kvgate, mounted: Path) -> None:
    swap(mounted, 2, "pools:\n  default:\n    max_concurrency: lots\n")
    kvgate.wait_metric("kvgate_config_reload_errors_total", 1)
    assert kvgate.metric("kvgate_concurrency_limit") == 2
    assert "pools.default.max_concurrency" in kvgate.proc.output()
    s = Stream(kvgate.stub)
    assert admitted(s.request())
    s.respond()
    s.close()
    # Fixed: applied.
    swap(mounted, 3, config_text(5))
    kvgate.wait_metric("kvgate_concurrency_limit", 5)
    assert kvgate.metric("kvgate_config_reload_errors_total") == 1


def test_sighup_reloads(kvgate: Kvgate, mounted: Path) -> None:
    reloads = kvgate.metric("kvgate_config_reload_total")
    kvgate.proc.signal(signal.SIGHUP)  # unchanged file: SIGHUP re-applies it anyway
    kvgate.wait_metric("kvgate_config_reload_total", reloads + 1)
    assert kvgate.proc.alive()
    assert kvgate.metric("kvgate_concurrency_limit") == 2
