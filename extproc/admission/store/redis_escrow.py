"""redis_escrow: the room a replica's leases certainly hold in Redis, which it admits in alone.

While Redis is away a replica of the shared store admits within what its own leases hold
there beyond its live requests (``RedisStore`` module doc, local share): the room of the
requests that ended since, whose settles wait for shared mode. ``Escrow`` keeps, per pool
and lease, what Redis holds for it as far as this replica knows (``Held``), each until a
margin before its expiry there, and answers what may be admitted alone (``within``).
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.admission.rules import node_headroom
from extproc.admission.store.fallback import Within
from extproc.admission.store.redis_ledger import escrow_hold
from extproc.admission.store.redis_settles import Pending
from extproc.admission.types import Grant, Plan


class Held:
    """Held is what Redis holds for one lease of this replica, as far as this replica knows:
    its KV ``tokens``, its ``node`` (None: none) and ``hold`` there, and ``until``, the caller
    instant (s) before which its expiry in Redis cannot come (the send of the round trip
    that last set it, plus the lease TTL)."""

    __slots__ = ("tokens", "node", "hold", "until")

    def __init__(self, tokens: int, node: str | None, hold: int, until: float) -> None:
        self.tokens = tokens
        self.node = node
        self.hold = hold
        self.until = until


class Escrow:
    """Escrow is, per pool and lease id, what Redis holds for this replica's leases there (live,
    or settled by a settle not sent yet), and the room that leaves to admit in alone.

    ``margin`` (s): how long before a lease's expiry in Redis it is no longer counted on.
    """

    __slots__ = ("ledger", "margin")

    def __init__(self, margin: float) -> None:
        self.ledger: dict[str, dict[str, Held]] = {}
        self.margin = margin

    def held(self, pool: str, lease_id: str, held: Held) -> None:
        """held records that Redis holds ``held`` for lease ``lease_id`` of ``pool``."""
        self.ledger.setdefault(pool, {})[lease_id] = held

    def sent(self, settles: Iterable[Pending]) -> None:
        """sent forgets what Redis holds for the leases of ``settles`` now on the wire: whether
        they land or not, their room is no longer certain."""
        for p in settles:
            if p.lease_id is not None:
                ledger = self.ledger.get(p.pool)
                if ledger is not None:
                    ledger.pop(p.lease_id, None)

    def refreshed(self, pools: list[str], sent: list[list[tuple[str, Held]]], live: dict[str, dict[str, Grant]],
                  until: float, lost: bool) -> None:
        """refreshed keeps what a refresh left in Redis: each lease it carried (``sent``, per
        refresh of ``pools``), still ``live`` or settled by a settle not yet sent, is held
        there with the hold it carried until ``until`` (caller s). ``lost``: Redis had lost
        some leases, so the settled ones it did not carry may be gone too and are no longer
        counted on."""
        carried: dict[str, set[str]] = {}
        for pool, grants in zip(pools, sent):
            alive = live.get(pool, {})
            ledger = self.ledger.setdefault(pool, {})
            ids = carried.setdefault(pool, set())
            for lease_id, held in grants:
                ids.add(lease_id)
                if lease_id in alive or lease_id in ledger:
                    held.until = until
                    ledger[lease_id] = held
        if lost:
            for pool, ledger in self.ledger.items():
                ids = carried.get(pool, set())
                for lease_id in [i for i in ledger if i not in ids]:
                    del ledger[lease_id]

    def within(self, plan: Plan, live: dict[str, Grant], now: float, node_held: dict[str, int]) -> Within:
        """within is what this replica may admit alone in ``plan``'s pool at ``now`` (caller
        s): what its leases certainly hold in Redis (each until a margin before its expiry)
        less what its ``live`` requests there take (slots, KV tokens, tokens per node), and
        on each node less what it is short of (``overcommit``, over ``node_held``: every
        replica's holds per node at the last refresh)."""
        slots = kv = 0
        nodes: dict[str, int] = {}
        for h in self.ledger.get(plan.limits.pool, {}).values():
            if h.until - self.margin > now:
                slots += 1
                kv += h.tokens
                if h.node is not None:
                    nodes[h.node] = nodes.get(h.node, 0) + h.hold
        for g in live.values():
            slots -= 1
            kv -= g.plan.tokens
            if g.picked is not None:
                nodes[g.picked] = nodes.get(g.picked, 0) - escrow_hold(g)
        if plan.nodes is not None:
            overcommit(plan, nodes, node_held)
        return Within(slots, kv, nodes)


def overcommit(plan: Plan, nodes: dict[str, int], held: dict[str, int]) -> None:
    """overcommit takes from this replica's room on each node (``nodes``, tokens) what the
    node's KV that is not this replica's (as this replica reads it) leaves short of every
    replica's holds there (``held``) at the last refresh: the shared rule's headroom, when
    it is below 0.

    Why: the ledger's holds fitted the node when they were taken; KV that is not
    kvgate's may have risen since, and then the shared rule admits nobody there while
    every replica alone would refill the room of its ended requests, each seeing the
    rise in its own reading but not what the others refill meanwhile. Each taking the
    whole shortfall from its own room, together they refill at most what is left.

    Nothing the other replicas published is subtracted (as the admit script subtracts
    it): a request they published may have ended since the store was last reached, its
    room refilled by another within their holds or by KV that is not kvgate's, and the
    reading cannot tell which. Their requests in the node's cache so count twice, in the
    reading and in their holds: the price of never over-filling while cut off
    (docs/operations.md, the replicas' faults).
    """
    ask = plan.nodes
    assert ask is not None
    for c in ask.candidates:
        if c.name not in nodes:
            continue
        short = node_headroom(c.cap, ask.reserve_fraction, max(c.rise, c.foreign), held.get(c.name, 0))
        if short < 0:
            nodes[c.name] += short
