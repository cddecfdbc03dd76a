"""Smoke test of the usage filter's benchmark (make bench-usage-filter): with tiny counts
(``--quick``) it runs every setup through the real Envoy, and the filter of this tree and
the one at a git revision hide the usage chunk from a client that did not ask for it where
Envoy without the filter does not. The figures of a quick run mean nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate_testkit.procs import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.bench]


@pytest.mark.timeout(300)
def test_quick_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "usage-filter.md"
    done = subprocess.run([sys.executable, "bench/bench_usage_filter.py", "--quick", "--rounds", "1",
                           "--baseline", "HEAD", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in out.read_text().splitlines()
                                          if line.startswith("| ") and not line.startswith("| setup"))}
    assert set(rows) == {"none", "reader", "shipped", "baseline"}
    # The last cell: whether the usage chunk was hidden from the client.
    assert {name: cells[-1] for name, cells in rows.items()} == {
        "none": "no", "reader": "no", "shipped": "yes", "baseline": "yes"}
    assert all(int(cells[1]) == 8 * 10 for cells in rows.values())  # every stream's chunks
    assert "`python bench/bench_usage_filter.py --baseline HEAD --rounds 1 --quick`" in out.read_text()
