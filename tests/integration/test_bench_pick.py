"""Smoke test of make bench-pick: the picks and the refusals by requests held, in-process,
each row measured in a worker process. The figures of so short a run mean nothing."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from bench import bench_pick

pytestmark = pytest.mark.bench


def test_the_pick_and_refusal_rows_are_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "pick.md"
    monkeypatch.setattr(sys, "argv", ["bench_pick.py"])
    assert bench_pick.main(["--growth", "worst_case", "--held", "0", "5", "--refusals",
                            "--out", str(out)]) == 0
    text = out.read_text()
    assert re.search(r"^\| worst_case \| 5 \| [\d.]+ \| [\d.]+ \|$", text, re.M)
    for budget in bench_pick.REFUSALS:
        # Each refusal row ran to its end: the request was refused every time, and every
        # lease the row held was given back (the worker raises otherwise).
        assert re.search(rf"^\| {budget} \| 5 \| [\d.]+ \| [\d.]+ \|$", text, re.M), budget
