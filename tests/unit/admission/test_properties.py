"""Hypothesis properties of the admission core, over random sequences of operations.

Invariants: in-flight <= effective limit and KV in-flight <= KV budget at every
admission, and <= the class's KV ceiling (watermark x budget) at every admission of a
class with a watermark; a bucket never holds more than its capacity; a second release
changes nothing; once every lease is released nothing is held and the buckets were
charged exactly the settled amounts; a class below its guarantee always gets a slot; the
part of the KV budget above a class's watermark is always there for the other classes.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.admission import Admission, Demand, Lease, Outcome, PoolSignals
from extproc.admission.types import POOL_BUCKET
from extproc.admission.store.memory import MemoryStore
from extproc.clock import ManualClock
from extproc.config import Config
from extproc.configparse import parse_config
from kvgate_testkit.admission import acquire_now
from tests.unit.admission.helpers import STALE_AFTER_S

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OUTCOMES = list(Outcome)
TENANTS = {"a": "gold", "b": "standard", "c": "batch"}


def make_config(base: int, gold: int, tpm: int | None, tenant_tpm: int | None, kv: int | None,
                backends: bool, watermark: float = 1.0) -> Config:
    pool: dict[str, Any] = {"max_concurrency": base, "tpm": tpm, "kv_budget_tokens": kv,
                            "context_window": 4096, "default_max_tokens": 256}
    if backends:
        pool["backends"] = [{"name": "n", "metrics_url": "http://127.0.0.1:9/m"}]
    return parse_config({
        "pools": {"default": pool},
        "tenants": {"classes": {"standard": {}, "gold": {"guaranteed_slots": gold, "priority": 5},
                                "batch": {"sheddable": True, "tpm": tenant_tpm,
                                          "kv_watermark": watermark}},
                    "tenants": {"a": {"class": "gold", "tpm": tenant_tpm}}},
    })


configs = st.builds(
    make_config,
    base=st.integers(1, 8),
    gold=st.integers(0, 1),
    tpm=st.one_of(st.none(), st.integers(500, 20_000)),
    tenant_tpm=st.one_of(st.none(), st.integers(300, 5_000)),
    kv=st.one_of(st.none(), st.integers(200, 5_000)),
    backends=st.booleans(),
    watermark=st.sampled_from([1.0, 0.7, 0.35]) | st.floats(0.01, 1.0),
)

acquire = st.tuples(st.just("acquire"), st.sampled_from(sorted(TENANTS)), st.integers(0, 1500),
                    st.integers(0, 1500))
release = st.tuples(st.just("release"), st.integers(0, 10**6), st.sampled_from(OUTCOMES),
                    st.one_of(st.none(), st.integers(0, 3000)))
again = st.tuples(st.just("again"), st.integers(0, 10**6))
advance = st.tuples(st.just("advance"), st.floats(0.0, 90.0))
signals = st.tuples(st.just("signals"), st.one_of(st.none(), st.floats(0.0, 1.0)),
                    st.integers(0, 12), st.booleans())
ops = st.lists(st.one_of(acquire, acquire, release, again, advance, signals), max_size=60)


def demand(tenant: str, prompt: int, completion: int) -> Demand:
    return Demand("default", tenant, TENANTS[tenant], prompt, completion)


def check_buckets(store: MemoryStore, now: float) -> None:
    for key in (POOL_BUCKET, "tenant:a", "tenant:c"):
        state = store.bucket_state("default", key, now)
        if state is not None:
            tokens, capacity = state
            assert tokens <= capacity + 1e-9


@SETTINGS
@given(cfg=configs, script=ops)
def test_invariants_hold_through_any_sequence(cfg: Config, script: list[tuple]) -> None:
    clock = ManualClock(100.0)
    store = MemoryStore()
    adm = Admission(cfg, clock, store)
    leases: list[Lease] = []
    released: list[Lease] = []
    for op in script:
        kind = op[0]
        if kind == "acquire":
            res = acquire_now(adm, demand(*op[1:]))
            if isinstance(res, Lease):
                snap = adm.snapshot("default")
                assert snap.inflight <= snap.concurrency_limit
                if snap.kv_budget is not None:
                    assert snap.kv_inflight <= snap.kv_budget
                    mark = cfg.tenants.classes[res.demand.class_name].kv_watermark
                    assert snap.kv_inflight <= math.floor(mark * snap.kv_budget + 1e-9)
                leases.append(res)
        elif kind == "release" and leases:
            lease = leases.pop(op[1] % len(leases))
            assert lease.release(op[2], op[3]) is True
            released.append(lease)
        elif kind == "again" and released:
            before = adm.snapshot("default")
            state = store.bucket_state("default", POOL_BUCKET, clock.now())
            assert released[op[1] % len(released)].release(Outcome.COMPLETED, 0) is False
            assert adm.snapshot("default") == before
            assert store.bucket_state("default", POOL_BUCKET, clock.now()) == state
        elif kind == "advance":
            clock.advance(op[1])
        elif kind == "signals":
            now = clock.now()
            adm.update_signals("default", PoolSignals(op[1], op[2], op[3], None, now, now + STALE_AFTER_S))
        check_buckets(store, clock.now())
    for lease in leases:
        assert lease.release(Outcome.CLIENT_DISCONNECT, None)
    snap = adm.snapshot("default")
    assert (snap.inflight, snap.kv_inflight, snap.inflight_by_class) == (0, 0, {})
    check_buckets(store, clock.now())


refill_ops = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(sorted(TENANTS)), st.integers(0, 1500), st.integers(0, 1500)),
    st.tuples(st.just("release"), st.integers(0, 10**6), st.sampled_from(OUTCOMES),
              st.one_of(st.none(), st.integers(0, 1500))),
    st.tuples(st.just("advance"), st.floats(0.0, 90.0))), max_size=40)


@SETTINGS
@given(tpm=st.integers(500, 20_000), tenant_tpm=st.integers(300, 5_000), script=refill_ops)
def test_refunds_and_refills_never_fill_a_bucket_above_capacity(tpm: int, tenant_tpm: int,
                                                                script: list[tuple]) -> None:
    cfg = make_config(base=8, gold=0, tpm=tpm, tenant_tpm=tenant_tpm, kv=None, backends=False)
    clock = ManualClock(100.0)
    store = MemoryStore()
    adm = Admission(cfg, clock, store)
    leases: list[Lease] = []
    for op in script:
        if op[0] == "acquire":
            res = acquire_now(adm, demand(*op[1:]))
            if isinstance(res, Lease):
                leases.append(res)
        elif op[0] == "release" and leases:
            leases.pop(op[1] % len(leases)).release(op[2], op[3])
        elif op[0] == "advance":
            clock.advance(op[1])
        check_buckets(store, clock.now())


charged_ops = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(sorted(TENANTS)), st.integers(0, 400), st.integers(0, 400)),
    st.tuples(st.just("release"), st.integers(0, 10**6), st.one_of(st.none(), st.integers(0, 800)))),
    max_size=60)


@SETTINGS
@given(script=charged_ops)
def test_buckets_are_charged_exactly_the_settled_amounts(script: list[tuple]) -> None:
    # No time passes, so nothing refills: every token gone is a token charged.
    cfg = make_config(base=8, gold=1, tpm=50_000, tenant_tpm=20_000, kv=None, backends=False)
    clock = ManualClock(100.0)
    store = MemoryStore()
    adm = Admission(cfg, clock, store)
    leases: list[Lease] = []
    charged = {POOL_BUCKET: 0, "tenant:a": 0, "tenant:c": 0}

    def settle(lease: Lease, completion: int | None) -> None:
        d = lease.demand
        used = d.prompt_tokens + (d.reserved_completion if completion is None else completion)
        assert lease.release(Outcome.COMPLETED, completion)
        charged[POOL_BUCKET] += used
        if d.tenant in ("a", "c"):
            charged["tenant:" + d.tenant] += used

    for op in script:
        if op[0] == "acquire":
            res = acquire_now(adm, demand(*op[1:]))
            if isinstance(res, Lease):
                leases.append(res)
        elif leases:
            settle(leases.pop(op[1] % len(leases)), op[2])
    for lease in leases:
        settle(lease, None)
    for key, capacity in ((POOL_BUCKET, 50_000), ("tenant:a", 20_000), ("tenant:c", 20_000)):
        state = store.bucket_state("default", key, clock.now())
        tokens = capacity if state is None else state[0]
        assert tokens == capacity - charged[key]
    snap = adm.snapshot("default")
    assert (snap.inflight, snap.kv_inflight) == (0, 0)


guarantee_ops = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(["standard", "gold", "silver"])),
    st.tuples(st.just("release"), st.integers(0, 10**6))), max_size=80)


@SETTINGS
@given(base=st.integers(2, 10), gold=st.integers(1, 4), silver=st.integers(0, 4), script=guarantee_ops)
def test_a_class_below_its_guarantee_always_gets_a_slot(base: int, gold: int, silver: int,
                                                        script: list[tuple]) -> None:
    gold = min(gold, base)
    silver = min(silver, base - gold)
    cfg = parse_config({"pools": {"default": {"max_concurrency": base}},
                        "tenants": {"classes": {"standard": {}, "gold": {"guaranteed_slots": gold},
                                                "silver": {"guaranteed_slots": silver}}}})
    adm = Admission(cfg, ManualClock(0.0))
    guarantees = {"gold": gold, "silver": silver}
    leases: list[Lease] = []
    for op in script:
        by_class = adm.snapshot("default").inflight_by_class
        for cls, g in guarantees.items():
            if by_class.get(cls, 0) < g:
                probe = acquire_now(adm, Demand("default", "t", cls, 1, 0))
                assert isinstance(probe, Lease), (cls, by_class, probe)
                probe.release(Outcome.COMPLETED, 0)
        if op[0] == "acquire":
            res = acquire_now(adm, Demand("default", "t", op[1], 1, 0))
            if isinstance(res, Lease):
                leases.append(res)
        elif leases:
            leases.pop(op[1] % len(leases)).release(Outcome.COMPLETED, 0)
        assert adm.snapshot("default").inflight <= base


headroom_ops = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(["batch", "standard"]), st.integers(0, 3000)),
    st.tuples(st.just("release"), st.integers(0, 10**6))), max_size=60)


@SETTINGS
@given(budget=st.integers(1, 8000), watermark=st.floats(0.01, 1.0), script=headroom_ops)
def test_the_budget_above_a_watermark_is_always_there_for_the_others(budget: int, watermark: float,
                                                                     script: list[tuple]) -> None:
    # However batch requests came and went, a request of another class fits the KV budget
    # when it and that class's own in-flight tokens fit in the part above batch's ceiling:
    # the probe asks for exactly what is left of that part.
    cfg = parse_config({"pools": {"default": {"max_concurrency": 1000, "kv_budget_tokens": budget,
                                              "context_window": 4096, "default_max_tokens": 256}},
                        "tenants": {"classes": {"standard": {}, "batch": {"kv_watermark": watermark}}}})
    adm = Admission(cfg, ManualClock(0.0))
    ceiling = math.floor(watermark * budget + 1e-9)
    leases: list[Lease] = []
    for op in script:
        if op[0] == "acquire":
            res = acquire_now(adm, Demand("default", "t", op[1], op[2], 0))
            if isinstance(res, Lease):
                leases.append(res)
        elif leases:
            leases.pop(op[1] % len(leases)).release(Outcome.COMPLETED, 0)
        others = sum(x.demand.tokens for x in leases if x.demand.class_name == "standard")
        probe = budget - ceiling - others
        if probe >= 0:
            got = acquire_now(adm, Demand("default", "t", "standard", probe, 0))
            assert isinstance(got, Lease), (others, probe, ceiling, got)
            got.release(Outcome.COMPLETED, 0)
