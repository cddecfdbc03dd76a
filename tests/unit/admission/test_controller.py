"""Admission end to end over the store interface, at fixed instants of a manual clock."""

from __future__ import annotations

import random

import pytest

from extproc.admission import (Admission, Demand, InvalidDemandError, Lease, Outcome, PoolSignals,
                               Reason, Rejection, UnknownPoolError)
from extproc.admission.store.base import Store
from extproc.clock import ManualClock
from kvgate_testkit.admission import acquire_now
from tests.unit.admission.helpers import STALE_AFTER_S, T0, config, no_jitter, tenants

BACKENDS = [{"name": "n1", "metrics_url": "http://127.0.0.1:9/metrics"}]


def sig(usage: float, at: float, waiting: int = 0, capacity: int | None = None) -> PoolSignals:
    return PoolSignals(kv_usage=usage, waiting=waiting, stale=False, kv_capacity_tokens=capacity, at=at,
                       fresh_until=at + STALE_AFTER_S)


def demand(prompt: int = 100, completion: int = 100, tenant: str = "t", class_name: str = "standard",
           pool: str = "default") -> Demand:
    return Demand(pool=pool, tenant=tenant, class_name=class_name, prompt_tokens=prompt,
                  reserved_completion=completion)


async def test_slots_refuse_beyond_the_limit_until_one_is_released(clock: ManualClock, store: Store):
    adm = Admission(config(), clock, store)
    leases = [await adm.acquire(demand()) for _ in range(4)]
    assert all(isinstance(x, Lease) for x in leases)
    r = await adm.acquire(demand())
    assert isinstance(r, Rejection) and r.reason is Reason.CONCURRENCY
    assert r.retryable and r.retry_after_s > 0 and "concurrency" in r.message
    assert r.rate.limit_requests == 4 and r.rate.remaining_requests == 0
    assert leases[0].release(Outcome.COMPLETED, 10)
    assert isinstance(await adm.acquire(demand()), Lease)


async def test_a_shrink_refuses_new_requests_and_revokes_nothing(clock: ManualClock, store: Store):
    adm = Admission(config(pool={"max_concurrency": 10, "backends": BACKENDS}), clock, store)
    assert adm.snapshot("default").concurrency_limit == 6  # no signals yet: saturated
    adm.update_signals("default", sig(0.2, clock.now()))
    for _ in range(4):  # the scraper's polls, once a second
        clock.advance(1)
        adm.update_signals("default", sig(0.2, clock.now()))
    assert adm.snapshot("default").concurrency_limit == 10
    held = [await adm.acquire(demand()) for _ in range(8)]
    assert all(isinstance(x, Lease) for x in held)
    adm.update_signals("default", sig(0.95, clock.now()))
    snap = adm.snapshot("default")
    assert (snap.scale, snap.concurrency_limit, snap.inflight, snap.alarm) == (0.6, 6, 8, True)
    assert not any(x.released for x in held)
    for i in range(3):  # 8 -> 5 in flight: a slot frees only once below 6
        assert isinstance(await adm.acquire(demand()), Rejection)
        held[i].release(Outcome.COMPLETED, 1)
    assert isinstance(await adm.acquire(demand()), Lease)
    assert isinstance(await adm.acquire(demand()), Rejection)


async def test_recovery_is_smooth(clock: ManualClock, store: Store):
    adm = Admission(config(pool={"max_concurrency": 100, "backends": BACKENDS}), clock, store)
    adm.update_signals("default", sig(0.0, clock.now()))
    limits = []
    for _ in range(5):
        clock.advance(1)
        adm.update_signals("default", sig(0.0, clock.now()))
        limits.append(adm.snapshot("default").concurrency_limit)
    assert limits == [70, 80, 90, 100, 100]


async def test_stale_signals_shrink_and_pools_without_backends_stay_at_one(clock: ManualClock):
    cfg = config(pools={"default": {"max_concurrency": 10, "backends": BACKENDS},
                        "plain": {"max_concurrency": 10}})
    adm = Admission(cfg, clock)
    adm.update_signals("default", sig(0.1, clock.now()))
    clock.advance(3)
    adm.update_signals("default", sig(0.1, clock.now()))
    assert adm.snapshot("default").scale == pytest.approx(0.9)
    clock.advance(3.5)  # the scraper stopped: the last signals are now stale
    assert adm.snapshot("default").scale == 0.6 and adm.snapshot("default").alarm
    assert adm.snapshot("plain").scale == 1.0 and not adm.snapshot("plain").alarm
    clock.advance(1000)
    assert adm.snapshot("plain").concurrency_limit == 10


