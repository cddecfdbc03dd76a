"""fairshare: replicas share a saturated pool fairly: one with more leases yields to one refused.

Why: a replica re-tries its own waiters the moment one of its own requests ends, in the
same round trip as that settle, while the others see the room only at their next poll
(``waiting.SHARED_POLL_S``). So the room a request frees goes, nearly always, to a
waiter of the replica that ran it: a replica that holds more of the pool's leases gets
more of the room that frees, and the shares drift apart (``make bench-replicas`` over
identical clients; the figures are in docs/operations.md, "Scaling out").

The rule (``yields``), applied by the admit script after a request fits and before it is
taken: while another replica wants room (one of its requests, of no more KV tokens than
this one, was refused for lack of room, slots or KV, pool or node, within the last
``FAIR_WINDOW_S``) and holds fewer of the pool's live leases than this one, this one does
not take more: it is refused with ``Budget.FAIR_SHARE`` (retryable, so a waiter keeps
waiting, and counted as ``rejected_fair_share`` if its wait ends there). The room goes to the other replica's next try, at most one poll later. A
larger request is not yielded to: the room this one leaves would not seat it, and would
stay empty.

Only a refusal that leaves a request waiting for room wants room (``wants``): its budget
is one of room (``WANTING``: a token bucket's refusal is about time, not room), and its
request stays in the bounded wait (``Plan.waits``: a waiter's re-try, or the first try of
a class with a ``max_wait_s``), so that a try of it comes back within one poll to take
the room. A request answered with a 429 at once never comes back for it: had it wanted
room, the other replicas would have left the room empty for the window (seen: the
replicas' end-to-end test of the global limit failed under load).

A want for node room gathers room on one node, by placement first. The refused request
records its hold and, per node, the room its replica read there before any hold
(``Want``); its ``target`` is the node where that room less every replica's holds now is
the largest, where it is closest to fitting. A replica that defers to it (``deferred``)
places its own request elsewhere when any other node fits it (``gathering``: those nodes
are taken last, ``rules.choose_node``), and yields only when the target is the one node
its request fits. Yielding wherever the wanted request was no larger left room empty for
nothing: each replica reads a node by its own scrape, the poorer one fuller (it counts
more of the others' unpublished requests as foreign KV), so the room left was seldom room
it could take. Leaving room only where the poorer replica reads that it fits took the
hand-overs away but left the poorer replica's large requests to time out, and the 429
split failed; gathering keeps the hand-over where it builds the room, and costs nothing
where another node takes the request. Gathering alone failed the split after Redis
faults: each replica admitted alone meanwhile, their leases are far apart, and only
hand-overs bring them together (each trial's figures: bench/results/replicas-experiments.md). So a
replica holding fewer than ``FAIR_FAR`` times this one's leases is left the room wherever
this one's request goes, as before.

As Netflix's partitions, the shares are enforced only when the pool is full (someone was
refused), and nothing is held for a replica that does not ask. Unlike a quota it never
refuses a request that the pool's budgets and no other replica's wish would refuse: the
cost is room left free for up to one poll interval while the poorer replica takes it.

Ledger (``redis_ledger`` key layout, in ``P{pool}:st``): ``r:<replica>`` the replica's live
leases (taken with the lease, given back wherever a lease leaves: settle, expiry, a dead
replica's release), ``w:<replica>`` the store instant (s) of its latest refusal that
wanted room and that request's KV tokens (for a node refusal, then its hold and its
``node room`` pairs), removed when it is granted. The Lua in ``redis_lua`` mirrors
``wants``, ``deferred``, ``target`` and ``yields``; the differential tests hold them equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from extproc.admission.types import Budget

FAIR_WINDOW_S = 0.25
"""FAIR_WINDOW_S is how long (s, store time) a refusal makes its replica want room: longer
than the poll of a replica's waiters in shared mode (0.05 s) and a round trip, so that a
replica whose waiter re-tries keeps wanting, and short, so that one that stopped asking
stops holding the others back soon."""

FAIR_SLACK = 0.8
"""FAIR_SLACK is how far below this replica's live leases another's must be for this one to
yield to it (ratio): within it the shares may differ, so that replicas near their share do
not hand room back and forth (each hand-over leaves the room free for up to one poll)."""

FAIR_FAR = 0.5
"""FAIR_FAR is how far below this replica's live leases another's must be for this one to
leave it the room wherever it places its request (ratio): far apart, as after a fault
(each replica admitted alone meanwhile), the hand-over brings the shares together; near
them, a node want's room is gathered by placement (module doc)."""

