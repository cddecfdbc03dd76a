"""redis_commands: the calls of the store's scripts built from a plan, and the admit reply read.

The argument layouts are ``redis_lua``'s (one definition for both languages); this module
fills them from a ``Plan`` or a ``Grant`` and reads the admit script's answer into a
``Grant`` or a ``Refusal``. ``now`` is the instant a script runs at: None (Redis ``TIME``)
or the caller's (s, with an injected clock); ``ttl`` the lease TTL (s); ``texp`` how long
a full tenant bucket is kept (s, < 0: kept).
"""

from __future__ import annotations

from typing import Any

from extproc.admission.shared_nodes import Shared
from extproc.admission.store.redis_ledger import Keys, keyed, ledger_hold
from extproc.admission.store.redis_lua import (ADMIT, REFRESH, SETTLE, AdmitArg, AdmitPool, Guarantee, RefreshArg,
                                               RefreshLease, SettleArg, chain_arg, node_arg, pack, word)
from extproc.admission.types import Budget, Grant, Plan, Refusal


class Rebuilding(Exception):
    """Rebuilding is the admit script's answer while a pool's ledger is rebuilt (``seconds`` left)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds


def admit_cmd(plan: Plan, keys: Keys, lease_id: str, now: float | None, ttl: float,
              texp: float) -> tuple[Any, ...]:
    """admit_cmd is the admit script's call for ``plan`` as lease ``lease_id``."""
    lim = plan.limits
    pb = lim.bucket
    tb = plan.tenant_bucket
    cached = keys.limits
    if cached is None or cached[0] is not lim:
        # The pool's part of the argument changes only with its limits (the scale).
        if pb is not None:
            keys.pool_bucket = keys.bucket(pb)
        pool = AdmitPool(limit=lim.limit, kvb=lim.kv_budget, base_kv=lim.base_kv_budget,
                         est=float(lim.retry_estimate_s),
                         pcap=None if pb is None else float(pb.capacity),
                         prate=None if pb is None else float(pb.rate),
                         pbase=None if pb is None else float(pb.base_capacity))
        guarantees = pack(w for name, g in lim.guarantees.items() for w in Guarantee(name, g))
        cached = keys.limits = (lim, pack(pool), guarantees)
    ceiling = lim.kv_ceilings.get(plan.class_name) if lim.kv_ceilings else None
    arg = AdmitArg(now=now, id=lease_id, ttl=ttl, cls=plan.class_name,
                   n=int(plan.tokens), pool=cached[1],
                   tcap=None if tb is None else float(tb.capacity),
                   trate=None if tb is None else float(tb.rate),
                   tbase=None if tb is None else float(tb.base_capacity),
                   texp=texp,
                   ckv=None if ceiling is None else ceiling[0],
                   cbase=None if ceiling is None else ceiling[1], waits=1 if plan.waits else 0,
                   guarantees=cached[2])
    if plan.nodes is None:
        return ADMIT.command(keys.of_plan(plan), pack(arg), "-", "-")
    return ADMIT.command(keys.of_plan(plan), pack(arg), node_arg(plan.nodes), chain_arg(plan.nodes))


def read_admit(plan: Plan, lease_id: str, head: bytes) -> Grant | Refusal:
    """read_admit reads the head of the admit script's reply to lease ``lease_id`` (the part
    before its view). Raises ``Rebuilding``, or ValueError (and the parsers' errors) on a
    reply it cannot read."""
    r = head.split()
    code = int(r[0])
    if code == 3:
        raise Rebuilding(float(r[1]))
    if code == 1:
        grant = Grant(lease_id, plan, int(r[1]))
        if r[2] != b"-":
            grant.bucket_tokens = float(r[2])
            grant.bucket_capacity = float(r[3])
            grant.bucket_rate = float(r[4])
        if plan.nodes is not None:
            if r[5] == b"-":
                raise ValueError("admit picked no node for a plan that asked one")
            grant.picked = r[5].decode()
            grant.node_hold = plan.nodes.need
            grant.node_pooled = plan.nodes.pooled
            if r[6] != b"0" or r[7] != b"0" or r[8] != b"0":
                grant.node_shared = Shared(keyed(plan.nodes, grant.picked, int(r[6])), int(r[7]), r[8] == b"1")
        return grant
    if code == 0:
        return Refusal(Budget(r[1].decode()), float(r[2]), r[3] == b"1", float(r[4]),
                       float(r[5]), float(r[6]))
    raise ValueError(f"admit answered code {code} for a fresh lease id")


