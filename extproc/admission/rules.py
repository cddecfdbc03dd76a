"""rules: THE admission rule, a pure function of a plan and a pool's state.

Every store applies ``decide`` (the in-memory store calls it; a shared store mirrors it
in one atomic script), so the rule is written once and tested alone. The order of the
checks decides which budget a refusal names:

1. never fits (not retryable): tokens above the KV budget, the class's KV ceiling or a
   bucket's capacity at scale 1.0;
2. concurrency slots (``slots.slot_refusal``);
3. in-flight KV tokens: the pool's KV budget, then the ceiling of the plan's class
   (``kv_watermark`` below 1: the class may fill the budget only up to
   ``floor(w × budget)``, every class's tokens counted; see ``kvbudget``);
4. the tenant's bucket, then the pool's bucket.

Every budget that refuses is checked, and the refusal's retry delay is the longest of
theirs: a client that waits that long is not refused again by another budget at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from extproc.admission.bucket import FIT_SLACK, wait_for
from extproc.admission.slots import slot_refusal
from extproc.admission.store.base import Budget, BucketSpec, Plan, Refusal


def _bucket_wait(n: int, tokens: float, spec: BucketSpec, estimate: float) -> float:
    """_bucket_wait is the wait (s) until ``n`` fits; above the scaled capacity, a refill's worth."""
    w = wait_for(n, tokens, spec.capacity, spec.rate)
    if w == math.inf:
        # Fits at scale 1.0 but not now: it waits for the scale to recover, which no
        # bucket can time; the refill of the missing tokens is a lower bound.
        w = max(estimate, (n - tokens) / spec.rate)
    return w


def decide(plan: Plan, inflight: int, by_class: Mapping[str, int], kv_inflight: int,
           pool_tokens: float | None, tenant_tokens: float | None) -> Refusal | None:
    """decide admits ``plan`` (None) or says which budget refuses it (a ``Refusal``).

    State, as of the decision's instant: ``inflight`` slots in use in the pool,
    ``by_class`` the same per class, ``kv_inflight`` reserved KV tokens, and the tokens in
    the pool's and the tenant's buckets after refill and after applying the plan's
    capacities (None when the plan has no such bucket). Nothing is changed.
    """
    limits = plan.limits
    n = plan.tokens
    pb = limits.bucket
    tb = plan.tenant_bucket
    # 1. Never fits: more than a budget holds even at full scale.
    if limits.base_kv_budget is not None and n > limits.base_kv_budget:
        return Refusal(Budget.KV, 0.0, False, n, kv_inflight, limits.base_kv_budget)
    ceilings = limits.kv_ceilings
    ceiling = ceilings.get(plan.class_name) if ceilings else None
    if ceiling is not None and n > ceiling[1]:
        return Refusal(Budget.CLASS_KV, 0.0, False, n, kv_inflight, ceiling[1])
    if tb is not None and n > tb.base_capacity + FIT_SLACK:
        return Refusal(Budget.TENANT_TPM, 0.0, False, n, 0, tb.base_capacity)
    if pb is not None and n > pb.base_capacity + FIT_SLACK:
        return Refusal(Budget.POOL_TPM, 0.0, False, n, 0, pb.base_capacity)

    first: Refusal | None = None
    wait = 0.0
    estimate = limits.retry_estimate_s
    slots = slot_refusal(inflight, by_class, plan.class_name, limits.limit, limits.guarantees)
    if slots is not None:
        first = Refusal(slots, estimate, True, 1, inflight, limits.limit)
        wait = estimate
    kv = limits.kv_budget
    if kv is not None and kv_inflight + n > kv:
        if first is None:
            first = Refusal(Budget.KV, estimate, True, n, kv_inflight, kv)
        wait = estimate
    elif ceiling is not None and kv_inflight + n > ceiling[0]:
        if first is None:
            first = Refusal(Budget.CLASS_KV, estimate, True, n, kv_inflight, ceiling[0])
        wait = estimate
    if tb is not None and tenant_tokens is not None and n > tenant_tokens + FIT_SLACK:
        w = _bucket_wait(n, tenant_tokens, tb, estimate)
        if first is None:
            first = Refusal(Budget.TENANT_TPM, w, True, n, tenant_tokens, tb.capacity)
        wait = max(wait, w)
    if pb is not None and pool_tokens is not None and n > pool_tokens + FIT_SLACK:
        w = _bucket_wait(n, pool_tokens, pb, estimate)
        if first is None:
            first = Refusal(Budget.POOL_TPM, w, True, n, pool_tokens, pb.capacity)
        wait = max(wait, w)
    if first is None:
        return None
    if wait != first.retry_after_s:
        first = Refusal(first.budget, wait, True, first.needed, first.used, first.limit)
    return first


