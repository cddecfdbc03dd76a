"""The retry hint's estimator (``retry``): residual holds given the age, the walks, the spread.

Times are seconds; nothing sleeps. The mixed case is issue 30's: after many short requests
the median hold is ~50 ms, and a request refused behind 2 s generations was told 50 ms.
"""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.admission.retry import (BAND_MIN, HOLD_SAMPLES, JITTER, MAX_WAIT_S, MIN_WAIT_S, TAIL_MIN,
                                     WALK_LIMIT, HoldTimes, band, expected_wait, first_end, spread)


def holds_of(*seconds: float) -> HoldTimes:
    h = HoldTimes()
    for s in seconds:
        h.add(s)
    return h


def brute_residual(samples: list[float], age: float) -> float:
    """brute_residual is E[T - age | T > age] over ``samples``, read off the definition (age
    itself when no sample is longer), and at least age x (TAIL_MIN - m) / TAIL_MIN where only
    m < TAIL_MIN samples are longer."""
    longer = [max(0.0, t) for t in samples if max(0.0, t) > age]
    if not longer:
        return max(0.0, age)
    tail = (TAIL_MIN - len(longer)) / TAIL_MIN if len(longer) < TAIL_MIN else 0.0
    return max(0.0, statistics.fmean(longer) - age, tail * age)


def bounded(t: float) -> float:
    return min(MAX_WAIT_S, max(MIN_WAIT_S, t))


NOW = 1_000.0


def instants(ages, reserved=None):
    """instants are (clock instant of admission, reservation) of requests of these ages, at NOW."""
    return ((NOW - a, reserved) for a in ages)


def slot(ages, h: HoldTimes) -> float | None:
    """slot is ``first_end`` at NOW for requests of these ages (oldest first)."""
    return first_end(NOW, instants(ages), h)


def kv(holders, short: float, h: HoldTimes) -> float | None:
    """kv is ``expected_wait`` at NOW for (age, tokens) holders (oldest first)."""
    return expected_wait(NOW, ((NOW - a, u, None) for a, u in holders), short, h)


# --- the residual hold given the age ----------------------------------------------------------

@pytest.mark.parametrize(("age", "residual"), [
    (0.0, 2.5),     # a fresh request: the mean hold
    (0.5, 2.0),     # past nothing yet: all four still speak for it
    (1.0, 2.0),     # past the 1 s hold: mean(2, 3, 4) - 1
    (1.5, 1.5),     # three longer holds: mean(2, 3, 4) - 1.5 = 1.5 > 1.5 x 1/4
    (2.5, 1.25),    # two longer: mean(3, 4) - 2.5 = 1 < 2.5 x 2/4
    (3.5, 2.625),   # only the 4 s hold is longer: 0.5 left by it, but 3.5 x 3/4 by the tail
    (4.0, 4.0),     # as old as the longest: as long again as its age
    (10.0, 10.0),   # older than every sample: as long again as its age
])
def test_the_residual_is_the_mean_of_the_longer_holds_less_the_age(age, residual):
    assert holds_of(3.0, 1.0, 4.0, 2.0).residual(age) == pytest.approx(residual)


def test_nothing_is_known_before_a_request_completed():
    h = HoldTimes()
    assert h.residual(1.0) is None and h.median() is None and len(h) == 0
    assert slot([1.0], h) is None and kv([(1.0, 10.0)], 5.0, h) is None


@given(holds=st.lists(st.floats(-1.0, 1e4, allow_nan=False), min_size=1, max_size=300),
       ages=st.lists(st.floats(0.0, 2e4, allow_nan=False), min_size=1, max_size=10))
@settings(max_examples=150, deadline=None)
def test_the_residual_is_that_of_the_latest_samples(holds, ages):
    """Property: over the latest HOLD_SAMPLES holds, the O(log n) residual (a bisection and
    prefix sums, rebuilt after each change) equals the definition's."""
    h = HoldTimes()
    for i, seconds in enumerate(holds):
        h.add(seconds)
        if i % 37 == 0 or i == len(holds) - 1:
            latest = [max(0.0, t) for t in holds[max(0, i + 1 - HOLD_SAMPLES):i + 1]]
            for age in ages:
                assert h.residual(age) == pytest.approx(brute_residual(latest, age), rel=1e-9, abs=1e-9)
    assert len(h) == min(len(holds), HOLD_SAMPLES)