def refused_holds(head: bytes) -> dict[str, int]:
    """refused_holds is what a node refusal of the admit script (``read_admit``'s head) saw
    every replica's leases hold on each candidate node (tokens; empty for any other reply)."""
    r = head.split()
    if len(r) < 9 or r[0] != b"0":
        return {}
    return {r[i].decode(): int(float(r[i + 1])) for i in range(7, len(r) - 1, 2)}


def settle_cmd(plan: Plan, keys: Keys, lease_id: str, charged: int, now: float | None, ttl: float,
               texp: float) -> tuple[Any, ...]:
    """settle_cmd is the settle script's call for lease ``lease_id`` of ``plan``, charged
    ``charged`` tokens in the end."""
    pb = plan.limits.bucket
    tb = plan.tenant_bucket
    arg = SettleArg(now=now, id=lease_id, charged=int(charged), ttl=ttl,
                    pcap=None if pb is None else float(pb.capacity),
                    prate=None if pb is None else float(pb.rate),
                    tcap=None if tb is None else float(tb.capacity),
                    trate=None if tb is None else float(tb.rate), texp=texp)
    return SETTLE.command(keys.of_plan(plan), pack(arg))


def refresh_cmd(keys: Keys, lead: RefreshArg, leases: list[Grant]) -> tuple[Any, ...]:
    """refresh_cmd is the refresh script's call that extends ``leases`` of one pool (and takes
    again those Redis lost), each with the hold and the footprint its marks saw now."""
    argv: list[object] = [*lead]
    for g in leases:
        p = g.node_pooled
        argv.extend(RefreshLease(id=g.id, cls=g.plan.class_name, tok=int(g.plan.tokens),
                                 node=g.picked or "-", hold=ledger_hold(g),
                                 seen=int(g.node.seen) if g.node is not None else 0,
                                 l=0 if p is None else int(p.left),
                                 m=0.0 if p is None else float(p.mean),
                                 v=0.0 if p is None else float(p.var)))
    return REFRESH.command(keys.of_refresh(), *map(word, argv))


REFRESH_CHUNK = 500
"""REFRESH_CHUNK is how many leases one refresh script call carries at most, so that one call
never blocks Redis for long."""


def refresh_cmds(keys: dict[str, Keys], live: dict[str, dict[str, Grant]], now: float | None, ttl: float,
                 replica: str, round_: int) -> tuple[list[tuple[Any, ...]], list[str], list[list[Grant]]]:
    """refresh_cmds are the refresh script's calls of refresh round ``round_`` of ``replica``:
    every known pool's ``live`` leases, in chunks (one call for a pool with none); the pool
    of each call, and the leases each carries."""
    cmds: list[tuple[Any, ...]] = []
    pools: list[str] = []
    sent: list[list[Grant]] = []
    for pool, k in keys.items():
        leases = list(live.get(pool, {}).values())
        chunks = [leases[i:i + REFRESH_CHUNK] for i in range(0, len(leases), REFRESH_CHUNK)] or [[]]
        lead = RefreshArg(now=now, ttl=ttl, has_pb=1 if k.pool_bucket else 0, replica=replica, round=round_)
        for chunk in chunks:
            cmds.append(refresh_cmd(k, lead, chunk))
            pools.append(pool)
            sent.append(chunk)
    return cmds, pools, sent
