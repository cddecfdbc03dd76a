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
once). Its reservation tells them apart sooner: completed holds are also kept by band of
reserved completion tokens (factors of 4), and a band with enough of them speaks for its
holders, so a fresh 2,000-token generation is read against generations, not chats. A
holder older than every completed hold has nothing to go by; it is expected to live about
as long again as its age (the rule of a heavy tail: what has lasted long is likely to last
long), so a client refused behind a record-long request is not told to come back at once,
and is told a longer wait each time it is refused again. The rule fades in over the last
few longer holds (``TAIL_MIN``), so that a holder just younger than the longest sample is
not told it ends at once either.

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
# A band of reservations speaks for its holders once it holds this many completed holds;
# before that, the window of every band does.
BAND_MIN = 16
# With fewer than TAIL_MIN completed holds longer than a holder's age, the heavy-tail rule
# (as long again as its age) weighs in: a holder just younger than the longest sample is not
# expected to end at once (see ``Window.residual``).
TAIL_MIN = 4


_UNSET = object()


def band(reserved: int) -> int:
    """band is the reservation band of a request that reserved ``reserved`` completion tokens:
    bands grow by factors of 4 (0: none or 1, 1: 2-7, 2: 8-31, ... 5: 512-2,047)."""
    # A conditional expression, not max(): a builtin's call costs several times as much.
    return (reserved if reserved > 0 else 0).bit_length() >> 1


class Window:
    """Window keeps the latest HOLD_SAMPLES hold times (seconds), in the order they came and
    sorted, and answers the residual life of a request of a given age over them.

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
        seconds = seconds if seconds > 0.0 else 0.0  # not max(): a builtin's call costs more
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
        (seconds); None before any request completed. O(log n).

        E[T - age | T > age] over the completed holds T, and at least ``age`` x (TAIL_MIN - m)
        / TAIL_MIN where only m < TAIL_MIN holds are longer: with no longer hold, ``age``
        itself (as long again), and with one or two, mostly that still, so that a holder just
        younger than the longest sample is not expected to end at once.
        """
        if not self._sorted:
            return None
        return _end(_segment(*self.window(), age), age)


class HoldTimes:
    """HoldTimes keeps the hold times (seconds) of the latest completed requests of one pool,
    in one window of all of them and one per reservation band (``band``), and answers the
    residual life of a request of a given age and reservation over them.

    A request's reservation tells a 16-token chat from a 2,000-token generation before its
    age can: a band with BAND_MIN completed holds speaks for its holders, a band with fewer
    (and a holder of unknown reservation) is read against every band's window.
    """

    __slots__ = ("all", "_bands")

    def __init__(self) -> None:
        self.all = Window()
        self._bands: dict[int, Window] = {}

    def __len__(self) -> int:
        return len(self.all)

    def add(self, seconds: float, reserved: int | None = None) -> None:
        """add remembers one completed request's hold time (seconds), under the band of its
        ``reserved`` completion tokens when known."""
        self.all.add(seconds)
        if reserved is not None:
            b = band(reserved)
            w = self._bands.get(b)
            if w is None:
                w = self._bands[b] = Window()
            w.add(seconds)

    def median(self) -> float | None:
        """median is the typical hold time of every band (None before any request completed)."""
        return self.all.median()

    def of(self, reserved: int | None) -> Window:
        """of is the window that speaks for a holder that reserved ``reserved`` tokens."""
        if reserved is None:
            return self.all
        w = self._bands.get(band(reserved))
        return w if w is not None and len(w) >= BAND_MIN else self.all

    def residual(self, age: float, reserved: int | None = None) -> float | None:
        """residual is how much longer a request held for ``age`` seconds, that reserved
        ``reserved`` completion tokens, is expected to hold (seconds; ``Window.residual``)."""
        return self.of(reserved).residual(age)


_Stretch = tuple[float, float, float, float]
# No stretch yet: the first age finds one.
_NOWHERE: _Stretch = (math.inf, -math.inf, 0.0, 0.0)


def _switch(holds: HoldTimes, reserved: int | None, win: Window, st: _Stretch,
            at: dict[Window, _Stretch]) -> tuple[Window, _Stretch]:
    """_switch moves a walk to the window that speaks for ``reserved``, at the stretch where
    the walk left that window (``at`` keeps it), leaving ``st`` in ``at`` for ``win``."""
    new = holds.of(reserved)
    if new is win:
        return new, st
    at[win] = st
    return new, at.get(new, _NOWHERE)