async def test_tpm_reserves_then_refunds_with_the_exact_wait(clock: ManualClock, store: Store):
    adm = Admission(config(pool={"tpm": 6000}), clock, store, rand=no_jitter)   # 100 tokens/s
    a = await adm.acquire(demand(1000, 2000))
    b = await adm.acquire(demand(1000, 2000))
    assert isinstance(a, Lease) and isinstance(b, Lease)
    assert b.rate.remaining_tokens == 0 and b.rate.limit_tokens == 6000
    assert b.rate.reset_tokens_s == pytest.approx(60.0)
    r = await adm.acquire(demand(400, 100))
    assert isinstance(r, Rejection) and r.reason is Reason.TPM
    assert r.retry_after_s == pytest.approx(5.0) and r.retryable
    assert "tokens per minute" in r.message
    a.release(Outcome.COMPLETED, 500)  # 1500 charged of 3000 reserved: 1500 back
    assert adm.snapshot("default").tpm_available == pytest.approx(1500)
    assert isinstance(await adm.acquire(demand(1000, 500)), Lease)


async def test_unknown_usage_charges_the_whole_reservation(clock: ManualClock, store: Store):
    adm = Admission(config(pool={"tpm": 6000}), clock, store)
    lease = await adm.acquire(demand(1000, 2000))
    assert lease.release(Outcome.CLIENT_DISCONNECT, None)
    assert adm.snapshot("default").tpm_available == pytest.approx(3000)
    assert lease.outcome is Outcome.CLIENT_DISCONNECT


@pytest.mark.parametrize("reported, charged", [
    (0, 1000),            # a real zero-token completion
    (-5, 3000),           # nonsense: the whole reservation
    ("12", 3000), (1.5, 3000), (True, 3000),
    (10**12, 1000 + 32768),  # capped at the context window
])
async def test_hostile_completion_counts(clock: ManualClock, reported, charged):
    adm = Admission(config(pool={"tpm": 100_000}), clock)
    lease = acquire_now(adm, demand(1000, 2000))
    lease.release(Outcome.COMPLETED, reported)
    assert adm.snapshot("default").tpm_available == pytest.approx(100_000 - charged)


async def test_a_request_larger_than_the_bucket_is_never_retryable(clock: ManualClock, store: Store):
    adm = Admission(config(pool={"tpm": 6000}), clock, store)
    r = await adm.acquire(demand(5000, 1001))
    assert isinstance(r, Rejection) and r.reason is Reason.TPM and r.retryable is False
    assert "can never be admitted" in r.message
    assert adm.snapshot("default").inflight == 0


async def test_ten_32k_requests_stop_at_the_kv_budget(clock: ManualClock, store: Store):
    adm = Admission(config(pool={"max_concurrency": 64, "kv_budget_tokens": 200_000}), clock, store)
    results = [await adm.acquire(demand(32_768 - 1024, 1024)) for _ in range(10)]
    admitted = [x for x in results if isinstance(x, Lease)]
    refused = [x for x in results if isinstance(x, Rejection)]
    assert len(admitted) == 6 and all(x.reason is Reason.KV_BUDGET for x in refused)
    assert refused[0].retryable and "KV-token budget" in refused[0].message
    assert adm.snapshot("default").kv_inflight == 6 * 32_768 <= 200_000
    big = await adm.acquire(demand(200_000, 1))
    assert isinstance(big, Rejection) and not big.retryable


