"""retry: when capacity is expected back, from how long requests hold it.

A refused request's ``retry-after`` should be long enough that a client honouring it
usually gets in, and no longer. For budgets freed by releases (slots, in-flight KV, a
node's room), ``HoldTimes`` learns how long completed requests held their lease, and
``expected_wait`` walks the requests in flight in the order they are expected to end:
each is expected to end at the median hold time (one already older than that: soon, a
tenth of it), and the wait is the instant at which enough has been freed. Pure, times in
seconds.

The requests in flight are kept oldest first (a pool's leases, a node's charges), so the
walk needs no sort and stops at the first request that frees enough; it reads at most
``WALK_LIMIT`` of them. A refusal comes when the budget is full, under overload for nearly
every new request: sorting every lease in flight for each one cost ~0.3 us per request in
flight (1.6 ms a 429 with 5,000 in flight, ``make bench-pick``'s refusal rows).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

HOLD_SAMPLES = 200
# The retry hint stays within these bounds (seconds): never 0, never longer than a client
# would wait (openai-python ignores a retry-after above 60 s).
MIN_WAIT_S = 0.05
MAX_WAIT_S = 60.0
# A walk reads at most this many requests, oldest first. Those after them are younger, so
# each is expected to end within ``typical``: a walk cut there answers ``typical``, never
# sooner than the whole walk would have where it finds an answer at all.
WALK_LIMIT = 128


class HoldTimes:
    """HoldTimes keeps the hold times (seconds) of the latest completed requests of one pool,
    in the order they came and sorted: each completion changes the median, which the next
    pick reads (sorting the samples then cost ~20 us a request)."""

    __slots__ = ("_samples", "_sorted")

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=HOLD_SAMPLES)
        self._sorted: list[float] = []

    def add(self, seconds: float) -> None:
        """add remembers one completed request's hold time, forgetting the oldest beyond
        HOLD_SAMPLES."""
        seconds = max(0.0, seconds)
        if len(self._samples) == HOLD_SAMPLES:
            del self._sorted[bisect.bisect_left(self._sorted, self._samples[0])]
        self._samples.append(seconds)
        bisect.insort(self._sorted, seconds)

    def median(self) -> float | None:
        """median is the typical hold time (None before any request completed)."""
        held = self._sorted
        return held[len(held) // 2] if held else None


def expected_wait(holders: Iterable[tuple[float, float]], short: float, typical: float) -> float | None:
    """expected_wait is the seconds until ``short`` units are expected to be freed (None: never).

    ``holders`` are (age in seconds, units it holds) of the requests in flight;
    ``typical`` the median hold time. ``short`` <= 0 needs no wait.
    """
    if short <= 0:
        return MIN_WAIT_S
    return _freed_by(sorted((max(typical * 0.1, typical - age), units) for age, units in holders), short)


def expected_wait_oldest_first(holders: Iterable[tuple[float, float]], short: float,
                               typical: float) -> float | None:
    """expected_wait_oldest_first is ``expected_wait`` for ``holders`` that come oldest first
    (ages not increasing): they then end in that order, so the walk needs no sort and stops
    at the first request that frees enough. It reads at most ``WALK_LIMIT`` holders: when
    they do not free enough, the wait is ``typical`` (whether or not the rest would)."""
    if short <= 0:
        return MIN_WAIT_S
    return _freed_by(((max(typical * 0.1, typical - age), units) for age, units in holders), short,
                     limit=WALK_LIMIT, beyond=typical)


def _freed_by(ends: Iterable[tuple[float, float]], short: float, limit: int | None = None,
              beyond: float = 0.0) -> float | None:
    """_freed_by walks (end in seconds, units) in order of end: the end at which ``short``
    units are freed, within the hint's bounds (None: never). With ``limit``, after that
    many the answer is ``beyond`` (within the same bounds)."""
    for i, (t, units) in enumerate(ends, 1):
        short -= units
        if short <= 0:
            return min(MAX_WAIT_S, max(MIN_WAIT_S, t))
        if i == limit:
            return min(MAX_WAIT_S, max(MIN_WAIT_S, beyond))
    return None
