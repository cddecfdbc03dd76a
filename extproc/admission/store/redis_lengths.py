"""redis_lengths: the completion lengths every replica learned, shared through Redis.

A picking pool expects each request's growth from the completion lengths of its class
(``growth.GrowthRule``). Each replica learns them from its own completions, so beside
others it would see a part of them: a class would depart from the worst case later
(``min_samples``), and a request that has run longer than every length its replica
learned would be expected to use its whole reservation. ``SharedLengths`` pushes what
this replica learned to the pool's list of the class, ``P{pool}:ln:<class>`` (the latest
LENGTH_SAMPLES kept; ``P{pool}:lc`` names the classes), in its refresh round trip, and
every READ_EVERY refreshes reads every class's list back for the node ledger to expect
what all of them saw (``GrowthRule.adopt``). The pushes go in a round trip of their own
after the refresh's: a round trip with scripts is sent again whole when Redis lost them
(``RedisClient.round_trip``), and a push sent twice would count twice. One whose reply
was lost after Redis applied it still does: a sample among a thousand, not a budget.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from extproc.admission.lengths import LENGTH_SAMPLES
from extproc.admission.store.redis_client import RoundTripError
from extproc.admission.store.redis_ledger import Keys
from extproc.admission.types import ERROR_RESPONSE

log = logging.getLogger("kvgate.store")

READ_EVERY = 4
"""READ_EVERY is how many refresh round trips one read of the shared lengths is apart."""


def lengths_of(reply: Sequence[Any]) -> list[int]:
    """lengths_of is a list's lengths that are whole numbers of tokens; what else a list holds
    (a value written by anything but kvgate) is passed over."""
    out = []
    for x in reply:
        try:
            n = int(x)
        except (TypeError, ValueError):
            continue
        if n >= 0:
            out.append(n)
    return out


class SharedLengths:
    """SharedLengths is what this replica learned and has not pushed yet (``pending``, per pool
    and class, the latest LENGTH_SAMPLES of each kept while Redis is away), the classes
    each pool's lists are known for, and the lists last read (``fresh``, until asked)."""

    __slots__ = ("pending", "classes", "fresh", "_round", "_sent", "_reads", "_refused")

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, list[int]]] = {}
        self.classes: dict[str, set[str]] = {}
        self.fresh: dict[str, dict[str, list[int]]] = {}
        self._round = 0
        self._sent: list[tuple[str, str, int]] = []  # (pool, class, lengths) the last cmds pushed, 3 commands each
        self._reads: list[tuple[str, str | None]] = []  # (pool, class or None: the classes) per reply
        self._refused = False  # Redis refused the last sync (logged once until one passes)

    def teach(self, pool: str, class_name: str, completion_tokens: int) -> None:
        """teach keeps one length to push with the next refresh."""
        q = self.pending.setdefault(pool, {}).setdefault(class_name, [])
        q.append(completion_tokens)
        if len(q) > LENGTH_SAMPLES:
            del q[0]

    def learned(self, pool: str) -> Mapping[str, Sequence[int]] | None:
        """learned is the lists of ``pool`` read since it was last asked (None: none)."""
        return self.fresh.pop(pool, None)

    async def sync(self, round_trip: Callable[[Sequence[tuple[Any, ...]]], Awaitable[list[Any]]],
                   keys: Mapping[str, Keys]) -> None:
        """sync pushes and reads in one ``round_trip`` of its own (none when there is nothing
        to do). Raises RoundTripError when Redis does not answer; an answer it cannot use (a
        key of another type, written by anything but kvgate) drops what it pushed and keeps
        the lengths adopted before, with a warning: the store stays shared."""
        cmds = self.cmds(keys)
        if not cmds:
            return
        try:
            replies = await round_trip(cmds)
            self.read(replies)
        except (RoundTripError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, RoundTripError) and exc.reason != ERROR_RESPONSE:
                raise
            self._drop_sent()
            if not self._refused:
                log.warning("shared store: Redis refused the shared completion lengths (%s): each replica "
                            "expects growth from its own until it takes them", exc)
            self._refused = True
            return
        self._refused = False

    def cmds(self, keys: Mapping[str, Keys]) -> list[tuple[Any, ...]]:
        """cmds are one refresh's commands: the pushes of what is pending in the pools of
        ``keys`` and, every READ_EVERY rounds (the first included), the reads; ``read`` takes
        their replies."""
        self._round += 1
        out: list[tuple[Any, ...]] = []
        self._sent, self._reads = [], []
        for pool, k in keys.items():
            for cls, q in self.pending.get(pool, {}).items():
                if q:
                    out += [("RPUSH", k.ln + cls, *q), ("LTRIM", k.ln + cls, -LENGTH_SAMPLES, -1),
                            ("SADD", k.lc, cls)]
                    self._sent.append((pool, cls, len(q)))
        if self._round % READ_EVERY == 1:
            for pool, k in keys.items():
                out.append(("SMEMBERS", k.lc))
                self._reads.append((pool, None))
                for cls in sorted(self.classes.get(pool, ())):
                    out.append(("LRANGE", k.ln + cls, 0, -1))
                    self._reads.append((pool, cls))
        return out

    def read(self, replies: Sequence[Any]) -> None:
        """read takes the replies to the last ``cmds``: the pushed lengths leave ``pending``, the
        lists read become ``fresh`` (their whole numbers only; an empty one is not news)."""
        reads = replies[3 * len(self._sent):]
        self._drop_sent()
        lists: dict[str, dict[str, list[int]]] = {}
        for (of, listed), r in zip(self._reads, reads):
            if listed is None:
                self.classes[of] = {m.decode(errors="replace") if isinstance(m, bytes) else str(m) for m in r}
            elif values := lengths_of(r):  # an empty list (Redis restarted) keeps what was adopted
                lists.setdefault(of, {})[listed] = values
        self.fresh.update(lists)

    def _drop_sent(self) -> None:
        """_drop_sent takes what the last ``cmds`` pushed out of ``pending``."""
        for pool, cls, n in self._sent:
            del self.pending[pool][cls][:n]
        self._sent = []
