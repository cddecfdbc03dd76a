"""`make run`'s stack: started as a user would, the printed request gets an answer."""

from __future__ import annotations

import subprocess
import sys

from tests.support.procs import ROOT, free_port


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
