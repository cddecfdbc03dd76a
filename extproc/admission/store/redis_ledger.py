"""redis_ledger: the shared ledger's keys in Redis (``Keys``) and the readers of its hashes.

Key layout (``P`` = ``key_prefix``; ``{pool}`` is a hash tag, so that a pool's keys share
one Redis Cluster slot and one script may touch them all):

=========================  ======  ==========================================================
``P{pool}:st``             hash    ``n`` slots in use, ``kv`` in-flight KV tokens, ``c:<class>`` slots per class,
                                   ``r:<replica>`` live leases per replica and ``w:<replica>`` the instant and
                                   tokens of its latest refusal that wants room (``fairshare.wants``; for a
                                   node refusal then the hold and ``node room`` pairs, ``fairshare.Want``)
``P{pool}:lz``             zset    lease id -> expiry (s, store time)
``P{pool}:lh``             hash    lease id -> ``<class>\\t<tokens>[\\t<node>\\t<hold>\\t<round>\\t<fn>\\t<fo>[\\t<l>\\t<m>\\t<v>]]``:
                                   what the lease holds, what it adds to its replica's newest
                                   (``fn``) and older (``fo``) generation (tokens; < 0: idle), and
                                   its growth's moments with pooled growth
``P{pool}:nk``             hash    node name -> tokens every live lease holds on it (picking pools)
``P{pool}:sn``             hash    ``<replica>\\t<node>\\t<F|I|f|i>`` -> tokens a replica's marks saw in
                                   the node's cache: firm or idle, newest (``F``, ``I``) or older
``P{pool}:sr``             hash    replica id -> ``<new_at> <old_at> <round>``: its generations' stamps
``P{pool}:nm``             hash    ``<node>\\t<l|m|v>`` -> with pooled growth, the sums of the moments of the
                                   growth of every lease on the node (``shared_nodes.Pooled``)
``P{pool}:pk``             hash    ``<node>\\t<key>`` -> ``<holders> <tokens> <replicas>``, and
                                   ``<node>\\t<key>\\t<replica>`` -> that replica's holders: the prefix
                                   keys of the leases on the node (``sharing.SharedPrefixes``)
``P{pool}:ps``             hash    ``<node>\\t<b|d|e|n|x>`` -> the node's block size, dup, extra,
                                   distinct keys and cross-replica tokens of those prefixes
``P{pool}:lk``             hash    lease id -> the prefix keys it took on its node, in order
``P{pool}:done``           zset    settled lease id -> when its tombstone may go (s)
``P{pool}:b:<bucket key>`` hash    a token bucket: ``tok`` tokens, ``t`` instant, ``cap`` tokens, ``rate`` tokens/s
``P{pool}:ln:<class>``     list    the latest completion lengths (tokens) every replica learned for the
                                   class (``redis_lengths``); ``P{pool}:lc`` (set) names the classes
``P{pool}:rb``             string  while set (it expires): the pool's ledger is rebuilt, no admission
``Preplicas``              zset    replica id -> heartbeat expiry (s)
``Preplica_addrs``         hash    replica id -> where it answers ``/healthz`` (host:port)
``Preplicas_gone``         zset    replica id whose heartbeat expired -> when to forget it (s)
=========================  ======  ==========================================================

"""

from __future__ import annotations

import asyncio

from extproc.admission.rules import pooled_bound
from extproc.admission.shared_nodes import NodeAsk, SeenGen, Sums
from extproc.admission.store.base import REPLICA_HEADER
from extproc.admission.store.redis_lua import PoolKeys, RefreshKeys
from extproc.admission.types import BucketSpec, Grant, Plan, PoolLimits


class Keys:
    """Keys are one pool's Redis keys (see the module's key layout)."""

    __slots__ = ("st", "lz", "lh", "done", "nk", "rb", "sn", "sr", "nm", "pk", "ps", "lk", "ln", "lc",
                 "bucket_prefix", "pool_bucket", "limits")

    def __init__(self, prefix: str, pool: str) -> None:
        base = f"{prefix}{{{pool}}}:"
        self.st = base + "st"
        self.nk = base + "nk"
        self.lz = base + "lz"
        self.lh = base + "lh"
        self.done = base + "done"
        self.rb = base + "rb"
        self.sn = base + "sn"
        self.sr = base + "sr"
        self.nm = base + "nm"
        self.pk = base + "pk"
        self.ps = base + "ps"
        self.lk = base + "lk"
        self.ln = base + "ln:"
        self.lc = base + "lc"
        self.bucket_prefix = base + "b:"
        self.pool_bucket: str | None = None  # learnt from the plans: the pool's bucket key
        # the last PoolLimits seen and its part of the admit argument, and the guarantees
        self.limits: tuple[PoolLimits, str, str] | None = None

    def bucket(self, spec: BucketSpec | None) -> str:
        return self.st if spec is None else self.bucket_prefix + spec.key

    def of_plan(self, plan: Plan) -> PoolKeys:
        """of_plan is the KEYS of the admit and settle scripts for ``plan``."""
        return PoolKeys(st=self.st, lz=self.lz, lh=self.lh, done=self.done,
                        pbk=self.bucket(plan.limits.bucket), tbk=self.bucket(plan.tenant_bucket), nk=self.nk,
                        rb=self.rb, sn=self.sn, sr=self.sr, nm=self.nm, pk=self.pk, ps=self.ps, lk=self.lk)

    def of_refresh(self) -> RefreshKeys:
        """of_refresh is the KEYS of the refresh script (the pool bucket as last learnt)."""
        return RefreshKeys(st=self.st, lz=self.lz, lh=self.lh, done=self.done,
                           pbk=self.pool_bucket or self.st, nk=self.nk, sn=self.sn, sr=self.sr, nm=self.nm,
                           pk=self.pk, ps=self.ps, lk=self.lk)


