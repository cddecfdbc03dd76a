"""bench/bench_instructions.py: its reading of callgrind's dumps, its arithmetic and report, its
worker's rows (run here without callgrind, a few requests: the checks that every request was
admitted or refused), and the marker itself under the real callgrind (a few seconds)."""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_instructions import (FILES, KINDS, MARKER, OUT_NAME, Job, Part, Ticks, _worker, label,
                                      per_request, phases, read_part, read_parts, report, rows, spread,
                                      targets)

pytestmark = pytest.mark.bench

# The head of a dump as callgrind 3.19 writes it (a part after the first, one event).
DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 4242
cmd:  python bench/bench_instructions.py --worker kvgate
part: 3


desc: I1 cache: 
desc: D1 cache: 
desc: LL cache: 

desc: Timerange: Basic block 1000 - 2000
desc: Trigger: --dump-before=getppid

positions: line
events: Ir
summary: 171372254


ob=(1) /usr/lib/x86_64-linux-gnu/libc.so.6
fl=(1) ???
fn=(1) getppid
0 5

totals: 171372254
"""


def _dump(folder: Path, number: int | None, instructions: int, trigger: str = "--dump-before=getppid") -> None:
    name = OUT_NAME if number is None else f"{OUT_NAME}.{number}"
    text = DUMP.replace("171372254", str(instructions)).replace("--dump-before=getppid", trigger)
    (folder / name).write_text(text)


def test_a_dump_gives_its_trigger_and_its_total_instructions() -> None:
    assert read_part(DUMP) == Part("--dump-before=getppid", 171_372_254)


def test_an_older_dump_without_totals_is_read_from_its_summary() -> None:
    assert read_part(DUMP.replace("totals: 171372254\n", "")).instructions == 171_372_254


def test_a_file_that_is_no_dump_is_refused() -> None:
    with pytest.raises(ValueError, match="not a callgrind output"):
        read_part("events: Ir\n")


def test_dumps_are_read_in_number_order_and_the_final_one_left_out(tmp_path: Path) -> None:
    for number in (10, 2, 1, 3, 4, 5, 6, 7, 8, 9):  # 10 sorts before 2 as text
        _dump(tmp_path, number, number * 1000)
    _dump(tmp_path, None, 7)  # the program's end
    (tmp_path / "labels.json").write_text("[]")
    assert [p.instructions for p in read_parts(tmp_path)] == [n * 1000 for n in range(1, 11)]


def test_a_missing_dump_is_an_error(tmp_path: Path) -> None:
    _dump(tmp_path, 1, 5)
    _dump(tmp_path, 3, 5)
    with pytest.raises(ValueError, match="not numbered"):
        read_parts(tmp_path)


def test_each_marker_s_label_gets_the_phase_it_closed() -> None:
    parts = [Part(f"--dump-before={MARKER}", n) for n in (5, 7, 9)]
    assert phases(parts, ["startup", "a", "b"]) == {"startup": 5, "a": 7, "b": 9}


def test_a_dump_more_than_the_markers_means_another_caller_of_the_marker() -> None:
    parts = [Part(f"--dump-before={MARKER}", n) for n in (5, 7, 9)]
    with pytest.raises(ValueError, match="something else called"):
        phases(parts, ["startup", "a"])


def test_a_dump_by_another_trigger_is_an_error() -> None:
    with pytest.raises(ValueError, match="not triggered by the marker"):
        phases([Part("Program termination", 5)], ["startup"])


def test_instructions_per_request_are_the_difference_of_two_rounds_over_their_sizes() -> None:
    # 1,000,000 to start a round, 500,000 a request: the start cancels out.
    assert per_request({100: 51_000_000, 300: 151_000_000}) == 500_000
    assert per_request({300: 151_000_000, 100: 51_000_000}) == 500_000


def test_one_round_size_is_not_enough() -> None:
    with pytest.raises(ValueError, match="two round sizes"):
        per_request({100: 5})


def test_spread_is_the_range_over_the_mean() -> None:
    assert spread([99.0, 101.0]) == pytest.approx(0.02)
    assert spread([5.0, 5.0]) == 0.0


def test_rows_name_each_file_and_kind_that_ran() -> None:
    by_label = {"startup": 1, label("recommended", "admitted", None): 9,
                label("recommended", "admitted", 10): 1_500, label("recommended", "admitted", 30): 3_500}
    assert rows(by_label, FILES, KINDS, 10, 30) == {"recommended admitted": 100.0}


def test_the_report_sets_each_column_s_mean_and_spread_beside_the_ratios() -> None:
    args = argparse.Namespace(files=["recommended"], kinds=["admitted", "refused"])
    done = {Job("bare", "bare", None, 1): {"recommended admitted": 100_000.0},
            Job("bare", "bare", None, 2): {"recommended admitted": 100_000.0},
            Job("this", "kvgate", None, 1): {"recommended admitted": 495_000.0, "recommended refused": 400_000.0},
            Job("this", "kvgate", None, 2): {"recommended admitted": 505_000.0, "recommended refused": 400_000.0},
            Job("base", "kvgate", Path("x"), 1): {"recommended admitted": 600_000.0, "recommended refused": 500_000.0},
            Job("base", "kvgate", Path("x"), 2): {"recommended admitted": 600_000.0, "recommended refused": 500_000.0}}
    text = report(done, ["bare", "this", "base"], args, ["# head"])
    assert "| recommended | admitted | 100.0k (0.00 %) | 500.0k (2.00 %) | 600.0k (0.00 %) | 0.833 | 5.000 |" in text
    assert "| recommended | refused | – | 400.0k (0.00 %) | 500.0k (0.00 %) | 0.800 | – |" in text
    assert "2.00 % (OVER the 1 % target)" in text
    assert "Rows above base by more than 1%: none." in text
    assert "recommended admitted at most 0.667 of base: 0.833 (not met)." in text


def test_a_row_above_the_baseline_beyond_a_rerun_s_reach_is_named_and_a_third_less_is_met() -> None:
    got = targets({"recommended admitted": 0.66, "access-log admitted": 1.009, "access-log refused": 1.02}, "main")
    assert got == ["Rows above main by more than 1%: access-log refused (1.020).",
                   "Issue 31's cut, recommended admitted at most 0.667 of main: 0.660 (met)."]


def test_the_clock_moves_by_the_reading_not_by_the_time_spent() -> None:
    clock = Ticks()
    first = clock.now()
    assert clock.now() - first == pytest.approx(1e-5)


@pytest.mark.parametrize("impl", ["kvgate", "bare"])
def test_the_worker_runs_every_row_and_checks_what_each_request_got(impl: str, tmp_path: Path) -> None:
    # Without callgrind the markers dump nothing; _kvgate_row raises if a request of a round
    # was not admitted (admitted rows) or not refused (refused rows), or a lease was left held.
    try:
        _worker(impl, FILES, KINDS, 2, 5, tmp_path / "labels.json")
    finally:
        gc.unfreeze()  # the markers froze this process's objects
    labels = json.loads((tmp_path / "labels.json").read_text())
    kinds = KINDS if impl == "kvgate" else ("admitted",)
    assert labels == ["startup", *(label(f, k, n) for f in FILES for k in kinds for n in (None, 2, 5))]


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_callgrind_dumps_at_each_call_of_the_marker_and_nowhere_else(tmp_path: Path) -> None:
    code = ("import os\nos.getppid()\nfor i in range(20000): pass\nos.getppid()\n"
            "for i in range(60000): pass\nos.getppid()\n")
    subprocess.run([str(shutil.which("valgrind")), "--tool=callgrind", f"--dump-before={MARKER}",
                    f"--callgrind-out-file={tmp_path / OUT_NAME}", sys.executable, "-S", "-c", code],
                   check=True, capture_output=True, env={"PYTHONHASHSEED": "0"})
    got = phases(read_parts(tmp_path), ["startup", "20000", "60000"])
    per_loop = per_request({20_000: got["20000"], 60_000: got["60000"]})
    assert 20 < per_loop < 2_000  # instructions of one iteration of an empty loop
