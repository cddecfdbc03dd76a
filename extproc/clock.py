"""clock: time as an injected dependency, so every rule can be tested at fixed instants.

A ``Clock`` gives the instant; ``Timers`` call back after a delay on the same scale. A
running server reads ``MonotonicClock`` and arms the event loop's own timers
(``LoopTimers``); a test or a simulation moves a ``ManualClock``, whose timers fire as it
passes their instant.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    """Clock gives the current instant in seconds on a monotonic scale."""

    def now(self) -> float: ...


class Timer(Protocol):
    """Timer is an armed callback; ``cancel`` disarms it (a fired or cancelled one: no effect)."""

    def cancel(self) -> None: ...


class Timers(Protocol):
    """Timers call ``callback`` on ``loop`` ``delay_s`` seconds from now (a clock's seconds)."""

    def call_later(self, loop: asyncio.AbstractEventLoop, delay_s: float,
                   callback: Callable[[], None]) -> Timer: ...


class LoopTimers:
    """LoopTimers are the event loop's own timers (``loop.call_later``): those of a running
    server, whose ``MonotonicClock`` runs at the loop's pace."""

    __slots__ = ()

    def call_later(self, loop: asyncio.AbstractEventLoop, delay_s: float,
                   callback: Callable[[], None]) -> Timer:
        return loop.call_later(delay_s, callback)


class MonotonicClock:
    """MonotonicClock reads ``time.monotonic()``: the clock of a running server."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()


class _ManualTimer:
    """_ManualTimer is a callback a ManualClock holds until its instant (s)."""

    __slots__ = ("at", "loop", "callback", "cancelled")

    def __init__(self, at: float, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self.at = at
        self.loop = loop
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """ManualClock is a clock that moves only when told: for tests and simulations.

    It is also ``Timers``: a callback armed for an instant is handed to its event loop (to
    run at the loop's next turn, as a due timer would) when ``advance`` or ``set`` moves the
    clock to or past that instant.
    """

    __slots__ = ("_t", "_timers", "_seq")

    def __init__(self, t: float = 0.0) -> None:
        self._t = float(t)
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._seq = 0  # arming order: timers due at one instant fire in it

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> float:
        """advance moves the clock forward by ``seconds`` (>= 0) and returns the new instant."""
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._t += seconds
        self._fire()
        return self._t

    def set(self, t: float) -> None:
        """set puts the clock at instant ``t``, which must not be earlier than now."""
        if t < self._t:
            raise ValueError("a clock does not go backwards")
        self._t = float(t)
        self._fire()

    def call_later(self, loop: asyncio.AbstractEventLoop, delay_s: float,
                   callback: Callable[[], None]) -> Timer:
        """call_later arms ``callback`` for ``delay_s`` seconds from now (fired at once when 0)."""
        timer = _ManualTimer(self._t + max(0.0, delay_s), loop, callback)
        self._seq += 1
        heapq.heappush(self._timers, (timer.at, self._seq, timer))
        self._fire()
        return timer

    def _fire(self) -> None:
        """_fire hands every timer due by now to its loop, in order of instant then arming."""
        due = self._timers
        while due and due[0][0] <= self._t:
            timer = heapq.heappop(due)[2]
            if not timer.cancelled and not timer.loop.is_closed():
                timer.loop.call_soon(self._run, timer)

    @staticmethod
    def _run(timer: _ManualTimer) -> None:
        if not timer.cancelled:  # cancelled after it was handed to the loop
            timer.callback()
