"""The admission rule alone: check order, never-fit refusals, retry delays, messages."""

from __future__ import annotations

import pytest

from extproc.admission.rules import (decide, effective_capacity, message, node_watermark, pick_node,
                                     queued_message, shed_message)
from extproc.admission.types import Budget, BucketSpec, Plan, PoolLimits, Refusal
from extproc.admission.types import Reason

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


# batch may fill the 10,000-token KV budget up to 7,000 tokens (watermark 0.7); at scale
# 0.6 the budget is 6,000 and the ceiling 4,200.
WATERMARKED = limits(kv_ceilings={"batch": (7000, 7000)})
SHRUNK = limits(scale=0.6, kv_budget=6000, kv_ceilings={"batch": (4200, 7000)})


@pytest.mark.parametrize("lim, cls, tokens, kv_inflight, budget, retryable, limit", [
    (WATERMARKED, "batch", 1000, 6000, None, None, None),            # 7000: at the ceiling, in
    (WATERMARKED, "batch", 1001, 6000, Budget.CLASS_KV, True, 7000),  # one token above it
    (WATERMARKED, "batch", 7001, 0, Budget.CLASS_KV, False, 7000),    # never fits the class
    (WATERMARKED, "standard", 4000, 6000, None, None, None),          # others fill the rest
    (WATERMARKED, "standard", 4001, 6000, Budget.KV, True, 10_000),   # up to the budget only
    (WATERMARKED, "batch", 4001, 6000, Budget.KV, True, 10_000),      # the pool's budget first
    (SHRUNK, "batch", 200, 4000, None, None, None),
    (SHRUNK, "batch", 201, 4000, Budget.CLASS_KV, True, 4200),       # the ceiling shrinks too
    (SHRUNK, "batch", 5000, 0, Budget.CLASS_KV, True, 4200),         # fits at 1.0: waits
    (SHRUNK, "standard", 1500, 4000, None, None, None),
])
def test_a_class_fills_the_kv_budget_up_to_its_watermark(lim, cls, tokens, kv_inflight, budget,
                                                         retryable, limit):
    r = decide(plan(tokens, lim, class_name=cls), 0, {}, kv_inflight, 6000.0, None)
    if budget is None:
        assert r is None
    else:
        assert (r.budget, r.retryable, r.limit) == (budget, retryable, limit)
        assert r.used == kv_inflight and r.needed == tokens
        assert r.budget.reason is Reason.KV_BUDGET


def test_the_class_ceiling_keeps_the_longest_wait_and_the_slot_refusal_first():
    p = plan(500, WATERMARKED, tenant_bucket=TENANT_TPM, class_name="batch")
    r = decide(p, 4, {"batch": 4}, 6600, 6000.0, 10.0)   # slots, class KV and tenant TPM short
    assert r.budget is Budget.SLOTS and r.retry_after_s == pytest.approx(49.0)
    r = decide(p, 0, {}, 6600, 6000.0, 10.0)
    assert r.budget is Budget.CLASS_KV and r.retry_after_s == pytest.approx(49.0)
    r = decide(p, 0, {}, 6600, 6000.0, 600.0)
    assert r.budget is Budget.CLASS_KV and r.retry_after_s == 1.0


def test_class_kv_messages_name_the_class_and_its_share():
    p = plan(1000, WATERMARKED, class_name="batch")
    text = message(decide(p, 0, {}, 6500, 6000.0, None), p)
    assert "class 'batch'" in text and "7000 tokens" in text and "6500 are in use" in text
    assert "retry after 1.0s" in text
    never = plan(8000, WATERMARKED, class_name="batch")
    text = message(decide(never, 0, {}, 0, 6000.0, None), never)
    assert "can never be admitted" in text and "class 'batch'" in text and "(7000 tokens)" in text
    text = queued_message(Refusal(Budget.CLASS_KV, 1.0, True, 1000, 6500, 7000), p)
    assert "their class may fill" in text and "6500" not in text


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


@pytest.mark.parametrize(("w", "r", "share"), [
    (1.0, 0.1, 1.0),       # no watermark
    (1.5, 0.1, 1.5),       # above 1: none either
    (0.7, 0.1, 0.7 / 0.9),  # the class fills 0.7 of the whole node, not 0.7 x 0.9
    (0.95, 0.1, 1.0),      # above 1 - r: the reserve is the tighter
    (0.5, 0.0, 0.5),
])
def test_a_class_watermark_is_a_share_of_the_whole_node(w, r, share):
    assert node_watermark(w, r) == pytest.approx(share)


def test_a_class_at_0_7_takes_two_10k_documents_on_a_32k_node_with_a_reserve_of_0_1():
    """The transform's reason (rules.node_watermark): cutting the class by the reserve again
    would leave room for one."""
    cap, r = 32_768, 0.1
    doc = 10_500                                     # a 10k-token document and its answer
    assert effective_capacity(cap, r) * 0.7 < 2 * doc < cap * 0.7
    second = pick_node([("n", cap, 0, doc)], doc, r, node_watermark(0.7, r))
    assert second.chosen == "n"
    cut_twice = pick_node([("n", cap, 0, doc)], doc, r, 0.7)
    assert cut_twice.chosen is None and cut_twice.by_watermark
