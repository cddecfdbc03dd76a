"""sample: what one scrape of one backend yields, and the named ways a scrape fails.

A ``NodeSample`` is the pure result of reading one exposition: KV-cache usage (ratio),
queue and batch sizes (requests), preemptions (a counter) and KV capacity (tokens).
``Findings`` collects the problems met while reading it, so every oddity is counted by
reason instead of crashing the scraper or being read as "idle".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from extproc.errors import KvgateError

# Counts above this are nonsense for one node (requests or tokens) and are clamped;
# it also keeps hostile values from overflowing sums downstream.
MAX_COUNT = 10**9
MAX_TOKENS = 10**12


class ScrapeError(StrEnum):
    """ScrapeError is why a scrape failed or was doubtful: the ``reason`` label of scrape errors."""

    CONNECT = "connect"
    TIMEOUT = "timeout"
    HTTP_STATUS = "http_status"
    TOO_LARGE = "too_large"
    PARSE = "parse"
    MISSING_METRICS = "missing_metrics"
    BAD_VALUE = "bad_value"


class ScrapeFailure(KvgateError):
    """ScrapeFailure is a scrape that yielded nothing usable: ``reason`` and a detail for logs."""

    def __init__(self, reason: ScrapeError, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Problem:
    """Problem is one doubtful thing found in an otherwise readable exposition."""

    reason: ScrapeError
    detail: str


@dataclass(frozen=True, slots=True)
class NodeSample:
    """NodeSample is one backend's state as read from one exposition.

    ``kv_usage``: KV-cache usage ratio in [0, 1]; None when it could not be read (the
    sample is then not usable: the node is treated as not answering). ``waiting`` and
    ``running``: requests queued / in the batch (None: not reported).
    ``preemptions_total``: the engine's preemption counter (None: not reported).
    ``kv_capacity_tokens``: the node's KV cache size in tokens (None: not reported).
    ``block_tokens``: the tokens of one KV block, the unit its prefix cache shares (None:
    not reported). ``prefix_hits`` and ``prefix_queries``: the engine's prefix cache
    counters, in tokens (None: not reported). ``problems``: what was doubtful, each counted under its reason.
    """

    kv_usage: float | None
    waiting: int | None = None
    running: int | None = None
    preemptions_total: int | None = None
    kv_capacity_tokens: int | None = None
    problems: tuple[Problem, ...] = ()
    block_tokens: int | None = None
    prefix_hits: int | None = None
    prefix_queries: int | None = None

    @property
    def usable(self) -> bool:
        """usable is True when the sample carries a KV usage the pool can rely on."""
        return self.kv_usage is not None


class Findings:
    """Findings checks values read from an exposition and records what was wrong with them.

    Rules (the issue's "none is read as idle"): NaN, infinite or negative usage is
    unreadable (None, so the node counts as failed and goes stale like any broken node;
    clamping a negative value to 0 would read it as idle, and +Inf is no more a reading
    than NaN); a finite usage above 1 is clamped to 1, i.e. saturated.
    Counts that are NaN, infinite or negative are unknown (None); huge ones are clamped.
    Every such value is recorded as ``bad_value``.
    """

    __slots__ = ("problems",)

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, reason: ScrapeError, detail: str) -> None:
        """add records one problem."""
        self.problems.append(Problem(reason, detail))

    def missing(self, detail: str) -> None:
        """missing records a metric the engine should have exposed but did not."""
        self.add(ScrapeError.MISSING_METRICS, detail)

    def ratio(self, value: float, what: str) -> float | None:
        """ratio checks a usage ratio: [0, 1] passes, finite > 1 clamps to 1, NaN, ±Inf or
        < 0 gives None."""
        if not math.isfinite(value):
            self.add(ScrapeError.BAD_VALUE, f"{what} is {value}")
            return None
        if value < 0.0:
            self.add(ScrapeError.BAD_VALUE, f"{what} is negative ({value})")
            return None
        if value > 1.0:
            self.add(ScrapeError.BAD_VALUE, f"{what} is above 1 ({value}), clamped to 1")
            return 1.0
        return value

    def count(self, value: float, what: str) -> int | None:
        """count checks a request count or counter: NaN, infinite or negative give None."""
        if not math.isfinite(value) or value < 0.0:
            self.add(ScrapeError.BAD_VALUE, f"{what} is {value}")
            return None
        if value > MAX_COUNT:
            self.add(ScrapeError.BAD_VALUE, f"{what} is {value}, clamped to {MAX_COUNT}")
            return MAX_COUNT
        return int(round(value))

    def tokens(self, value: float | str | None, what: str) -> int | None:
        """tokens checks a KV capacity in tokens, from a sample value or a label string.

        None, "" and "None" (vLLM before profiling) mean "not reported" and are not
        problems; anything else that is not a positive integer below ``MAX_TOKENS`` is.
        """
        if value is None or value in ("", "None"):
            return None
        try:
            number = float(value)
        except ValueError:
            self.add(ScrapeError.BAD_VALUE, f"{what} is not a number ({str(value)[:40]!r})")
            return None
        if not math.isfinite(number) or number <= 0 or number > MAX_TOKENS or not number.is_integer():
            self.add(ScrapeError.BAD_VALUE, f"{what} is {number}")
            return None
        return int(number)

    def sample(self, kv_usage: float | None, waiting: int | None = None, running: int | None = None,
               preemptions_total: int | None = None, kv_capacity_tokens: int | None = None,
               block_tokens: int | None = None, prefix_hits: int | None = None,
               prefix_queries: int | None = None) -> NodeSample:
        """sample builds the ``NodeSample`` carrying the problems found so far."""
        return NodeSample(kv_usage=kv_usage, waiting=waiting, running=running,
                          preemptions_total=preemptions_total,
                          kv_capacity_tokens=kv_capacity_tokens, problems=tuple(self.problems),
                          block_tokens=block_tokens, prefix_hits=prefix_hits,
                          prefix_queries=prefix_queries)
