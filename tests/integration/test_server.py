"""Integration tests of the ext_proc service through a real grpc.aio server.

A gRPC client sends what Envoy 1.40 sends (DESIGN.md: request headers, one BUFFERED
body, response headers, STREAMED body chunks, a separate empty end-of-stream message)
and ends streams the ways Envoy does (a clean end, a cancel). The admin HTTP endpoint is
read for metrics. The last tests run kvgate as a real process: SIGTERM drain, SIGHUP
reload, check-config.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from extproc.configparse import parse_config
from extproc.metrics import Metrics
from extproc.server import Server
from kvgate_testkit.procs import LOOPBACK, ROOT, Proc, free_port, wait_until

CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 2, "tpm": 1_000_000, "context_window": 4096,
                          "default_max_tokens": 256}},
    "limits": {"max_body_bytes": 65536},
    "server": {"drain_s": 0.0, "grace_s": 1.0},
}


def headers(path: str = "/v1/chat/completions", extra: list[tuple[str, str]] = ()) -> pb.ProcessingRequest:
    hs = [(":path", path), (":method", "POST"), (":scheme", "http"), (":authority", "gw"),
          ("content-type", "application/json"), ("x-request-id", "r1"), *extra]
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs])))


def body(data: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))


def response_headers(status: int = 200, content_type: str = "text/event-stream") -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
        base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode())])))


def chunk(data: bytes, eos: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def chat(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "Hello"}], **fields})


def sse_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


TOKEN = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(port: int, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in scrape(port).items() if n == name and want <= set(ls))


async def ametric(port: int, name: str, **labels: str) -> float:
    """ametric is ``metric`` for a server on this test's own event loop (off-loop read)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, lambda: metric(port, name, **labels))


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    srv = Server(parse_config(CONFIG), grpc_listen=f"{LOOPBACK}:0", admin_listen=f"{LOOPBACK}:0",
                 metrics=Metrics(CollectorRegistry()), scrape=False)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


