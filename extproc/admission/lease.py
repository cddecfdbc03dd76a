"""lease: ``Lease``, an admitted request's hold on its pool's budgets, given back once.

A lease reports to the ``Admission`` that granted it (``LeaseOwner``): its admission, the
tokens its request generates, the node that served it, and its release.
"""

from __future__ import annotations

from typing import Protocol

from extproc.admission.node import Charge
from extproc.admission.types import Demand, Grant, Outcome, RateInfo

_tuple_new = tuple.__new__
# A module name: reading an attribute of an Enum class goes through EnumType.__getattr__'s
# hook in Python 3.11 (~1k instructions, a global ~0.1k), on every release.
_COMPLETED = Outcome.COMPLETED


class LeaseOwner(Protocol):
    """LeaseOwner is the port a lease reports through, to the controller that granted it:
    its admission (the instant, s), its request's progress (tokens generated), the node that
    served it, and its settlement (tokens charged, the completion known)."""

    def lease_admitted(self, lease: Lease) -> float: ...

    def lease_progress(self, pool: str, charge: Charge, generated: int, grant: Grant) -> None: ...

    def lease_served(self, pool: str, charge: Charge, address: str) -> bool: ...

    def lease_settled(self, grant: Grant, charged: int, completion: int | None = None,
                      completed: bool = False, lease: Lease | None = None) -> None: ...


class Lease:
    """Lease is an admitted request's hold on its pool's budgets, until ``release``.

    ``demand`` is what was asked; ``id`` is the store's grant id; ``released`` tells
    whether it was released; ``outcome`` is how it ended (None while held).
    """

    __slots__ = ("_adm", "_grant", "demand", "released", "outcome", "_max_completion", "_charge",
                 "admitted_at")

    def __init__(self, adm: LeaseOwner, grant: Grant, demand: Demand, max_completion: int) -> None:
        self._adm = adm
        self._grant = grant
        self.demand = demand
        self.released = False
        self.outcome: Outcome | None = None
        # n choices (or a batch of prompts) reserve and generate up to n x max_tokens,
        # which can exceed one context window.
        reserved = demand.reserved_completion
        self._max_completion = reserved if reserved > max_completion else max_completion
        self._charge: Charge | None = grant.node
        self.admitted_at = adm.lease_admitted(self)

    @property
    def node(self) -> str | None:
        """node is the address (``HOST:PORT``) of the node picked for the request (None: not picked)."""
        return None if self._charge is None else self._charge.address

    @property
    def destination(self) -> str | None:
        """destination is what the request is steered by (None: not picked): the node picked,
        then the fallbacks picked with it, as the endpoint picker protocol lists them
        (``HOST:PORT,HOST:PORT``; the charge is on the first)."""
        c = self._charge
        return None if c is None else ",".join((c.address, *c.fallbacks))

    def progress(self, generated_tokens: int) -> None:
        """progress tells a picked node's ledger how many tokens the request has generated so far."""
        c = self._charge
        if c is not None and not self.released:
            self._adm.lease_progress(self.demand.pool, c, generated_tokens, self._grant)

    def served(self, address: str) -> bool:
        """served moves the request's node charge to ``address`` (``HOST:PORT``), the endpoint
        the proxy says served it, when that is another node of the pool than the one picked.
        False when nothing moved: not picked, released, the same node, or an address that is
        no node of the pool (the charge then stays on the node picked). With a store that
        shares the nodes' ledger the charge stays on the node picked (see ``Admission.lease_served``): True
        for an address that is a node of the pool."""
        c = self._charge
        if c is None or self.released:
            return False
        return self._adm.lease_served(self.demand.pool, c, address)

    @property
    def id(self) -> str:
        """id is the grant's id in the store."""
        return self._grant.id

    @property
    def rate(self) -> RateInfo:
        """rate is what the ``x-ratelimit-*`` headers report, as of the admission.

        Tokens describe the binding bucket (the tenant's or the pool's, whichever had
        fewer tokens left); None without buckets.
        """
        g = self._grant
        limit = g.plan.limits.limit
        remaining = limit - g.inflight
        if remaining < 0:
            remaining = 0
        # The tuple made by tuple.__new__, all six fields given: RateInfo's generated
        # __new__ is a Python frame with keyword matching, a few thousand instructions on
        # every admitted request (the result is the same RateInfo).
        if g.bucket_capacity is None:
            return _tuple_new(RateInfo, (limit, remaining, None, None, 0.0, 0.0))
        cap = g.bucket_capacity
        left = g.bucket_tokens or 0.0
        rate = g.bucket_rate
        # Conditional expressions, not max(): a builtin's call costs several times as much.
        tokens = int(left)
        reset = (cap - left) / rate if rate else 0.0
        return _tuple_new(RateInfo, (limit, remaining, int(cap), tokens if tokens > 0 else 0,
                                     reset if reset > 0.0 else 0.0, 0.0))

    def release(self, outcome: Outcome, completion_tokens: int | None = None) -> bool:
        """release gives the lease back once; True only for the call that released it.

        ``completion_tokens`` is the completion the upstream reported; the buckets end up
        charged prompt + that. None (unknown), or anything that is not an integer >= 0,
        charges the whole reservation, never zero. A count above the larger of the pool's
        context window and the reservation is capped there (a backend's report is outside
        input).
        """
        if self.released:
            return False
        self.released = True
        self.outcome = outcome
        d = self.demand
        known: int | None = None
        if type(completion_tokens) is int and completion_tokens >= 0:
            known = completion_tokens if completion_tokens < self._max_completion else self._max_completion
            charged = d.prompt_tokens + known
        else:
            charged = d.prompt_tokens + d.reserved_completion
        completed = outcome is _COMPLETED
        self._adm.lease_settled(self._grant, charged, known if completed else None, completed, self)
        return True

    def abandon(self) -> None:
        """abandon takes back a lease its requester never received: nothing ran, nothing is charged."""
        if not self.released:
            self.released = True
            self.outcome = Outcome.CLIENT_DISCONNECT
            self._adm.lease_settled(self._grant, 0, None, False, self)

    def __repr__(self) -> str:
        return f"Lease({self.id}, {self.demand.pool}/{self.demand.tenant}, released={self.released})"
