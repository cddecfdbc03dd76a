"""redis_gone: the leases of a replica whose heartbeat expired, released once it certainly stopped.

A refresh's heartbeat script answers the replicas whose heartbeat expired and where each
answered ``/healthz`` (``redis_ledger`` key layout: ``Preplicas_gone``, ``Preplica_addrs``).
``GoneReplicas`` asks there whether it still runs (``redis_ledger.replica_runs``) and takes
its leases out of every known pool when its port refuses or another process answers: so
the leases of a replica killed with SIGKILL come back within seconds rather than their TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from extproc.admission.store.redis_client import RoundTripError
from extproc.admission.store.redis_ledger import Keys, replica_runs
from extproc.admission.store.redis_lua import RELEASE, HeartbeatKeys, ReleaseArg, word

log = logging.getLogger("kvgate.store")


class GoneReplicas:
    """GoneReplicas checks the replicas whose heartbeat expired, one task each (``checking``).

    ``round_trip``: the client's; ``keys``: every known pool's keys; ``heartbeat``: the
    heartbeat's keys; ``now_arg``: the instant a script runs at (None: Redis TIME);
    ``read_view``: keeps what a script reported of a pool; ``ttl`` the lease TTL (s);
    ``timeout_s`` how long an asked replica has to answer (s).
    """

    __slots__ = ("checking", "_round_trip", "_keys", "_heartbeat", "_now_arg", "_read_view", "_ttl", "_timeout")

    def __init__(self, round_trip: Callable[[list[tuple[Any, ...]]], Awaitable[list[Any]]],
                 keys: dict[str, Keys], heartbeat: HeartbeatKeys, now_arg: Callable[[], float | None],
                 read_view: Callable[[str, bytes], None], ttl: float, timeout_s: float) -> None:
        self.checking: dict[str, asyncio.Task[None]] = {}
        self._round_trip = round_trip
        self._keys = keys
        self._heartbeat = heartbeat
        self._now_arg = now_arg
        self._read_view = read_view
        self._ttl = ttl
        self._timeout = timeout_s

    def gone(self, replica: str, addr: str) -> None:
        """gone starts the check of ``replica``, last seen answering at ``addr`` ("-": nowhere),
        unless one runs already."""
        if addr != "-" and replica not in self.checking:
            self.checking[replica] = asyncio.get_running_loop().create_task(
                self._check(replica, addr), name=f"kvgate-check-{replica}")

    async def _check(self, replica: str, addr: str) -> None:
        """_check asks ``addr`` whether ``replica`` still runs, and releases its leases in every
        known pool when it certainly does not: its port refuses connections, or another
        process (another replica id) answers there. A replica that answers, or does not
        answer in time (cut off from this one as well), keeps its leases until they expire:
        it may be admitting within them alone."""
        try:
            alive = await replica_runs(addr, replica, min(0.5, self._timeout))
            if alive is not False:
                return
            released = await self.release(replica)
            log.warning("shared store: replica %s at %s no longer runs (its heartbeat expired, its address "
                        "refuses it): released its %d leases", replica, addr, released)
        except RoundTripError as f:
            log.info("shared store: could not release the leases of replica %s: %s", replica, f)
        except Exception:  # noqa: BLE001 - a check must not take the store down
            log.exception("shared store: checking replica %s at %s failed", replica, addr)
        finally:
            self.checking.pop(replica, None)

    async def release(self, replica: str) -> int:
        """release takes every lease of ``replica`` out of every known pool, in one round trip."""
        now_arg = self._now_arg()
        pools = list(self._keys)
        cmds: list[tuple[Any, ...]] = [
            RELEASE.command(self._keys[p].of_refresh(), *map(word, ReleaseArg(now_arg, self._ttl, replica)))
            for p in pools]
        cmds += [("ZREM", self._heartbeat.gone, replica), ("HDEL", self._heartbeat.addrs, replica)]
        results = await self._round_trip(cmds)
        released = 0
        for pool, r in zip(pools, results):
            head, _, view = r.partition(b"|")
            released += int(head)
            with contextlib.suppress(IndexError, TypeError, ValueError):
                self._read_view(pool, view)
        return released
