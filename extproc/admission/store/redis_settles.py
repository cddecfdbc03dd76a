"""redis_settles: the shared store's queue of settles waiting for their round trip.

A settle never blocks its caller: ``RedisStore.settle`` queues it, and it goes with this
replica's next admission (in the same round trip, before the admit script) or, if none
comes on this loop turn, with a flusher of its own. While Redis is away the queue keeps
them (bounded: ``MAX_PENDING``; a dropped settle's lease expires by itself) until the store
shares again. One batch is on the wire at a time (``batch``): admissions, flushes and a
refresh that must land before the settles (``exclusive``) wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from extproc.admission.store.redis_client import RoundTripError

MAX_PENDING = 100_000
"""MAX_PENDING is how many settles wait at most while Redis is unreachable; beyond it the oldest
are dropped: their leases expire by themselves, so memory stays bounded during a long outage."""


class Pending:
    """Pending is one settle waiting for its round trip: its pool, command and lease id.

    ``lease_id`` is None for the cancel of an admission whose answer was lost (it is not
    in the usage view, so nothing is to be taken out of it).
    """

    __slots__ = ("pool", "cmd", "lease_id")

    def __init__(self, pool: str, cmd: tuple[Any, ...], lease_id: str | None) -> None:
        self.pool = pool
        self.cmd = cmd
        self.lease_id = lease_id


class SettleQueue:
    """SettleQueue is the settles not yet sent (``pending``), the batch on the wire (``batch``,
    done when its round trip ends) and the flusher that sends what no admission took along.

    The store gives it: ``round_trip`` (the client's), ``shared`` (whether the store shares
    now: nothing is flushed otherwise), ``sent`` (a batch goes on the wire), ``read`` (its
    replies came back), ``dropped`` (a settle dropped by the bound), ``degrade`` (a round
    trip failed), ``survived`` (the flusher met an exception it did not expect) and ``closed``
    (whether the store closed: no flusher starts then).
    """

    __slots__ = ("pending", "batch", "flusher", "_closed", "_round_trip", "_shared", "_sent", "_read",
                 "_dropped", "_degrade", "_survived")

    def __init__(self, round_trip: Callable[[list[tuple[Any, ...]]], Awaitable[list[Any]]],
                 shared: Callable[[], bool], sent: Callable[[list[Pending]], None],
                 read: Callable[[list[Pending], list[Any]], None], dropped: Callable[[Pending], None],
                 degrade: Callable[[RoundTripError], None], survived: Callable[[str, BaseException], None],
                 closed: Callable[[], bool]) -> None:
        self.pending: list[Pending] = []
        self.batch: asyncio.Future[None] | None = None
        self.flusher: asyncio.Task[None] | None = None
        self._closed = closed
        self._round_trip = round_trip
        self._shared = shared
        self._sent = sent
        self._read = read
        self._dropped = dropped
        self._degrade = degrade
        self._survived = survived

    def queue(self, pending: Pending) -> None:
        """queue adds one settle, and starts the flusher when the store shares."""
        self.pending.append(pending)
        if len(self.pending) > MAX_PENDING:
            self._dropped(self.pending.pop(0))
        if self._shared() and self.flusher is None and not self._closed():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop (a test settling by hand): the next round trip takes it
            self.flusher = loop.create_task(self._flush_soon())

    def take(self) -> list[Pending]:
        """take is every queued settle, now on the wire with the caller's round trip."""
        batch, self.pending = self.pending, []
        self._sent(batch)
        return batch

    def put_back(self, batch: Sequence[Pending]) -> None:
        """put_back queues again a batch whose round trip failed (settles are idempotent)."""
        self.pending[:0] = batch

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """exclusive waits for the batch on the wire, then holds the place of one until the
        block ends: admissions and flushes wait for it."""
        while self.batch is not None:
            await asyncio.shield(self.batch)
        self.batch = done = asyncio.get_running_loop().create_future()
        try:
            yield
        finally:
            self.batch = None
            done.set_result(None)

    async def _flush_soon(self) -> None:
        """_flush_soon sends the settles no admission took along, one pipeline at a time."""
        try:
            while self.pending and self._shared():
                try:
                    await self.flush_pending()
                except RoundTripError as f:
                    self._degrade(f)
                except Exception as exc:  # noqa: BLE001 - queued settles stay queued
                    self._survived("settle flusher", exc)
        finally:
            self.flusher = None

    async def flush_pending(self) -> None:
        """flush_pending sends every queued settle in one round trip; re-queues them on
        failure. Raises RoundTripError."""
        while self.batch is not None:
            await asyncio.shield(self.batch)
        if not self.pending:
            return
        async with self.exclusive():
            batch = self.take()
            try:
                results = await self._round_trip([p.cmd for p in batch])
            except BaseException:  # a failure, or a cancelled flush (close): send them again later
                self.put_back(batch)
                raise
        self._read(batch, results)

    async def flush(self) -> None:
        """flush waits until every settle queued so far is applied in Redis (or Redis failed)."""
        while self.pending or self.batch is not None or self.flusher is not None:
            if not self._shared():
                return
            if self.flusher is not None:
                await asyncio.shield(self.flusher)
            elif self.batch is not None:
                await asyncio.shield(self.batch)
            else:
                try:
                    await self.flush_pending()
                except RoundTripError as f:
                    self._degrade(f)
