"""Adaptive scale: the pure target from signals, the recovery step, staleness, the tracker."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.admission.adaptive import (ScaleParams, ScaleTracker, in_alarm, next_scale,
                                        target_scale)
from extproc.admission.types import PoolSignals
from tests.unit.admission.helpers import STALE_AFTER_S

P = ScaleParams(enabled=True)  # high 0.85, low 0.70, min 0.6, +0.1/s, waiting 8
# Signals read at ``at`` may be used until at + 3 s (the signal layer's default).
T0 = 50.0


def sig(usage: float | None, waiting: int | None = 0, stale: bool = False, at: float = T0,
        capacity: int | None = None) -> PoolSignals:
    return PoolSignals(kv_usage=usage, waiting=waiting, stale=stale, kv_capacity_tokens=capacity, at=at,
                       fresh_until=at + STALE_AFTER_S)


@pytest.mark.parametrize("usage, scale", [
    (0.0, 1.0), (0.5, 1.0), (0.70, 1.0),          # at or below low: full
    (0.775, 0.8),                                  # halfway: halfway between 1 and 0.6
    (0.73, 1.0 - 0.2 * 0.4), (0.82, 1.0 - 0.8 * 0.4),
    (0.85, 0.6), (0.99, 0.6), (1.0, 0.6),          # at or above high: min
])
def test_target_is_linear_between_the_watermarks(usage, scale):
    assert target_scale(sig(usage), P, T0) == pytest.approx(scale)


@pytest.mark.parametrize("signals", [
    None,                                   # no signals yet
    sig(0.1, stale=True),                   # the scraper says stale
    sig(0.1, at=T0 - 3.5),                  # older than stale_after_s
    sig(None),                              # usage missing
    sig(float("nan")), sig(float("inf")),   # hostile numbers
    sig(1.7), sig(-0.5),                    # out of range
    sig(0.1, waiting=-1),                   # a negative queue is a broken exporter
])
def test_untrusted_signals_count_as_saturated(signals):
    assert target_scale(signals, P, T0) == P.min_scale
    assert in_alarm(signals, P, T0)


@pytest.mark.parametrize("fresh_until, trusted", [
    (T0 + 10.0, T0 + 10.0), (T0 + 0.5, T0 + 0.5),
    (float("nan"), -math.inf), (float("inf"), -math.inf), (True, -math.inf), ("soon", -math.inf),
])
def test_signals_are_trusted_until_the_instant_the_signal_layer_gave(fresh_until, trusted):
    s = PoolSignals(kv_usage=0.1, waiting=0, stale=False, kv_capacity_tokens=None, at=T0,
                    fresh_until=fresh_until)
    assert s.trusted_until() == trusted
    stale = PoolSignals(kv_usage=0.1, waiting=0, stale=True, kv_capacity_tokens=None, at=T0,
                        fresh_until=T0 + 10.0)
    assert stale.trusted_until() == -math.inf


def test_the_core_ages_signals_by_fresh_until_alone():
    # The core keeps no age limit of its own: signals the signal layer lets it use for 10 s
    # are fresh 5 s on, and those it lets it use for 1 s are stale 2 s on.
    long_lived = PoolSignals(0.1, 0, False, None, T0, T0 + 10.0)
    assert target_scale(long_lived, P, T0 + 5.0) == 1.0 and not in_alarm(long_lived, P, T0 + 5.0)
    short_lived = PoolSignals(0.1, 0, False, None, T0, T0 + 1.0)
    assert target_scale(short_lived, P, T0 + 2.0) == P.min_scale and in_alarm(short_lived, P, T0 + 2.0)
    t = ScaleTracker(P, T0)
    t.update(long_lived, T0)
    assert t.at(T0 + 5.0) == 1.0 and not t.alarm
    assert t.at(T0 + 10.01) == P.min_scale and t.alarm
    t.update(short_lived, T0 + 10.01)
    assert t.at(T0 + 10.01) == P.min_scale and t.alarm  # already past its fresh_until


def test_waiting_at_the_threshold_counts_as_high_usage():
    assert target_scale(sig(0.1, waiting=7), P, T0) == 1.0
    assert not in_alarm(sig(0.1, waiting=7), P, T0)
    assert target_scale(sig(0.1, waiting=8), P, T0) == 0.6
    assert in_alarm(sig(0.1, waiting=8), P, T0)
    assert target_scale(sig(0.1, waiting=None), P, T0) == 1.0  # usage alone decides


def test_alarm_is_at_or_above_the_high_watermark():
    assert not in_alarm(sig(0.849), P, T0)
    assert in_alarm(sig(0.85), P, T0)


def test_no_backends_means_scale_one_forever():
    off = ScaleParams(enabled=False)
    assert target_scale(None, off, T0) == 1.0
    assert target_scale(sig(1.0), off, T0) == 1.0
    assert not in_alarm(None, off, T0)
    t = ScaleTracker(off, T0)
    assert t.at(T0 + 1000) == 1.0 and not t.alarm


@pytest.mark.parametrize("prev, target, dt, expected", [
    (1.0, 0.6, 0.0, 0.6),     # a shrink applies at once
    (0.8, 0.6, 5.0, 0.6),
    (0.6, 1.0, 1.0, 0.7),     # recovery at most 0.1/s
    (0.6, 1.0, 2.5, 0.85),
    (0.6, 1.0, 10.0, 1.0),    # and never past the target
    (0.6, 0.65, 1.0, 0.65),
    (0.6, 1.0, 0.0, 0.6),
    (0.6, 1.0, -1.0, 0.6),    # a clock that went back does not move it
])
def test_next_scale(prev, target, dt, expected):
    assert next_scale(prev, target, dt, 0.1) == pytest.approx(expected)


def test_tracker_starts_saturated_then_recovers_smoothly():
    t = ScaleTracker(P, T0)
    assert t.at(T0) == 0.6 and t.alarm              # no signals yet: fail safe
    t.update(sig(0.2, at=T0 + 1), T0 + 1)
    assert t.scale == pytest.approx(0.6) and not t.alarm  # recovery starts now, not at T0
    assert t.at(T0 + 2) == pytest.approx(0.7)
    assert t.at(T0 + 3) == pytest.approx(0.8)
    t.update(sig(0.85, at=T0 + 3), T0 + 3)
    assert t.scale == 0.6 and t.alarm               # shrink at once
    t.update(sig(0.2, at=T0 + 3.5), T0 + 3.5)
    assert t.at(T0 + 4) == pytest.approx(0.65)


def test_tracker_goes_stale_when_signals_stop():
    t = ScaleTracker(P, T0)
    t.update(sig(0.1, at=T0), T0)
    assert t.at(T0 + 2) == pytest.approx(0.8)
    assert t.at(T0 + 3) == pytest.approx(0.9) and not t.alarm   # 3 s old: still fresh
    assert t.at(T0 + 3.01) == 0.6 and t.alarm                   # older: saturated at once


steps = st.lists(st.one_of(
    st.tuples(st.just("advance"), st.floats(0.0, 5.0)),
    st.tuples(st.just("update"), st.one_of(st.none(), st.floats(0.0, 1.0)), st.integers(0, 12),
              st.booleans(), st.floats(-5.0, 1.0))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(script=steps)
def test_the_tracker_is_the_pure_functions_evaluated_lazily(script):
    t = ScaleTracker(P, T0)
    now, prev, prev_t, current = T0, P.min_scale, T0, None
    for step in script:
        if step[0] == "advance":
            now += step[1]
        else:
            prev = next_scale(prev, target_scale(current, P, now), now - prev_t, P.recovery_per_s)
            prev_t = now
            current = sig(step[1], waiting=step[2], stale=step[3], at=now + step[4])
            t.update(current, now)
        expected = next_scale(prev, target_scale(current, P, now), now - prev_t, P.recovery_per_s)
        assert t.at(now) == pytest.approx(expected)
        assert t.alarm == in_alarm(current, P, now)
        prev, prev_t = expected, now
