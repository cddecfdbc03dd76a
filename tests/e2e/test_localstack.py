"""`make run`'s stack: started as a user would, the printed request gets an answer."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvgate_testkit.procs import LOOPBACK, ROOT, free_port, wait_until


def test_local_stack_answers_the_printed_request():
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "extproc.localstack", "--check",
                           "--envoy-port", str(port)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "curl -s http://127.0.0.1:" in done.stdout
    assert "from openai import OpenAI" in done.stdout
    answer = done.stdout.strip().splitlines()[-1]
    assert answer.startswith("200 "), answer
    assert '"usage"' in answer
    # The printed request carries tenant online-1's API key: admitted in its class, online.
    admitted = [line for line in done.stdout.splitlines() if line.startswith("kvgate_requests_total{")]
    assert len(admitted) == 1 and 'class="online"' in admitted[0] and admitted[0].endswith(" 1.0"), admitted


def test_the_banner_comes_once_envoy_listens_and_ctrl_c_stops_it_in_about_a_second():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "extproc.localstack", "--envoy-port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until the stack prints; the test timeout bounds it
            lines.append(line)
            if "kvgate local stack is up" in line:
                break
        else:
            raise AssertionError("the stack exited before its banner:\n" + "".join(lines[-40:]))
        # Printed only after Envoy bound its port: a connection succeeds at once.
        with socket.create_connection((LOOPBACK, port), timeout=1.0):
            pass
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 3.0  # kvgate's drain_s is 0 here; 5 s by default
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _listener_pid(port: int) -> int:
    """_listener_pid is the process whose command line listens on LOOPBACK:``port`` (a node)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = (Path("/proc") / entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"{LOOPBACK}:{port}".encode() in argv and b"sim" in argv:
                return int(entry)
    raise AssertionError(f"no process listens on {port}")


def test_a_killed_node_leaves_the_stack_up_and_requests_go_to_the_others():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "extproc.localstack", "--nodes", "2",
                             "--envoy-port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "background_kv_tokens" in line:  # the banner's last lines
                break
        banner = "".join(lines)
        nodes = [int(p) for p in re.findall(r"node-\d \(simulated vLLM\) +http://[\d.]+:(\d+)/", banner)]
        metrics = re.search(r"kvgate metrics +(http://\S+/metrics)", banner).group(1)  # type: ignore[union-attr]
        assert len(nodes) == 2, banner
        os.kill(_listener_pid(nodes[1]), signal.SIGKILL)

        def up() -> float:
            with urllib.request.urlopen(metrics, timeout=5) as resp:
                text = resp.read().decode()
            return sum(float(v) for v in re.findall(r"^kvgate_backend_up\{[^}]*\} (\S+)$", text, re.M))
        wait_until(lambda: up() == 1.0, timeout=30, what="kvgate marking the killed node down")
        body = b'{"model": "sim-llama-3-8b", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}'
        for _ in range(6):
            req = urllib.request.Request(f"http://{LOOPBACK}:{port}/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200
        assert proc.poll() is None, "the stack stopped with its node"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
