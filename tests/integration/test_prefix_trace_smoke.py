"""Smoke run of ``make bench-prefix``'s trace mode: the oracle's row over three real simulated
nodes behind the real Envoy, on a few requests of the committed Mooncake slice."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.prefix_trace import Window, build_replay, figures, main_rows, read_mooncake, run_row

pytestmark = pytest.mark.bench

SLICE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "mooncake-conversation-slice.jsonl"


def test_the_oracle_row_places_every_request_through_envoy_by_the_nodes_caches(tmp_path: Path) -> None:
    w = Window(300.0, 30.0, 6, 10.0, drain_s=30.0)
    replay = build_replay(read_mooncake(SLICE, w.start_s, w.window_s), w)
    assert len(replay.reqs) >= 6
    oracle = next(r for r in main_rows(1.0, 8192) if r.oracle)
    r = run_row(oracle, replay, w, 196_608, 10.0, tmp_path, "smoke")
    assert r.error is None, r.error
    f = figures(r)
    assert (f.completed, f.preemptions) == (len(replay.reqs), 0)
    assert len(r.oracle_lookup_s) == len(replay.reqs)       # every request asked the three nodes' caches
    assert f.hit_rate is not None and f.hit_rate > 0        # block 0 is every prompt's, cached after the first
    assert f.ttft_p50 is not None and f.ttft_p50 > 0
