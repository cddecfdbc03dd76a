"""fairshare: replicas share a saturated pool fairly: one with more leases yields to one refused.

Why: a replica re-tries its own waiters the moment one of its own requests ends, in the
same round trip as that settle, while the others see the room only at their next poll
(``controller.SHARED_POLL_S``). So the room a request frees goes, nearly always, to a
waiter of the replica that ran it: a replica that holds more of the pool's leases gets
more of the room that frees, and the shares drift apart. Measured with three replicas
over identical clients (``make bench-replicas``): one replica gave 58 % to 75 % of the
429s, and after a Redis outage one replica admitted 115 online requests where the
others admitted about 300 each.

The rule (``yields``), applied by the admit script after a request fits and before it is
taken: while another replica wants room (one of its requests, of no more KV tokens than
this one, was refused for lack of room, slots or KV, pool or node, within the last
``FAIR_WINDOW_S``) and holds fewer of the pool's live leases than this one, this one does
not take more: it is refused with ``Budget.SLOTS`` (retryable, so a waiter keeps
waiting). The room goes to the other replica's next try, at most one poll later. A
larger request is not yielded to: the room this one leaves would not seat it, and would
stay empty.

Only a refusal that leaves a request waiting for room wants room (``wants``): its budget
is one of room (``WANTING``: a token bucket's refusal is about time, not room), and its
request stays in the bounded wait (``Plan.waits``: a waiter's re-try, or the first try of
a class with a ``max_wait_s``), so that a try of it comes back within one poll to take
the room. A request answered with a 429 at once never comes back for it: had it wanted
room, the other replicas would have left the room empty for the window (seen: the
replicas' end-to-end test of the global limit failed under load).

As Netflix's partitions, the shares are enforced only when the pool is full (someone was
refused), and nothing is held for a replica that does not ask. Unlike a quota it never
refuses a request that the pool's budgets and no other replica's wish would refuse: the
cost is room left free for up to one poll interval while the poorer replica takes it.

Ledger (``redis_ledger`` key layout, in ``P{pool}:st``): ``r:<replica>`` the replica's live
leases (taken with the lease, given back wherever a lease leaves: settle, expiry, a dead
replica's release), ``w:<replica>`` the store instant (s) of its latest refusal that
wanted room and that request's KV tokens, removed when it is granted. The Lua in
``redis_lua`` mirrors ``wants`` and ``yields``; the differential test holds them equal.
"""

from __future__ import annotations

from collections.abc import Mapping

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

WANTING = (Budget.SLOTS, Budget.RESERVED_SLOTS, Budget.KV, Budget.CLASS_KV, Budget.NODE_KV)
"""WANTING are the budgets whose retryable refusal makes a replica want room."""


def wants(budget: Budget, retryable: bool, waits: bool) -> bool:
    """wants says whether a refusal for ``budget`` (``retryable`` or not) of a plan that
    ``waits`` (``Plan.waits``) makes its replica want room."""
    return waits and retryable and budget in WANTING


def yields(me: str, tokens: int, leases: Mapping[str, int], wants: Mapping[str, tuple[float, int]],
           now: float) -> bool:
    """yields says whether replica ``me`` must leave the room a request of ``tokens`` KV tokens
    would take at store instant ``now`` (s) to another: some other replica wanted room less
    than FAIR_WINDOW_S ago for a request of no more tokens (``wants``: replica -> (instant,
    tokens) of its latest wanting refusal) and holds fewer live leases than FAIR_SLACK
    times ``me``'s (``leases``: replica -> live leases; missing: none)."""
    mine = leases.get(me, 0)
    return any(r != me and now - at < FAIR_WINDOW_S and need <= tokens and leases.get(r, 0) < FAIR_SLACK * mine
               for r, (at, need) in wants.items())
