"""placement: a picking pool's request placed on a node, around the store's answer.

In a pool that picks its nodes, admission is one sequence whatever the store: ``place`` (a
node charged here, or the per-node question for a store that shares the nodes' ledger),
the store's admission of the resulting plan, then ``attach`` (the grant given its charge,
or a refusal that gives the charge back) — or ``undo`` when the store failed. The node
ledger's bookkeeping around a store's answer lives here, over ``nodes.PoolNodes``; the
controller only calls the store between the two.

| store                         | place                             | attach: grant           | attach: refusal                      |
|-------------------------------|-----------------------------------|-------------------------|--------------------------------------|
| keeps no node ledger          | a node picked and charged here    | the grant gets it       | the charge is taken back              |
| shares the nodes' ledger      | the question (``NodeAsk``)        | the node it chose,      | KV refusals: every candidate passed   |
| (``Store.shares_nodes``)      |                                   | charged here            | over, a retry hint from these nodes   |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from extproc.admission.node import Charge, PassedOver
from extproc.admission.nodes import PoolNodes, Seen
from extproc.admission.shared_nodes import NodeAsk
from extproc.admission.types import Budget, Demand, Grant, Plan, Refusal
from extproc.config import ClassConfig


@dataclass(slots=True)
class Placement:
    """Placement is a request placed in a picking pool before the store answers: ``plan``
    for the store (with the per-node question when the store shares the nodes' ledger),
    ``charge`` the node charged here (None: the store picks), ``ask`` the question."""

    nodes: PoolNodes
    demand: Demand
    cls: ClassConfig
    plan: Plan
    charge: Charge | None
    ask: NodeAsk | None


def place(nodes: PoolNodes, demand: Demand, cls: ClassConfig, plan: Plan, now: float,
          retry_estimate_s: float, shared: bool, seen: Seen | None = None) -> Placement | Refusal:
    """place charges a node for ``demand`` (``shared`` False), or asks the question a store
    that shares the nodes' ledger answers (``shared`` True), or says why no node fits.

    A request above every node's capacity is refused for good (no retry); one that fits no
    node now is refused with the expected wait until one has room (``PoolNodes.retry_after``).
    """
    pt, ct = demand.prompt_tokens, demand.reserved_completion
    largest = nodes.never_fits(cls.name, pt, ct)
    if largest is not None:
        return Refusal(Budget.NODE_KV, 0.0, False, nodes.growth.hold(pt, ct, 0, cls.name), 0, largest)
    if shared:
        ask = nodes.ask(cls.name, pt, ct, cls.kv_watermark, now, demand.among, demand.prefix)
        return Placement(nodes, demand, cls, Plan(plan.limits, plan.tenant, plan.class_name, plan.tokens,
                                                  plan.tenant_bucket, ask, plan.waits), None, ask)
    picked = nodes.pick(cls.name, pt, ct, cls.kv_watermark, now, demand.among, demand.prefix, seen)
    if isinstance(picked, Charge):
        return Placement(nodes, demand, cls, plan, picked, None)
    wait = nodes.retry_after(picked.need, now, retry_estimate_s)
    budget = Budget.CLASS_KV if picked.by_watermark else Budget.NODE_KV
    return Refusal(budget, wait, True, picked.need, picked.best_room or 0, picked.best_room or 0)


def attach(placed: Placement, res: Grant | Refusal, now: float, retry_estimate_s: float,
           holds: Mapping[str, int] | None = None) -> Grant | Refusal:
    """attach completes a placement with the store's answer: a grant gets its node charge (the
    one charged here, or the one the sharing store chose, charged here now); a refusal takes
    the charge back, and a sharing store's KV refusal counts every candidate passed over and
    gets its retry hint from these nodes over every replica's holds there (``holds``,
    ``Store.node_holds``; a picking pool has no pool-wide KV budget, so its KV refusals are
    the node rule's)."""
    nodes, charge = placed.nodes, placed.charge
    if charge is not None:
        if isinstance(res, Grant):
            res.node = charge
        else:
            undo(placed)
        return res
    ask = placed.ask
    assert ask is not None
    if isinstance(res, Refusal):
        if res.budget is Budget.NODE_KV or res.budget is Budget.CLASS_KV:
            nodes.passed_over_all(ask, PassedOver.NO_ROOM if res.budget is Budget.NODE_KV
                                  else PassedOver.CLASS_WATERMARK)
            wait = nodes.retry_after(ask.need, now, retry_estimate_s, holds)
            return Refusal(res.budget, wait, True, res.needed, res.used, res.limit)
        return res
    if res.picked is not None:
        d, shared = placed.demand, res.node_shared
        res.node = nodes.charge(res.picked, placed.cls.name, d.prompt_tokens, d.reserved_completion, now,
                                d.prefix, 0 if shared is None else shared.credit,
                                False if shared is None else shared.by_affinity)
    return res


def undo(placed: Placement) -> None:
    """undo takes back the node charge of a placement the store did not grant (refused, or
    failed): the node is left as it was, its pick uncounted."""
    charge = placed.charge
    if charge is not None and charge.held:
        charge.drop()
        charge.node.picks -= 1
