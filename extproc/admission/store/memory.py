"""memory: the in-process store, for one kvgate replica (the default).

All state changes happen on one event loop between awaits, so no lock is needed
(``admit`` never suspends). It applies ``rules.decide`` and nothing else.
"""

from __future__ import annotations

from extproc.admission.bucket import TokenBucket
from extproc.admission.kvbudget import KvLedger
from extproc.admission.rules import decide
from extproc.admission.slots import Slots
from extproc.admission.store.base import SyncStore
from extproc.admission.types import POOL_BUCKET, BucketSpec, Grant, Plan, PoolUsage, Refusal


class _PoolState:
    """_PoolState is one pool's budgets: slots, in-flight KV tokens and token buckets by key."""

    __slots__ = ("slots", "kv", "buckets")

    def __init__(self) -> None:
        self.slots = Slots()
        self.kv = KvLedger()
        self.buckets: dict[str, TokenBucket] = {}

    def bucket(self, spec: BucketSpec, now: float) -> TokenBucket:
        """bucket is the bucket ``spec`` names, created full, refilled to ``now`` with the spec's limits."""
        b = self.buckets.get(spec.key)
        if b is None:
            b = self.buckets[spec.key] = TokenBucket(spec.capacity, spec.rate, now)
        elif b.capacity != spec.capacity or b.rate != spec.rate:
            b.set_limits(spec.capacity, spec.rate, now)
        else:
            b.refill(now)
        return b


class MemoryStore(SyncStore):
    """MemoryStore keeps every pool's budgets in this process; grant ids are ``m<n>``."""

    __slots__ = ("_pools", "_next_id")

    shared = False

    def __init__(self) -> None:
        self._pools: dict[str, _PoolState] = {}
        self._next_id = 0

    def _state(self, pool: str) -> _PoolState:
        st = self._pools.get(pool)
        if st is None:
            st = self._pools[pool] = _PoolState()
        return st

    def admit_now(self, plan: Plan, now: float) -> Grant | Refusal:
        """admit_now charges every budget of ``plan`` at ``now`` (s), or refuses it; see ``Store.admit``."""
        limits = plan.limits
        st = self._pools.get(limits.pool)
        if st is None:
            st = self._state(limits.pool)
        pb = tb = None
        pool_tokens = tenant_tokens = None
        if limits.bucket is not None:
            pb = st.bucket(limits.bucket, now)
            pool_tokens = pb.tokens
        if plan.tenant_bucket is not None:
            tb = st.bucket(plan.tenant_bucket, now)
            tenant_tokens = tb.tokens
        slots = st.slots
        refusal = decide(plan, slots.inflight, slots.by_class, st.kv.inflight, pool_tokens, tenant_tokens)
        if refusal is not None:
            return refusal
        n = plan.tokens
        inflight = slots.take(plan.class_name)
        st.kv.inflight += n
        self._next_id += 1
        grant = Grant("m" + str(self._next_id), plan, inflight)
        binding = None
        if pb is not None:
            pb.tokens -= n  # refilled to ``now`` by st.bucket above
            binding = pb
        if tb is not None:
            tb.tokens -= n
            if binding is None or tb.tokens < binding.tokens:
                binding = tb
        if binding is not None:
            grant.bucket_tokens = binding.tokens
            grant.bucket_capacity = binding.capacity
            grant.bucket_rate = binding.rate
        return grant

    def settle(self, grant: Grant, charged_tokens: int, now: float) -> None:
        """settle frees the grant's slot and KV tokens and settles its buckets at ``charged_tokens``."""
        plan = grant.plan
        st = self._state(plan.limits.pool)
        st.slots.give(plan.class_name)
        st.kv.give(plan.tokens)
        refund = plan.tokens - charged_tokens
        if refund:
            spec = plan.limits.bucket
            if spec is not None:
                b = st.buckets.get(spec.key)
                if b is not None:
                    b.give(refund, now)
            spec = plan.tenant_bucket
            if spec is not None:
                b = st.buckets.get(spec.key)
                if b is not None:
                    b.give(refund, now)

    def usage(self, pool: str, now: float) -> PoolUsage:
        """usage reports the pool's slots, KV tokens and pool-bucket tokens at ``now`` (s)."""
        st = self._pools.get(pool)
        if st is None:
            return PoolUsage()
        b = st.buckets.get(POOL_BUCKET)
        return PoolUsage(inflight=st.slots.inflight, by_class=dict(st.slots.by_class),
                         kv_inflight=st.kv.inflight,
                         bucket_tokens=None if b is None else b.peek(now))

    def bucket_state(self, pool: str, key: str, now: float) -> tuple[float, float] | None:
        """bucket_state is a bucket's (tokens, capacity) at ``now`` (s), or None when it does not exist yet."""
        st = self._pools.get(pool)
        b = None if st is None else st.buckets.get(key)
        return None if b is None else (b.peek(now), b.capacity)