@pytest.fixture
async def stub(server: Server) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    async with grpc.aio.insecure_channel(f"{LOOPBACK}:{server.grpc_port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel)


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    """wait_for polls a condition on another task's work (bounded), not the passing of time."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.005)


def streams_active(server: Server) -> float | None:
    """streams_active is kvgate_streams_active, read from the in-process server's registry."""
    return server.metrics.registry.get_sample_value("kvgate_streams_active")


async def wait_for_async(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """wait_for_async is wait_for for a condition that must be awaited (an RPC's answer)."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.005)


async def refuses_rpcs(health: health_pb2_grpc.HealthStub) -> bool:
    """refuses_rpcs tells whether the gRPC server has stopped taking new calls (UNAVAILABLE)."""
    try:
        await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    except grpc.aio.AioRpcError as exc:
        return exc.code() is grpc.StatusCode.UNAVAILABLE
    return False


async def admit_stream(stub: pb_grpc.ExternalProcessorStub, **fields: Any) -> Any:
    call = stub.Process()
    await call.write(headers())
    assert (await call.read()).WhichOneof("response") == "request_headers"
    await call.write(body(chat(**fields)))
    resp = await call.read()
    return call, resp


# --- one stream, as Envoy sends it ----------------------------------------------------------

async def test_streamed_request_round_trip(server: Server, stub: Any) -> None:
    call, resp = await admit_stream(stub, stream=True, max_tokens=20)
    mutated = resp.request_body.response.body_mutation.body
    assert orjson.loads(mutated)["stream_options"]["include_usage"] is True
    assert server.admission.snapshot("default").inflight == 1

    await call.write(response_headers())
    rh = await call.read()
    keys = {o.header.key for o in rh.response_headers.response.header_mutation.set_headers}
    assert {"x-ratelimit-limit-requests", "x-ratelimit-remaining-tokens"} <= keys
    await call.write(chunk(sse_event(TOKEN) + sse_event(TOKEN)))
    assert (await call.read()).WhichOneof("response") == "response_body"
    await call.write(chunk(sse_event(USAGE) + b"data: [DONE]\n\n"))
    stripped = (await call.read()).response_body.response.body_mutation.body
    assert stripped == b"data: [DONE]\n\n"
    await call.write(chunk(b"", eos=True))
    await call.read()
    assert server.admission.snapshot("default").inflight == 0  # released at end of stream
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    port = server.admin_port
    assert await ametric(port, "kvgate_releases_total", cause="completed") == 1
    assert await ametric(port, "kvgate_requests_total", outcome="admitted") == 1
    assert await ametric(port, "kvgate_inflight_requests") == 0
    assert await ametric(port, "kvgate_concurrency_limit", pool="default") == 2
    assert await ametric(port, "kvgate_admission_scale", pool="default") == 1.0
    assert await ametric(port, "kvgate_decision_seconds_count") == 1


async def test_clean_end_without_response_end_is_a_client_disconnect(server: Server, stub: Any) -> None:
    call, _ = await admit_stream(stub, stream=True, max_tokens=20)
    await call.write(response_headers())
    await call.read()
    await call.write(chunk(sse_event(TOKEN)))
    await call.read()
    await call.done_writing()  # Envoy ends the stream: the client went away
    assert await call.read() == grpc.aio.EOF
    await wait_for(lambda: server.admission.snapshot("default").inflight == 0)
    assert await ametric(server.admin_port, "kvgate_releases_total", cause="client_disconnect") == 1


async def test_cancelled_stream_releases_its_lease(server: Server, stub: Any) -> None:
    call, _ = await admit_stream(stub, max_tokens=20)
    assert server.admission.snapshot("default").inflight == 1
    call.cancel()
    await wait_for(lambda: server.admission.snapshot("default").inflight == 0)
    await wait_for(lambda: streams_active(server) == 0)
    assert await ametric(server.admin_port, "kvgate_releases_total", cause="client_disconnect") == 1
    assert await ametric(server.admin_port, "kvgate_streams_active") == 0


async def test_full_pool_answers_429_over_grpc(server: Server, stub: Any) -> None:
    calls = [(await admit_stream(stub))[0] for _ in range(2)]
    call, resp = await admit_stream(stub)
    imm = resp.immediate_response
    assert imm.status.code == 429
    hs = {o.header.key: o.header.raw_value.decode() for o in imm.headers.set_headers}
    assert hs["x-kvgate-reason"] == "concurrency" and int(hs["retry-after"]) >= 1
    assert orjson.loads(imm.body)["error"]["code"] == "rate_limit_exceeded"
    for c in (*calls, call):
        c.cancel()
    await wait_for(lambda: server.admission.snapshot("default").inflight == 0)
    assert await ametric(server.admin_port, "kvgate_requests_total", outcome="rejected_concurrency") == 1


async def test_many_concurrent_streams_end_with_nothing_held(server: Server, stub: Any) -> None:
    async def one(i: int) -> None:
        call, resp = await admit_stream(stub, max_tokens=5)
        if resp.WhichOneof("response") == "immediate_response" or i % 3 == 0:
            call.cancel()
            return
        await call.write(response_headers(200, "application/json"))
        await call.read()
        await call.write(chunk(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}', eos=True))
        await call.read()
        await call.done_writing()
    await asyncio.gather(*(one(i) for i in range(30)))
    await wait_for(lambda: streams_active(server) == 0)
    snap = server.admission.snapshot("default")
    assert snap.inflight == 0 and snap.kv_inflight == 0
    port = server.admin_port
    assert await ametric(port, "kvgate_releases_total") == await ametric(port, "kvgate_requests_total", outcome="admitted")


async def test_the_access_log_service_reads_raw_batches_and_outlives_a_broken_one(server: Server) -> None:
    """Envoy's access log reaches the receiver as raw bytes (parsed entry by entry there): a
    batch cut short is refused and counted, and the same stream's next batch is read."""
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.response.response_code.value = 200  # no link: a request without a lease here
    batch = als_pb2.StreamAccessLogsMessage()
    batch.identifier.log_name = "kvgate"
    batch.http_logs.log_entry.extend([entry, entry])
    good = batch.SerializeToString()

    async def batches() -> AsyncIterator[bytes]:
        for data in (good, good[:-1], good):
            yield data

    async with grpc.aio.insecure_channel(f"{LOOPBACK}:{server.grpc_port}") as channel:
        send = channel.stream_unary("/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
                                    request_serializer=None,
                                    response_deserializer=als_pb2.StreamAccessLogsResponse.FromString)
        assert isinstance(await send(batches()), als_pb2.StreamAccessLogsResponse)
        # Envoy's own client sends messages: the same bytes.
        stub = als_pb2_grpc.AccessLogServiceStub(channel)

        async def messages() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
            yield batch

        await stub.StreamAccessLogs(messages())
    assert await ametric(server.admin_port, "kvgate_access_log_entries_total", result="no_lease") == 6
    assert await ametric(server.admin_port, "kvgate_access_log_entries_total", result="malformed") == 1


async def test_health_service_and_admin_endpoints(server: Server) -> None:
    async with grpc.aio.insecure_channel(f"{LOOPBACK}:{server.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    base = f"http://{LOOPBACK}:{server.admin_port}"
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, http_status, f"{base}/healthz") == 200
    assert await loop.run_in_executor(None, http_status, f"{base}/readyz") == 200
    assert await ametric(server.admin_port, "kvgate_ready") == 1


@pytest.mark.redis
async def test_a_redis_store_is_wired_in_and_settled(tmp_path: Path) -> None:
    from kvgate_testkit.redis_server import RedisServer
    redis = RedisServer(tmp_path).start()
    try:
        cfg = {**CONFIG, "store": {"redis": {"url": redis.url, "key_prefix": "it:"}}}
        srv = Server(parse_config(cfg), grpc_listen=f"{LOOPBACK}:0", admin_listen=f"{LOOPBACK}:0",
                     metrics=Metrics(CollectorRegistry()), scrape=False)
        await srv.start()
        try:
            async with grpc.aio.insecure_channel(f"{LOOPBACK}:{srv.grpc_port}") as channel:
                stub = pb_grpc.ExternalProcessorStub(channel)
                call, resp = await admit_stream(stub, max_tokens=5)
                assert resp.WhichOneof("response") == "request_body"
                assert srv.store.live_leases("default") == 1
                await call.write(response_headers(200, "application/json"))
                await call.read()
                await call.write(chunk(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2}}', eos=True))
                await call.read()
                await call.done_writing()
            assert srv.store.live_leases("default") == 0
            assert await ametric(srv.admin_port, "kvgate_store_mode", mode="shared") == 1
            assert await ametric(srv.admin_port, "kvgate_releases_total", cause="completed") == 1
        finally:
            await srv.close()
    finally:
        redis.stop()


# --- a real process ---------------------------------------------------------------------------

class KvgateProc:
    """KvgateProc is ``python -m extproc serve`` on free loopback ports."""

    def __init__(self, tmp: Path, config: dict[str, Any]) -> None:
        self.config_path = tmp / "kvgate.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.grpc_port, self.admin_port = free_port(), free_port()
        self.proc = Proc([sys.executable, "-m", "extproc", "serve", "--config", str(self.config_path),
                          "--grpc-listen", f"{LOOPBACK}:{self.grpc_port}",
                          "--admin-listen", f"{LOOPBACK}:{self.admin_port}"], tmp / "kvgate.log")
        self.proc.wait_port(self.admin_port)
        self.proc.wait_port(self.grpc_port)

    @property
    def admin(self) -> str:
        return f"http://{LOOPBACK}:{self.admin_port}"


async def test_sigterm_drains_then_waits_for_streams_then_exits_0(tmp_path: Path) -> None:
    kv = KvgateProc(tmp_path, {**CONFIG, "server": {"drain_s": 1.0, "grace_s": 10.0}})
    loop = asyncio.get_running_loop()
    try:
        async with grpc.aio.insecure_channel(f"{LOOPBACK}:{kv.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            first, _ = await admit_stream(stub, max_tokens=10)
            kv.proc.signal(signal.SIGTERM)
            # not ready at once
            await wait_for(lambda: http_status(f"{kv.admin}/readyz") == 503, timeout=0.5)
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # new streams are still served while draining
            second, resp = await admit_stream(stub, max_tokens=10)
            assert resp.WhichOneof("response") == "request_body"
            assert metric(kv.admin_port, "kvgate_inflight_requests") == 2
            second.cancel()
            # After drain_s the server takes no new RPC, yet waits for the stream in flight.
            await wait_for_async(lambda: refuses_rpcs(health), timeout=10)
            assert kv.proc.alive()
            await first.write(response_headers(200, "application/json"))
            await first.read()
            await first.write(chunk(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}', eos=True))
            await first.read()
            await first.done_writing()
        code = await loop.run_in_executor(None, kv.proc.popen.wait, 10)
        assert code == 0
        assert "gave up" not in kv.proc.output()
    finally:
        kv.proc.stop()


async def test_streams_left_after_the_grace_period_are_released_as_timeout(tmp_path: Path) -> None:
    kv = KvgateProc(tmp_path, {**CONFIG, "server": {"drain_s": 0.0, "grace_s": 0.5}})
    loop = asyncio.get_running_loop()
    try:
        async with grpc.aio.insecure_channel(f"{LOOPBACK}:{kv.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            call, _ = await admit_stream(stub, stream=True, max_tokens=10)
            kv.proc.signal(signal.SIGTERM)
            code = await loop.run_in_executor(None, kv.proc.popen.wait, 10)
            assert code == 0
            with pytest.raises(grpc.aio.AioRpcError):
                while (await call.read()) != grpc.aio.EOF:
                    pass
        assert "gave up 1 streams" in kv.proc.output()
    finally:
        kv.proc.stop()


async def test_sighup_reloads_the_config_and_bad_files_keep_the_old_one(tmp_path: Path) -> None:
    kv = KvgateProc(tmp_path, CONFIG)
    try:
        assert metric(kv.admin_port, "kvgate_concurrency_limit", pool="default") == 2
        new = orjson.loads(orjson.dumps(CONFIG))
        new["pools"]["default"]["max_concurrency"] = 7
        kv.config_path.write_text(yaml.safe_dump(new))
        kv.proc.signal(signal.SIGHUP)
        wait_until(lambda: metric(kv.admin_port, "kvgate_concurrency_limit", pool="default") == 7,
                   timeout=15, what="reloaded limit")
        assert metric(kv.admin_port, "kvgate_config_reload_total") >= 2
        kv.config_path.write_text("pools: {default: {max_concurrency: -1}}\n")
        kv.proc.signal(signal.SIGHUP)
        wait_until(lambda: metric(kv.admin_port, "kvgate_config_reload_errors_total") == 1,
                   timeout=15, what="refused reload")
        assert metric(kv.admin_port, "kvgate_concurrency_limit", pool="default") == 7
    finally:
        assert kv.proc.stop() == 0


# --- the command line ---------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extproc", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_check_config_accepts_the_example_and_names_the_bad_key(tmp_path: Path) -> None:
    ok = run_cli("check-config", "deploy/kvgate.yaml")
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  default:\n    tpm: -3\n")
    res = run_cli("check-config", str(bad))
    assert res.returncode == 2
    assert res.stderr.startswith("error: pools.default.tpm:")
    bad.write_text("pools:\n  default:\n    tokenizer: 'tiktoken:/no/such/file'\n")
    res = run_cli("check-config", str(bad))
    assert res.returncode == 2
    assert res.stderr.startswith("error: pools.default.tokenizer:")


def test_serve_refuses_a_bad_config_with_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  default:\n    max_concurrency: 0\n")
    res = run_cli("serve", "--config", str(bad), "--grpc-listen", f"{LOOPBACK}:0",
                  "--admin-listen", f"{LOOPBACK}:0")
    assert res.returncode == 2
    assert "pools.default.max_concurrency" in res.stderr


def test_example_config_keys_are_the_documented_ones() -> None:
    data = yaml.safe_load((ROOT / "deploy" / "kvgate.yaml").read_text())
    assert parse_config(data).pools["default"].kv_budget_tokens == 400000
    key = data["tenants"]["tenants"]["web-app"]["api_key_sha256"][0]
    assert key == hashlib.sha256(b"test").hexdigest()


def test_sim_subcommand_hands_its_arguments_to_the_simulator() -> None:
    res = run_cli("sim", "--help")
    assert res.returncode == 0, res.stderr
    assert "--kv-capacity-tokens" in res.stdout