async def test_kv_budget_derived_from_reported_capacity(clock: ManualClock, store: Store):
    cfg = config(pool={"max_concurrency": 64, "backends": BACKENDS, "signals": {"kv_budget_fraction": 0.5}})
    adm = Admission(cfg, clock, store)
    assert adm.snapshot("default").kv_budget is None
    adm.update_signals("default", sig(0.1, clock.now(), capacity=100_000))
    assert adm.snapshot("default").kv_budget == 30_000  # 100k × 0.5 × scale 0.6 (recovering)
    for _ in range(4):
        clock.advance(1)
        adm.update_signals("default", sig(0.1, clock.now(), capacity=100_000))
    assert adm.snapshot("default").kv_budget == 50_000
    assert isinstance(await adm.acquire(demand(40_000, 10_000)), Lease)
    assert isinstance(await adm.acquire(demand(1, 0)), Rejection)


async def test_alarm_sheds_sheddable_classes_first(clock: ManualClock, store: Store):
    cfg = config(pool={"max_concurrency": 10, "backends": BACKENDS},
                 tenants=tenants({"standard": {}, "batch": {"sheddable": True}}))
    adm = Admission(cfg, clock, store)
    adm.update_signals("default", sig(0.9, clock.now()))
    r = await adm.acquire(demand(class_name="batch"))
    assert isinstance(r, Rejection) and r.reason is Reason.SHED and r.retryable
    assert "shed" in r.message
    assert isinstance(await adm.acquire(demand()), Lease)  # non-sheddable still admitted
    adm.update_signals("default", sig(0.5, clock.now()))
    assert isinstance(await adm.acquire(demand(class_name="batch")), Lease)


async def test_tenant_buckets_are_separate(clock: ManualClock, store: Store):
    cfg = config(pool={"tpm": 1_000_000},
                 tenants=tenants({"standard": {"tpm": 1200}}, {"big": {"class": "standard", "tpm": 6000}}))
    adm = Admission(cfg, clock, store, rand=no_jitter)
    assert isinstance(await adm.acquire(demand(1000, 200, tenant="a")), Lease)
    r = await adm.acquire(demand(10, 0, tenant="a"))
    assert isinstance(r, Rejection) and r.reason is Reason.TPM and "tenant 'a'" in r.message
    assert r.retry_after_s == pytest.approx(0.5)  # 10 tokens at 20/s
    assert isinstance(await adm.acquire(demand(1000, 200, tenant="b")), Lease)
    assert isinstance(await adm.acquire(demand(5000, 0, tenant="big")), Lease)
    r = await adm.acquire(demand(1201, 0, tenant="b"))
    assert isinstance(r, Rejection) and not r.retryable


def test_release_is_idempotent_and_changes_nothing_twice(clock: ManualClock):
    adm = Admission(config(pool={"tpm": 6000, "kv_budget_tokens": 10_000}), clock)
    lease = acquire_now(adm, demand(100, 100))
    other = acquire_now(adm, demand(100, 100))
    assert lease.release(Outcome.COMPLETED, 50) is True
    before = adm.snapshot("default")
    assert lease.release(Outcome.UPSTREAM_ERROR, None) is False
    assert lease.released and lease.outcome is Outcome.COMPLETED
    assert adm.snapshot("default") == before
    other.release(Outcome.TIMEOUT, None)
    snap = adm.snapshot("default")
    assert (snap.inflight, snap.kv_inflight) == (0, 0)


def test_lease_fields(clock: ManualClock):
    adm = Admission(config(), clock)
    d = demand()
    lease = acquire_now(adm, d)
    assert lease.demand is d and lease.id and not lease.released
    assert lease.rate.limit_requests == 4 and lease.rate.remaining_requests == 3
    assert lease.rate.limit_tokens is None


async def test_bad_calls_raise_named_errors(clock: ManualClock):
    adm = Admission(config(), clock)
    with pytest.raises(UnknownPoolError):
        acquire_now(adm, demand(pool="nope"))
    with pytest.raises(UnknownPoolError):
        await adm.acquire(demand(pool="nope"))
    with pytest.raises(UnknownPoolError):
        adm.update_signals("nope", sig(0.1, T0))
    with pytest.raises(UnknownPoolError):
        adm.snapshot("nope")
    for bad in (demand(-1, 0), demand(1, -1), demand(1.5, 0), demand(True, 0)):  # type: ignore[arg-type]
        with pytest.raises(InvalidDemandError):
            acquire_now(adm, bad)
    assert adm.snapshot("default").inflight == 0


