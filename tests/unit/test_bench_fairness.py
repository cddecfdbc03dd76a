"""bench/bench_fairness.py's harness: the quantile, and a short run of the admission core in
which the quiet tenant waits far less with tenants in turn than in arrival order."""

from __future__ import annotations

import asyncio

import pytest

from bench.bench_fairness import LOUD_FACTOR, arrivals, percentile, run

pytestmark = pytest.mark.bench


def test_percentile_is_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.99) == 99.0
    assert percentile([], 0.99) == 0.0 and percentile([3.0], 0.99) == 3.0


def test_a_short_run_serves_the_quiet_tenant_in_turn() -> None:
    quiet = arrivals(0.4, 300.0, 1.0, 1)
    loud = arrivals(0.4 * LOUD_FACTOR, 300.0, 1.0, 2)
    loop = asyncio.new_event_loop()
    try:
        fifo = loop.run_until_complete(run(4, "fifo", 30.0, {"quiet": quiet, "loud": loud}))
        fair = loop.run_until_complete(run(4, "tenant", 30.0, {"quiet": quiet, "loud": loud}))
    finally:
        loop.close()
    for tallies in (fifo, fair):  # every request ends admitted or refused, once
        assert len(tallies["quiet"].all_waits()) == len(quiet)
        assert len(tallies["loud"].all_waits()) == len(loud)
    assert fair["quiet"].refused == 0
    assert percentile(fair["quiet"].all_waits(), 0.99) < 5.0 < percentile(fifo["quiet"].all_waits(), 0.99)
