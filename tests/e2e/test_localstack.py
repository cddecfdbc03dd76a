"""`make run`'s stack: started as a user would, the printed request gets an answer."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

from kvgate_testkit.procs import LOOPBACK, ROOT, free_port


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
