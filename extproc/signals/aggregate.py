"""aggregate: a pool's nodes' latest samples and their ages -> the pool's ``PoolSignals``.

Pure. Rules, per node, with ``age_s`` the seconds since its last usable sample (or since
it was configured, if it never gave one):

- fresh (a sample, age < ``stale_after_s``): its sample counts, even if its latest
  scrapes failed (one lost scrape is not an outage);
- stale (age >= ``stale_after_s``): the node counts as saturated, usage 1.0, and its
  queue and capacity no longer count (a dead node holds no KV cache for us);
- pending (never sampled, configured less than ``stale_after_s`` ago): not counted yet.

A pool with no fresh node is stale: ``PoolSignals(stale=True, kv_usage=None)``, which
the admission core runs at min_scale. Signals of a pool with a fresh node may be used
until ``at + stale_after_s`` (``fresh_until``): if no newer signals arrive by then (the
scraper stopped), the core counts them as stale. This module is the one place that
decides staleness; the core only compares its clock with ``fresh_until``.

Usage combines over nodes by ``max`` (the fullest node decides) or ``mean``; queues and
capacities are summed over fresh nodes (None when no fresh node reports them).

Choice for unreadable values (NaN or negative usage, missing metrics): such a scrape
is a failed scrape, like a refused connection. The node keeps its last usable sample
until it is ``stale_after_s`` old and then counts as saturated; it is never read as idle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from extproc.admission.types import PoolSignals
from extproc.config import SignalsConfig
from extproc.signals.sample import NodeSample

SATURATED = 1.0


@dataclass(frozen=True, slots=True)
class NodeReading:
    """NodeReading is what the pool knows of one node: its last usable sample and its age.

    ``sample`` is None when the node never gave a usable one; ``age_s`` is seconds since
    that sample was read (or since the node was configured, without one).
    """

    sample: NodeSample | None
    age_s: float

    def stale(self, stale_after_s: float) -> bool:
        """stale is True when the node has had no usable sample for ``stale_after_s`` seconds."""
        return self.age_s >= stale_after_s

    def fresh(self, stale_after_s: float) -> bool:
        """fresh is True when the node's sample is usable and younger than ``stale_after_s``."""
        return self.sample is not None and self.sample.usable and self.age_s < stale_after_s


def aggregate(readings: Iterable[NodeReading], signals: SignalsConfig, stale_after_s: float,
              at: float) -> PoolSignals:
    """aggregate combines a pool's node readings into ``PoolSignals`` as of instant ``at`` (s).

    ``stale_after_s``: seconds after which a node's sample, and the pool's signals, are stale.
    """
    usages: list[float] = []
    waiting: int | None = None
    capacity: int | None = None
    fresh = 0
    for r in readings:
        if r.fresh(stale_after_s):
            s = r.sample
            assert s is not None and s.kv_usage is not None
            fresh += 1
            usages.append(s.kv_usage)
            if s.waiting is not None:
                waiting = (waiting or 0) + s.waiting
            if s.kv_capacity_tokens is not None:
                capacity = (capacity or 0) + s.kv_capacity_tokens
        elif r.stale(stale_after_s):
            usages.append(SATURATED)
    if fresh == 0:
        return PoolSignals(kv_usage=None, waiting=None, stale=True, kv_capacity_tokens=None, at=at,
                           fresh_until=-math.inf)
    usage = max(usages) if signals.aggregate == "max" else sum(usages) / len(usages)
    return PoolSignals(kv_usage=usage, waiting=waiting, stale=False, kv_capacity_tokens=capacity, at=at,
                       fresh_until=at + stale_after_s)