async def test_reconfigure_applies_to_new_admissions_and_old_leases_release(clock: ManualClock, store: Store):
    adm = Admission(config(pools={"default": {"max_concurrency": 4}, "old": {"max_concurrency": 2}}),
                    clock, store)
    held = [await adm.acquire(demand()) for _ in range(3)]
    old = await adm.acquire(demand(pool="old"))
    adm.reconfigure(config(pools={"default": {"max_concurrency": 2, "tpm": 6000}}))
    assert adm.pools == ("default",)
    assert isinstance(await adm.acquire(demand()), Rejection)  # 3 in flight, limit 2
    for x in held:
        assert x.release(Outcome.COMPLETED, 1)
    assert old.release(Outcome.COMPLETED, 1)
    snap = adm.snapshot("default")
    assert (snap.inflight, snap.concurrency_limit, snap.tpm_capacity) == (0, 2, 6000)
    assert store.usage("old", clock.now()).inflight == 0
    assert isinstance(await adm.acquire(demand()), Lease)


def test_unknown_class_falls_back_to_the_default_class(clock: ManualClock):
    adm = Admission(config(), clock)
    lease = acquire_now(adm, demand(class_name="removed-by-a-reload"))
    assert isinstance(lease, Lease)
    assert adm.snapshot("default").inflight_by_class == {"standard": 1}
    lease.release(Outcome.COMPLETED, 1)
    assert adm.snapshot("default").inflight_by_class == {}


async def test_guarantees_shrink_with_the_limit(clock: ManualClock, store: Store):
    # Base 10 slots, gold guaranteed 5. Shrunk to 0.6: limit 6, gold's guarantee 3.
    cfg = config(pool={"max_concurrency": 10, "backends": BACKENDS},
                 tenants=tenants({"standard": {}, "gold": {"guaranteed_slots": 5}}))
    adm = Admission(cfg, clock, store)
    adm.update_signals("default", sig(0.95, clock.now()))
    std = [await adm.acquire(demand()) for _ in range(4)]
    assert [isinstance(x, Lease) for x in std] == [True, True, True, False]  # 3 kept for gold
    gold = [await adm.acquire(demand(class_name="gold")) for _ in range(4)]
    assert [isinstance(x, Lease) for x in gold] == [True, True, True, False]  # 3 + 3 = limit 6
    snap = adm.snapshot("default")
    assert (snap.concurrency_limit, snap.inflight, snap.inflight_by_class) == (6, 6, {"standard": 3, "gold": 3})


@pytest.mark.parametrize("watermark, docs, chats", [
    (1.0, 7, 0),   # batch may fill the whole budget: the shrink leaves nothing for chats
    (0.7, 5, 6),   # batch stops at 70%: the chats still fit after the same shrink
])
async def test_a_batch_kv_watermark_keeps_chats_in_when_the_scale_shrinks(clock: ManualClock, store: Store,
                                                                          watermark, docs, chats):
    # The protection benchmark in small: a burst of long documents, then the node's KV
    # usage climbs into the adaptive band (0.76: scale 0.84) as they are prefilled.
    cfg = config(pool={"max_concurrency": 48, "kv_budget_tokens": 10_000, "backends": BACKENDS},
                 tenants=tenants({"online": {"priority": 10},
                                  "batch": {"priority": -10, "sheddable": True, "kv_watermark": watermark}},
                                 default_class="online"))
    adm = Admission(cfg, clock, store)
    for _ in range(5):
        adm.update_signals("default", sig(0.1, clock.now()))
        clock.advance(1)
    assert adm.snapshot("default").scale == 1.0
    burst = [await adm.acquire(demand(1200, 100, class_name="batch")) for _ in range(10)]
    assert sum(isinstance(x, Lease) for x in burst) == docs
    refused = [x for x in burst if isinstance(x, Rejection)]
    assert all(x.reason is Reason.KV_BUDGET and x.retryable for x in refused)
    adm.update_signals("default", sig(0.76, clock.now()))
    snap = adm.snapshot("default")
    assert (snap.scale, snap.kv_budget, snap.alarm) == (pytest.approx(0.84), 8400, False)
    got = [await adm.acquire(demand(200, 100, class_name="online")) for _ in range(8)]
    assert sum(isinstance(x, Lease) for x in got) == chats
    assert adm.snapshot("default").kv_inflight == 1300 * docs + 300 * chats
    # batch is back only below its ceiling at the new scale (0.7 x 8400 = 5880 tokens).
    if watermark < 1.0:
        more = await adm.acquire(demand(1, 0, class_name="batch"))
        assert isinstance(more, Rejection) and "class 'batch'" in more.message


