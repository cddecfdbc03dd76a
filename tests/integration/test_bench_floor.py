"""The benchmarks' floor and their CPU reading: the bare processor (kvgate_testkit/bare.py) takes the
access log the access-log and picker-log files send it (or refuses it, as the ``no-log-sink``
lever), and bench_cpu splits a process's CPU by thread."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2

from bench.bench_cpu import _thread_delta, thread_cpu, thread_table
from kvgate_testkit.held import periodic_message
from kvgate_testkit.procs import LOOPBACK, ROOT, Proc, free_port

pytestmark = pytest.mark.bench

LOG_METHOD = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"


def _send_log(port: int) -> grpc.StatusCode:
    """_send_log streams two batches of access log entries to ``port``; the call's status."""
    batches = [periodic_message([f"l-{i}"], 3).SerializeToString() for i in range(2)]
    with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
        call = channel.stream_unary(LOG_METHOD, request_serializer=None,
                                    response_deserializer=als_pb2.StreamAccessLogsResponse.FromString)
        try:
            call(iter(batches), timeout=10)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(("lever", "status"), [([], grpc.StatusCode.OK),
                                               (["--no-log-sink"], grpc.StatusCode.UNIMPLEMENTED)])
def test_the_bare_processor_takes_the_access_log_unless_told_not_to(
        tmp_path: Path, lever: list[str], status: grpc.StatusCode) -> None:
    port = free_port()
    bare = Proc([sys.executable, str(ROOT / "kvgate_testkit" / "bare.py"),
                 "--port", str(port), *lever], tmp_path / "bare.log")
    try:
        bare.wait_port(port)
        assert _send_log(port) == status
    finally:
        bare.stop()


def _spin(seconds: float) -> None:
    """_spin uses ``seconds`` of this thread's CPU (its own clock: no wall time waited on)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_thread_cpu_tells_which_thread_spent_the_cpu() -> None:
    before = thread_cpu(os.getpid())
    # A thread that has ended is gone from /proc with its CPU: this one spins, then stays.
    stop = threading.Event()
    spun = threading.Event()

    def spin_then_wait() -> None:
        _spin(0.2)
        spun.set()
        stop.wait()

    held = threading.Thread(target=spin_then_wait)
    held.start()
    try:
        spun.wait()
        delta = _thread_delta(before, thread_cpu(os.getpid()))
    finally:
        stop.set()
        held.join()
    busiest = max(delta.values(), key=sum)
    assert sum(busiest) >= 0.15, delta  # the held thread's 0.2 s, less a tick or two
    assert all(u >= 0 and s >= 0 for u, s in delta.values())


def test_the_thread_table_sums_the_small_threads_and_sorts_the_rest() -> None:
    threads = {"kvgate x": {"python#1": [0.30, 0.10], "python#2": [0.001, 0.001],
                            "event_engine#1": [0.05, 0.0], "event_engine#2": [0.0, 0.0005]}}
    lines = thread_table(threads, {"kvgate x": 1000})
    assert lines[2:] == [
        "| kvgate x | python#1 | 300 us | 100 us | 400 us |",
        "| kvgate x | event_engine#1 | 50 us | 0 us | 50 us |",
        "| kvgate x | (the others) | 1 us | 2 us | 2 us |",
    ]
