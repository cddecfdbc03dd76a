"""redis_view: what Redis last reported of each pool, for ``RedisStore.usage``.

Every script answers with the state of its pool (``view`` in the Lua prelude): slots in
use (in total and per class), in-flight KV tokens, the pool bucket and the store instant.
``PoolViews`` keeps the newest of them per pool and shows this replica's settles that
Redis has not confirmed yet as already applied, as the in-memory store shows its own.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from extproc.admission.bucket import refilled
from extproc.admission.store.redis_ledger import Keys
from extproc.admission.types import PoolUsage

log = logging.getLogger("kvgate.store")


class View:
    """View is the last state of one pool that Redis reported.

    ``offset`` is store time minus caller time (s) when it was seen; bucket fields are
    None when the pool has no bucket. A view older than the one kept, by (store instant,
    version), is ignored.
    """

    __slots__ = ("inflight", "by_class", "kv", "tok", "t", "cap", "rate", "offset", "at", "version")

    def __init__(self) -> None:
        self.at = -math.inf  # store instant of the view (s)
        self.version = 0     # the pool's view counter in Redis: orders views of one instant
        self.inflight = 0
        self.by_class: dict[str, int] = {}
        self.kv = 0
        self.tok: float | None = None
        self.t = 0.0
        self.cap = 0.0
        self.rate = 0.0
        self.offset = 0.0


class Settled:
    """Settled is a settle Redis has not confirmed yet, as ``usage`` takes it out of the view.

    ``class_name`` and ``tokens`` are what the lease held; ``refund`` the tokens given back
    to the buckets (negative: charged more); ``now`` the caller instant (s) of the settle.
    """

    __slots__ = ("class_name", "tokens", "refund", "now")

    def __init__(self, class_name: str, tokens: int, refund: int, now: float) -> None:
        self.class_name = class_name
        self.tokens = tokens
        self.refund = refund
        self.now = now


class PoolViews:
    """PoolViews is every pool's last view (``View``), the store instant (s) of the latest
    reply, and the settles of this replica not yet confirmed by Redis."""

    __slots__ = ("views", "store_at", "unconfirmed")

    def __init__(self) -> None:
        self.views: dict[str, View] = {}
        # The store's instant (s) of the latest reply received: a node's report whose mark
        # saw it was rendered after every script up to that instant.
        self.store_at = -math.inf
        self.unconfirmed: dict[str, dict[str, Settled]] = {}

    def instant(self) -> float | None:
        """instant is the store's instant (s) of the latest reply received (None: none yet)."""
        return None if self.store_at == -math.inf else self.store_at

    def restarted(self) -> None:
        """restarted forgets the order of the views: Redis lost its state, its counters start again."""
        for view in self.views.values():
            view.at = -math.inf
            view.version = 0

    def lost(self, keys: Mapping[str, Keys], replica_id: str, window_s: float, where: str) -> list[tuple[Any, ...]]:
        """lost hears that Redis lost the scripts: it restarted (empty, unless it persists) or
        was flushed. The views start again (their counters did), and the commands returned
        open every known pool's rebuild window (``window_s``) before any script can run there
        again: no replica admits until every replica in shared mode had a refresh in which
        to take its live leases again."""
        self.restarted()
        if self.views:
            log.warning("shared store: Redis at %s lost its scripts (a restart?): no admission for %.1fs "
                        "while every replica takes its live leases again", where, window_s)
        # Only the pools this replica has heard of from Redis before: a server that never
        # ran the scripts (a new deployment) has no ledger to rebuild.
        return [("SET", k.rb, replica_id, "PX", int(window_s * 1000), "NX") for pool, k in keys.items()
                if pool in self.views]

    def settled(self, pool: str, lease_id: str, settled: Settled) -> None:
        """settled shows the settle of ``lease_id`` in ``pool`` until Redis confirms it."""
        self.unconfirmed.setdefault(pool, {})[lease_id] = settled

    def confirmed(self, pool: str, lease_id: str) -> None:
        """confirmed forgets the settle of ``lease_id``: Redis applied it, or it was dropped."""
        unconfirmed = self.unconfirmed.get(pool)
        if unconfirmed is not None:
            unconfirmed.pop(lease_id, None)

    def read(self, pool: str, text: bytes, now: float) -> None:
        """read keeps what a script reported of ``pool`` at caller instant ``now`` (s)."""
        v = text.split()
        store_now, version = float(v[0]), int(v[1])
        if store_now > self.store_at:
            self.store_at = store_now
        view = self.views.get(pool)
        if view is None:
            view = self.views[pool] = View()
        if (store_now, version) < (view.at, view.version):
            return  # an older state that arrived late on another connection
        by_class: dict[str, int] = {}
        for item in v[8:]:
            name, _, n = item.partition(b"=")
            by_class[name.decode()] = int(n)
        view.at = store_now
        view.version = version
        view.inflight = int(v[2])
        view.kv = int(v[3])
        view.by_class = by_class
        if v[4] != b"-":
            view.tok, view.t, view.cap, view.rate = float(v[4]), float(v[5]), float(v[6]), float(v[7])
        view.offset = store_now - now

    def usage(self, pool: str, now: float) -> PoolUsage:
        """usage is the pool's state as Redis last reported it, less the unconfirmed settles.

        The pool bucket's tokens are refilled from the last report to ``now`` (s).
        """
        view = self.views.get(pool)
        if view is None:
            return PoolUsage()
        inflight, kv, by_class = view.inflight, view.kv, dict(view.by_class)
        tok, t = view.tok, view.t
        for s in self.unconfirmed.get(pool, {}).values():
            # Queued settles are this replica's own releases: show them at once, as the
            # in-memory store does, rather than a round trip later.
            inflight -= 1
            kv -= s.tokens
            by_class[s.class_name] = by_class.get(s.class_name, 0) - 1
            if tok is not None and s.refund:
                tok, t = refilled(tok, t, s.now + view.offset, view.cap, view.rate)
                tok = min(tok + s.refund, view.cap)
        tokens = None
        if tok is not None:
            tokens, _ = refilled(tok, t, now + view.offset, view.cap, view.rate)
        return PoolUsage(inflight=max(0, inflight), kv_inflight=max(0, kv),
                         by_class={c: max(0, n) for c, n in by_class.items()},
                         bucket_tokens=tokens)
