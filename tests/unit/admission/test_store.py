"""The Store contract, run against every store of the suite (see ``conftest.STORES``).

A shared store joins by adding a fixture parameter: these tests only use the interface.
"""

from __future__ import annotations

import pytest

from extproc.admission.store.base import Store
from extproc.admission.types import Budget, BucketSpec, Grant, Plan, PoolLimits, Refusal

T0 = 1000.0
POOL = BucketSpec("pool", 6000.0, 100.0, 6000.0)
TENANT = BucketSpec("tenant:acme", 1200.0, 20.0, 1200.0)


def limits(**kw) -> PoolLimits:
    base = dict(pool="p", scale=1.0, limit=3, base_limit=3, guarantees={}, kv_budget=5000,
                base_kv_budget=5000, bucket=POOL, retry_estimate_s=1.0)
    base.update(kw)
    return PoolLimits(**base)


def plan(tokens: int, lim: PoolLimits | None = None, tenant: BucketSpec | None = TENANT,
         class_name: str = "standard") -> Plan:
    return Plan(lim or limits(), "acme", class_name, tokens, tenant)


async def test_admit_charges_every_budget_and_settle_takes_it_back(store: Store):
    g = await store.admit(plan(1000), T0)
    assert isinstance(g, Grant) and g.inflight == 1
    u = store.usage("p", T0)
    assert (u.inflight, u.kv_inflight, u.bucket_tokens) == (1, 1000, 5000)
    assert u.by_class == {"standard": 1}
    # The binding bucket is the tenant's (200 left of 1200), not the pool's (5000 of 6000).
    assert (g.bucket_tokens, g.bucket_capacity, g.bucket_rate) == (200, 1200, 20)
    store.settle(g, 400, T0)  # used 400 of 1000: 600 come back
    u = store.usage("p", T0)
    assert (u.inflight, u.kv_inflight, u.bucket_tokens) == (0, 0, 5600)
    assert u.by_class.get("standard", 0) == 0


async def test_a_refusal_changes_nothing(store: Store):
    held = [await store.admit(plan(100), T0) for _ in range(3)]
    before = store.usage("p", T0)
    r = await store.admit(plan(100), T0)
    assert isinstance(r, Refusal) and r.budget is Budget.SLOTS
    assert store.usage("p", T0) == before
    r = await store.admit(plan(4000, tenant=None), T0)  # KV: 300 + 4000 fits, slots do not
    assert isinstance(r, Refusal) and store.usage("p", T0) == before
    for g in held:
        store.settle(g, 100, T0)
    assert store.usage("p", T0).inflight == 0


async def test_kv_budget_holds_across_admissions(store: Store):
    lim = limits(limit=10, base_limit=10)
    grants = []
    for _ in range(10):
        res = await store.admit(plan(1024, lim, tenant=None), T0)
        if isinstance(res, Grant):
            grants.append(res)
        else:
            assert res.budget is Budget.KV and res.retryable
    assert len(grants) == 4 and store.usage("p", T0).kv_inflight == 4096


async def test_overuse_goes_into_debt_repaid_before_the_next_admission(store: Store):
    lim = limits(kv_budget=None, base_kv_budget=None)
    g = await store.admit(plan(6000, lim, tenant=None), T0)
    store.settle(g, 6600, T0)  # 600 more than reserved
    assert store.usage("p", T0).bucket_tokens == -600
    r = await store.admit(plan(100, lim, tenant=None), T0 + 6.5)
    assert isinstance(r, Refusal) and r.budget is Budget.POOL_TPM
    assert r.retry_after_s == pytest.approx(0.5)  # 650 refilled of 700 needed, at 100/s
    assert isinstance(await store.admit(plan(100, lim, tenant=None), T0 + 7), Grant)


async def test_refund_is_clamped_at_capacity(store: Store):
    g = await store.admit(plan(1000, tenant=None), T0)
    store.settle(g, 0, T0 + 60)  # a minute later the bucket is full again
    assert store.usage("p", T0 + 60).bucket_tokens == 6000


