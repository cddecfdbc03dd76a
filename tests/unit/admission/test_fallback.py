"""The shared store's modes without a server: degrade at once, share again at the first
answer or with hysteresis, decide locally within what the replica's leases hold or fail closed. Instants are fixed; nothing sleeps."""

from __future__ import annotations

import logging

import pytest

from extproc.admission.shared_nodes import Candidate as C, NodeAsk
from extproc.admission.store.fallback import (FLAP_WINDOW_S, LOCAL_PREFIX, MODE_FAIL_CLOSED, MODE_LOCAL_SHARE,
                                              MODE_SHARED, Fallback,
                                              StoreUnavailableError, Within)
from extproc.admission.types import Budget, Grant, Plan, PoolLimits, Refusal
from tests.unit.admission.helpers import Recorder

T0 = 1000.0
RECOVER_S = 0.5  # the hysteresis the tests below set (``store.redis.recover_s``; default 0)
LIMITS = PoolLimits(pool="p", scale=1.0, limit=6, base_limit=6, kv_budget=6000, base_kv_budget=6000)


def fallback(on_unavailable: str = MODE_LOCAL_SHARE, expected: int | None = 2,
             recover_s: float = RECOVER_S) -> tuple[Fallback, Recorder]:
    heard = Recorder()
    return Fallback(on_unavailable, expected, heard, "127.0.0.1:6379/0", recover_s), heard


def test_a_failure_degrades_at_once_and_loudly(caplog: pytest.LogCaptureFixture) -> None:
    f, heard = fallback()
    assert f.shared and heard.modes == [MODE_SHARED]
    with caplog.at_level(logging.WARNING, logger="kvgate.store"):
        assert f.degrade("timeout", "no answer within 0.05s", T0)
    assert f.mode == MODE_LOCAL_SHARE and heard.modes == [MODE_SHARED, MODE_LOCAL_SHARE]
    assert "admitting locally within this replica's leases, with 1/2 of each token bucket" in caplog.text
    assert not f.degrade("connection", "refused", T0 + 0.1)  # already degraded: counted, no change
    assert heard.errors == ["timeout", "connection"] and heard.modes[-1] == MODE_LOCAL_SHARE


def test_shared_mode_returns_only_after_answering_for_recover_s() -> None:
    f, heard = fallback()
    f.degrade("timeout", "", T0)
    assert not f.answered(T0 + 1)
    assert not f.answered(T0 + 1 + RECOVER_S / 2)
    f.probe_failed("timeout")  # one unanswered probe starts the wait again
    assert not f.answered(T0 + 1 + RECOVER_S)
    assert not f.answered(T0 + 1 + RECOVER_S + RECOVER_S / 2)
    assert f.answered(T0 + 1 + 2 * RECOVER_S)
    assert f.shared and heard.modes == [MODE_SHARED, MODE_LOCAL_SHARE, MODE_SHARED]
    assert heard.errors == ["timeout", "timeout"]


def test_by_default_shared_mode_returns_at_the_first_answer() -> None:
    f, heard = fallback(recover_s=0.0)
    f.degrade("timeout", "", T0)
    assert f.answered(T0 + 0.5)
    assert heard.modes == [MODE_SHARED, MODE_LOCAL_SHARE, MODE_SHARED]
    f.degrade("timeout", "", T0 + 1.0)  # flapping: twice nothing is nothing
    assert f.answered(T0 + 1.5)


def test_a_flapping_server_must_answer_twice_as_long() -> None:
    f, _ = fallback()
    now = T0
    waits = []
    for _ in range(8):
        f.degrade("timeout", "", now)
        waits.append(f.recover_s)
        f.answered(now)
        now += f.recover_s
        assert f.answered(now)
        now += 1.0  # fails again soon after it came back
    assert waits == [RECOVER_S] + [2 * RECOVER_S] * 7
    f.degrade("timeout", "", now + FLAP_WINDOW_S)  # quiet for a window: no longer flapping
    assert f.recover_s == RECOVER_S


def test_fail_closed_refuses_every_admission() -> None:
    f, _ = fallback(MODE_FAIL_CLOSED)
    f.degrade("connection", "refused", T0)
    assert f.mode == MODE_FAIL_CLOSED
    with pytest.raises(StoreUnavailableError, match="does not answer"):
        f.admit(Plan(LIMITS, "a", "standard", 10), T0, Within(6, 6000))


def test_an_unknown_share_fails_closed_until_a_heartbeat_counted_the_replicas() -> None:
    f, _ = fallback(expected=None)
    f.degrade("timeout", "", T0)
    with pytest.raises(StoreUnavailableError, match="expected_replicas"):
        f.admit(Plan(LIMITS, "a", "standard", 10), T0, Within(6, 6000))
    f.saw_replicas(3)
    assert f.share_replicas == 3
    assert isinstance(f.admit(Plan(LIMITS, "a", "standard", 10), T0, Within(6, 6000)), Grant)


def test_local_admissions_stay_within_what_the_leases_hold_beyond_the_live_requests() -> None:
    f, _ = fallback(expected=2)
    f.degrade("timeout", "", T0)
    # the leases hold 2 slots and 3000 KV tokens more than the live requests take
    # (what the store works out again after each grant: one slot and 10 tokens fewer)
    grants = [f.admit(Plan(LIMITS, "a", "standard", 10), T0, Within(2 - k, 3000 - 10 * k)) for k in range(3)]
    assert [isinstance(g, Grant) for g in grants] == [True, True, False]
    assert all(g.id.startswith(LOCAL_PREFIX) for g in grants if isinstance(g, Grant))
    refusal = grants[2]
    assert isinstance(refusal, Refusal) and refusal.budget is Budget.SLOTS
    kv = f.admit(Plan(LIMITS, "a", "standard", 2990), T0, Within(1, 2980))
    assert isinstance(kv, Refusal) and kv.budget is Budget.KV  # 2980 + the 20 in flight locally
    assert isinstance(f.admit(Plan(LIMITS, "a", "standard", 1), T0, Within(0, 5000)), Refusal)


def test_a_local_pick_takes_a_node_within_the_room_its_leases_hold() -> None:
    f, _ = fallback(expected=2)
    f.degrade("timeout", "", T0)
    ask = NodeAsk((C("n0", 1000, 0, 0), C("n1", 4000, 0, 0)), 1500, 0.0, 1.0)
    g = f.admit(Plan(LIMITS, "a", "standard", 10, None, ask), T0, Within(6, 6000, {"n0": 3000, "n1": 2000}))
    assert isinstance(g, Grant) and g.picked == "n1" and g.node_hold == 1500  # n0 reads too small
    too_big = NodeAsk((C("n0", 1000, 0, 0), C("n1", 4000, 0, 0)), 2500, 0.0, 1.0)
    r = f.admit(Plan(LIMITS, "a", "standard", 10, None, too_big), T0, Within(6, 6000, {"n1": 2000}))
    assert isinstance(r, Refusal) and r.budget is Budget.NODE_KV and r.limit == 2000


def test_an_unknown_on_unavailable_is_refused() -> None:
    with pytest.raises(ValueError, match="on_unavailable"):
        fallback("pray")
