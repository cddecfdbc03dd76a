"""In-flight KV-token budget and the completion a request reserves."""

from __future__ import annotations

import pytest

from extproc.admission.kvbudget import (KvLedger, base_kv_budget, effective_kv_budget, kv_ceilings,
                                        reserved_completion)


@pytest.mark.parametrize("prompt, max_tokens, reserved", [
    (1000, 256, 256),        # the request's max_tokens wins
    (1000, None, 1024),      # the pool default
    (32_000, None, 768),     # less room left in the context window than the default
    (32_768, None, 0),       # nothing left
    (40_000, None, 0),       # over the window: the service answers 400, never negative here
])
def test_reserved_completion(prompt, max_tokens, reserved):
    assert reserved_completion(prompt, max_tokens, 32_768, 1024) == reserved


def test_budget_is_configured_or_derived_from_capacity():
    assert base_kv_budget(50_000, 1_000_000, 0.9) == 50_000
    assert base_kv_budget(None, 1_000_000, 0.9) == 900_000
    assert base_kv_budget(None, None, 0.9) is None
    assert base_kv_budget(None, 0, 0.9) is None
    assert effective_kv_budget(100_000, 0.6) == 60_000
    assert effective_kv_budget(None, 0.6) is None


def test_ten_32k_requests_do_not_fit_together():
    budget = 200_000
    ledger = KvLedger()
    admitted = 0
    for _ in range(10):
        if ledger.inflight + 32_768 + 1024 <= budget:
            ledger.take(32_768 + 1024)
            admitted += 1
    assert admitted == 5
    assert ledger.inflight <= budget


def test_ledger_refuses_to_free_more_than_held():
    ledger = KvLedger()
    ledger.take(10)
    with pytest.raises(ValueError):
        ledger.give(11)
    assert ledger.give(10) == 0


def test_kv_ceilings_are_the_watermark_of_the_effective_and_the_base_budget():
    marks = {"batch": 0.7, "bulk": 0.25, "whole": 1.0}
    # 0.7 x 10,000 is 6999.999... in floats: the floor is taken within a hair.
    assert kv_ceilings(marks, 10_000, 10_000) == {"batch": (7000, 7000), "bulk": (2500, 2500)}
    assert kv_ceilings(marks, 6_000, 10_000) == {"batch": (4200, 7000), "bulk": (1500, 2500)}
    assert kv_ceilings({"tiny": 0.1}, 5, 9) == {"tiny": (0, 0)}
    assert kv_ceilings(marks, None, None) == {}  # no KV budget: nothing to fill
    assert kv_ceilings({}, 10_000, 10_000) == {}
