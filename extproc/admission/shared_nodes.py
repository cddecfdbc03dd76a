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

Shared prompt prefixes (``picking.shared_prefix``): a candidate carries the node's block
size as this replica reads it, and the ask the prompt's chain; the store keeps every
replica's leases' prefixes per node (``sharing.SharedPrefixes``) and charges a request its
prompt less the blocks it shares with them, as one replica's ledger does with its own.

Which report counts: each replica scrapes every node itself and uses its own latest
report: ``foreign`` is what the node holds that this replica did not subtract (its own
requests certainly in the cache at the report's mark, see ``nodes``). Reports are not
shared: a replica whose report of a node is stale does not pick that node, whatever the
other replicas read (``node.Node.state``).

Every replica's requests counted once. Another replica's requests in a node's cache are in
this replica's ``foreign`` too, and in the shared holds: counted twice, they left a replica
beside one that held 7 long requests admitting none where 2 more fit, and the 429s of
identical clients fell on one replica. So each replica publishes, with its refreshes, what
its marks know: per node, the footprint of its leases whose first token it had seen
(*firm*) and of those held past the settle time without one (*idle*: in the cache when the
node queues nothing), in two generations stamped with the store's instant of the refresh
that wrote them (``SeenGen``). A candidate carries ``since``, the store's instant of the
latest reply this replica had received when it took the report's mark: a generation
stamped before ``since`` was written before the node rendered the report, so its requests
were in the cache then, unless they ended, and ``others_seen`` subtracts them (the idle
ones only when the report said the node queued nothing). A lease's contribution leaves the
sums in the same script that takes its hold off the node's total, so what is subtracted is
always still held there (a hold is at least the footprint that was published): a request
that ended before the report is then counted by its hold alone, never by nothing. Two
generations, because a replica's newest one is usually younger than another's report; a
replica whose both are younger is not subtracted at all (the safe side). Foreign KV on the
rise (``rise``) is this replica's reading net of the others' published requests, and is
never subtracted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from extproc.admission import rules
from extproc.admission.sharing import SharedPrefixes
from extproc.admission.types import Chain


class Candidate(NamedTuple):
    """Candidate is one node a request may be placed on, as a replica reads it (tokens).

    ``foreign``: KV the node holds that this replica did not subtract, with its ``rise``
    to come (``node.Node.foreign_ahead``); ``own``: what this replica's requests there hold;
    ``since``: the store's instant of the latest reply received when the report's mark was
    taken (None: no such reply; nothing of the others' is subtracted); ``idle``: the
    report said the node queued nothing; ``block``: the node's KV block size as this
    replica reads it (tokens; 0: prefixes are not shared there); ``cached``: the tokens of
    the request's prefix that this replica saw running or recently ended there (placement
    only, ``node.Node.cached``).
    """

    name: str
    cap: int
    foreign: int
    own: int
    rise: int = 0
    since: float | None = None
    idle: bool = False
    block: int = 0
    cached: int = 0


class Pooled(NamedTuple):
    """Pooled is what a request adds to its node's sums with pooled growth (``growth: pooled``):
    its ``footprint`` (tokens: prompt + generated) and its growth's moments
    (``rules.growth_moments``: ``left`` tokens of reservation, ``mean`` and ``var``), with
    the ``quantile`` the node's bound is taken at (``rules.pooled_bound``).

    A shared store keeps, per node, the footprints (as the leases' holds) and the sums of
    the moments of every replica's requests, so that the bound is the one rule over all of
    them: the growth to come is pooled across replicas as within one.
    """

    footprint: int
    left: int
    mean: float
    var: float
    quantile: float


Sums = tuple[int, float, float]
"""Sums are the sums of the moments (left, mean, var) of the requests on one node."""


@dataclass(frozen=True, slots=True)
class NodeAsk:
    """NodeAsk is a request's per-node question to a shared store.

    ``candidates``: the nodes that may be picked, in order of preference (ties go to the
    first); ``need``: the request's hold (``rules.node_hold`` with nothing generated yet,
    tokens); ``reserve_fraction``: the part of each node's capacity kvgate never fills;
    ``watermark``: the class's ``kv_watermark`` (1.0: none); ``pooled``: with pooled growth,
    what the request adds to its node's sums (``need`` is then its hold alone on a node);
    ``chain``: the prompt's prefix chain where the pool shares prefixes (None: charged
    whole), ``prompt`` its tokens (a credit is at most that) and ``affinity`` the pool's
    ``prefix_affinity`` (``nodes.PoolNodes.pick``).
    """

    candidates: tuple[Candidate, ...]
    need: int
    reserve_fraction: float
    watermark: float
    pooled: Pooled | None = None
    chain: Chain | None = None
    prompt: int = 0
    affinity: float = 0.0


class Shared(NamedTuple):
    """Shared is what a shared store's pick says of a request's prefix on the node picked:
    ``keyed``, the tokens of the whole prompt blocks its keys cover in the ledger (which
    the ledger may count once with other leases'); ``credit``, the tokens it was charged
    less for the blocks it shares there; ``by_affinity``, whether its prefix chose the node
    over a roomier one. Kept with a grant only where one of them is not nothing."""

    keyed: int
    credit: int
    by_affinity: bool


class SeenGen(NamedTuple):
    """SeenGen is one replica's published generations: the store's instants (s) of the refresh
    that wrote the newest (``new_at``) and the one before (``old_at``; None: none yet), and
    per node the footprints (tokens) of its leases still held that each one saw in the
    cache: ``new``/``old`` map a node to (firm, idle)."""

    new_at: float | None
    old_at: float | None
    new: Mapping[str, tuple[int, int]]
    old: Mapping[str, tuple[int, int]]


def others_seen(gens: Mapping[str, SeenGen], me: str, node: str, since: float | None, idle: bool) -> int:
    """others_seen is the KV (tokens) of the other replicas' leases on ``node`` that were in
    its cache when it rendered a report whose mark saw the store's instant ``since``: of
    each replica but ``me``, its newest generation stamped before ``since``, else the one
    before, else nothing; firm footprints, and idle ones when the report said ``idle``.

    The Redis admit script computes the same (``others`` there); the differential test
    holds them equal.
    """
    if since is None:
        return 0
    total = 0
    for replica, g in gens.items():
        if replica == me:
            continue
        sums = (g.new if g.new_at is not None and g.new_at < since
                else g.old if g.old_at is not None and g.old_at < since else None)
        if sums is not None:
            firm, idle_fp = sums.get(node, (0, 0))
            total += firm + (idle_fp if idle else 0)
    return total


def pick_shared(ask: NodeAsk, held: Mapping[str, int], others: Mapping[str, int] | None = None,
                sums: Mapping[str, Sums] | None = None,
                prefixes: Mapping[str, SharedPrefixes] | None = None,
                last: frozenset[str] = frozenset()) -> rules.NodePass:
    """pick_shared is ``rules.pick_node`` over ``ask``'s candidates with ``held`` (tokens per
    node, every replica's requests; missing: 0) in place of this replica's own holds, and
    each node's foreign KV less ``others`` (tokens per node, ``others_seen``; missing: 0)
    beyond the node's ``cross`` (see ``sharing``), never below its rise.

    With pooled growth (``ask.pooled``), ``held`` is the footprints and ``sums`` the sums of
    every replica's requests' moments per node (missing: none): a node then holds its
    footprints plus the bound of the sums with the request's, less the request's need, as
    ``nodes.PoolNodes.pick`` hands ``rules.pick_node`` its own node's.

    ``prefixes``: every replica's leases' prefixes per node (missing: none): a node holds
    less their shared tokens, and the request is charged less its credit there, and
    ranked by its credit or what this replica saw cached there, at ``ask.affinity``, as
    ``nodes.PoolNodes.pick`` does with its own.

    ``last``: the nodes where other replicas' waiting requests gather room, taken only when
    no other fits (``fairshare.gathering``).

    This is the rule the Redis admit script applies; the differential test holds them equal.
    """
    rows = []
    p = ask.pooled
    affinity: dict[str, int] = {}
    for c in ask.candidates:
        shared = (prefixes or {}).get(c.name)
        foreign = _foreign(c, others, shared)
        on = held.get(c.name, 0)
        if p is not None:
            left, mean, var = (sums or {}).get(c.name, (0, 0.0, 0.0))
            on += p.footprint + rules.pooled_bound(left + p.left, mean + p.mean, var + p.var, p.quantile) - ask.need
        credit = 0
        if shared is not None:
            credit = min(ask.prompt, shared.credit(ask.chain, c.block))
            on -= shared.shared + credit
        bonus = max(credit, c.cached)
        if bonus:
            affinity[c.name] = math.floor(bonus * ask.affinity)
        rows.append((c.name, c.cap, foreign, on))
    return rules.pick_node(rows, ask.need, ask.reserve_fraction, ask.watermark, affinity, last)


def _foreign(c: Candidate, others: Mapping[str, int] | None, shared: SharedPrefixes | None) -> int:
    """_foreign is candidate ``c``'s foreign KV less ``others`` beyond the node's ``cross``,
    never below its rise (``pick_shared``)."""
    gone = (others or {}).get(c.name, 0) - (shared.cross if shared is not None else 0)
    return max(c.rise, c.foreign - max(0, gone))


def room_bases(ask: NodeAsk, others: Mapping[str, int] | None = None,
               prefixes: Mapping[str, SharedPrefixes] | None = None) -> tuple[tuple[str, int], ...]:
    """room_bases is, per candidate of ``ask``, the room ``pick_shared`` reads there before any
    lease's hold (tokens): the effective capacity, or the class's share of it where the
    watermark is lower, less the foreign KV. A node refusal's want keeps them
    (``fairshare.Want``): the other replicas read there where its request is closest to
    fitting."""
    out = []
    for c in ask.candidates:
        limit = rules.effective_capacity(c.cap, ask.reserve_fraction)
        if ask.watermark < 1.0:
            limit = min(limit, math.floor(ask.watermark * limit))
        out.append((c.name, limit - _foreign(c, others, (prefixes or {}).get(c.name))))
    return tuple(out)


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
    for name, capacity, foreign, own, *_ in ask.candidates:
        eff = rules.effective_capacity(capacity, ask.reserve_fraction)
        class_room = None if ask.watermark >= 1.0 else math.floor(ask.watermark * eff) - foreign - own
        room = rules.node_headroom(capacity, ask.reserve_fraction, foreign, own)
        rooms.append((name, room if free is None else min(room, free.get(name, 0)), class_room))
    return rules.choose_node(rooms, ask.need)


def candidates_of(rows: Sequence[tuple[str, int, int, int]]) -> tuple[Candidate, ...]:
    """candidates_of is ``Candidate`` rows from (name, capacity, foreign, own_held) tuples."""
    return tuple(Candidate(str(n), int(c), int(f), int(h)) for n, c, f, h in rows)
