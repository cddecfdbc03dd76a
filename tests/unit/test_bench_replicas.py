"""The pure parts of bench/bench_replicas.py: the faults' plans, the 429 split and its limit,
the time until every replica is shared again, the store mode read from an exposition, the
row filter, the targets' verdict, where a load balancer sends a try, and the passes and
comparison against a baseline revision."""

from __future__ import annotations

import pytest

from bench.bench_replicas import (DEFAULT_POLICY, FAULTS, REPLICA_POLICIES, TINY, Fault, Figures, Row, RowRun,
                                  all_rows, degraded_s, error_answers, fails_over, fault_plan, lb_pick, max_share,
                                  mode_from_metrics, next_replica, select_rows, shared_again_s, split_limit, verdict)
from bench.replicas_passes import THIS, run_passes
from bench.replicas_report import compared
from bench.trace_report import Run, Summary
from bench.trace_workload import Req
from kvgate_testkit.load import Result
pytestmark = pytest.mark.bench

FAULT = {f.key: f for f in FAULTS}


def test_a_pause_is_one_stop_and_one_resume() -> None:
    assert fault_plan(FAULT["stop10"], 5.0) == [(5.0, "down"), (15.0, "up")]


def test_flapping_stops_redis_two_seconds_in_every_four_for_twenty() -> None:
    plan = fault_plan(FAULT["flap"], 1.0)
    assert [a for _, a in plan] == ["down", "up"] * 5
    assert plan[0] == (1.0, "down") and plan[-1] == (19.0, "up")


def test_reset_spells_end_with_the_proxies_passing_again() -> None:
    plan = fault_plan(FAULT["reset"], 0.0)
    assert len(plan) == 20 and plan[1] == (0.5, "pass") and plan[-1] == (18.5, "pass")


def test_no_fault_does_nothing_and_a_kill_is_one_action() -> None:
    assert fault_plan(FAULT["none"], 3.0) == []
    assert fault_plan(FAULT["kill"], 3.0) == [(3.0, "kill")]


@pytest.mark.parametrize(("counts", "share"), [((60, 40), 0.6), ((0, 0), None), ((5,), 1.0), ((1, 1, 2), 0.5)])
def test_max_share_is_the_largest_count_over_the_total(counts: tuple[int, ...], share: float | None) -> None:
    assert max_share(counts) == share


def test_the_split_limit_is_sixty_forty_for_two_and_forty_percent_for_three() -> None:
    assert split_limit(2) == pytest.approx(0.6)
    assert split_limit(3) == pytest.approx(0.4)
    assert split_limit(1) == 1.0


def test_shared_again_is_the_first_poll_after_the_answer_where_every_live_replica_is_shared() -> None:
    polls: list[tuple[float, list[str | None]]] = [
        (0.9, ["shared", "shared"]),            # before Redis answered: not counted
        (1.1, ["local_share", "shared"]),
        (1.3, ["shared", None]),                # a replica that did not answer is not shared
        (1.5, ["shared", "shared"])]
    assert shared_again_s(1.0, polls, [True, True]) == pytest.approx(0.5)
    assert shared_again_s(1.0, polls, [True, False]) == pytest.approx(0.3)   # the dead one is left out
    assert shared_again_s(2.0, polls, [True, True]) is None


def test_degraded_counts_the_polls_a_replica_spent_out_of_shared_mode() -> None:
    polls: list[tuple[float, list[str | None]]] = [
        (0.0, ["shared"]), (0.1, ["local_share"]), (0.3, ["fail_closed"]), (0.4, ["shared"]), (0.5, [None])]
    assert degraded_s(polls, 0) == pytest.approx(0.3)


def test_the_mode_is_the_one_the_gauge_marks_one() -> None:
    text = ('# TYPE kvgate_store_mode gauge\nkvgate_store_mode{mode="shared"} 0.0\n'
            'kvgate_store_mode{mode="local_share"} 1.0\nkvgate_other 1.0\n')
    assert mode_from_metrics(text) == "local_share"
    assert mode_from_metrics("kvgate_other 1.0\n") is None


def test_rows_are_chosen_by_key_or_shell_pattern_in_the_matrix_order() -> None:
    rows = all_rows()
    assert rows[0].key == "1x-none" and len(rows) == 1 + 2 * len(FAULTS)
    assert [r.key for r in select_rows(rows, ["3x-kill", "2x-stop*"])] == ["2x-stop2", "2x-stop10", "3x-kill"]


def _figures(preemptions: int = 0, ratio: float | None = 1.0, share: float | None = 0.5, alive: int = 2,
             again: float | None = None, goodput: float = 1.0) -> Figures:
    summary = Summary(preemptions=(preemptions, 0, 0), at_arrival=0, by_class={}, ttft_p50=None, ttft_p99=None,
                      under_target=None, kv_utilization=None, goodput=goodput, span_s=1.0)
    return Figures(summary=summary, preemptions=preemptions, goodput_ratio=ratio, refusals=(), ok=(), refused=(),
                   errors=(), share=share, alive=alive, latency_p99=None, shared_again=again, degraded=(),
                   kv_max=())


