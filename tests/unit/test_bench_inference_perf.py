"""bench/inference_perf_reports.py: inference-perf's per-stage reports and the nodes' samples
become the tables of bench/results/inference-perf.md (no inference-perf needed: the reports are
files; their shape below is cut from a real inference-perf 0.7.0 run of the benchmark)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.inference_perf_reports import (
    KV_USAGE,
    PREEMPTIONS,
    PREFIX_HITS,
    PREFIX_QUERIES,
    WAITING,
    Measured,
    NodeFigures,
    Sample,
    node_figures,
    read_stages,
    stage_from,
    stage_table,
    tables,
    window_of,
)

# Cut from stage_1_lifecycle_metrics.json of a real run (kvgate-prefix, 2 requests/s).
STAGE_1 = {
    "benchmark_time_seconds": 15.02,
    "load_summary": {"count": 20, "send_duration": 9.79, "requested_rate": 2.0, "achieved_rate": 2.0433777407706932},
    "successes": {
        "count": 20,
        "latency": {
            "request_latency": {"mean": 5.41, "median": 5.44670536700005, "p99": 5.51},
            "time_to_first_token": {"mean": 0.0883, "min": 0.0337, "max": 0.2388,
                                    "median": 0.08099575350001942, "p90": 0.1325, "p99": 0.22473117676006485},
        },
        "throughput": {"input_tokens_per_sec": 4079.9, "output_tokens_per_sec": 340.9165186156337,
                       "total_tokens_per_sec": 4420.9, "requests_per_sec": 1.3317051508423192},
        "prompt_tokens": {"total": 61274.0, "cached": 0.0, "uncached": 61274.0, "mean": 3063.7},
    },
    "failures": {"count": 0, "request_latency": None,
                 "prompt_tokens": {"total": 0.0, "cached": 0.0, "uncached": 0.0}, "by_label": {}},
}
# inference-perf.partial.stage_1.yaml's run section, as written.
PARTIAL_1 = """version: 0.2.1
run:
  uid: inference-perf-stage-1-51588dcc
  eid: inference-perf-experiment-06c6d0dc
  time:
    start: '2026-12-07T02:10:24.437901Z'
    end: '2026-12-07T02:10:41.469342Z'
    duration: PT17.031S
