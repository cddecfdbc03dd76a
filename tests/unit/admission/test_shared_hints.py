"""Retry hints beside other replicas: a replica of the Redis store that is refused for the
pool's KV budget reads when its own leases free their share of what is missing, the
others' leases being like its own, against a real Redis-protocol server at fixed instants."""

from __future__ import annotations

import pytest

from extproc.admission import Admission, Demand, Lease, Outcome, Rejection
from extproc.admission.types import Reason
from extproc.clock import ManualClock
from extproc.configparse import parse_config
from tests.unit.admission.helpers import no_jitter
from tests.unit.admission.test_redis_store import T0, cfg, open_store, stores  # noqa: F401

pytestmark = pytest.mark.redis

HOLD_S = 6.0


def demand(prompt: int, completion: int) -> Demand:
    return Demand(pool="default", tenant="t", class_name="standard", prompt_tokens=prompt,
                  reserved_completion=completion)


async def test_a_kv_refusal_beside_a_replica_holding_most_is_told_when_its_own_share_frees(stores, redis_server):
    """The pool's 1,000 KV tokens: b learned holds of 6 s, then holds 100 tokens 2 s old while a
    holds 800. b asks 300, 200 more than is free: more than its own lease holds, so its
    lease alone never frees it, yet with a's leases like b's, b's share of the 200 (100 of
    the 900 in use) comes back when b's lease ends, 4 s on. Without the share the hint was
    the default estimate, 1 s, a retry sent long before the room."""
    clock = ManualClock(T0)
    config = parse_config({"pools": {"default": {"max_concurrency": 100, "kv_budget_tokens": 1000}}})
    store_cfg = cfg(redis_server.url)
    a = Admission(config, clock, open_store(stores, store_cfg, clock))
    b = Admission(config, clock, open_store(stores, store_cfg, clock), rand=no_jitter)
    for _ in range(3):
        done = await b.acquire(demand(50, 50))
        clock.advance(HOLD_S)
        assert isinstance(done, Lease) and done.release(Outcome.COMPLETED, 50)
    own = await b.acquire(demand(50, 50))
    held = [await a.acquire(demand(200, 200)) for _ in range(2)]
    assert isinstance(own, Lease) and all(isinstance(h, Lease) for h in held)
    clock.advance(2.0)
    refused = await b.acquire(demand(150, 150))
    assert isinstance(refused, Rejection) and refused.reason is Reason.KV_BUDGET and refused.retryable
    assert refused.retry_after_s == pytest.approx(HOLD_S - 2.0)
    own.release(Outcome.CLIENT_DISCONNECT, 10)
    assert own.release(Outcome.COMPLETED, 10) is False  # released once: counted out once
    assert b._pools["default"].live_tokens == 0 and not b._pools["default"].live
