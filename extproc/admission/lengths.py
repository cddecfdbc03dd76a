"""lengths: the completion lengths a class learned (``Lengths``), for the growth to expect.

Everything runs on the event-loop thread.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from itertools import accumulate
from operator import mul



# Completion lengths remembered per class to learn the growth to expect.
LENGTH_SAMPLES = 1000


# The share of a class's lengths whose learning rebuilds the view pooled growth reads.
VIEW_SHARE = 64


class Lengths:
    """Lengths keeps the latest completion lengths (tokens) of one class, sorted.

    ``view`` is what pooled growth reads: a copy of the sorted lengths with their running
    sums, rebuilt (a walk of every length) once the lengths learned since reach
    1/VIEW_SHARE of those kept: at every length while fewer than VIEW_SHARE are kept, every
    LENGTH_SAMPLES / VIEW_SHARE lengths at most after that. A rebuild at every length cost
    each release a walk of a thousand; the view lags the lengths learned by 1.6% at most.
    """

    __slots__ = ("_order", "sorted", "_view", "_since")

    def __init__(self) -> None:
        self._order: deque[int] = deque()
        self.sorted: list[int] = []
        self._view: tuple[list[int], tuple[list[int], list[int]]] | None = None
        self._since = 0  # lengths learned since the view was built

    @classmethod
    def of(cls, lengths: Sequence[int]) -> Lengths:
        """of is the lengths of ``lengths``, oldest first (the latest LENGTH_SAMPLES of them)."""
        out = cls()
        out._order.extend(lengths[-LENGTH_SAMPLES:])
        out.sorted = sorted(out._order)
        out._since = len(out.sorted)
        return out

    def add(self, n: int) -> None:
        """add remembers one settled completion length, forgetting the oldest beyond LENGTH_SAMPLES."""
        self._order.append(n)
        bisect.insort(self.sorted, n)
        if len(self._order) > LENGTH_SAMPLES:
            old = self._order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
        self._since += 1

    def view(self) -> tuple[list[int], tuple[list[int], list[int]]]:
        """view is (sorted lengths, their running sums and those of their squares, from 0), as
        of the last rebuild (see the class doc): integers, so exact."""
        if self._view is None or self._since * VIEW_SHARE >= len(self.sorted):
            lengths = list(self.sorted)
            self._view = (lengths, (list(accumulate(lengths, initial=0)),
                                    list(accumulate(map(mul, lengths, lengths), initial=0))))
            self._since = 0
        return self._view
