"""A benchmark killed with SIGTERM (a CI timeout, `kill`) still stops the processes it
started: they run in sessions of their own, so only its ``finally`` can
(``kvgate_testkit.procs.exit_on_sigterm``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate_testkit.procs import ROOT, wait_until

# A stand-in for a benchmark's main: start a child as the benchmarks do, report its pid,
# wait on a pipe that never speaks (nothing timed), stop the child in ``finally``.
SCRIPT = """
import os, sys
from pathlib import Path
from kvgate_testkit.procs import Proc, exit_on_sigterm
if sys.argv[1] == "handled":
    exit_on_sigterm()
child = Proc([sys.executable, "-c", "import sys; sys.stdin.read()"], Path(sys.argv[2]))
try:
    print(child.pid, flush=True)
    sys.stdin.read()
finally:
    child.stop()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child that ended but is not yet reaped by its (dead) parent's init is a zombie.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize(("mode", "child_stopped"), [("handled", True), ("default", False)])
def test_a_killed_benchmark_stops_its_children_only_with_the_handler(
        tmp_path: Path, mode: str, child_stopped: bool) -> None:
    bench = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(tmp_path / "child.log")],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert bench.stdout is not None
    child = int(bench.stdout.readline())
    try:
        assert _alive(child)
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=20)
        if child_stopped:
            wait_until(lambda: not _alive(child), timeout=15, what="the child stopped")
            assert bench.returncode == 128 + signal.SIGTERM
        else:
            assert _alive(child)  # what the handler is for: without it the child lives on
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
        bench.wait()
