"""redis_upkeep: the shared store's background task and its mode machine (probe, degrade, recover).

In shared mode the task refreshes every ``refresh_every`` seconds (the heartbeat, the
leases, the readings); out of it, it probes Redis every ``probe_every`` seconds with the
same round trip, and the store shares again once ``fallback.Fallback`` says Redis answered
long enough (hysteresis). What a replica admitted alone is carried into Redis before the
settles queued meanwhile go (``probe``): until then the room of the requests they end is
what it admits within.

Nothing ends the task but ``close``: an exception it did not expect (a client library's,
on any event loop, or the store's own) is logged with its traceback, counted
(``internal``), taken as a failed round trip, and the loop goes on (``survived``); a task
that ended anyway is started again by the next admission (``ensure``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from extproc.admission.store.fallback import Fallback
from extproc.admission.store.redis_client import RoundTripError
from extproc.admission.store.redis_settles import SettleQueue
from extproc.admission.types import ERROR_INTERNAL

log = logging.getLogger("kvgate.store")


class Upkeep:
    """Upkeep is the store's background task (``task``) and the mode machine it drives.

    ``fallback``: the modes; ``settles``: the queued settles; ``round_trip``: one refresh
    round trip, returning the ids of the leases it carried (raises RoundTripError);
    ``alone_since``: whether a live grant made alone is not among such ids; ``now``: the
    caller clock (s); ``closed``: whether the store closed; ``refresh_every`` and ``probe_every``: intervals (s).
    """

    __slots__ = ("task", "_closed", "_wake", "_fallback", "_settles", "_round_trip", "_alone_since", "_now",
                 "_refresh_every", "_probe_every")

    def __init__(self, fallback: Fallback, settles: SettleQueue, round_trip: Callable[[], Awaitable[set[str]]],
                 alone_since: Callable[[set[str]], bool], now: Callable[[], float], closed: Callable[[], bool],
                 refresh_every: float, probe_every: float) -> None:
        self.task: asyncio.Task[None] | None = None
        self._closed = closed
        self._wake: asyncio.Event | None = None
        self._fallback = fallback
        self._settles = settles
        self._round_trip = round_trip
        self._alone_since = alone_since
        self._now = now
        self._refresh_every = refresh_every
        self._probe_every = probe_every

    def ensure(self) -> None:
        """ensure starts the task, or starts it again if it ever ended (it should not)."""
        if (self.task is None or self.task.done()) and not self._closed():
            if self.task is not None and not self.task.cancelled() and self.task.exception() is not None:
                self.survived("refresher task", self.task.exception())  # type: ignore[arg-type]
            self._wake = asyncio.Event()
            self.task = asyncio.get_running_loop().create_task(self._maintain(), name="kvgate-redis-store")

    async def _maintain(self) -> None:
        """_maintain refreshes every ``refresh_every`` s in shared mode, probes Redis otherwise."""
        wake = self._wake
        assert wake is not None
        while not self._closed():
            try:
                if self._fallback.shared:
                    wake.clear()
                    try:
                        await asyncio.wait_for(wake.wait(), self._refresh_every)
                    except TimeoutError:
                        await self.refresh()  # the timer, not a failure, ended the wait
                else:
                    await asyncio.sleep(self._probe_every)
                    await self.probe()
            except Exception as exc:  # noqa: BLE001 - the refresher must outlive any failure
                self.survived("refresher", exc)
                await asyncio.sleep(self._probe_every)

    def survived(self, what: str, exc: BaseException) -> None:
        """survived records an exception the store's background work ``what`` did not expect
        and carries on: logged with its traceback, counted, and taken as a failed round trip
        (the store degrades, or its probe starts again)."""
        log.error("shared store: the %s survived an unexpected %s; going on", what, type(exc).__name__,
                  exc_info=exc)
        failure = RoundTripError(ERROR_INTERNAL, f"{what}: {type(exc).__name__}: {exc}")
        if self._fallback.shared:
            self.degrade(failure)
        else:
            self._fallback.probe_failed(failure.reason)

    def degrade(self, failure: RoundTripError) -> None:
        """degrade leaves shared mode on ``failure``; the task starts probing at once."""
        if self._fallback.degrade(failure.reason, str(failure), self._now()) and self._wake is not None:
            self._wake.set()

    async def refresh(self) -> bool:
        """refresh is one refresh round trip in shared mode; degrades the store when Redis
        fails. True on success."""
        if not self._fallback.shared:
            return False
        try:
            await self._round_trip()
        except RoundTripError as f:
            self.degrade(f)
            return False
        return True

    async def probe(self) -> bool:
        """probe asks Redis whether it is back; if so, applies queued settles and re-takes live
        leases, and returns to shared mode once Redis has answered every probe for
        ``recover_s`` (the hysteresis rule). Returns True when the store is in shared mode
        afterwards."""
        if self._fallback.shared:
            return True
        try:
            # Leases first: what this replica admitted alone is in the ledger before the
            # room of what ended goes back, so the ledger never shows less than it holds.
            carried = await self._round_trip()
        except RoundTripError as f:
            self._fallback.probe_failed(f.reason)
            return False
        if not self._fallback.answered(self._now()):
            # The settles wait for shared mode: until then the room of the leases they end
            # is what this replica admits within (``Escrow.within``); sent now, it would be
            # gone from both this replica and, while they are cut off too, every other.
            return False
        try:
            if self._alone_since(carried):
                # Granted alone while that refresh was on the wire, within the room the
                # settles end: they wait until another refresh carried it (no grant is made
                # alone any more, the store is shared). Admissions and flushes wait too.
                async with self._settles.exclusive():
                    await self._round_trip()
            await self._settles.flush_pending()
        except RoundTripError as f:
            self.degrade(f)
            return False
        return True
