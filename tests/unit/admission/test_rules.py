"""The admission rule alone: check order, never-fit refusals, retry delays, messages."""

from __future__ import annotations

import pytest

from extproc.admission.rules import decide, message, shed_message
from extproc.admission.store.base import Budget, BucketSpec, Plan, PoolLimits, Refusal

POOL_TPM = BucketSpec("pool", 6000.0, 100.0, 6000.0)       # 6000 TPM: 100 tokens/s
TENANT_TPM = BucketSpec("tenant:acme", 600.0, 10.0, 600.0)  # 600 TPM: 10 tokens/s


def limits(**kw) -> PoolLimits:
    base = dict(pool="default", scale=1.0, limit=4, base_limit=4, guarantees={},
                kv_budget=10_000, base_kv_budget=10_000, bucket=POOL_TPM, retry_estimate_s=1.0)
    base.update(kw)
    return PoolLimits(**base)


def plan(tokens: int = 100, lim: PoolLimits | None = None, tenant_bucket: BucketSpec | None = None,
         class_name: str = "standard") -> Plan:
    return Plan(lim or limits(), "acme", class_name, tokens, tenant_bucket)


def test_everything_free_admits():
    assert decide(plan(), 0, {}, 0, 6000.0, None) is None


def test_no_buckets_no_kv_budget_only_slots_count():
    lim = limits(kv_budget=None, base_kv_budget=None, bucket=None)
    assert decide(plan(10**9, lim), 3, {}, 10**12, None, None) is None
    assert decide(plan(1, lim), 4, {}, 0, None, None).budget is Budget.SLOTS


@pytest.mark.parametrize("p, budget", [
    (plan(10_001), Budget.KV),
    (plan(601, tenant_bucket=TENANT_TPM), Budget.TENANT_TPM),
    (plan(6001, limits(kv_budget=None, base_kv_budget=None)), Budget.POOL_TPM),
])
def test_more_than_a_budget_ever_holds_is_not_retryable(p, budget):
    r = decide(p, 0, {}, 0, 6000.0, 600.0)
    assert r.budget is budget and r.retryable is False
    assert "can never be admitted" in message(r, p)


def test_above_the_scaled_capacity_but_within_the_base_waits_for_recovery():
    lim = limits(scale=0.6, bucket=BucketSpec("pool", 3600.0, 60.0, 6000.0), kv_budget=6000)
    r = decide(plan(4000, lim), 0, {}, 0, 3600.0, None)
    assert r.budget is Budget.POOL_TPM and r.retryable
    assert r.retry_after_s >= 1.0
    r = decide(plan(7000, limits(scale=0.6, bucket=None, kv_budget=6000)), 0, {}, 0, None, None)
    assert r.budget is Budget.KV and r.retryable


def test_order_slots_then_kv_then_tenant_then_pool_and_the_longest_wait():
    p = plan(500, tenant_bucket=TENANT_TPM)
    # Every budget short: slots named first; the wait is the longest (tenant: 490/10 s).
    r = decide(p, 4, {"standard": 4}, 9_600, 0.0, 10.0)
    assert r.budget is Budget.SLOTS
    assert r.retry_after_s == pytest.approx(49.0)
    r = decide(p, 0, {}, 9_600, 0.0, 10.0)
    assert r.budget is Budget.KV
    r = decide(p, 0, {}, 0, 0.0, 10.0)
    assert r.budget is Budget.TENANT_TPM and r.retry_after_s == pytest.approx(49.0)
    r = decide(p, 0, {}, 0, 0.0, 600.0)
    assert r.budget is Budget.POOL_TPM and r.retry_after_s == pytest.approx(5.0)


def test_tpm_wait_counts_the_debt():
    r = decide(plan(100), 0, {}, 0, -250.0, None)
    assert r.budget is Budget.POOL_TPM and r.retry_after_s == pytest.approx(3.5)


def test_reserved_slots_are_their_own_budget():
    lim = limits(guarantees={"gold": 2})
    r = decide(plan(1, lim), 2, {"standard": 2}, 0, 6000.0, None)
    assert r.budget is Budget.RESERVED_SLOTS
    assert decide(plan(1, lim, class_name="gold"), 2, {"standard": 2}, 0, 6000.0, None) is None


def test_decide_changes_nothing():
    by_class = {"standard": 1}
    decide(plan(100), 1, by_class, 0, 6000.0, None)
    assert by_class == {"standard": 1}


@pytest.mark.parametrize("refusal, words", [
    (Refusal(Budget.SLOTS, 1.0, True, 1, 4, 4), ["concurrent", "4 of 4", "1.0s"]),
    (Refusal(Budget.RESERVED_SLOTS, 1.0, True, 1, 2, 4), ["guaranteed to other classes"]),
    (Refusal(Budget.KV, 0.25, True, 500, 9600, 10000), ["KV-token budget", "500", "250ms"]),
    (Refusal(Budget.TENANT_TPM, 3.0, True, 500, 10.0, 600), ["tenant 'acme'", "limit 600", "requested 500"]),
    (Refusal(Budget.POOL_TPM, 3.0, True, 500, -20.0, 6000), ["pool 'default'", "available 0"]),
])
def test_messages_name_the_budget(refusal, words):
    text = message(refusal, plan())
    for w in words:
        assert w in text


def test_shed_message():
    text = shed_message("default", "batch", 1.0)
    assert "overloaded" in text and "'batch'" in text and "shed" in text
