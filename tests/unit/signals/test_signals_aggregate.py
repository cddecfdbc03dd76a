"""Pool aggregation over fixed ages: fresh, pending and stale nodes; max and mean."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.config import SignalsConfig
from extproc.signals import NodeReading, NodeSample, aggregate

STALE_AFTER = 3.0
MAX = SignalsConfig(aggregate="max")
MEAN = SignalsConfig(aggregate="mean")


def node(usage: float | None, age: float, waiting: int | None = 0, capacity: int | None = None) -> NodeReading:
    sample = None if usage is None else NodeSample(kv_usage=usage, waiting=waiting, kv_capacity_tokens=capacity)
    return NodeReading(sample, age)


# (readings, config, kv_usage, waiting, stale, capacity)
TABLE = [
    # fresh nodes: max usage, summed queues and capacities
    ([node(0.5, 0.0, 2, 1000), node(0.7, 1.0, 3, 3000)], MAX, 0.7, 5, False, 4000),
    ([node(0.5, 0.0, 2, 1000), node(0.7, 1.0, 3, 3000)], MEAN, 0.6, 5, False, 4000),
    # a node whose last sample is 2.9 s old still counts with that sample
    ([node(0.5, 0.0), node(0.2, 2.9)], MAX, 0.5, 0, False, None),
    # a stale node counts as saturated, and its queue and capacity drop out
    ([node(0.5, 0.0, 2, 1000), node(0.2, 3.0, 9, 5000)], MAX, 1.0, 2, False, 1000),
    ([node(0.5, 0.0, 2, 1000), node(0.2, 3.0, 9, 5000)], MEAN, 0.75, 2, False, 1000),
    # a node never sampled: pending (not counted) until stale_after_s, then saturated
    ([node(0.5, 0.0), node(None, 2.0)], MAX, 0.5, 0, False, None),
    ([node(0.5, 0.0), node(None, 3.0)], MAX, 1.0, 0, False, None),
    # no fresh node: the pool is stale, with nothing that could be read as idle
    ([node(0.1, 3.0), node(None, 10.0)], MAX, None, None, True, None),
    ([node(None, 0.0)], MAX, None, None, True, None),
    ([], MAX, None, None, True, None),
    # nodes that report no queue (DCGM) do not make the queue zero
    ([node(0.9, 0.0, None)], MAX, 0.9, None, False, None),
    ([node(0.9, 0.0, None), node(0.3, 0.0, 4)], MAX, 0.9, 4, False, None),
]


@pytest.mark.parametrize("readings,cfg,usage,waiting,stale,capacity", TABLE)
def test_aggregate_table(readings, cfg, usage, waiting, stale, capacity):
    s = aggregate(readings, cfg, STALE_AFTER, at=42.0)
    assert s.at == 42.0
    assert s.stale is stale
    # the signal layer decides for how long the core may use them: stale_after_s from now,
    # never for stale ones
    assert s.trusted_until() == (-math.inf if stale else 42.0 + STALE_AFTER)
    assert (s.kv_usage is None) is (usage is None)
    if usage is not None:
        assert s.kv_usage == pytest.approx(usage)
    assert (s.waiting, s.kv_capacity_tokens) == (waiting, capacity)


readings_st = st.lists(
    st.builds(node, st.one_of(st.none(), st.floats(0.0, 1.0)), st.floats(0.0, 10.0),
              st.one_of(st.none(), st.integers(0, 1000))), max_size=8)


@given(readings_st, st.sampled_from([MAX, MEAN]))
def test_usage_stays_a_ratio_and_stale_means_no_usage(readings, cfg):
    s = aggregate(readings, cfg, STALE_AFTER, at=0.0)
    if s.stale:
        assert s.kv_usage is None and s.waiting is None
    else:
        assert 0.0 <= s.kv_usage <= 1.0


@given(readings_st, st.sampled_from([MAX, MEAN]), st.floats(0.0, 100.0))
def test_a_node_going_stale_never_lowers_the_usage(readings, cfg, extra_age):
    """Fail safe: losing a node's metrics can only make the pool look fuller."""
    fresh = [r for r in readings if r.fresh(STALE_AFTER)]
    if not fresh:
        return
    before = aggregate(readings, cfg, STALE_AFTER, at=0.0)
    victim = fresh[0]
    aged = [NodeReading(r.sample, STALE_AFTER + extra_age) if r is victim else r for r in readings]
    after = aggregate(aged, cfg, STALE_AFTER, at=0.0)
    assert after.stale or after.kv_usage >= before.kv_usage - 1e-12
