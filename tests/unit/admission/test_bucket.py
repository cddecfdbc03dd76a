"""TokenBucket at fixed instants: refill, debt, refunds clamped at capacity, exact waits."""

from __future__ import annotations

import math

import pytest

from extproc.admission.bucket import TokenBucket, tpm_rate, wait_for

T0 = 100.0


def bucket(capacity: float = 600.0) -> TokenBucket:
    return TokenBucket(capacity, tpm_rate(capacity), T0)  # 600 TPM = 10 tokens/s


def take(b: TokenBucket, n: float, now: float) -> None:
    """take removes ``n`` tokens at ``now``, as a store charging a request does."""
    b.refill(now)
    b.tokens -= n


def delay(b: TokenBucket, n: float, now: float) -> float:
    """delay is the rules' wait (s) until ``n`` tokens fit in ``b`` at ``now``."""
    return wait_for(n, b.refill(now), b.capacity, b.rate)


def fits(b: TokenBucket, n: float, now: float) -> bool:
    return delay(b, n, now) == 0.0


def test_starts_full_and_refills_at_capacity_per_minute():
    b = bucket()
    assert b.tokens == 600
    take(b, 600, T0)
    assert b.refill(T0) == 0
    assert b.refill(T0 + 1) == pytest.approx(10)
    assert b.refill(T0 + 30) == pytest.approx(300)
    assert b.refill(T0 + 3600) == 600  # never above capacity


@pytest.mark.parametrize("taken, n, at, expected", [
    (0, 600, 0.0, 0.0),          # fits now
    (600, 10, 0.0, 1.0),         # empty: 10 tokens at 10/s
    (600, 600, 0.0, 60.0),       # a full bucket's worth: one minute
    (550, 100, 2.0, 3.0),        # 50 left, +20 after 2 s: 30 missing at 10/s
    (600, 601, 0.0, math.inf),   # above capacity: never
])
def test_delay_is_exact(taken, n, at, expected):
    b = bucket()
    take(b, taken, T0)
    assert delay(b, n, T0 + at) == pytest.approx(expected)
    if 0 < expected < math.inf:
        # One millisecond early it does not fit; exactly on time it does.
        assert not fits(bucket_at(taken), n, T0 + at + expected - 0.001)
        assert fits(bucket_at(taken), n, T0 + at + expected)


def bucket_at(taken: float) -> TokenBucket:
    b = bucket()
    take(b, taken, T0)
    return b


def test_debt_is_repaid_by_refill_before_anything_fits():
    b = bucket()
    take(b, 600, T0)
    b.give(-100, T0)  # the request used 100 more than it reserved
    assert b.tokens == -100
    assert delay(b, 50, T0) == pytest.approx(15.0)
    assert not fits(b, 1, T0 + 10)       # 10 s repay the debt only
    assert fits(b, 50, T0 + 15)


def test_refund_never_above_capacity():
    b = bucket()
    take(b, 100, T0)
    b.refill(T0 + 60)
    assert b.give(100, T0 + 60) == 600


def test_shrink_takes_tokens_away_and_rise_adds_none():
    b = bucket()
    b.set_limits(360, 6, T0)
    assert b.tokens == 360 and b.capacity == 360
    take(b, 100, T0)
    b.set_limits(600, 10, T0 + 1)
    assert b.tokens == pytest.approx(266)  # refilled 1 s at the old rate, nothing added
    assert b.refill(T0 + 2) == pytest.approx(276)


def test_a_rise_after_idle_time_credits_the_idle_time_past_the_old_capacity():
    b = bucket()
    b.set_limits(360, 6, T0)          # a pressure period: the bucket shrinks
    take(b, 360, T0)
    # Idle for 100 s; the limits rise back, and reach the bucket with the next request.
    b.set_limits(600, 10, T0 + 100)
    assert b.tokens == 600            # 100 s at the old 6 tokens/s: full, not held at 360


def test_earlier_instant_refills_nothing():
    b = bucket()
    take(b, 600, T0)
    b.refill(T0 + 5)
    assert b.refill(T0 + 1) == pytest.approx(50)


def test_wait_for_table():
    assert wait_for(10, 10, 100, 1) == 0.0
    assert wait_for(10, -5, 100, 1) == 15.0
    assert wait_for(101, 100, 100, 1) == math.inf


@pytest.mark.parametrize("capacity, rate", [(0, 1), (10, 0), (-1, 1), (math.inf, 1)])
def test_bad_limits_are_refused(capacity, rate):
    with pytest.raises(ValueError):
        TokenBucket(capacity, rate, T0)
