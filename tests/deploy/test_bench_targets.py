"""`make bench-*` leaves a checkout clean: every benchmark writes under a folder git ignores,
and the committed reports change only when asked (``BENCH_OUT=bench/results``)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.deploy.support import ROOT

pytestmark = pytest.mark.bench


def bench_commands(*make_args: str) -> list[str]:
    # bench-vllm and bench-inference-perf stay out of `make bench` (each installs a virtualenv of
    # its own, the engine several GB) but write their reports by the same rule.
    # The Makefile's defaults, not those of a make that runs this suite (its command-line
    # variables, BENCH_OUT included, reach a child make through MAKEFLAGS).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "BENCH_OUT")}
    out = subprocess.run(["make", "-n", "bench", "bench-vllm", "bench-vllm-prefix", "bench-inference-perf", *make_args], cwd=ROOT,
                         capture_output=True,
                         text=True, timeout=60, check=True, env=env).stdout
    return [line for line in out.splitlines() if re.search(r"bench/bench_\w+\.py", line)]


def test_every_benchmark_writes_where_git_does_not_look() -> None:
    commands = bench_commands()
    scripts = sorted(p.name for p in (ROOT / "bench").glob("bench_*.py"))
    # bench_vllm.py twice: its default scenario and bench-vllm-prefix's
    assert sorted({re.search(r"bench/(bench_\w+\.py)", c).group(1) for c in commands}) == scripts
    for command in commands:
        out = re.search(r"--out (\S+)", command)
        assert out, f"no --out: {command}"
        target = out.group(1)
        probe = target if target.endswith(".md") else f"{target}/report.md"
        ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT, timeout=30)
        assert ignored.returncode == 0, f"{probe} is not ignored by git: a benchmark would dirty the checkout"


def test_the_committed_reports_are_written_when_asked() -> None:
    for command in bench_commands("BENCH_OUT=bench/results"):
        assert re.search(r"--out bench/results(/[\w-]+\.md)?(\s|$)", command), command