def _seconds(s: float) -> str:
    if s < 1.0:
        return f"{max(1, math.ceil(s * 1000))}ms"
    return f"{s:.1f}s"


def message(refusal: Refusal, plan: Plan) -> str:
    """message words a refusal for the client: the budget, the numbers, when to retry.

    Names in it are configured pool and tenant names, never raw request input.
    """
    pool = plan.limits.pool
    b = refusal.budget
    if not refusal.retryable:
        if b is Budget.KV:
            what = f"the in-flight KV-token budget of pool '{pool}' ({int(refusal.limit)} tokens)"
        elif b is Budget.CLASS_KV:
            what = (f"the part of the in-flight KV-token budget of pool '{pool}' that class "
                    f"'{plan.class_name}' may fill ({int(refusal.limit)} tokens)")
        elif b is Budget.TENANT_TPM:
            what = f"the tokens-per-minute limit of tenant '{plan.tenant}' ({int(refusal.limit)} tokens)"
        else:
            what = f"the tokens-per-minute limit of pool '{pool}' ({int(refusal.limit)} tokens)"
        return (f"This request needs {int(refusal.needed)} tokens (prompt + max_tokens), more than "
                f"{what}: it can never be admitted. Lower max_tokens or shorten the prompt.")
    retry = _seconds(refusal.retry_after_s)
    if b is Budget.SLOTS:
        return (f"Too many concurrent requests on pool '{pool}': {int(refusal.used)} of "
                f"{int(refusal.limit)} concurrency slots are in use. Please retry after {retry}.")
    if b is Budget.RESERVED_SLOTS:
        return (f"Too many concurrent requests on pool '{pool}': the free concurrency slots are "
                f"guaranteed to other classes. Please retry after {retry}.")
    if b is Budget.KV:
        return (f"The in-flight KV-token budget of pool '{pool}' is full: this request needs "
                f"{int(refusal.needed)} tokens, {int(refusal.used)} of {int(refusal.limit)} are in use. "
                f"Please retry after {retry}.")
    if b is Budget.CLASS_KV:
        return (f"Requests of class '{plan.class_name}' may fill the in-flight KV-token budget of "
                f"pool '{pool}' only up to {int(refusal.limit)} tokens (the rest is kept for other "
                f"classes): this request needs {int(refusal.needed)} tokens, {int(refusal.used)} are "
                f"in use. Please retry after {retry}.")
    whose = f"tenant '{plan.tenant}'" if b is Budget.TENANT_TPM else f"pool '{pool}'"
    return (f"Rate limit reached for tokens per minute (TPM) on {whose}: limit {int(refusal.limit)}, "
            f"available {max(0, int(refusal.used))}, requested {int(refusal.needed)}. "
            f"Please retry after {retry}.")


def shed_message(pool: str, class_name: str, retry_after_s: float) -> str:
    """shed_message words a refusal by load shedding for the client."""
    return (f"Pool '{pool}' is overloaded (KV cache at or above its high watermark, or its "
            f"metrics are stale): requests of class '{class_name}' are shed first. "
            f"Please retry after {_seconds(retry_after_s)}.")


_BUDGET_WORDS = {
    Budget.SLOTS: "a concurrency slot",
    Budget.RESERVED_SLOTS: "a concurrency slot",
    Budget.KV: "room in the in-flight KV-token budget",
    Budget.CLASS_KV: "room in the part of the in-flight KV-token budget their class may fill",
    Budget.POOL_TPM: "tokens of the tokens-per-minute limit",
    Budget.TENANT_TPM: "tokens of the tokens-per-minute limit",
}


def queued_message(refusal: Refusal, plan: Plan) -> str:
    """queued_message words a refusal because earlier requests wait for the same budget first.

    ``refusal`` is the waiting request's; the numbers in it are not this request's, so
    the message names the budget and the order, not amounts.
    """
    whose = (f"tenant '{plan.tenant}'" if refusal.budget is Budget.TENANT_TPM
             else f"pool '{plan.limits.pool}'")
    return (f"Requests queued earlier on {whose} are waiting for {_BUDGET_WORDS[refusal.budget]}, "
            f"and this request may not go ahead of them. Please retry after "
            f"{_seconds(refusal.retry_after_s)}.")