WANTING = (Budget.SLOTS, Budget.RESERVED_SLOTS, Budget.KV, Budget.CLASS_KV, Budget.NODE_KV)
"""WANTING are the budgets whose retryable refusal makes a replica want room."""


def wants(budget: Budget, retryable: bool, waits: bool) -> bool:
    """wants says whether a refusal for ``budget`` (``retryable`` or not) of a plan that
    ``waits`` (``Plan.waits``) makes its replica want room."""
    return waits and retryable and budget in WANTING


class Want(NamedTuple):
    """Want is a replica's latest refusal that wants room (``wants``): its store instant (s)
    and its request's KV tokens; for a node refusal also the request's node hold (``need``,
    tokens) and, per candidate node, the room its reading left there before any lease's hold
    (``bases``: ``shared_nodes.room_bases``; empty for a refusal of slots or pool KV)."""

    at: float
    tokens: int
    need: int = 0
    bases: tuple[tuple[str, int], ...] = ()


def deferred(me: str, tokens: int, leases: Mapping[str, int], wants: Mapping[str, Want],
             now: float) -> list[Want]:
    """deferred is the wants replica ``me`` defers to with a request of ``tokens`` KV tokens at
    store instant ``now`` (s): another replica's, less than FAIR_WINDOW_S old, for a request
    of no more tokens, of a replica that holds fewer live leases than FAIR_SLACK times
    ``me``'s (``leases``: replica -> live leases; missing: none)."""
    return [w for r, w in wants.items() if _defers(me, tokens, leases, r, w, now)]


def _defers(me: str, tokens: int, leases: Mapping[str, int], r: str, w: Want, now: float) -> bool:
    """_defers says whether ``me`` defers to replica ``r``'s want ``w`` (``deferred``)."""
    return (r != me and now - w.at < FAIR_WINDOW_S and w.tokens <= tokens
            and leases.get(r, 0) < FAIR_SLACK * leases.get(me, 0))


def target(want: Want, held: Mapping[str, int]) -> str | None:
    """target is the node a node want gathers room on: where its request is closest to fitting
    by its replica's reading over every replica's holds now (``held``, per node; a node
    missing is not read); None for a want of slots or pool KV, or none read."""
    best: tuple[int, str] | None = None
    for name, base in want.bases:
        h = held.get(name)
        if h is not None and (best is None or base - h > best[0]):
            best = (base - h, name)
    return None if best is None else best[1]


def gathering(waits_for: list[Want], held: Mapping[str, int]) -> frozenset[str]:
    """gathering is the nodes the wants ``waits_for`` (``deferred``) gather room on: this
    replica's request takes one of them only when no other node fits it."""
    return frozenset(t for w in waits_for if (t := target(w, held)) is not None)


def yields(me: str, tokens: int, leases: Mapping[str, int], wants: Mapping[str, Want], now: float,
           held: Mapping[str, int] | None = None, node: str | None = None) -> bool:
    """yields says whether replica ``me`` must leave the room a request of ``tokens`` KV tokens
    would take at store instant ``now`` (s), placed on ``node`` (None: no node), to another:
    it defers to a want (``deferred``) of slots or pool KV, or to a node want whose room
    gathers on ``node`` (``target`` over every replica's holds now, ``held``; or on no node
    this replica reads)."""
    held = held or {}
    far = FAIR_FAR * leases.get(me, 0)
    return any(not w.bases or (t := target(w, held)) is None or t == node or leases.get(r, 0) < far
               for r, w in wants.items() if _defers(me, tokens, leases, r, w, now))
