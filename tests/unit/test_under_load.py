"""The under-load runner reads pytest's own summary: a real pytest run over a tiny suite."""

from __future__ import annotations

from pathlib import Path

from tests.under_load import Run, report, run_suite

TINY = '''
import pytest

def test_ok():
    assert True

def test_broken():
    assert 1 == 2

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
'''


def test_a_real_run_is_counted_and_its_failure_named(tmp_path: Path) -> None:
    (tmp_path / "test_tiny.py").write_text(TINY)
    run = run_suite(0, ["test_tiny.py"], cwd=tmp_path)
    assert run.counts == {"passed": 1, "failed": 1, "skipped": 1}
    assert run.failed == ["test_tiny.py::test_broken"]
    assert not run.clean


def test_the_report_counts_clean_runs_only() -> None:
    runs = [Run(100.0, {"passed": 10}), Run(120.0, {"passed": 9, "failed": 1}, ["t.py::x"]),
            Run(5.0, {})]  # a run that collected nothing is not clean
    text = report(runs, burners=2, workers=2)
    assert "| 2 | 120 | 9 | 1 | 0 | t.py::x |" in text
    assert "1 of 3 runs without a failure." in text