def test_the_verdict_applies_each_target_where_it_belongs() -> None:
    stop = Row(2, FAULT["stop10"])
    v = verdict(stop, _figures(ratio=0.92, share=0.61, again=2.5))
    assert v == {"0 preemptions": True, "goodput": True, "429 split": False, "shared within 2 s": False}
    # Without a fault the goodput must be 0.97 of one replica's, and recovery does not apply.
    v = verdict(Row(2, FAULT["none"]), _figures(ratio=0.95, share=None))
    assert v == {"0 preemptions": True, "goodput": False, "429 split": True, "shared within 2 s": None}
    # The reference row is measured against nothing; a lone survivor has no split.
    v = verdict(Row(1, FAULT["none"]), _figures(preemptions=2, alive=1))
    assert v == {"0 preemptions": False, "goodput": None, "429 split": None, "shared within 2 s": None}


def test_only_the_faults_that_cut_redis_off_are_timed_for_recovery() -> None:
    assert [f.key for f in FAULTS if f.redis] == ["stop2", "stop10", "flap", "reset"]
    assert not Fault("x", "x", "kill").redis


def test_errors_are_counted_by_the_last_answer_most_frequent_first() -> None:
    req = Req(0, 0.0, "online-1", "online", 10, 5, None, 5, b"{}")
    results = [Result(req, status="error", last_status=503), Result(req, status="error", last_status=None),
               Result(req, status="error", last_status=503), Result(req, status="ok", last_status=200),
               Result(req, status="refused", last_status=429)]
    assert list(error_answers(results).items()) == [("503", 2), ("no answer", 1)]


def test_a_load_balancer_sends_no_answer_a_cut_stream_and_502_503_on_but_not_a_429_or_a_success() -> None:
    assert fails_over(None, ok=False) and fails_over(503, ok=False) and fails_over(502, ok=False)
    assert fails_over(200, ok=False)          # a stream cut after its headers
    assert not fails_over(429, ok=False) and not fails_over(504, ok=False) and not fails_over(400, ok=False)
    assert not fails_over(200, ok=True)


def test_the_next_replica_is_another_one_spread_by_request_and_none_once_all_were_tried() -> None:
    assert next_replica([1], 2, 7) == 0 and next_replica([0, 1], 2, 7) is None
    # A dead third replica's requests spread over the two others, and never return to it.
    assert {next_replica([2], 3, i) for i in range(4)} == {0, 1}
    assert next_replica([2, 0], 3, 5) == 1 and next_replica([2, 0, 1], 3, 5) is None
    assert next_replica([0], 1, 3) is None


def test_a_first_try_goes_to_its_replica_and_a_retry_to_any_alike_the_same_in_every_run() -> None:
    assert [lb_pick(i, 1, 3) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    retries = [lb_pick(i, a, 2) for i in range(400) for a in (2, 3)]
    assert 0.4 < sum(retries) / len(retries) < 0.6
    assert retries == [lb_pick(i, a, 2) for i in range(400) for a in (2, 3)]
    assert {lb_pick(i, 2, 3) for i in range(30)} == {0, 1, 2}


def test_with_a_baseline_each_row_runs_by_both_trees_back_to_back_in_alternating_order(tmp_path, capsys) -> None:
    rows = [Row(1, FAULT["none"]), Row(2, FAULT["none"])]
    ran: list[tuple[str, str | None]] = []

    def run_row(row: Row, workdir, label: str, source) -> RowRun:
        ran.append((row.key, None if source is None else source.name))
        return RowRun(row, Run(REPLICA_POLICIES[DEFAULT_POLICY]))

    out = run_passes(rows, 2, tmp_path, TINY, ("v1", tmp_path / "v1"), run_row)
    assert ran == [("1x-none", None), ("1x-none", "v1"), ("2x-none", "v1"), ("2x-none", None),
                   ("1x-none", None), ("1x-none", "v1"), ("2x-none", "v1"), ("2x-none", None)]
    assert [[rr.row.key for rr in p] for p in out[THIS]] == [["1x-none", "2x-none"]] * 2 == \
        [[rr.row.key for rr in p] for p in out["v1"]]
    ran.clear()
    assert list(run_passes(rows, 1, tmp_path, TINY, None, run_row)) == [THIS] and ran == [
        ("1x-none", None), ("2x-none", None)]


def test_the_comparison_reads_each_tree_against_its_own_reference_and_counts_the_passes_won() -> None:
    mine = [{"2x-none": _figures(ratio=0.97, share=0.55, goodput=12_500)},
            {"2x-none": _figures(ratio=0.93, share=0.61, goodput=12_100, preemptions=2)}]
    theirs = [{"2x-none": _figures(ratio=0.95, share=0.50, goodput=12_300)},
              {"2x-none": _figures(ratio=0.99, share=None, goodput=12_900)}]
    lines = compared(mine, theirs, ["2x-none"], "abc123")
    assert lines[1] == "## Against `abc123`"
    this, base = lines[-2:]
    assert this == "| 2x-none | this tree | 0.97 / 0.93 | 0.95 | 12,500 / 12,100 | 55% / 61% | 58% | 0 / 2 | 1 of 2 |"
    assert base == "| 2x-none | `abc123` | 0.95 / 0.99 | 0.97 | 12,300 / 12,900 | 50% / n/a | 50% | 0 / 0 | 1 of 2 |"