def test_the_retry_hint_comes_from_when_a_slot_is_expected_back(clock: ManualClock):
    adm = Admission(config(), clock, rand=no_jitter)
    for _ in range(3):                          # requests that each held a slot for 6 s
        x = acquire_now(adm, demand())
        clock.advance(6.0)
        x.release(Outcome.COMPLETED, 10)
    held = [acquire_now(adm, demand()) for _ in range(4)]
    clock.advance(2.0)
    r = acquire_now(adm, demand())
    assert isinstance(r, Rejection) and r.reason is Reason.CONCURRENCY
    assert r.retry_after_s == pytest.approx(4.0)  # the holders are 2 s into holds of 6 s
    assert "retry after 4.0s" in r.message
    held[0].release(Outcome.CLIENT_DISCONNECT)    # a disconnect is no hold time to learn from
    assert isinstance(acquire_now(adm, demand()), Lease)
    assert len(adm._pools["default"].live) == 4 and len(adm._pools["default"].holds) == 3


def test_without_completed_requests_the_retry_hint_is_the_poll_interval(clock: ManualClock):
    adm = Admission(config(), clock, rand=no_jitter)
    [acquire_now(adm, demand()) for _ in range(4)]
    r = acquire_now(adm, demand())
    assert isinstance(r, Rejection) and r.retry_after_s == 1.0


def mixed_history(adm: Admission, clock: ManualClock, tokens: tuple[int, int] = (100, 100)) -> None:
    """mixed_history completes 18 chats of 50 ms, then 2 generations of 2 s side by side:
    the pool's median hold is 50 ms, its mean 0.245 s."""
    for _ in range(18):
        x = acquire_now(adm, demand(*tokens))
        clock.advance(0.05)
        assert isinstance(x, Lease) and x.release(Outcome.COMPLETED, 10)
    longs = [acquire_now(adm, demand(*tokens)) for _ in range(2)]
    clock.advance(2.0)
    for x in longs:
        assert isinstance(x, Lease) and x.release(Outcome.COMPLETED, 10)
    assert adm._pools["default"].holds.median() == pytest.approx(0.05)


def test_in_mixed_traffic_a_slot_behind_long_generations_is_expected_back_when_they_end(clock: ManualClock):
    """Issue 30: after many short requests the median hold is 50 ms; a request refused
    behind two generations 0.3 s in was told 50 ms (a holder older than the median was
    expected to end within a tenth of it). Past every chat, only the 2 s holds speak for
    them: the slot is back in 1.7 s, when the first of them is expected to end."""
    adm = Admission(config(pool={"max_concurrency": 2}), clock, rand=no_jitter)
    mixed_history(adm, clock)
    longs = [acquire_now(adm, demand()) for _ in range(2)]
    clock.advance(0.3)
    r = acquire_now(adm, demand())
    assert isinstance(r, Rejection) and r.reason is Reason.CONCURRENCY
    assert r.retry_after_s == pytest.approx(1.7) and "retry after 1.7s" in r.message
    clock.advance(r.retry_after_s)              # the client honours it: the generations end then
    for x in longs:
        assert isinstance(x, Lease) and x.release(Outcome.COMPLETED, 10)
    assert isinstance(acquire_now(adm, demand()), Lease)


def test_a_slot_held_past_every_completed_hold_is_expected_to_take_as_long_again(clock: ManualClock):
    """A holder older than every completed hold has nothing to go by: it is expected to live
    as long again as its age, so a client refused again is told a longer wait each time,
    not the 50 ms floor over and over."""
    adm = Admission(config(pool={"max_concurrency": 1}), clock, rand=no_jitter)
    for _ in range(10):
        x = acquire_now(adm, demand())
        clock.advance(0.05)
        assert isinstance(x, Lease) and x.release(Outcome.COMPLETED, 10)
    held = acquire_now(adm, demand())
    assert isinstance(held, Lease)
    waits = []
    for _ in range(3):
        clock.advance(waits[-1] if waits else 0.5)
        r = acquire_now(adm, demand())
        assert isinstance(r, Rejection)
        waits.append(r.retry_after_s)
    assert waits == pytest.approx([0.5, 1.0, 2.0])


