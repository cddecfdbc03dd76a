"""shared_nodes: the per-node rule when the nodes' ledger is shared by replicas through a store.

With a shared store, the per-node headroom rule of ``rules.pick_node`` is applied by the
store, atomically with the pool's budgets, because what each node holds is the sum over
every replica's requests there. The controller states the question as a ``NodeAsk``:
the candidate nodes (name, capacity, foreign KV as this replica read it, what this
replica's own requests there hold), the new request's hold, the reserve fraction and
the class's watermark. The store answers with the node picked or a node refusal.

``pick_shared`` is the Python rule the Redis admit script mirrors: ``rules.pick_node``
with each node's ``held`` replaced by the shared total (how a ``NodeAsk`` reaches the
script, its constants included, is ``store.redis_lua.NodeArg``). ``pick_share`` is the rule while the store is unreachable: this
replica's share of every node (see its docstring).

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


def share_room(capacity: int, reserve_fraction: float, foreign: int, own_held: int,
               replicas: int) -> int:
    """share_room is the room (tokens, may be < 0) one of ``replicas`` replicas has on a node
    without the shared ledger: floor((floor(C x (1 - r)) - foreign) / N) - own_held.

    Why it never over-fills: ``foreign`` as each replica reads it includes the other
    replicas' requests in the node's report, so a replica admits only while
    T + need + (N - 1) x (own + need) <= C_eff - F, T being every replica's total and F
    the node's own foreign KV: T + need never passes C_eff - F.
    """
    eff = rules.effective_capacity(capacity, reserve_fraction)
    return (eff - foreign) // max(1, replicas) - own_held


def pick_share(ask: NodeAsk, replicas: int) -> rules.NodePass:
    """pick_share picks like ``rules.pick_node`` with each node's room cut to this replica's
    share (``share_room``); the class's watermark is cut the same way. Nothing is changed.
    """
    n = max(1, replicas)
    rooms = []
    for name, capacity, foreign, own in ask.candidates:
        class_room = None if ask.watermark >= 1.0 else \
            (math.floor(ask.watermark * rules.effective_capacity(capacity, ask.reserve_fraction))
             - foreign) // n - own
        rooms.append((name, share_room(capacity, ask.reserve_fraction, foreign, own, n), class_room))
    return rules.choose_node(rooms, ask.need)


def candidates_of(rows: Sequence[tuple[str, int, int, int]]) -> tuple[tuple[str, int, int, int], ...]:
    """candidates_of freezes a list of (name, capacity, foreign, own_held) rows for a ``NodeAsk``."""
    return tuple((str(n), int(c), int(f), int(h)) for n, c, f, h in rows)