@given(holds=st.lists(st.floats(-1.0, 1e6, allow_nan=False), max_size=700))
@settings(max_examples=100)
def test_the_hold_times_median_is_that_of_the_latest_samples(holds):
    times = HoldTimes()
    for i, seconds in enumerate(holds):
        times.add(seconds)
        latest = sorted(max(0.0, h) for h in holds[max(0, i + 1 - HOLD_SAMPLES):i + 1])
        assert times.median() == latest[len(latest) // 2]
    assert times.median() is None or holds


# --- a slot: the first holder expected to end --------------------------------------------------

MIXED = [0.05] * 180 + [2.0] * 20   # mostly 50 ms chats, one in ten a 2 s generation


def test_in_mixed_traffic_a_holder_past_the_short_holds_is_expected_to_run_as_the_long_ones():
    """Issue 30: the median is 50 ms, but two generations 0.3 s old are past every short
    hold: only the 2 s ones speak for them, so the slot is back in 1.7 s, not in 50 ms."""
    h = holds_of(*MIXED)
    assert h.median() == 0.05
    assert h.residual(0.3) == pytest.approx(1.7)
    assert slot([0.3, 0.25], h) == pytest.approx(1.7)   # the older of the two ends first
    # A holder 10 ms old is most likely a chat: its slot is expected back far sooner.
    fresh = statistics.fmean(MIXED) - 0.01
    assert slot([0.3, 0.01], h) == pytest.approx(fresh) and fresh < 0.3


def test_a_holder_older_than_every_sample_is_expected_to_live_as_long_again():
    h = holds_of(*([0.05] * 50))
    assert slot([3.0], h) == pytest.approx(3.0)
    assert slot([3.0, 2.0], h) == pytest.approx(2.0)    # the younger is expected to end first
    assert slot([100.0], h) == MAX_WAIT_S              # bounded by the ceiling
    assert slot([0.05], h) == pytest.approx(0.05)      # as old as the longest: as long again
    assert slot([0.049], h) == MIN_WAIT_S              # 1 ms left, and 50 longer holds: the floor


def test_a_holder_just_younger_than_the_longest_sample_is_not_told_it_ends_at_once():
    """Issue 30: a generation 1.99 s old among holds of at most 2 s was told ~50 ms."""
    h = holds_of(*([0.05] * 190 + [2.0]))
    assert slot([1.99], h) == pytest.approx(1.99 * (TAIL_MIN - 1) / TAIL_MIN)
    h = holds_of(*([0.05] * 190 + [2.0] * TAIL_MIN))  # enough longer holds: they speak alone
    assert slot([1.99], h) == MIN_WAIT_S


@given(holds=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=80),
       ages=st.lists(st.floats(0.0, 200.0), max_size=WALK_LIMIT))
@settings(max_examples=150, deadline=None)
def test_the_first_end_is_the_soonest_residual_of_all_holders(holds, ages):
    """Property: the walk (each segment of the window found once, oldest first) gives the
    soonest residual of all holders, as computing each one's would."""
    h = holds_of(*holds)
    admitted = sorted((NOW - a, None) for a in ages)     # oldest first
    want = min((brute_residual(holds, NOW - t) for t, _ in admitted), default=None)
    got = first_end(NOW, admitted, h)
    assert (got is None) == (want is None)
    if want is not None:
        assert got == pytest.approx(bounded(want), rel=1e-9, abs=1e-9)


def test_a_slot_walk_reads_at_most_its_limit_and_takes_the_rest_as_fresh():
    read = 0

    def admitted(n: int):
        nonlocal read
        for i in range(n):
            read += 1
            yield NOW - 50.0 + i / 1000, None   # oldest first, older than every sample
    h = holds_of(1.0, 3.0)
    assert first_end(NOW, admitted(10_000), h) == pytest.approx(2.0)   # the fresh ones: a mean hold
    assert read == WALK_LIMIT + 1                            # the limit, and one to see there are more
    read = 0
    assert first_end(NOW, admitted(WALK_LIMIT), h) == pytest.approx(50.0 - (WALK_LIMIT - 1) / 1000)
    assert read == WALK_LIMIT


# --- KV tokens: holders summed in order of expected end -------------------------------------

def test_kv_sums_the_holders_in_order_of_expected_end_until_the_missing_tokens_are_freed():
    h = holds_of(*([0.1] * 12 + [2.0] * 4))    # mean 0.575 s; four generations: no tail weight
    holders = [(1.5, 100.0),                   # a generation 1.5 s in: 0.5 s left
               (0.5, 50.0),                    # past the chats: 1.5 s left
               (0.05, 30.0)]                   # a chat, most likely: 0.525 s left
    assert kv(holders, 100, h) == pytest.approx(0.5)
    assert kv(holders, 120, h) == pytest.approx(0.525)   # the oldest and the chat
    assert kv(holders, 150, h) == pytest.approx(1.5)     # the young generation too
    assert kv(holders, 181, h) is None                   # never freed by these
    assert kv(holders, 0, h) == MIN_WAIT_S


@given(holds=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=80),
       holders=st.lists(st.tuples(st.floats(0.0, 200.0), st.integers(0, 5_000)), max_size=WALK_LIMIT),
       short=st.integers(1, 60_000))
