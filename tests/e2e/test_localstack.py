"""`make run`'s stack: started as a user would, the printed request gets an answer, and the
README's commands against it (its curl and openai snippets, the fill-node-0 experiment, with
kvgate picking and at the pool level) do what the README says."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvgate_testkit.procs import LOOPBACK, ROOT, free_port, wait_until
from tests import doccommands


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
        _stop(proc)


def _start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """_start runs the local stack with ``args`` and returns it with its banner."""
    proc = subprocess.Popen([sys.executable, "-m", "extproc.localstack", *args, "--envoy-port", str(free_port())],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "/metrics | grep" in line:  # the banner's last line
            return proc, "".join(lines)
    proc.wait()
    raise AssertionError("the stack exited before its banner:\n" + "".join(lines[-40:]))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _readme_command(start: str) -> str:
    (command,) = [c.text for c in doccommands.local_stack_commands() if c.text.startswith(start)]
    return command


def _shell(command: str) -> str:
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


def _series(metrics_url: str, name: str) -> dict[str, float]:
    """_series reads one metric family: the value of each series by its labels."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return {labels: float(value) for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def _node(series: dict[str, float], backend: str) -> float:
    (value,) = [v for labels, v in series.items() if f'backend="{backend}"' in labels]
    return value


@pytest.mark.skipif(not shutil.which("curl"), reason="the README's commands use curl, absent here")
def test_the_readmes_commands_do_what_it_says_with_kvgate_picking():
    proc, banner = _start([])
    try:
        metrics = doccommands.for_stack("http://127.0.0.1:9464/metrics", banner)
        chat = doccommands.for_stack(_readme_command("curl -s http://127.0.0.1:8080/v1/chat"), banner)
        assert '"usage"' in _shell(chat)
        (snippet,) = doccommands.blocks("README.md", "python")
        done = subprocess.run([sys.executable, "-c", doccommands.for_stack(snippet, banner)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "completion_tokens=" in done.stdout, done.stderr[-2000:]

        # Fill node-0 with load kvgate did not admit: kvgate sees it, and picks the others.
        _shell(doccommands.for_stack(_readme_command("curl -s 127.0.0.1:8000/sim/config"), banner))
        wait_until(lambda: _node(_series(metrics, "kvgate_backend_kv_foreign_tokens"), "node-0") > 100_000
                   and _node(_series(metrics, "kvgate_backend_kv_headroom_tokens"), "node-0") < 0,
                   timeout=30, what="node-0's foreign KV risen and its headroom below zero")
        picks = _series(metrics, "kvgate_backend_picks_total")
        for _ in range(4):
            assert '"usage"' in _shell(chat)
        after = _series(metrics, "kvgate_backend_picks_total")
        assert _node(after, "node-0") == _node(picks, "node-0")
        assert sum(after.values()) == sum(picks.values()) + 4
        shown = _shell(doccommands.for_stack(_readme_command("curl -s 127.0.0.1:9464/metrics"), banner))
        assert 'kvgate_backend_kv_foreign_tokens{backend="node-0"' in shown.replace('pool="default",', "")
    finally:
        _stop(proc)


@pytest.mark.skipif(not shutil.which("curl"), reason="the README's commands use curl, absent here")
def test_the_readmes_pool_level_experiment_shrinks_the_pool():
    (command,) = [c for c in doccommands.commands("README.md") if "extproc.localstack" in c.text]
    proc, banner = _start(command.words[3:])
    try:
        assert "(deploy/envoy.yaml)" in banner
        metrics = doccommands.for_stack("http://127.0.0.1:9464/metrics", banner)
        # kvgate starts at min_scale (no report yet counts as saturated) and recovers.
        wait_until(lambda: list(_series(metrics, "kvgate_concurrency_limit").values()) == [96.0],
                   timeout=30, what="the pool's limit recovering to its base")
        _shell(doccommands.for_stack(_readme_command("curl -s 127.0.0.1:8000/sim/config"), banner))
        wait_until(lambda: list(_series(metrics, "kvgate_admission_scale").values()) == [0.6],
                   timeout=30, what="the pool's scale falling to min_scale")
        assert list(_series(metrics, "kvgate_concurrency_limit").values()) == [57.0]
    finally:
        _stop(proc)
