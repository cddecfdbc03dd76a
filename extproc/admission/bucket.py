"""bucket: a token bucket with explicit instants, debt, refunds and the exact wait.

Every method takes the instant ``now`` (seconds, on the caller's monotonic clock), so the
bucket can be tested at fixed instants and driven by a shared store's clock.
"""

from __future__ import annotations

import math

# Float refill is not exact: after waiting exactly ``delay(n)`` the bucket may hold
# n - 1e-12 tokens. Amounts within this many tokens count as fitting.
FIT_SLACK = 1e-6


def tpm_rate(capacity: float) -> float:
    """tpm_rate is the refill rate, in tokens per second, of a tokens-per-minute capacity."""
    return capacity / 60.0


class TokenBucket:
    """TokenBucket holds up to ``capacity`` tokens and refills at ``rate`` tokens per second.

    Invariant: ``tokens <= capacity`` after every method. Tokens may be negative: a debt,
    left when a settled request used more than it reserved; refill repays it before
    anything else fits. ``t`` is the instant (seconds) ``tokens`` was computed at; an
    instant earlier than ``t`` refills nothing (a clock never runs backwards here).
    """

    __slots__ = ("capacity", "rate", "tokens", "t")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        if not capacity > 0 or not rate > 0 or math.isinf(capacity) or math.isinf(rate):
            raise ValueError(f"a bucket needs a finite capacity and rate above 0, got {capacity}, {rate}")
        self.capacity = float(capacity)
        self.rate = float(rate)
        self.tokens = float(capacity)
        self.t = now

    def refill(self, now: float) -> float:
        """refill adds ``rate`` tokens per second elapsed since ``t`` (up to capacity); returns tokens."""
        self.tokens, self.t = refilled(self.tokens, self.t, now, self.capacity, self.rate)
        return self.tokens

    def peek(self, now: float) -> float:
        """peek is the tokens ``refill(now)`` would return, leaving the bucket as it is.

        Readers (metrics, usage reports) peek: a refill written by a reader would cap the
        idle time at the current capacity before ``set_limits`` could credit it.
        """
        return refilled(self.tokens, self.t, now, self.capacity, self.rate)[0]

    def set_limits(self, capacity: float, rate: float, now: float) -> float:
        """set_limits refills at the old rate up to ``now``, then applies the new capacity and rate.

        The limits reach the bucket with the next request, not when they changed: the time
        elapsed since ``t`` is credited at the old rate (the lower one when the limits
        rise) up to the larger of the two capacities, so a bucket left shrunk by a
        pressure period and then idle is not held at the small size until it refills
        again. A smaller capacity takes the excess tokens away at once. Returns the tokens.
        """
        top = capacity if capacity > self.capacity else self.capacity
        self.tokens, self.t = refilled(self.tokens, self.t, now, top, self.rate)
        if capacity != self.capacity or rate != self.rate:
            if not capacity > 0 or not rate > 0:
                raise ValueError(f"a bucket needs a capacity and rate above 0, got {capacity}, {rate}")
            self.capacity = float(capacity)
            self.rate = float(rate)
            if self.tokens > self.capacity:
                self.tokens = self.capacity
        return self.tokens

    def give(self, n: float, now: float) -> float:
        """give returns ``n`` tokens at ``now``, never above capacity; a negative ``n`` charges more.

        This is the settle step: ``n = reserved - actual``. Returns tokens left.
        """
        self.refill(now)
        tokens = self.tokens + n
        self.tokens = tokens if tokens < self.capacity else self.capacity
        return self.tokens


def refilled(tokens: float, t: float, now: float, top: float, rate: float) -> tuple[float, float]:
    """refilled is a bucket holding ``tokens`` at instant ``t`` (s), refilled to ``now`` (s):
    (tokens, instant) with ``rate`` tokens per second added, up to ``top`` tokens.

    The one refill formula of the Python side (the Redis store's Lua has its one twin). An
    instant not after ``t`` adds nothing and keeps ``t``: a clock never runs backwards here.
    """
    dt = now - t
    if dt > 0:
        tokens = tokens + dt * rate
        return (tokens if tokens < top else top), now
    return tokens, t


def wait_for(n: float, tokens: float, capacity: float, rate: float) -> float:
    """wait_for is the exact wait, in seconds, until ``n`` tokens fit in a bucket now holding ``tokens``.

    ``capacity`` and ``rate`` are in tokens and tokens per second. 0.0 when they fit;
    ``math.inf`` when ``n`` is above ``capacity``.
    """
    if n <= tokens + FIT_SLACK:
        return 0.0
    if n > capacity + FIT_SLACK:
        return math.inf
    return (n - tokens) / rate
