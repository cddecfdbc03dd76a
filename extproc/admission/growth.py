"""growth: what a picking pool expects its requests to hold as they grow (``GrowthRule``).

A request's hold on its node is its footprint (prompt + tokens generated so far) plus the
growth still to come, bounded as the pool's ``growth`` setting says (``config.Growth``):

| growth       | a request's growth to come                                     | rule                  |
|--------------|----------------------------------------------------------------|-----------------------|
| ``worst_case``| the rest of its reservation                                   | ``rules.node_hold``   |
| ``learned``  | the ``quantile`` of its class's completion lengths, per request | ``rules.node_hold``   |
| ``pooled``   | one bound per node over every request's moments                 | ``rules.pooled_growth``|

A class's lengths count once it has learned ``min_samples`` of them; until then its
requests are expected to use their whole reservation. Everything runs on the event-loop
thread; tokens throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from extproc.admission import rules
from extproc.admission.lengths import Lengths
from extproc.admission.node import Charge, Moments, Node
from extproc.config import Growth, PickingConfig


class GrowthRule:
    """GrowthRule is a picking pool's rule for what its requests are expected to hold (tokens),
    with the completion lengths each class has learned.

    ``picking``: the pool's picking settings (growth, quantile, min_samples; a reload
    replaces them); ``lengths``: per class, the completion lengths learned; ``taught``: a
    length was learned since every charge was last counted (``PoolNodes.mark`` recounts);
    ``share``, when set, is told every length learned (a store shared by replicas,
    ``Store.teach``).
    """

    __slots__ = ("picking", "lengths", "taught", "share")

    def __init__(self, picking: PickingConfig) -> None:
        self.picking = picking
        self.lengths: dict[str, Lengths] = {}
        self.taught = False
        self.share: Callable[[str, int], None] | None = None

    @property
    def pooled(self) -> bool:
        """pooled is True when growth is bounded per node, not per request (``growth: pooled``)."""
        return self.picking.growth is Growth.POOLED

    def learned(self, class_name: str) -> Lengths | None:
        """learned is the lengths of ``class_name`` when the rule reads them (None: the whole
        reservation is expected: worst-case growth, or fewer than ``min_samples`` learned)."""
        if self.picking.growth is Growth.WORST_CASE:
            return None
        known = self.lengths.get(class_name)
        if known is None or len(known.sorted) < self.picking.min_samples:
            return None
        return known

    def adopt(self, shared: Mapping[str, Sequence[int]]) -> None:
        """adopt takes the completion lengths every replica of a shared store learned (per class,
        oldest first) in place of this replica's own: each replica then expects what all of
        them saw, not its part of it (``Store.learned``)."""
        for class_name, lengths in shared.items():
            self.lengths[class_name] = Lengths.of(lengths)
        self.taught = self.picking.growth is not Growth.WORST_CASE

    def learn(self, class_name: str, completion_tokens: int) -> None:
        """learn adds a completed request's length to its class's (and tells ``share``)."""
        self.lengths.setdefault(class_name, Lengths()).add(completion_tokens)
        if self.share is not None:
            self.share(class_name, completion_tokens)
        self.taught = self.picking.growth is not Growth.WORST_CASE

    def moments(self, reserved: int, generated: int, class_name: str) -> Moments:
        """moments is what a request may still generate, for pooled growth (``rules.growth_moments``)."""
        known = self.learned(class_name)
        if known is None:
            return rules.growth_moments(reserved, generated, None, None)
        lengths, prefix = known.view()
        return rules.growth_moments(reserved, generated, lengths, prefix)

    def _node_hold(self, prompt: int, reserved: int, generated: int, class_name: str) -> int:
        known = self.learned(class_name)
        return rules.node_hold(prompt, reserved, generated, None if known is None else known.sorted,
                               self.picking.quantile)

    def expect(self, class_name: str, prompt: int, reserved: int,
               generated: int) -> tuple[int, Moments | None]:
        """expect is what a request adds to its node's sums with the lengths learned now: its
        own hold and its ``Moments`` (see ``Charge``; one of them is 0 or None)."""
        if self.pooled:
            return 0, self.moments(reserved, generated, class_name)
        return self._node_hold(prompt, reserved, generated, class_name), None

    def hold(self, prompt: int, reserved: int, generated: int, class_name: str) -> int:
        """hold is what a request is expected to hold on its node at most (alone on it, with
        pooled growth)."""
        if self.pooled:
            return prompt + generated + rules.pooled_growth(
                [self.moments(reserved, generated, class_name)], self.picking.quantile)
        return self._node_hold(prompt, reserved, generated, class_name)

    def alone(self, c: Charge) -> int:
        """alone is what charge ``c`` is expected to hold at most, alone on its node, as it was
        last counted (``hold`` of its request then)."""
        if c.moments is None:
            return c.own
        return c.footprint + rules.pooled_bound(*c.moments, self.picking.quantile)

    def held(self, n: Node, extra: tuple[str, int, int] | None = None) -> int:
        """held is what kvgate's charges on ``n`` are expected to hold at most; with ``extra``
        (class, prompt, reserved), one more request that has generated nothing.

        Read from the node's sums, whatever the requests held there; the prompt blocks they
        share are counted once (``Node.shared``)."""
        if self.pooled:
            footprint, left, mean, var = n.footprints - n.shared, n.left, n.mean, n.var
            if extra is not None:
                more, m, v = self.moments(extra[2], 0, extra[0])
                footprint, left, mean, var = footprint + extra[1], left + more, mean + m, var + v
            return footprint + rules.pooled_bound(left, mean, var, self.picking.quantile)
        total = n.owns - n.shared
        if extra is not None:
            total += self.hold(extra[1], extra[2], 0, extra[0])
        return total