"""
START_1 = 1796609424.437901  # 2026-12-07T02:10:24.437901Z
END_1 = 1796609441.469342


def refused(count_429: int, timeouts: int = 0) -> dict[str, Any]:
    """refused is STAGE_1 with some requests failed as inference-perf labels them."""
    labels: dict[str, Any] = {"429 - Rate Limit": {"count": count_429, "messages": [{"message": "rate_limit_exceeded"}]}}
    if timeouts:
        labels["timeout"] = {"count": timeouts, "messages": []}
    ok = {**STAGE_1["successes"], "count": 20 - count_429 - timeouts}  # type: ignore[dict-item]
    return {**STAGE_1, "successes": ok, "failures": {"count": count_429 + timeouts, "by_label": labels}}


def test_a_stage_report_reads_as_inference_perf_wrote_it() -> None:
    s = stage_from(1, STAGE_1, window_of(yaml.safe_load(PARTIAL_1)))
    assert (s.index, s.rate, s.sent, s.completed, s.failed) == (1, 2.0, 20, 20, 0)
    assert s.achieved_rate == pytest.approx(2.0434, abs=1e-4)
    assert s.ttft_p50 == pytest.approx(0.0810, abs=1e-4) and s.ttft_p99 == pytest.approx(0.2247, abs=1e-4)
    assert s.latency_p50 == pytest.approx(5.4467, abs=1e-4)
    assert s.output_tokens_per_s == pytest.approx(340.92, abs=0.01)
    assert s.prompt_tokens_mean == pytest.approx(3063.7)
    assert (s.start, s.end) == (pytest.approx(START_1), pytest.approx(END_1))


def test_failures_keep_their_labels_and_a_count_without_labels_still_counts() -> None:
    s = stage_from(0, refused(3, timeouts=1))
    assert s.failures == {"429 - Rate Limit": 3, "timeout": 1} and s.completed == 16
    bare = stage_from(0, {**STAGE_1, "failures": {"count": 2, "by_label": {}}})
    assert bare.failures == {"unlabelled": 2}


def test_a_stage_where_nothing_succeeded_has_no_latencies() -> None:
    report = {"load_summary": {"count": 5, "requested_rate": 8.0},
              "successes": {"count": 0, "latency": {"time_to_first_token": None, "request_latency": None},
                            "throughput": {"output_tokens_per_sec": 0.0, "requests_per_sec": 0.0}},
              "failures": {"count": 5, "by_label": {"429 - Rate Limit": {"count": 5}}}}
    s = stage_from(3, report)
    assert (s.ttft_p50, s.ttft_p99, s.latency_p50, s.start) == (None, None, None, None)
    assert "n/a" in stage_table([Measured("kvgate-prefix", s)])[2]


def test_read_stages_pairs_each_report_with_its_window_in_stage_order(tmp_path: Path) -> None:
    for i in (10, 2):  # 10 sorts before 2 as text
        (tmp_path / f"stage_{i}_lifecycle_metrics.json").write_text(json.dumps(STAGE_1))
    (tmp_path / "inference-perf.partial.stage_2.yaml").write_text(PARTIAL_1)
    (tmp_path / "summary_lifecycle_metrics.json").write_text(json.dumps(STAGE_1))  # not a stage
    stages = read_stages(tmp_path)
    assert [s.index for s in stages] == [2, 10]
    assert stages[0].start == pytest.approx(START_1) and stages[1].start is None


def sample(at: float, preempt: tuple[float, ...], queries: tuple[float, ...], hits: tuple[float, ...],
           kv: tuple[float, ...], waiting: tuple[float, ...] = (0, 0, 0)) -> Sample:
    return Sample(at, tuple({PREEMPTIONS: p, PREFIX_QUERIES: q, PREFIX_HITS: h, KV_USAGE: k, WAITING: w}
                            for p, q, h, k, w in zip(preempt, queries, hits, kv, waiting, strict=True)))


SAMPLES = [
    sample(97.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), (0.0, 0.0, 0.0)),        # before: not this stage's
    sample(99.0, (1, 0, 0), (1000, 0, 0), (0, 0, 0), (0.1, 0.0, 0.0)),    # last at or before the start
    sample(100.5, (1, 0, 0), (2000, 0, 0), (500, 0, 0), (0.5, 0.2, 0.0), (4, 0, 0)),
    sample(105.0, (2, 1, 0), (5000, 3000, 0), (2500, 1500, 0), (0.3, 0.9, 0.1), (2, 2, 1)),
    sample(110.2, (4, 1, 0), (6000, 4000, 1000), (3000, 2000, 500), (0.2, 0.1, 0.0)),  # first at or after the end
    sample(120.0, (9, 9, 9), (9e6, 0, 0), (0, 0, 0), (1.0, 1.0, 1.0), (50, 0, 0)),  # after: not this stage's
]


def test_a_stage_gets_the_counters_between_its_bounding_samples_summed_over_nodes() -> None:
    n = node_figures(SAMPLES, 100.0, 110.0)
    assert n.preemptions == 5 - 1
    assert n.prefix_queries == 11000 - 1000 and n.prefix_hits == 5500 - 0
    assert n.hit_rate == pytest.approx(0.55)
    assert n.kv_peak == 0.9  # the highest of any node inside the window
    assert n.waiting_peak == 5  # the most waiting at once, all nodes together (not 4 + 2)


def test_samples_that_do_not_cover_a_stage_give_no_figures() -> None:
    assert node_figures(SAMPLES, 96.0, 110.0).preemptions is None   # nothing before the start
    assert node_figures(SAMPLES, 100.0, 121.0).preemptions is None  # nothing after the end
    assert node_figures(SAMPLES, None, None) == NodeFigures()
    assert NodeFigures(prefix_queries=0, prefix_hits=0).hit_rate is None


def test_each_stage_gets_its_table_with_setups_side_by_side_and_ratios_to_the_baseline() -> None:
    rr = stage_from(1, STAGE_1)
    kv = stage_from(1, {**refused(2), "successes": {**STAGE_1["successes"], "count": 18,  # type: ignore[dict-item]
                                                     "latency": {"time_to_first_token": {"median": 0.04, "p99": 0.11},
                                                                 "request_latency": {"median": 5.0}},
                                                     "throughput": {"output_tokens_per_sec": 170.5,
                                                                    "requests_per_sec": 1.0}}})
    other = stage_from(0, STAGE_1)
    text = "\n".join(tables([Measured("round-robin", rr, NodeFigures(3, 1000, 500, 0.97, 12)),
                             Measured("kvgate-prefix", kv, NodeFigures(0, 1000, 900, 0.71, 0)),
                             Measured("round-robin", other)], baseline="round-robin"))
    lines = text.splitlines()
    assert lines.index("### Stage 0: 2 requests/s offered, prompts of 3064 tokens on average (the nodes' count)") \
        < lines.index("### Stage 1: 2 requests/s offered, prompts of 3064 tokens on average (the nodes' count)")
    assert "| round-robin | 20 / 20 | 0 | 2.04 | 0.081 | 0.225 | 5.45 | 341 | 3 | 0.50 | 0.97 | 12 |" in lines
    assert "| kvgate-prefix | 18 / 20 | 2 (429 - Rate Limit: 2) | 2.04 | 0.040 | 0.110 | 5.00 | 170 | 0 | 0.90 | 0.71 " \
        "| 0 |" in lines
    assert "| kvgate-prefix ÷ round-robin | | | | 0.49x | 0.49x | 0.92x | 0.50x | | | | |" in lines
    assert sum(line.startswith("| kvgate-prefix ÷") for line in lines) == 1  # stage 0 has no kvgate row


def test_without_a_baseline_there_is_no_ratio_line() -> None:
    lines = stage_table([Measured("kvgate-prefix", stage_from(0, STAGE_1))])
    assert len(lines) == 3
