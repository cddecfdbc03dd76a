"""redis_nodes: what every replica's leases hold on each node, as this replica last read it.

Each refresh reads, per known pool, the ledger's node hashes (``redis_ledger`` key layout):
the holds (``nk``) and growth moments (``nm``) of every replica's leases per node, the
generations each replica published of what its marks saw in the nodes' caches (``sr``,
``sn``) and the prompt prefixes the leases share per node (``ps``). ``NodeReadings`` keeps
them: for the metrics (``held``), for admitting alone (``Escrow.within``), and for netting
the other replicas' requests out of a node's foreign KV (``others_seen``).
"""

from __future__ import annotations

from typing import Any

from extproc.admission.shared_nodes import SeenGen, others_seen
from extproc.admission.store.redis_commands import refused_holds
from extproc.admission.store.redis_ledger import Keys, node_totals, read_gens, read_shares
from extproc.admission.types import Grant, Refusal

_HASHES = 5
"""_HASHES is how many hashes one pool's reading takes (``nk``, ``nm``, ``sr``, ``sn``, ``ps``)."""


class NodeReadings:
    """NodeReadings is, per pool, the last refresh's reading of every replica's leases per node.

    ``held``: node -> tokens every replica's leases hold there (or as a later node refusal
    saw them, ``admitted``); ``gens``: every replica's
    published generations (``shared_nodes.SeenGen``); ``shares``: node -> (shared, cross),
    the prompt tokens the leases there share (counted once) and their cross-replica part;
    ``quantile``: the quantile the pool's pooled growth is bounded at (from its admissions).
    """

    __slots__ = ("held", "gens", "shares", "quantile")

    def __init__(self) -> None:
        self.held: dict[str, dict[str, int]] = {}
        self.gens: dict[str, dict[str, SeenGen]] = {}
        self.shares: dict[str, dict[str, tuple[int, int]]] = {}
        self.quantile: dict[str, float] = {}

    @staticmethod
    def cmds(keys: list[Keys]) -> list[tuple[Any, ...]]:
        """cmds are the reads of the pools of ``keys``, in the order ``read`` takes their replies."""
        return [("HGETALL", k) for keys_ in keys for k in (keys_.nk, keys_.nm, keys_.sr, keys_.sn, keys_.ps)]

    def read(self, pools: list[str], replies: list[Any]) -> None:
        """read keeps the replies to ``cmds`` for ``pools``. Raises the parsers' errors on a
        reply it cannot read."""
        for i, pool in enumerate(pools):
            nk, nm, sr, sn, ps = replies[_HASHES * i:_HASHES * (i + 1)]
            shares = self.shares[pool] = read_shares(ps)
            self.held[pool] = node_totals(nk, nm, self.quantile.get(pool), shares)
            self.gens[pool] = read_gens(sr, sn)

    def admitted(self, pool: str, decision: Grant | Refusal, head: bytes) -> None:
        """admitted keeps what the admit script's reply (``head``, read as ``decision``) tells of
        the nodes: a node refusal's holds, newer than the last refresh's (the retry hints read
        them, ``PoolNodes.retry_after``), and a grant's pooled-growth quantile."""
        if type(decision) is Refusal:
            fresh = refused_holds(head)
            if fresh:
                self.held.setdefault(pool, {}).update(fresh)
        elif isinstance(decision, Grant) and decision.node_pooled is not None:
            self.quantile[pool] = decision.node_pooled.quantile

    def others_seen(self, replica_id: str, pool: str, node: str, since: float | None, idle: bool) -> int:
        """others_seen is ``shared_nodes.others_seen`` over the replicas but ``replica_id``'s
        generations in ``pool``, beyond the node's cross-replica sharing (tokens; as the admit
        script subtracts it, ``shared_nodes.pick_shared``)."""
        gens = self.gens.get(pool)
        if not gens:
            return 0
        cross = self.shares.get(pool, {}).get(node, (0, 0))[1]
        return max(0, others_seen(gens, replica_id, node, since, idle) - cross)
