"""Concurrency slots: effective limit, class guarantees, the burstable rest, shrunken guarantees."""

from __future__ import annotations

import pytest

from extproc.admission.slots import (Slots, effective_guarantees, effective_limit,
                                     reserved_for_others, slot_refusal)
from extproc.admission.types import Budget


@pytest.mark.parametrize("base, scale, limit", [
    (10, 1.0, 10), (10, 0.7, 7), (10, 0.6, 6), (10, 0.65, 6), (1, 0.6, 1), (3, 0.1, 1),
    (100, 0.29, 29), (64, 0.6, 38),
])
def test_effective_limit(base, scale, limit):
    assert effective_limit(base, scale) == limit


def test_guarantees_shrink_with_the_scale_and_never_exceed_the_limit():
    g = {"gold": 5, "silver": 3, "bronze": 2}
    assert effective_guarantees(g, 1.0, 10) == g
    assert effective_guarantees(g, 0.6, 6) == {"gold": 3, "silver": 1, "bronze": 1}
    # The limit is never below 1 but the guarantees may all floor to 0.
    assert effective_guarantees({"gold": 1}, 0.6, 1) == {}
    # If rounding ever left them above the limit, the last ones are cut.
    assert effective_guarantees({"a": 2, "b": 2}, 1.0, 3) == {"a": 2, "b": 1}
    for scale in (0.6, 0.61, 0.7, 0.77, 0.9, 1.0):
        limit = effective_limit(10, scale)
        assert sum(effective_guarantees(g, scale, limit).values()) <= limit


def test_limit_reached_refuses_everyone():
    assert slot_refusal(4, {"a": 4}, "a", 4, {}) is Budget.SLOTS
    assert slot_refusal(3, {"a": 3}, "a", 4, {}) is None


def test_others_unused_guarantee_is_kept_free():
    g = {"gold": 2}
    # 4 slots, gold guaranteed 2 and using none: standard may take only 2.
    assert slot_refusal(0, {}, "standard", 4, g) is None
    assert slot_refusal(1, {"standard": 1}, "standard", 4, g) is None
    assert slot_refusal(2, {"standard": 2}, "standard", 4, g) is Budget.RESERVED_SLOTS
    # Gold gets its guaranteed slots...
    assert slot_refusal(2, {"standard": 2}, "gold", 4, g) is None
    assert slot_refusal(3, {"standard": 2, "gold": 1}, "gold", 4, g) is None
    # ...and beyond them borrows the burstable rest like anyone.
    assert slot_refusal(1, {"gold": 1}, "gold", 4, g) is None
    assert slot_refusal(3, {"gold": 3}, "gold", 4, g) is None
    assert slot_refusal(3, {"gold": 3}, "standard", 4, g) is None


def test_reserved_for_others_counts_only_unused_guarantees_of_other_classes():
    g = {"a": 3, "b": 2}
    assert reserved_for_others({"a": 1}, "a", g) == 2
    assert reserved_for_others({"a": 1}, "b", g) == 2
    assert reserved_for_others({"a": 5, "b": 0}, "c", g) == 2


def test_after_a_shrink_nobody_is_admitted_until_in_flight_drains():
    # Base 10, gold guaranteed 5; 8 standard requests were admitted at scale 1.0.
    # Scale 0.6: limit 6, gold's guarantee 3. In-flight 8 > 6: gold too waits.
    g = effective_guarantees({"gold": 5}, 0.6, 6)
    assert g == {"gold": 3}
    assert slot_refusal(8, {"standard": 8}, "gold", 6, g) is Budget.SLOTS
    # Standard drains to 5: gold finds its guarantee again, standard does not.
    assert slot_refusal(5, {"standard": 5}, "gold", 6, g) is None
    assert slot_refusal(5, {"standard": 5}, "standard", 6, g) is Budget.RESERVED_SLOTS
    # Standard drains to 3: with gold's 3 reserved, standard is at the limit.
    assert slot_refusal(3, {"standard": 3}, "standard", 6, g) is Budget.RESERVED_SLOTS
    assert slot_refusal(2, {"standard": 2}, "standard", 6, g) is None


def test_slots_counter():
    s = Slots()
    assert s.take("a") == 1 and s.take("b") == 2
    assert s.give("a") == 1
    assert s.by_class == {"a": 0, "b": 1}
    with pytest.raises(ValueError):
        s.give("a")
