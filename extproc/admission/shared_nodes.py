"""shared_nodes: the per-node rule when the nodes' ledger is shared by replicas through a store.

With a shared store, the per-node headroom rule of ``rules.pick_node`` is applied by the
store, atomically with the pool's budgets, because what each node holds is the sum over
every replica's requests there. The controller states the question as a ``NodeAsk``:
the candidate nodes (name, capacity, foreign KV as this replica read it, what this
replica's own requests there hold), the new request's hold, the reserve fraction and
the class's watermark. The store answers with the node picked or a node refusal.

``pick_shared`` is the Python rule the Redis admit script mirrors: ``rules.pick_node``
with each node's ``held`` replaced by the shared total (how a ``NodeAsk`` reaches the
script, its constants included, is ``store.redis_lua.NodeArg``). ``pick_within`` is the
rule while the store is unreachable: within the room this replica's own leases hold in
the ledger (see its docstring).

Which report counts: each replica scrapes every node itself and uses its own latest
report for ``foreign`` (KV the node holds that this replica did not admit). Reports are
not shared: a replica whose report of a node is stale does not pick that node, whatever
the other replicas read (``nodes.Node.state``). Because each replica subtracts only its
own requests from what a node reports, another replica's requests already in the report
are counted twice (as foreign, and in the shared holds) until they end: this errs on
the safe side, never the other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.admission import rules


@dataclass(frozen=True, slots=True)
class NodeAsk:
    """NodeAsk is a request's per-node question to a shared store.

    ``candidates``: (name, capacity, foreign, own_held) per node that may be picked, in
    tokens, in order of preference (ties go to the first); ``need``: the request's hold
    (``rules.node_hold`` with nothing generated yet, tokens); ``reserve_fraction``: the
    part of each node's capacity kvgate never fills; ``watermark``: the class's
    ``kv_watermark`` (1.0: none).
    """

    candidates: tuple[tuple[str, int, int, int], ...]
    need: int
    reserve_fraction: float
    watermark: float


def pick_shared(ask: NodeAsk, held: Mapping[str, int]) -> rules.NodePass:
    """pick_shared is ``rules.pick_node`` over ``ask``'s candidates with ``held`` (tokens per
    node, every replica's requests; missing: 0) in place of this replica's own holds.

    This is the rule the Redis admit script applies; the differential test holds them equal.
    """
    return rules.pick_node([(name, cap, foreign, held.get(name, 0))
                            for name, cap, foreign, _own in ask.candidates],
                           ask.need, ask.reserve_fraction, ask.watermark)


def pick_within(ask: NodeAsk, free: Mapping[str, int] | None) -> rules.NodePass:
    """pick_within is the per-node rule while the shared ledger cannot be reached: a node fits
    when the request's hold fits both the node as this replica reads it (``rules.pick_node``
    with its own holds) and ``free``, the room this replica's own leases still hold there in
    the ledger beyond what its live requests take (tokens per node; missing: none; None:
    no such bound, for the only replica there is).

    Why it never over-fills, whatever the other replicas do meanwhile: every other replica
    decides over the ledger, where this replica's leases keep holding that room until they
    expire, so what this replica admits within it was already counted by all of them. The
    class's watermark is checked on this replica's reading. Nothing is changed.
    """
    rooms = []
    for name, capacity, foreign, own in ask.candidates:
        eff = rules.effective_capacity(capacity, ask.reserve_fraction)
        class_room = None if ask.watermark >= 1.0 else math.floor(ask.watermark * eff) - foreign - own
        room = rules.node_headroom(capacity, ask.reserve_fraction, foreign, own)
        rooms.append((name, room if free is None else min(room, free.get(name, 0)), class_room))
    return rules.choose_node(rooms, ask.need)


def candidates_of(rows: Sequence[tuple[str, int, int, int]]) -> tuple[tuple[str, int, int, int], ...]:
    """candidates_of freezes a list of (name, capacity, foreign, own_held) rows for a ``NodeAsk``."""
    return tuple((str(n), int(c), int(f), int(h)) for n, c, f, h in rows)