def ledger_hold(g: Grant) -> int:
    """ledger_hold is what lease ``g`` holds on its node in the shared ledger (tokens): its
    hold, or with pooled growth its footprint (its growth is in the node's moments)."""
    return int(g.node_hold) if g.node_pooled is None else int(g.node_pooled.footprint)


def escrow_hold(g: Grant) -> int:
    """escrow_hold is the room lease ``g`` certainly keeps on its node in the shared ledger
    (tokens), for what this replica may admit alone within it (``_within``): its hold less
    the prompt blocks its prefix keys cover, which the ledger may count once with other
    leases' (``sharing``): a lease that ends gives back at least that much."""
    return ledger_hold(g) - (g.node_shared.keyed if g.node_shared is not None else 0)


def keyed(ask: NodeAsk, node: str, keys: int) -> int:
    """keyed is the tokens of the whole blocks that the first ``keys`` keys of ``ask``'s chain
    cover on ``node`` (at the block size it was asked at)."""
    if keys <= 0 or ask.chain is None:
        return 0
    block = next((c.block for c in ask.candidates if c.name == node), 0)
    end = ask.chain.ends[min(keys, len(ask.chain.ends)) - 1]
    return end - end % block if block > 0 else 0


def read_sums(moments: dict[bytes, bytes]) -> dict[str, Sums]:
    """read_sums is a pool's ``nm`` hash (see the key layout) as the moments' sums per node."""
    parts: dict[str, dict[str, float]] = {}
    for field, value in moments.items():
        node, kind = field.decode().rsplit("\t", 1)
        parts.setdefault(node, {})[kind] = float(value)
    return {node: (int(p.get("l", 0)), p.get("m", 0.0), p.get("v", 0.0)) for node, p in parts.items()}


def read_shares(sums: dict[bytes, bytes]) -> dict[str, tuple[int, int]]:
    """read_shares is a pool's ``ps`` hash (see the key layout) as (shared, cross) tokens per node."""
    parts: dict[str, dict[str, float]] = {}
    for field, value in sums.items():
        node, kind = field.decode().rsplit("\t", 1)
        parts.setdefault(node, {})[kind] = float(value)
    return {node: (max(0, int(p.get("d", 0) - p.get("b", 0) * p.get("e", 0))), int(p.get("x", 0)))
            for node, p in parts.items()}


def node_totals(held: dict[bytes, bytes], moments: dict[bytes, bytes], quantile: float | None,
                shares: dict[str, tuple[int, int]] | None = None) -> dict[str, int]:
    """node_totals is what every replica's leases hold on each node (tokens), from a pool's
    ``nk`` and ``nm`` hashes: the holds, plus with pooled growth the bound of the node's
    moments at ``quantile`` (None: no pooled admission seen yet, so the sum of the
    reservations left, which bounds it), less the prompt tokens they share (``shares``,
    ``read_shares``)."""
    totals = {k.decode(): int(v) - (shares or {}).get(k.decode(), (0, 0))[0] for k, v in held.items()}
    for node, (left, mean, var) in read_sums(moments).items():
        grow = left if quantile is None else pooled_bound(left, mean, var, quantile)
        totals[node] = totals.get(node, 0) + grow
    return totals


def read_gens(stamps: dict[bytes, bytes], sums: dict[bytes, bytes]) -> dict[str, SeenGen]:
    """read_gens is every replica's generations from a pool's ``sr`` and ``sn`` hashes (see the
    key layout); a replica without stamps is left out."""
    new: dict[str, dict[str, list[int]]] = {}
    old: dict[str, dict[str, list[int]]] = {}
    for field, value in sums.items():
        replica, node, kind = field.decode().split("\t")
        into = new if kind in ("F", "I") else old
        pair = into.setdefault(replica, {}).setdefault(node, [0, 0])
        pair[0 if kind in ("F", "f") else 1] += int(value)
    gens: dict[str, SeenGen] = {}
    for replica_b, value in stamps.items():
        replica = replica_b.decode()
        words = value.decode().split()
        gens[replica] = SeenGen(
            None if words[0] == "-" else float(words[0]), None if words[1] == "-" else float(words[1]),
            {n: (f, i) for n, (f, i) in new.get(replica, {}).items()},
            {n: (f, i) for n, (f, i) in old.get(replica, {}).items()})
    return gens


async def replica_runs(addr: str, replica: str, timeout: float) -> bool | None:
    """replica_runs asks ``addr`` (host:port of a replica's admin endpoint) whether replica
    ``replica`` runs there: True when its ``/healthz`` names it, False when the port refuses
    the connection or something else answers, None when nothing answers within ``timeout``
    (s) or the network fails otherwise (nothing can be concluded)."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(b"GET /healthz HTTP/1.0\r\nHost: kvgate\r\n\r\n")
                await writer.drain()
                head = await reader.read(4096)
            finally:
                writer.close()
    except ConnectionRefusedError:
        return False
    except (TimeoutError, OSError, ValueError):
        return None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == REPLICA_HEADER.encode():
            return value.strip().decode(errors="replace") == replica
    return False if head.startswith(b"HTTP/") else None