@settings(max_examples=150, deadline=None)
def test_the_kv_walk_is_the_sorted_walk_of_every_residual(holds, holders, short):
    h = holds_of(*holds)
    admitted = sorted((NOW - a, u, None) for a, u in holders)  # oldest first
    ends = sorted((brute_residual(holds, NOW - t), u) for t, u, _ in admitted)
    want = None
    left = short
    for t, u in ends:
        left -= u
        if left <= 0:
            want = bounded(t)
            break
    got = expected_wait(NOW, admitted, short, h)
    assert (got is None) == (want is None)
    if want is not None:
        assert got == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_a_kv_walk_cut_at_its_limit_answers_no_sooner_than_a_fresh_request():
    h = holds_of(1.0, 3.0)                     # mean 2 s
    holders = [(0.5 - i / 10_000, 1.0) for i in range(10_000)]   # each 1.5 s left (tail: 0.25 s)
    assert kv(holders, WALK_LIMIT, h) == pytest.approx(1.5 + (WALK_LIMIT - 1) / 10_000)
    assert kv(holders, 5_000, h) == pytest.approx(2.0)   # the rest: as fresh ones
    assert kv(holders[:WALK_LIMIT], 5_000, h) is None   # no more than those: never enough


# --- the spread ------------------------------------------------------------------------------

def test_the_spread_only_lengthens_by_up_to_a_quarter_and_spreads_the_clients():
    rng = random.Random(30)
    hints = [spread(2.0, rng.random()) for _ in range(1_000)]
    assert all(2.0 <= x < 2.0 * (1 + JITTER) for x in hints)
    assert len(set(hints)) == len(hints)                       # no two clients come back together
    # Uniform over the quarter: each tenth of it holds about a tenth of the clients.
    tenths = [sum(1 for x in hints if 2.0 + k * 0.05 <= x < 2.0 + (k + 1) * 0.05) for k in range(10)]
    assert min(tenths) > 60 and max(tenths) < 140
    assert statistics.fmean(hints) == pytest.approx(2.0 * (1 + JITTER / 2), rel=0.02)


def test_the_spread_keeps_the_hint_within_its_floor_and_ceiling():
    assert spread(0.0, 0.0) == MIN_WAIT_S
    assert spread(0.001, 0.999) == pytest.approx(MIN_WAIT_S * (1 + JITTER * 0.999))
    assert spread(59.0, 0.999) == MAX_WAIT_S
    assert spread(1e9, 0.5) == MAX_WAIT_S
    assert spread(2.0, 0.0) == 2.0                            # a draw of 0: the estimate itself


# --- the reservation: a band of completed holds speaks for its holders -----------------------

def test_bands_grow_by_factors_of_four():
    assert [band(n) for n in (0, 1, 2, 7, 8, 31, 32, 2_047, 2_048)] == [0, 0, 1, 1, 2, 2, 3, 5, 6]
    assert band(-5) == 0


def test_a_fresh_long_generation_is_read_against_the_long_generations_not_the_chats():
    """Issue 30: by age alone a fresh request is a mean hold (mostly chats); its reservation
    of 2,000 tokens says it is a generation: its band's 2 s holds speak for it."""
    h = HoldTimes()
    for _ in range(180):
        h.add(0.05, 16)
    for _ in range(BAND_MIN):
        h.add(2.0, 2_000)
    assert h.residual(0.1) == pytest.approx(1.9)            # by age alone (>0.05): generations
    assert h.residual(0.01, 2_000) == pytest.approx(1.99)    # its band: a generation
    assert h.residual(0.01, 16) == pytest.approx(0.04)       # a chat's band: a chat
    assert h.residual(0.01) < 0.3                            # unknown: mostly chats
    assert first_end(NOW, [(NOW - 0.01, 2_000)], h) == pytest.approx(1.99)
    assert expected_wait(NOW, [(NOW - 0.01, 100.0, 2_000), (NOW - 0.01, 100.0, 16)], 150, h) \
        == pytest.approx(1.99)


def test_a_band_with_few_holds_is_read_against_every_band():
    h = HoldTimes()
    for _ in range(40):
        h.add(1.0, 16)
    for _ in range(BAND_MIN - 1):
        h.add(9.0, 2_000)
    assert h.residual(0.0, 2_000) == h.residual(0.0)         # too few: the window of all
    h.add(9.0, 2_000)
    assert h.residual(0.0, 2_000) == pytest.approx(9.0)


@given(holds=st.lists(st.tuples(st.floats(0.0, 50.0), st.sampled_from([4, 64, 1_024])),
                      min_size=1, max_size=120),
       ages=st.lists(st.tuples(st.floats(0.0, 100.0), st.sampled_from([4, 64, 1_024, None])),
                     max_size=WALK_LIMIT))
@settings(max_examples=150, deadline=None)
def test_the_walks_with_bands_are_each_holders_own_residual(holds, ages):
    """Property: with holders of several bands interleaved, the walks (one stretch cache per
    window) give what computing each holder's residual in its own window would."""
    h = HoldTimes()
    for seconds, reserved in holds:
        h.add(seconds, reserved)
    admitted = sorted(((NOW - a, r) for a, r in ages), key=lambda x: x[0])
    want = min((h.residual(NOW - t, r) for t, r in admitted), default=None)
    got = first_end(NOW, admitted, h)
    assert (got is None) == (want is None)
    if want is not None:
        assert got == pytest.approx(bounded(want), rel=1e-9, abs=1e-9)
