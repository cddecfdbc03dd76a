"""slots: concurrency slots per pool, with guaranteed slots per class and a burstable rest.

Rule (``slot_refusal``): a class may take a slot when, after taking it, the slots in use
plus the *unused guarantees of the other classes* stay within the effective limit:

    inflight + 1 + sum(max(0, g[c] - n[c]) for every other class c) <= limit

So a class below its guarantee always finds a slot (its own unused guarantee was kept
free for it), a class at or above its guarantee borrows only from the capacity nobody is
guaranteed, and no admission ever brings in-flight above the limit.

Guarantees under a shrunken limit: when the adaptive scale shrinks the limit to
``max(1, floor(base × scale))``, every guarantee shrinks with it to ``floor(g × scale)``
(``effective_guarantees``), so the guarantees never add up to more than the effective
limit. Admitted requests are never revoked: while a shrink leaves more slots in use than
the new limit (or than the limit minus the others' unused guarantees) allows, nobody is
admitted, not even a class below its guarantee, until enough requests finish; from then on
every class below its (shrunken) guarantee gets its slots again.

Guarantees are held for their class, never lent: unlike partitioned limiters that let
other partitions borrow an idle guarantee and take it back later, a slot lent to a batch
request cannot be taken back from it while it runs (its KV stays on the node for
minutes), so the class it was guaranteed to would find no slot exactly when it needs
one. KV safety and the guarantee's promise come first; idle guaranteed slots are the
price.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from extproc.admission.types import Budget

# floor(base × scale) in floats: 10 × 0.7 is 6.999999999999999; a scale is a ratio, not
# a measurement that precise, so round within a hair before flooring.
_FLOOR_SLACK = 1e-9


def scaled_floor(base: int, scale: float) -> int:
    """scaled_floor is floor(base × scale), tolerant of float error, never below 0."""
    v = math.floor(base * scale + _FLOOR_SLACK)
    return v if v > 0 else 0


def effective_limit(base: int, scale: float) -> int:
    """effective_limit is the concurrency limit, in slots, at ``scale``: max(1, floor(base × scale))."""
    v = scaled_floor(base, scale)
    return v if v > 1 else 1


def effective_guarantees(guaranteed: Mapping[str, int], scale: float, limit: int) -> dict[str, int]:
    """effective_guarantees shrinks each class's guaranteed slots to floor(g × scale).

    ``limit`` is the effective limit; should rounding still leave the sum above it, the
    lowest guarantees of the iteration order are cut until it fits. Classes left with 0
    are dropped.
    """
    out = {name: scaled_floor(g, scale) for name, g in guaranteed.items() if g > 0}
    excess = sum(out.values()) - limit
    for name in reversed(list(out)):
        if excess <= 0:
            break
        cut = min(excess, out[name])
        out[name] -= cut
        excess -= cut
    return {name: g for name, g in out.items() if g > 0}


def reserved_for_others(by_class: Mapping[str, int], class_name: str,
                        guarantees: Mapping[str, int]) -> int:
    """reserved_for_others counts the slots kept free for the other classes' unused guarantees."""
    reserved = 0
    for name, g in guarantees.items():
        if name != class_name:
            free = g - by_class.get(name, 0)
            if free > 0:
                reserved += free
    return reserved


def slot_refusal(inflight: int, by_class: Mapping[str, int], class_name: str, limit: int,
                 guarantees: Mapping[str, int]) -> Budget | None:
    """slot_refusal tells whether ``class_name`` may take one slot: None, or the budget that refuses.

    ``inflight`` is the pool's slots in use, ``by_class`` the same per class, ``limit``
    the effective limit and ``guarantees`` the effective guarantees (see the module rule).
    An idle guarantee is refused to the other classes (``RESERVED_SLOTS``), never lent:
    a slot given to a running request cannot be taken back (the module docstring says why).
    """
    if inflight >= limit:
        return Budget.SLOTS
    if guarantees and inflight + 1 + reserved_for_others(by_class, class_name, guarantees) > limit:
        return Budget.RESERVED_SLOTS
    return None


class Slots:
    """Slots counts the slots in use in one pool, in total and per class name."""

    __slots__ = ("inflight", "by_class")

    def __init__(self) -> None:
        self.inflight = 0
        self.by_class: dict[str, int] = {}

    def take(self, class_name: str) -> int:
        """take records one more slot in use by ``class_name``; returns the pool's in-flight count."""
        self.inflight += 1
        self.by_class[class_name] = self.by_class.get(class_name, 0) + 1
        return self.inflight

    def give(self, class_name: str) -> int:
        """give records one slot of ``class_name`` freed; returns the pool's in-flight count."""
        n = self.by_class.get(class_name, 0)
        if n <= 0 or self.inflight <= 0:
            raise ValueError(f"no slot of class {class_name!r} is in use")
        self.by_class[class_name] = n - 1
        self.inflight -= 1
        return self.inflight
