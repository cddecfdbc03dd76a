"""adaptive: the pool's scale in [min_scale, 1] from its backends' signals, and its recovery.

``target_scale`` is a pure function from signals to the scale they call for;
``next_scale`` is the pure recovery step (a shrink at once, a rise at most
``recovery_per_s`` per second); ``ScaleTracker`` keeps one pool's last scale and signals
and evaluates both lazily at each instant it is asked. How long signals stay usable is
the signal layer's decision (``PoolSignals.fresh_until``): nothing here ages them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.admission.types import PoolSignals
from extproc.config import ADAPTIVE_DEFAULTS, SIGNALS_DEFAULTS, AdaptiveConfig, PoolConfig


@dataclass(frozen=True, slots=True)
class ScaleParams:
    """ScaleParams are the adaptive settings of one pool.

    ``enabled`` is False for a pool with no backends (its scale stays 1.0);
    watermarks are KV-cache usage ratios; ``waiting_threshold`` is queued requests at
    or above which the pool counts as saturated; ``recovery_per_s`` is scale per second.
    """

    enabled: bool
    high_watermark: float = ADAPTIVE_DEFAULTS.high_watermark
    low_watermark: float = ADAPTIVE_DEFAULTS.low_watermark
    min_scale: float = ADAPTIVE_DEFAULTS.min_scale
    recovery_per_s: float = ADAPTIVE_DEFAULTS.recovery_per_s
    waiting_threshold: int = SIGNALS_DEFAULTS.waiting_threshold

    @classmethod
    def of(cls, pool: PoolConfig, adaptive: AdaptiveConfig) -> ScaleParams:
        """of builds a pool's parameters from its configuration."""
        return cls(enabled=bool(pool.backends), high_watermark=adaptive.high_watermark,
                   low_watermark=adaptive.low_watermark, min_scale=adaptive.min_scale,
                   recovery_per_s=adaptive.recovery_per_s,
                   waiting_threshold=pool.signals.waiting_threshold)


def usable(signals: PoolSignals | None, params: ScaleParams, now: float) -> float | None:
    """usable is the signals' KV usage ratio at ``now``, or None when they cannot be trusted.

    None (saturated) for: no signals, and signals past their ``trusted_until`` at ``now``;
    otherwise what ``reading`` makes of their values.
    """
    if signals is None or now > signals.trusted_until():
        return None
    return reading(signals, params)


def reading(signals: PoolSignals, params: ScaleParams) -> float | None:
    """reading is the KV usage ratio the signals' values give, or None when they cannot be trusted.

    None (saturated) for: a missing or non-finite usage, or a usage outside [0, 1] beyond
    rounding (backends are outside input), or a waiting count that is not an integer
    >= 0. Waiting requests at or above the threshold read as usage 1.0. A missing waiting
    count alone is not saturation: the usage is the primary signal.
    """
    u = signals.kv_usage
    if u is None or isinstance(u, bool) or not isinstance(u, (int, float)) or not math.isfinite(u):
        return None
    if u < -0.01 or u > 1.01:
        return None
    w = signals.waiting
    if w is not None:
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            return None
        if w >= params.waiting_threshold:
            return 1.0
    return min(1.0, max(0.0, float(u)))


def scale_for(usage: float | None, params: ScaleParams) -> float:
    """scale_for is the scale a usage ratio calls for, in [min_scale, 1] (None: min_scale).

    Usage at or above the high watermark gives min_scale; at or below the low watermark
    1.0; linear in between.
    """
    if usage is None or usage >= params.high_watermark:
        return params.min_scale
    if usage <= params.low_watermark:
        return 1.0
    frac = (usage - params.low_watermark) / (params.high_watermark - params.low_watermark)
    return 1.0 - frac * (1.0 - params.min_scale)


def alarm_for(usage: float | None, params: ScaleParams) -> bool:
    """alarm_for tells whether a usage ratio sheds: at or above the high watermark, or None."""
    return usage is None or usage >= params.high_watermark


def target_scale(signals: PoolSignals | None, params: ScaleParams, now: float) -> float:
    """target_scale is the scale the signals call for at ``now``, in [min_scale, 1] (``scale_for``).

    Untrusted signals (``usable``) give min_scale. A pool without backends always gets 1.0.
    """
    if not params.enabled:
        return 1.0
    return scale_for(usable(signals, params, now), params)


def in_alarm(signals: PoolSignals | None, params: ScaleParams, now: float) -> bool:
    """in_alarm tells whether the pool sheds: usage at or above the high watermark, or untrusted signals."""
    if not params.enabled:
        return False
    return alarm_for(usable(signals, params, now), params)


def next_scale(prev: float, target: float, dt: float, recovery_per_s: float) -> float:
    """next_scale moves the scale from ``prev`` toward ``target`` over ``dt`` seconds.

    A shrink applies at once; a rise is at most ``recovery_per_s × dt``, so limits do
    not oscillate with noisy signals.
    """
    if target <= prev:
        return target
    if dt <= 0:
        return prev
    risen = prev + recovery_per_s * dt
    return risen if risen < target else target


class ScaleTracker:
    """ScaleTracker is one pool's adaptive state: its last signals, scale and alarm.

    ``at(now)`` evaluates the scale lazily at the instant asked (admissions, snapshots),
    so staleness and recovery follow the clock even when no signal arrives. A tracker
    with backends starts with no signals, which count as stale: the pool starts at
    ``min_scale`` until its first signals (fail safe). It gives exactly
    ``next_scale(scale, target_scale(signals, params, now), now - t, recovery_per_s)``;
    what the signals call for while fresh is worked out once per update, because ``at``
    runs on every admission.
    """

    __slots__ = ("params", "signals", "scale", "alarm", "t", "_fresh_until", "_target", "_alarm")

    def __init__(self, params: ScaleParams, now: float) -> None:
        self.params = params
        self.signals: PoolSignals | None = None
        self.t = now
        self.scale = params.min_scale if params.enabled else 1.0
        self.alarm = params.enabled
        self._derive()

    def _derive(self) -> None:
        """_derive works out the target and alarm the signals give while fresh, and until when."""
        s, params = self.signals, self.params
        u = None if s is None else reading(s, params)
        self._fresh_until = -math.inf if s is None else s.trusted_until()
        self._target, self._alarm = scale_for(u, params), alarm_for(u, params)

    def at(self, now: float) -> float:
        """at is the scale at instant ``now`` (seconds); it also refreshes ``alarm``."""
        params = self.params
        if not params.enabled:
            return 1.0
        if now <= self._fresh_until:
            target, self.alarm = self._target, self._alarm
        else:
            target, self.alarm = params.min_scale, True
        scale = self.scale
        if target < scale:
            scale = target
        elif target > scale and now > self.t:
            scale += params.recovery_per_s * (now - self.t)
            if scale > target:
                scale = target
        self.scale = scale
        if now > self.t:
            self.t = now
        return scale

    def update(self, signals: PoolSignals, now: float) -> float:
        """update takes new signals at ``now``: the scale recovers up to now first, then follows them."""
        self.at(now)
        self.signals = signals
        self._derive()
        return self.at(now)

    def retune(self, params: ScaleParams, now: float) -> None:
        """retune applies new parameters (hot reload), keeping the signals and the scale reached."""
        self.at(now)
        self.params = params
        self._derive()
        if not params.enabled:
            self.scale, self.alarm = 1.0, False
        else:
            self.at(now)