def test_in_mixed_traffic_kv_is_expected_back_when_the_holders_needed_have_ended(clock: ManualClock):
    """A KV refusal sums the holders in order of expected end until the missing tokens are
    freed: a young chat (300 tokens, expected to end in 0.235 s) is not enough, the
    generation 1 s in (600 tokens, 1 s left) is needed too. The median said 50 ms."""
    adm = Admission(config(pool={"max_concurrency": 10, "kv_budget_tokens": 1000}), clock,
                    rand=no_jitter)
    mixed_history(adm, clock)
    gen = acquire_now(adm, demand(500, 100))
    clock.advance(0.99)
    chat = acquire_now(adm, demand(200, 100))
    clock.advance(0.01)
    assert isinstance(gen, Lease) and isinstance(chat, Lease)
    r = acquire_now(adm, demand(400, 100))         # 900 in use + 500 > 1000: 400 missing
    assert isinstance(r, Rejection) and r.reason is Reason.KV_BUDGET
    assert r.retry_after_s == pytest.approx(1.0)
    r = acquire_now(adm, demand(100, 100))         # 100 missing: the chat alone frees them
    assert isinstance(r, Rejection) and r.retry_after_s == pytest.approx(0.245 - 0.01)


def test_refusals_at_one_instant_are_told_hints_spread_over_a_quarter_of_the_wait(clock: ManualClock):
    adm = Admission(config(pool={"max_concurrency": 2}), clock, rand=random.Random(30).random)
    mixed_history(adm, clock)
    [acquire_now(adm, demand()) for _ in range(2)]
    clock.advance(0.3)
    hints = []
    for _ in range(200):
        r = acquire_now(adm, demand())
        assert isinstance(r, Rejection)
        hints.append(r.retry_after_s)
    assert all(1.7 - 1e-9 <= h < 1.7 * 1.25 for h in hints)
    assert len(set(hints)) == 200 and max(hints) - min(hints) > 0.9 * 1.7 * 0.25


def test_a_slots_refusal_reads_at_most_the_walk_limit_of_leases_whatever_is_in_flight(clock: ManualClock,
                                                                                     monkeypatch):
    """Under overload nearly every request is refused while the pool is full: the retry hint
    reads the leases oldest first, at most ``retry.WALK_LIMIT`` of them (it once sorted
    every lease in flight for each refusal: 6 ms a 429 with 20,000 in flight)."""
    from extproc.admission import retry
    limit = retry.WALK_LIMIT + 50
    adm = Admission(config(pool={"max_concurrency": limit}), clock, rand=no_jitter)
    for _ in range(3):                          # requests that each held a slot for 6 s
        x = acquire_now(adm, demand())
        clock.advance(6.0)
        x.release(Outcome.COMPLETED, 10)
    held = []
    for _ in range(limit):                      # admitted 10 ms apart
        held.append(acquire_now(adm, demand()))
        clock.advance(0.01)
    held.pop(0).release(Outcome.CLIENT_DISCONNECT)  # the oldest leaves: order is kept
    held.append(acquire_now(adm, demand()))
    live = adm._pools["default"].live
    assert [x.admitted_at for x in live] == sorted(x.admitted_at for x in live)
    read: list[float] = []
    walk = retry.first_end

    def counting(now, admitted, holds):
        return walk(now, (read.append(now - t[0]) or t for t in admitted), holds)

    monkeypatch.setattr("extproc.admission.pool.first_end", counting)
    r = acquire_now(adm, demand())
    assert isinstance(r, Rejection) and r.reason is Reason.CONCURRENCY
    assert len(read) == retry.WALK_LIMIT + 1 and read == sorted(read, reverse=True)
    assert r.retry_after_s == pytest.approx(6.0 - read[0])  # the oldest, read[0] s into 6 s holds
