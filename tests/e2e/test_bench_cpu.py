"""Smoke test of make bench-cpu through the real Envoy: CPU per request against the bare
processor, split by thread, and (``--refused-under``) per refusal with requests held. The
figures of so short a run mean nothing; only that they are there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate_testkit.procs import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.bench]


def _run(tmp_path: Path, *args: str) -> str:
    out = tmp_path / "cpu.md"
    done = subprocess.run([sys.executable, "bench/bench_cpu.py", "--variants", "access-log",
                           "--rounds", "1", "--requests", "60", *args, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out.read_text()


@pytest.mark.timeout(300)
def test_cpu_per_request_against_the_bare_processor_by_thread(tmp_path: Path) -> None:
    text = _run(tmp_path)
    for setup in ("bare", "kvgate"):
        assert re.search(rf"^\| access-log \| {setup} \| 60 \| [\d.]+ \| [\d.]+ \| \d+ us \| [\d.]+x \|$",
                         text, re.M), setup
    assert "## By thread" in text
    assert re.search(r"^\| kvgate access-log \| python#1 \| \d+ us \| \d+ us \| \d+ us \|$", text, re.M)


@pytest.mark.timeout(300)
def test_refusals_with_requests_held(tmp_path: Path) -> None:
    # Every request of the round is answered 429 (the run fails on any other status).
    text = _run(tmp_path, "--refused-under", "20")
    assert "Every request of the rounds refused (429) with 20 streams held" in text
    assert re.search(r"^\| access-log \| kvgate \| 60 \| [\d.]+ \| [\d.]+ \| \d+ us \| 1.00x \|$", text, re.M)
    assert "| bare |" not in text