def first_end(now: float, admitted: Iterable[tuple[float, int | None]],
              holds: HoldTimes) -> float | None:
    """first_end is the seconds from ``now`` until the first of the requests in flight is
    expected to end (a slot back), within the hint's bounds (None: none in flight, or
    nothing known yet).

    ``admitted`` are (clock instant of admission in seconds, reserved completion tokens or
    None) of the requests in flight, oldest first; each is expected to end after
    ``holds.residual(now - instant, reserved)``. At most ``WALK_LIMIT`` are read; past
    them, the younger ones are taken as fresh requests (a mean hold), and the answer is the
    sooner of the two.
    """
    if not len(holds):
        return None
    best = math.inf
    # Where the walk stands: the window of the current reservation and its stretch of ages
    # (``_segment``), in locals: holders of one reservation mostly follow each other, so a
    # holder costs comparisons, not a bisection nor a lookup.
    current: object = _UNSET
    win = holds.all
    st = _NOWHERE
    at: dict[Window, _Stretch] = {}
    them = iter(admitted)
    for t0, reserved in islice(them, WALK_LIMIT):
        age = now - t0
        if reserved != current:
            current = reserved
            win, st = _switch(holds, reserved, win, st, at)
        if not st[0] <= age < st[1]:
            st = _segment(*win.window(), age)
        elif st[3] == 0.0 and st[2] >= 0.0:
            continue  # in one stretch of one window the oldest, met first, ends first
        mean = st[2]
        end = age if mean < 0.0 else max(mean - age, st[3] * age)
        if end < best:
            best = end
    if best == math.inf:
        return None
    if next(them, None) is not None:
        best = min(best, holds.residual(0.0) or 0.0)
    return _bounded(best)


def own_share(short: int, own: int, every: int) -> int:
    """own_share is what this replica's requests must free of ``short`` missing tokens when
    they hold ``own`` of the ``every`` in use, the other replicas' requests being like them:
    its share, rounded up; all of it when it holds nothing there (its requests cannot tell)
    or everything (it is alone)."""
    if short <= 0 or own <= 0 or every <= own:
        return short
    return math.ceil(short * own / every)


def expected_wait(now: float, holders: Iterable[tuple[float, float, int | None]], short: float,
                  holds: HoldTimes) -> float | None:
    """expected_wait is the seconds from ``now`` until ``short`` units are expected to be
    freed, within the hint's bounds (None: the holders never free that much, or nothing is
    known yet).

    ``holders`` are (clock instant of admission in seconds, units it holds, reserved
    completion tokens or None) of the requests in flight, oldest first; each is expected to
    end after ``holds.residual(now - instant, reserved)``, and the wait is the end of the
    last one needed, taken in order of expected end. ``short`` <= 0 needs no wait. At most
    ``WALK_LIMIT`` holders are read: when they do not free enough and there are more, the
    younger ones are taken as fresh requests (expected to end after a mean hold), so the
    wait is the later of the last end read and that.
    """
    if short <= 0:
        return MIN_WAIT_S
    if not len(holds):
        return None
    ends: list[tuple[float, float]] = []
    current: object = _UNSET   # where the walk stands, as in ``first_end``
    win = holds.all
    st = _NOWHERE
    at: dict[Window, _Stretch] = {}
    them = iter(holders)
    for t0, units, reserved in islice(them, WALK_LIMIT):
        age = now - t0
        if reserved != current:
            current = reserved
            win, st = _switch(holds, reserved, win, st, at)
        if not st[0] <= age < st[1]:
            st = _segment(*win.window(), age)
        mean = st[2]
        ends.append((age if mean < 0.0 else max(mean - age, st[3] * age), units))
    ends.sort()
    for t, units in ends:
        short -= units
        if short <= 0:
            return _bounded(t)
    if not ends or next(them, None) is None:
        return None
    return _bounded(max(ends[-1][0], holds.residual(0.0) or 0.0))


def _segment(held: list[float], sums: list[float], age: float) -> _Stretch:
    """_segment is the stretch of ages [lo, hi) between the two neighbouring completed holds
    around ``age``, the mean of the holds longer than those ages (-1.0 past every hold: the
    residual is then the age itself), and the tail weight (TAIL_MIN - m) / TAIL_MIN where
    only m < TAIL_MIN holds are longer (0.0 otherwise). Ages come oldest first, so a walk
    finds each stretch once; the holders after the first one in it cost a comparison, not
    a bisection."""
    n = len(held)
    i = bisect.bisect_right(held, age)
    m = n - i
    return (held[i - 1] if i else -math.inf, held[i] if i < n else math.inf,
            (sums[n] - sums[i]) / m if m else -1.0,
            (TAIL_MIN - m) / TAIL_MIN if m < TAIL_MIN else 0.0)


def _end(st: _Stretch, age: float) -> float:
    """_end is how much longer a holder of ``age`` in stretch ``st`` is expected to hold (s)."""
    _lo, _hi, mean, tail = st
    if mean < 0.0:
        return max(0.0, age)
    return max(0.0, mean - age, tail * age)


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
