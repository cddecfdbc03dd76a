"""base: the Store interface, where a pool's budget state lives.

The controller turns a request into a ``Plan`` (``extproc.admission.types``): pure data that says how many tokens the
request reserves and what the limits are *now* (after the adaptive scale, per class and
per tenant). A store holds the mutable state (in-flight counts, in-flight KV tokens,
token buckets) and applies ONE rule, ``extproc.admission.rules``, to a plan against that
state, atomically: the in-memory store calls the Python rule under the event loop; a
shared store (Redis) mirrors the same rule in one Lua script, so that both answer the same
plan on the same state identically. The controller never reads the state to decide.

Times are seconds on the caller's monotonic clock (``now``); a shared store may use its
own clock instead (Redis ``TIME``) so that replicas agree, as long as it uses one clock for
all its buckets. Token amounts are tokens (prompt + completion).

Contract of every store:
- ``admit`` is atomic: either every budget is charged (one slot, the plan's tokens on the
  KV budget and on each bucket of the plan) and a ``Grant`` comes back, or nothing changes
  and a ``Refusal`` comes back.
- ``settle`` undoes exactly what its grant charged, except that the buckets are charged
  ``charged_tokens`` in the end (refund ``plan.tokens - charged_tokens`` when positive,
  clamped at the bucket's capacity; extra charge, possibly into debt, when negative). It
  must not block and must not raise for a grant it issued; settling the same grant twice
  is a caller bug that the controller prevents (``Lease.release`` is idempotent).
- ``usage`` reports the state for metrics; a shared store may answer from its last view.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from extproc.admission.types import Grant, Plan, PoolUsage, Refusal
from extproc.errors import KvgateError


REPLICA_HEADER = "x-kvgate-replica"
"""REPLICA_HEADER carries, on the admin ``/healthz``, the id under which this process shares a
store with other replicas: how they tell that the same process still runs at an address."""


class StoreError(KvgateError):
    """StoreError is a store that cannot answer (unreachable, timed out, bad reply)."""


class Store(ABC):
    """Store holds the budgets of every pool and applies the admission rule atomically.

    ``shared`` is True when other processes change the same state (then the controller
    cannot learn of releases by itself and re-tries its waiters on a timer);
    ``shares_nodes`` is True when the store also picks nodes over every replica's holds
    (a plan's ``nodes``), answering ``Grant.picked`` or a ``node_kv`` refusal.
    """

    shared: bool = False
    shares_nodes: bool = False

    @abstractmethod
    async def admit(self, plan: Plan, now: float) -> Grant | Refusal:
        """admit charges every budget of ``plan`` at instant ``now`` (s) or refuses it.

        Raises ``StoreError`` when the store cannot answer.
        """

    @abstractmethod
    def settle(self, grant: Grant, charged_tokens: int, now: float) -> None:
        """settle releases ``grant`` at ``now`` (s): the buckets end up charged ``charged_tokens``.

        Never blocks: a remote store queues the write. Never raises for its own grants.
        """

    @abstractmethod
    def usage(self, pool: str, now: float) -> PoolUsage:
        """usage reports the pool's state at ``now`` (s) for metrics (possibly a last view)."""

    def instant(self) -> float | None:
        """instant is the store's instant (s) of the latest answer received from it, for a store
        whose replicas publish what their nodes' caches hold (``shared_nodes``); None: none."""
        return None

    def others_seen(self, pool: str, node: str, since: float | None, idle: bool) -> int:
        """others_seen is the KV (tokens) of other replicas' requests that ``node`` of ``pool``
        held when it rendered a report whose mark saw the store's instant ``since``, and
        that are still held (``shared_nodes.others_seen``); 0 without other replicas."""
        return 0

    def node_holds(self, pool: str) -> Mapping[str, int] | None:
        """node_holds is what every replica's leases hold per node of ``pool`` (tokens), as the
        store last read it, for retry hints (``nodes.PoolNodes.retry_after``); None: this
        replica's leases are all there is."""
        return None

    def teach(self, pool: str, class_name: str, completion_tokens: int) -> None:
        """teach hands a store shared by replicas one completion length this replica learned
        (tokens), for every replica's ``learned``; nothing for a store of one replica."""

    def learned(self, pool: str) -> Mapping[str, Sequence[int]] | None:
        """learned is the completion lengths every replica taught for ``pool`` (per class, oldest
        first) when the store read new ones since it was last asked; None: nothing new."""
        return None

    async def close(self) -> None:
        """close releases the store's connections; the in-memory store has none."""


class SyncStore(Store):
    """SyncStore is an in-process store that answers at once: ``Admission.acquire`` then decides without suspending."""

    @abstractmethod
    def admit_now(self, plan: Plan, now: float) -> Grant | Refusal:
        """admit_now is ``admit`` without the coroutine, for the synchronous hot path."""

    async def admit(self, plan: Plan, now: float) -> Grant | Refusal:
        return self.admit_now(plan, now)
