"""`kvgate serve` as a process: `--log-format json` (one JSON object a line, times in UTC, for
log pipelines) and `kvgate health` (the container's HEALTHCHECK) against it."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import orjson
import yaml

from extproc.logfmt import TEXT_FORMAT, JsonFormatter, UtcTextFormatter
from kvgate_testkit.procs import LOOPBACK, Proc, free_port, wait_until

T = 1_780_000_000.25  # 2026-05-28T20:26:40.250Z


def record(msg: str = "hello %s", args: tuple = ("world",), exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
    rec = logging.LogRecord("kvgate.test", logging.WARNING, __file__, 1, msg, args, info)
    rec.created, rec.msecs = T, 250.0
    return rec


def test_a_json_line_has_the_utc_time_level_logger_and_message() -> None:
    line = orjson.loads(JsonFormatter().format(record()))
    assert line == {"time": "2026-05-28T20:26:40.250Z", "level": "WARNING", "logger": "kvgate.test",
                    "message": "hello world"}
    with_exc = orjson.loads(JsonFormatter().format(record(exc=True)))
    assert "ValueError: boom" in with_exc["exception"] and "\n" not in JsonFormatter().format(record(exc=True))


def test_the_text_format_is_in_utc_too() -> None:
    assert UtcTextFormatter(TEXT_FORMAT).format(record()) == "2026-05-28T20:26:40.250Z WARNING kvgate.test: hello world"


def health(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extproc", "health", "--address", f"{LOOPBACK}:{port}",
                           "--timeout", "5"], capture_output=True, text=True, timeout=60)


def test_kvgate_serve_logs_json_lines_and_answers_health(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text(yaml.safe_dump({"pools": {"default": {"max_concurrency": 2}},
                                      "server": {"drain_s": 0, "grace_s": 0}}))
    grpc_port, admin_port = free_port(), free_port()
    proc = Proc([sys.executable, "-m", "extproc", "serve", "--config", str(config), "--log-format", "json",
                 "--grpc-listen", f"{LOOPBACK}:{grpc_port}", "--admin-listen", f"{LOOPBACK}:{admin_port}"],
                tmp_path / "kvgate.log")
    try:
        proc.wait_port(grpc_port)
        # Its SIGTERM handler is in place once it has said where it serves.
        wait_until(lambda: "kvgate serving" in proc.output(), timeout=20.0, what="kvgate's serving line")
        up = health(grpc_port)
        assert up.returncode == 0 and "SERVING" in up.stdout, up.stderr
        proc.signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0
    finally:
        proc.stop()
    down = health(grpc_port)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
    lines = [orjson.loads(line) for line in proc.log_path.read_text().splitlines() if line.strip()]
    assert lines, "kvgate logged nothing"
    now = datetime.now(timezone.utc)
    for line in lines:
        assert set(line) >= {"time", "level", "logger", "message"}
        at = datetime.strptime(line["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
        assert abs((now - at).total_seconds()) < 300


def health_of(port: int, service: str) -> str:
    """health_of is the gRPC health status ``kvgate serve`` gives ``service``, by name
    (NOT_FOUND: it does not know the name)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


PICKER_NAMES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


def test_the_endpoint_picker_protocols_health_names_follow_readiness_and_liveness(tmp_path: Path) -> None:
    """The protocol's three gRPC health names: all SERVING once kvgate serves; when SIGTERM
    starts the drain, readiness and the ext_proc name go NOT_SERVING with /readyz and "",
    while liveness stays SERVING (the process still answers)."""
    config = tmp_path / "kvgate.yaml"
    config.write_text(yaml.safe_dump({"pools": {"default": {"max_concurrency": 2}},
                                      "server": {"drain_s": 5, "grace_s": 0}}))
    grpc_port, admin_port = free_port(), free_port()
    proc = Proc([sys.executable, "-m", "extproc", "serve", "--config", str(config),
                 "--grpc-listen", f"{LOOPBACK}:{grpc_port}", "--admin-listen", f"{LOOPBACK}:{admin_port}"],
                tmp_path / "kvgate.log")
    try:
        proc.wait_port(grpc_port)
        wait_until(lambda: "kvgate serving" in proc.output(), timeout=20.0, what="kvgate's serving line")
        assert {name: health_of(grpc_port, name) for name in ("", *PICKER_NAMES)} == dict.fromkeys(
            ("", *PICKER_NAMES), "SERVING")
        assert health_of(grpc_port, "no-such-service") == "NOT_FOUND"
        proc.signal(signal.SIGTERM)
        wait_until(lambda: "draining" in proc.output(), timeout=10.0, what="the drain's log line")
        assert {name: health_of(grpc_port, name) for name in ("", *PICKER_NAMES)} == {
            "": "NOT_SERVING", "liveness": "SERVING", "readiness": "NOT_SERVING",
            "envoy.service.ext_proc.v3.ExternalProcessor": "NOT_SERVING"}
        assert proc.popen.wait(timeout=30) == 0
    finally:
        proc.stop()
