"""retry: when capacity is expected back, from how long requests hold it.

A refused request's ``retry-after`` should be long enough that a client honouring it
usually gets in, and no longer. For budgets freed by releases (slots, in-flight KV, a
node's room), ``HoldTimes`` learns how long completed requests held their lease, and
``first_end`` (a slot) and ``expected_wait`` (tokens) estimate, for each request in flight,
when it is expected to end, and answer the instant at which enough is expected to be
freed. Pure, times in seconds.

A holder of age ``a`` is expected to hold on for its *residual life* over the completed
holds T: ``E[T - a | T > a]``, the mean of the holds longer than ``a``, less ``a``. In
mixed traffic this tells a 2 s generation from a 50 ms chat: a holder 0.3 s old is past
every short hold, so only the long ones speak for it (a median would say it ends at
once). A holder older than every completed hold has nothing to go by; it is expected to
live about as long again as its age (the rule of a heavy tail: what has lasted long is
likely to last long), so a client refused behind a record-long request is not told to
come back at once, and is told a longer wait each time it is refused again.

| holders' budget | hint                                                           |
|-----------------|----------------------------------------------------------------|
| slots           | the earliest expected end among the holders                    |
| KV tokens       | the holders in order of expected end, summed until the missing |
|                 | tokens are freed: the end of the last one needed                |
| token buckets   | the bucket's own refill time (``rules``, exact): not here      |

Every hint is bounded by ``MIN_WAIT_S`` and ``MAX_WAIT_S`` and then spread by
``spread``: clients refused together do not return together.

Cost. A refusal comes when the budget is full, under overload for nearly every new
request. ``HoldTimes`` keeps a bounded window (``HOLD_SAMPLES``) sorted, with its prefix
sums built at the first question after a change, so a residual is one bisection: O(log n).
The requests in flight come oldest first (a pool's leases, a node's charges), so a walk
meets each stretch of ages between two completed holds once: one bisection there, a
comparison for each request after it. It reads at most ``WALK_LIMIT`` of them: reading
every request in flight for each refusal would cost in proportion to them, milliseconds a
429 under overload (bench/results/pick-refusals.md). The younger requests it
does not read are taken as fresh ones: each is expected to hold about a mean hold (the
residual at age 0).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from itertools import accumulate, islice

HOLD_SAMPLES = 200
# The retry hint stays within these bounds (seconds): never 0, and not past what clients
# honour (openai-python 3.63 follows a retry-after of up to 120 s, older releases 60 s).
MIN_WAIT_S = 0.05
MAX_WAIT_S = 60.0
# A walk reads at most this many requests, oldest first (see the module doc).
WALK_LIMIT = 128
# A hint is lengthened by a uniform share of itself in [0, JITTER) (see ``spread``).
JITTER = 0.25


class HoldTimes:
    """HoldTimes keeps the hold times (seconds) of the latest completed requests of one pool,
    in the order they came and sorted, and answers the residual life of a request of a
    given age over them.

    Each completion changes the window, which the next refusal reads: the sorted list is
    kept by insertion (sorting the samples for each pick cost every refusal a sort), its prefix
    sums are rebuilt at the first question after a change (one C-level pass of
    ``HOLD_SAMPLES`` additions), not at every completion.
    """

    __slots__ = ("_samples", "_sorted", "_sums")

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=HOLD_SAMPLES)
        self._sorted: list[float] = []
        # _sums[i] = sum(_sorted[:i]); None: to rebuild (the window changed since).
        self._sums: list[float] | None = None

    def __len__(self) -> int:
        return len(self._sorted)

    def add(self, seconds: float) -> None:
        """add remembers one completed request's hold time, forgetting the oldest beyond
        HOLD_SAMPLES."""
        seconds = max(0.0, seconds)
        if len(self._samples) == HOLD_SAMPLES:
            del self._sorted[bisect.bisect_left(self._sorted, self._samples[0])]
        self._samples.append(seconds)
        bisect.insort(self._sorted, seconds)
        self._sums = None

    def median(self) -> float | None:
        """median is the typical hold time (None before any request completed)."""
        held = self._sorted
        return held[len(held) // 2] if held else None

    def window(self) -> tuple[list[float], list[float]]:
        """window is the sorted hold times (seconds) and their prefix sums (``sums[i]`` is the
        sum of the ``i`` shortest): read them, never change them."""
        sums = self._sums
        if sums is None:
            sums = self._sums = list(accumulate(self._sorted, initial=0.0))
        return self._sorted, sums

    def residual(self, age: float) -> float | None:
        """residual is how much longer a request held for ``age`` seconds is expected to hold
        (seconds): E[T - age | T > age] over the completed holds T; ``age`` itself when no
        completed hold was longer; None before any request completed. O(log n)."""
        held = self._sorted
        n = len(held)
        if not n:
            return None
        i = bisect.bisect_right(held, age)
        if i == n:
            return max(0.0, age)
        sums = self.window()[1]
        return max(0.0, (sums[n] - sums[i]) / (n - i) - age)


def first_end(now: float, admitted: Iterable[float], holds: HoldTimes) -> float | None:
    """first_end is the seconds from ``now`` until the first of the requests in flight is
    expected to end (a slot back), within the hint's bounds (None: none in flight, or
    nothing known yet).

    ``admitted`` are the clock instants (seconds) at which the requests were admitted,
    oldest first; each is expected to end after ``holds.residual(now - instant)``. At most
    ``WALK_LIMIT`` are read; past them, the younger ones are taken as fresh requests (a
    mean hold), and the answer is the sooner of the two.
    """
    held, sums = holds.window()
    n = len(held)
    if not n:
        return None
    best = math.inf
    lo, hi, mean = math.inf, -math.inf, 0.0  # no stretch yet: the first age finds one
    them = iter(admitted)
    for t0 in islice(them, WALK_LIMIT):
        age = now - t0
        if lo <= age < hi:
            if mean >= 0.0:
                continue  # in one stretch of ages the oldest, met first, ends first
            end = age     # past every hold (as long again as its age): the youngest does
        else:
            lo, hi, mean = _segment(held, sums, age)
            end = mean - age if mean >= 0.0 else age
        if end < best:
            best = end
    if best == math.inf:
        return None
    if next(them, None) is not None:
        best = min(best, holds.residual(0.0) or 0.0)
    return _bounded(best)


def expected_wait(now: float, holders: Iterable[tuple[float, float]], short: float,
                  holds: HoldTimes) -> float | None:
    """expected_wait is the seconds from ``now`` until ``short`` units are expected to be
    freed, within the hint's bounds (None: the holders never free that much, or nothing is
    known yet).

    ``holders`` are (clock instant of admission in seconds, units it holds) of the requests
    in flight, oldest first; each is expected to end after ``holds.residual(now - instant)``,
    and the wait is the end of the last one needed, taken in order of expected end.
    ``short`` <= 0 needs no wait. At most ``WALK_LIMIT`` holders are read: when they do not
    free enough and there are more, the younger ones are taken as fresh requests (expected
    to end after a mean hold), so the wait is the later of the last end read and that.
    """
    if short <= 0:
        return MIN_WAIT_S
    held, sums = holds.window()
    n = len(held)
    if not n:
        return None
    ends: list[tuple[float, float]] = []
    lo, hi, mean = math.inf, -math.inf, 0.0  # no stretch yet: the first age finds one
    them = iter(holders)
    for t0, units in islice(them, WALK_LIMIT):
        age = now - t0
        if not lo <= age < hi:
            lo, hi, mean = _segment(held, sums, age)
        ends.append((mean - age if mean >= 0.0 else age, units))
    ends.sort()
    for t, units in ends:
        short -= units
        if short <= 0:
            return _bounded(t)
    if not ends or next(them, None) is None:
        return None
    return _bounded(max(ends[-1][0], holds.residual(0.0) or 0.0))


def _segment(held: list[float], sums: list[float], age: float) -> tuple[float, float, float]:
    """_segment is the stretch of ages [lo, hi) between the two neighbouring completed holds
    around ``age``, and the mean of the holds longer than those ages (-1.0 past every hold:
    the residual is then the age itself), as (lo, hi, mean). Ages come oldest first, so a
    walk finds each stretch once; the holders after the first one in it cost a comparison,
    not a bisection."""
    n = len(held)
    i = bisect.bisect_right(held, age)
    return (held[i - 1] if i else -math.inf, held[i] if i < n else math.inf,
            (sums[n] - sums[i]) / (n - i) if i < n else -1.0)


def _bounded(seconds: float) -> float:
    return min(MAX_WAIT_S, max(MIN_WAIT_S, seconds))


def spread(wait: float, draw: float) -> float:
    """spread is the retry hint (seconds) given for an expected ``wait`` (seconds): the wait
    within [MIN_WAIT_S, MAX_WAIT_S], lengthened by ``draw`` x JITTER of itself, and at most
    MAX_WAIT_S. ``draw`` is a uniform draw in [0, 1) (the caller's random source).

    The jitter only lengthens: a hint shorter than the expected wait would send a client
    back before capacity is expected, costing it one of its few retries (openai-python
    makes 2) and the gateway one more refusal; a quarter longer costs it at most a quarter
    of the wait. Clients refused together come back spread over a quarter of the wait (at
    least 12.5 ms at the floor) instead of all at once, when only some of them fit. Full
    jitter (uniform in [0, wait]) would send half of them back before half the wait.
    """
    return min(MAX_WAIT_S, _bounded(wait) * (1.0 + JITTER * draw))
