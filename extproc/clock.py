"""clock: time as an injected dependency, so every rule can be tested at fixed instants."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Clock gives the current instant in seconds on a monotonic scale."""

    def now(self) -> float: ...


class MonotonicClock:
    """MonotonicClock reads ``time.monotonic()``: the clock of a running server."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """ManualClock is a clock that moves only when told: for tests and simulations."""

    __slots__ = ("_t",)

    def __init__(self, t: float = 0.0) -> None:
        self._t = float(t)

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> float:
        """advance moves the clock forward by ``seconds`` (>= 0) and returns the new instant."""
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._t += seconds
        return self._t

    def set(self, t: float) -> None:
        """set puts the clock at instant ``t``, which must not be earlier than now."""
        if t < self._t:
            raise ValueError("a clock does not go backwards")
        self._t = float(t)