async def test_a_shrunken_capacity_takes_tokens_away(store: Store):
    g = await store.admit(plan(100, tenant=None), T0)
    store.settle(g, 100, T0)
    small = limits(scale=0.5, limit=1, bucket=BucketSpec("pool", 3000.0, 50.0, 6000.0))
    g = await store.admit(plan(100, small, tenant=None), T0)
    assert isinstance(g, Grant)
    assert store.usage("p", T0).bucket_tokens == 2900


async def test_a_bucket_left_shrunk_and_idle_is_full_when_the_limits_rise(store: Store):
    small = limits(scale=0.5, limit=1, bucket=BucketSpec("pool", 3000.0, 50.0, 6000.0))
    g = await store.admit(plan(3000, small, tenant=None), T0)
    store.settle(g, 3000, T0)
    # 120 s idle at 50 tokens/s refill 6000: the risen bucket is full at the next request
    g = await store.admit(plan(6000, limits(kv_budget=6000, base_kv_budget=6000), tenant=None),
                          T0 + 120)
    assert isinstance(g, Grant), g


async def test_guarantees_are_kept_for_their_class(store: Store):
    lim = limits(guarantees={"gold": 1})
    a = await store.admit(plan(1, lim, tenant=None), T0)
    b = await store.admit(plan(1, lim, tenant=None), T0)
    r = await store.admit(plan(1, lim, tenant=None), T0)
    assert isinstance(a, Grant) and isinstance(b, Grant)
    assert isinstance(r, Refusal) and r.budget is Budget.RESERVED_SLOTS
    assert isinstance(await store.admit(plan(1, lim, tenant=None, class_name="gold"), T0), Grant)


async def test_grant_ids_are_unique(store: Store):
    lim = limits(limit=100, base_limit=100, kv_budget=None, base_kv_budget=None, bucket=None)
    ids = set()
    for _ in range(50):
        g = await store.admit(plan(1, lim, tenant=None), T0)
        ids.add(g.id)
        store.settle(g, 1, T0)
    assert len(ids) == 50


async def test_pools_are_separate(store: Store):
    a = await store.admit(plan(100, limits(pool="a", limit=1, base_limit=1)), T0)
    b = await store.admit(plan(100, limits(pool="b", limit=1, base_limit=1)), T0)
    assert isinstance(a, Grant) and isinstance(b, Grant)
    assert store.usage("a", T0).inflight == 1 and store.usage("b", T0).inflight == 1
    assert store.usage("nobody", T0).inflight == 0


async def test_a_class_watermark_keeps_the_rest_of_the_kv_budget_for_others(store: Store):
    # batch may fill the 5000-token budget up to 3500 (watermark 0.7); its own tokens and
    # everyone else's count toward that fill.
    lim = limits(limit=10, base_limit=10, kv_ceilings={"batch": (3500, 3500)})
    online = await store.admit(plan(500, lim, tenant=None), T0)
    docs = [await store.admit(plan(1500, lim, tenant=None, class_name="batch"), T0) for _ in range(3)]
    assert isinstance(online, Grant) and [isinstance(d, Grant) for d in docs] == [True, True, False]
    r = docs[2]
    assert (r.budget, r.retryable, r.needed, r.used, r.limit) == (Budget.CLASS_KV, True, 1500, 3500, 3500)
    before = store.usage("p", T0)
    assert before.kv_inflight == 3500
    # The last 1500 tokens stay for the classes without a watermark, up to the budget.
    chats = [await store.admit(plan(500, lim, tenant=None), T0) for _ in range(4)]
    assert [isinstance(c, Grant) for c in chats] == [True, True, True, False]
    assert chats[3].budget is Budget.KV and store.usage("p", T0).kv_inflight == 5000
    never = await store.admit(plan(3501, lim, tenant=None, class_name="batch"), T0)
    assert (never.budget, never.retryable, never.limit) == (Budget.CLASS_KV, False, 3500)
    # Chats finishing make room for batch again only once the fill is back below 3500.
    for c in chats[:3]:
        store.settle(c, 500, T0)
    assert isinstance(await store.admit(plan(1, lim, tenant=None, class_name="batch"), T0), Refusal)
    store.settle(online, 500, T0)
    assert isinstance(await store.admit(plan(500, lim, tenant=None, class_name="batch"), T0), Grant)
