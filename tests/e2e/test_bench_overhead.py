"""Smoke test of the hot-path benchmark (make bench-overhead): it runs end to end with tiny
counts (``--quick``) and writes its report, with every section, the core count and the
command. The figures of a quick run mean nothing; only that they are there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate_testkit.procs import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.bench]


@pytest.mark.timeout(300)
def test_quick_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "overhead.md"
    # Three of the six files (fewer stacks to start): the recommended one, the picker file
    # (its node named by kvgate and by the bare processor) and the access-log file.
    bench = subprocess.Popen([sys.executable, "bench/bench_overhead.py", "--quick", "--variants",
                              "recommended", "endpoint-picker", "access-log", "--out", str(out)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=240)  # ~20 s alone; minutes on a loaded machine
    finally:
        if bench.poll() is None:
            # Ctrl-C, so that its cleanup stops the Envoys, processors and upstreams it started
            # (each in a session of its own); then kill it if that hangs.
            bench.send_signal(signal.SIGINT)
            try:
                bench.wait(20)
            except subprocess.TimeoutExpired:
                bench.kill()
                bench.wait()
    assert bench.returncode == 0, stdout[-2000:] + stderr[-2000:]
    text = out.read_text()
    cores = len(os.sched_getaffinity(0))
    assert f"{cores} CPU cores" in text
    assert "Command: `python bench/bench_overhead.py --quick --variants" in text
    for section in ("## Request path", "## Streaming", "## Highest rate", "## Memory",
                    "## Release after a client disconnect", "## Targets"):
        assert section in text, section
    # every setup at every client count, with a latency
    for clients in (1, 16, 64):
        for setup in ("plain", "bare", "kvgate"):
            assert re.search(rf"^\| {clients} \| {setup} \| \d+ \| \d+\.\d\d \|", text, re.M), (clients, setup)
    assert re.search(r"^\| kvgate \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", text, re.M)  # release row
    for setup in ("bare endpoint-picker", "kvgate endpoint-picker"):
        assert re.search(rf"^\| 16 \| {setup} \| \d+ \| \d+\.\d\d \|", text, re.M), setup
    # the targets against each Envoy file kvgate serves, the recommended one first, and the
    # ratios over the bare processor in the same file
    assert "| target | goal | kvgate | kvgate access-log | kvgate endpoint-picker |" in text
    assert re.search(r"^\| added p50 at 16 clients, x the bare processor's in the same file \| "
                     r"<= 1.3x \| [\d.-]+ \((meets|misses)\) \|", text, re.M)
