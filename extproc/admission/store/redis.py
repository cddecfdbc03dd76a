"""redis: the shared store: the admissions of every kvgate replica charge one budget in Redis.

With per-replica state, N replicas admit N times the budget. ``RedisStore`` keeps each
pool's slots, in-flight KV tokens and token buckets in Redis and applies the admission
rule (``extproc.admission.rules.decide``, mirrored line for line in Lua) in ONE script per
admission and ONE per settle, so a decision is atomic across replicas. Time inside the
scripts is Redis ``TIME``: replicas' clocks never meet.

Crash safety: every grant is a lease with an expiry (Redis time + ``lease_ttl_s``). A
background task of each replica extends its live leases every ``min(BEAT_S, lease_ttl_s /
3)`` in one pipelined round trip with its heartbeat (and re-takes any that Redis lost,
e.g. after a restart). Every script first purges the expired leases of its pool,
returning their slots and KV tokens. A heartbeat lives PRESENCE_BEATS refreshes plus
``timeout_s`` and carries where the replica answers ``/healthz`` (``advertise``); a
replica that finds another's heartbeat gone asks there, and releases that replica's
leases at once when its port refuses or another process answers (``replica_runs``): so
the leases of a replica killed with SIGKILL come back within seconds, at the latest
within ``lease_ttl_s``. A settle removes the lease and leaves a tombstone; a lease that
was settled or has expired is never refunded twice, and a tombstoned lease is never
re-taken. A Redis that lost its scripts (a restart) gets a rebuild window in every pool
before any script runs there again (``_scripts_lost``): no admission until every replica
had a refresh to take its live leases again.

Redis unavailable or slower than ``timeout_s``: the store says so loudly and, with
``on_unavailable: local_share``, admits in a local in-memory store within the room its
own leases hold in Redis beyond its live requests (``_within``, ``_ledger``), or fails
closed (``StoreUnavailableError``); shared mode comes back with hysteresis. That state
machine is ``fallback.Fallback``. A grant made locally is a live lease like the others:
the probes' refreshes take it into Redis, and the settles queued meanwhile go only once
the store shares again and a refresh carried every such grant (``probe``): until then
the room of the requests they end is what it admits within.

Pools that pick nodes: a plan's ``nodes`` (``shared_nodes.NodeAsk``) makes the admit
script pick the node over every replica's holds (``shared_nodes.pick_shared``) and charge
it with the lease, which records its node and hold: settles, refreshes (carrying the hold
the controller now expects, ``Grant.node_hold``) and the purge of expired leases move
each node's total with them. With pooled growth a lease holds its footprint, and its
growth's moments join the node's sums (``P{pool}:nm``): the script bounds the growth of
every replica's requests on a node together (``rules.pooled_bound``), as one replica does
for its own; while Redis is away, a replica admits alone within the footprints its
settled leases still hold there, less the growth its live ones may take alone.

Prompt prefixes counted once (``picking.shared_prefix``): the admit script charges a
request its prompt less the blocks it shares with every replica's leases running on the
node, as one replica's ledger does with its own (``sharing.SharedPrefixes``, mirrored in
Lua): the lease's prefix keys join the node's reference counts (``P{pool}:pk``) in the same
script, bounded per request and per node, and leave them with the lease (settle, expiry,
a dead replica's release); a refresh keeps them, a lease taken again (Redis lost it, or it
was granted alone) is held whole. While Redis is away a replica counts on a lease's room
less its prefix blocks (``escrow_hold``) and charges what it admits alone whole.

Every replica's requests counted once: a node's report counts, as its foreign KV, the
requests of every replica that its cache held. Each refresh publishes, per node, what this
replica's marks saw of its leases in the nodes' caches (``node.Charge.seen``: firm from a
first token, idle once settled and not yet gone) as a generation stamped with the store's
instant, keeping the generation before it; the admit script subtracts from a candidate's
foreign KV, of every other replica, the newest generation stamped before the instant its
report's mark saw (``shared_nodes.others_seen``), never below the node's rise. A lease that
settles or expires takes what it contributed to both generations with it, so a request
never counts twice (its hold and its published footprint) once it has left.

Key layout: ``redis_ledger``, with the readers of the ledger's hashes.

Tenant buckets expire once they would be full again (a full bucket and a missing one are
the same), so names that come and go leave nothing behind.

The parts: the scripts and the one definition of their arguments (``redis_lua``), the
round trips (``redis_client``), the modes (``fallback``); this module composes them:
leases, queued settles, the refresher and the usage view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Iterable
from typing import Any

from extproc.admission.bucket import refilled
from extproc.admission.rules import node_headroom
from extproc.admission.shared_nodes import SeenGen, Shared, others_seen
from extproc.admission.store.base import Store
from extproc.admission.store.fallback import (LOCAL_PREFIX, MODES, Fallback, UnobservedStore, StoreObserver,
                                              StoreUnavailableError, Within)
from extproc.admission.store.redis_client import MAX_CONNECTIONS, RedisClient, RoundTripError
from extproc.admission.store.redis_ledger import (Keys, escrow_hold, keyed, ledger_hold, node_totals, read_gens,
                                                  read_shares, replica_runs)
from extproc.admission.store.redis_lua import (ADMIT, HEARTBEAT, REFRESH, RELEASE, SETTLE, AdmitArg, AdmitPool,
                                               Guarantee, HeartbeatArg, HeartbeatKeys, RefreshArg,
                                               RefreshLease, ReleaseArg, SettleArg, chain_arg, node_arg,
                                               pack, word)
from extproc.admission.types import (ERROR_DROPPED, ERROR_INTERNAL, ERROR_RESPONSE, Budget, Grant, Plan,
                                     PoolUsage, Refusal)
from extproc.clock import Clock
from extproc.config import RedisStoreConfig

# What callers outside the store use of the Redis store: the store, its errors and the
# label values of its metrics.
__all__ = ["LOCAL_PREFIX", "MODES", "RedisStore", "StoreObserver", "StoreUnavailableError"]

log = logging.getLogger("kvgate.store")

# Settles queued while Redis is unreachable; beyond this the oldest are dropped: their
# leases expire by themselves, so memory stays bounded during a long outage.
_MAX_PENDING = 100_000
# Leases per refresh script call, so that one call never blocks Redis for long.
_REFRESH_CHUNK = 500

BEAT_S = 1.0
"""BEAT_S is the longest interval (s) between two refreshes of a replica in shared mode (less
when lease_ttl_s / 3 is less): its heartbeat, its leases and their node holds."""
PRESENCE_BEATS = 3
"""PRESENCE_BEATS is how many refresh intervals a replica's heartbeat outlives its last
refresh (plus one timeout): a replica that stops beating is absent that soon."""
ESCROW_MARGIN_S = 5.0
"""ESCROW_MARGIN_S is how long (s, at most half the lease TTL) before a lease's expiry in Redis
a replica cut off from Redis stops counting on the room it holds: what it admitted alone
has by then been seen by the nodes' reports the other replicas read."""


class _View:
    """_View is the last state of one pool that Redis reported, for ``usage``.

    ``offset`` is store time minus caller time (s) when it was seen; bucket fields are
    None when the pool has no bucket. A view older than the one kept, by (store instant,
    version), is ignored.
    """

    __slots__ = ("inflight", "by_class", "kv", "tok", "t", "cap", "rate", "offset", "at", "version")

    def __init__(self) -> None:
        self.at = -math.inf  # store instant of the view (s)
        self.version = 0     # the pool's view counter in Redis: orders views of one instant
        self.inflight = 0
        self.by_class: dict[str, int] = {}
        self.kv = 0
        self.tok: float | None = None
        self.t = 0.0
        self.cap = 0.0
        self.rate = 0.0
        self.offset = 0.0


class _Pending:
    """_Pending is one settle waiting for its round trip: its pool, command and lease id.

    ``lease_id`` is None for the cancel of an admission whose answer was lost (it is not
    in the usage view, so nothing is to be taken out of it).
    """

    __slots__ = ("pool", "cmd", "lease_id")

    def __init__(self, pool: str, cmd: tuple[Any, ...], lease_id: str | None) -> None:
        self.pool = pool
        self.cmd = cmd
        self.lease_id = lease_id


class _Held:
    """_Held is what Redis holds for one lease of this replica, as far as this replica knows:
    its KV ``tokens``, its ``node`` (None: none) and ``hold`` there, and ``until``, the caller
    instant (s) before which its expiry in Redis cannot come (the send of the round trip
    that last set it, plus the lease TTL)."""

    __slots__ = ("tokens", "node", "hold", "until")

    def __init__(self, tokens: int, node: str | None, hold: int, until: float) -> None:
        self.tokens = tokens
        self.node = node
        self.hold = hold
        self.until = until


class _Settled:
    """_Settled is a settle Redis has not confirmed yet, as ``usage`` takes it out of the view.

    ``class_name`` and ``tokens`` are what the lease held; ``refund`` the tokens given back
    to the buckets (negative: charged more); ``now`` the caller instant (s) of the settle.
    """

    __slots__ = ("class_name", "tokens", "refund", "now")

    def __init__(self, class_name: str, tokens: int, refund: int, now: float) -> None:
        self.class_name = class_name
        self.tokens = tokens
        self.refund = refund
        self.now = now


class _Rebuilding(Exception):
    """_Rebuilding is the admit script's answer while a pool's ledger is rebuilt (``seconds`` left)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds


class RedisStore(Store):
    """RedisStore is the store shared by kvgate replicas through one Redis (see the module doc).

    ``config``: URL, key prefix, lease TTL (s), round-trip timeout (s) and what to do
    when Redis is unavailable. ``clock``: None (the default) takes every instant from
    Redis ``TIME``, the one clock all replicas share; a ``Clock`` makes the scripts use
    the callers' ``now`` instead (and ``clock.now()`` for refreshes), for tests at fixed
    instants and single-process simulations. ``replica_id``: unique per process (random
    by default). Must be used from one event loop; background tasks start with ``start``
    or the first ``admit``.
    """

    shared = True
    shares_nodes = True

    def __init__(self, config: RedisStoreConfig, *, observer: StoreObserver | None = None,
                 clock: Clock | None = None, replica_id: str | None = None,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.config = config
        self.replica_id = replica_id or secrets.token_hex(6)
        self._observer: StoreObserver = observer or UnobservedStore()
        self._clock = clock
        self._ttl = config.lease_ttl_s
        self._refresh_every = min(BEAT_S, config.lease_ttl_s / 3.0)
        self._probe_every = min(0.5, self._refresh_every)
        # How long a heartbeat says present, and how long the ledger is rebuilt after
        # Redis lost it: every replica in shared mode refreshes within that time.
        self._presence_ttl = PRESENCE_BEATS * self._refresh_every + config.timeout_s
        self._margin = min(ESCROW_MARGIN_S, config.lease_ttl_s / 2.0)
        self._prefix = config.key_prefix
        self._replicas_key = f"{config.key_prefix}replicas"
        self._heartbeat_keys = HeartbeatKeys(self._replicas_key, f"{config.key_prefix}replica_addrs",
                                             f"{config.key_prefix}replicas_gone")
        # Where this replica answers whether it runs (its admin /healthz, host:port), for the
        # others once its heartbeat is gone; None: nowhere (then its leases wait their TTL).
        self.advertise: str | None = None
        self._checking: dict[str, asyncio.Task[None]] = {}
        # Tenant buckets expire a minute after they would be full; with caller instants
        # Redis's own expiry would run on another clock, so they are kept.
        self._tenant_expire = -1.0 if clock is not None else 60.0
        self._client = RedisClient(config, self.replica_id, self._scripts_lost, max_connections)
        self._keys: dict[str, Keys] = {}
        self._views: dict[str, _View] = {}
        self._live: dict[str, dict[str, Grant]] = {}
        # pool -> lease id -> what Redis holds for it: this replica's leases there (live, or
        # settled by a settle not sent yet), the room it may admit in alone (``Within``)
        self._ledger: dict[str, dict[str, _Held]] = {}
        # the local grants some refresh has carried to Redis: one never carried is new
        # there, so a refresh that takes it is not a sign that Redis lost anything
        self._carried_local: set[str] = set()
        # pool -> the quantile its pooled growth is bounded at (from its admissions), for
        # the shared per-node totals the metrics show
        self._quantile: dict[str, float] = {}
        # pool -> node -> what every replica's leases held there at the last refresh (tokens)
        self._node_held: dict[str, dict[str, int]] = {}
        self._pending: list[_Pending] = []
        self._unconfirmed: dict[str, dict[str, _Settled]] = {}
        self._batch: asyncio.Future[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._fallback = Fallback(config.on_unavailable, config.expected_replicas, self._observer,
                                  self._client.where)
        self._next = 0
        # The refresh round (one per round trip) and, per pool, every replica's published
        # generations as the last refresh read them (``shared_nodes.SeenGen``).
        self._round = 0
        self._gens: dict[str, dict[str, SeenGen]] = {}
        # per pool, node -> (shared, cross): the prompt tokens every replica's leases there
        # share (counted once) and their cross-replica part (``sharing``), as last read
        self._shares: dict[str, dict[str, tuple[int, int]]] = {}
        # The store's instant (s) of the latest reply received: a node's report whose mark
        # saw it was rendered after every script up to that instant.
        self._store_at = -math.inf
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False

    # --- public state ------------------------------------------------------------

    @property
    def mode(self) -> str:
        """mode is where admissions are decided now: one of ``MODES``."""
        return self._fallback.mode

    @property
    def replicas(self) -> int:
        """replicas is the number of live replicas this one last saw (itself included, >= 1)."""
        return self._fallback.replicas

    @property
    def recover_s(self) -> float:
        """recover_s is how long Redis must answer every probe before shared mode returns (s)."""
        return self._fallback.recover_s

    @property
    def share_replicas(self) -> int:
        """share_replicas is what a local share divides the limits by: the replicas last
        seen, at least ``expected_replicas``."""
        return self._fallback.share_replicas

    @property
    def pending_settles(self) -> int:
        """pending_settles is the number of settles not yet applied in Redis."""
        return len(self._pending)

    def instant(self) -> float | None:
        """instant is the store's instant (s) of the latest reply received (None: none yet)."""
        return None if self._store_at == -math.inf else self._store_at

    def others_seen(self, pool: str, node: str, since: float | None, idle: bool) -> int:
        """others_seen is ``shared_nodes.others_seen`` over the other replicas' generations in
        ``pool`` as the last refresh read them, beyond the node's cross-replica sharing then
        (tokens; as the admit script subtracts it, ``shared_nodes.pick_shared``)."""
        gens = self._gens.get(pool)
        if not gens:
            return 0
        cross = self._shares.get(pool, {}).get(node, (0, 0))[1]
        return max(0, others_seen(gens, self.replica_id, node, since, idle) - cross)

    def know_pools(self, pools: Iterable[str]) -> None:
        """know_pools names the pools every replica serves, so that this one refreshes their
        views and can release a dead replica's leases there before it admitted in them."""
        for pool in pools:
            self._keys_of(pool)

    def live_leases(self, pool: str) -> int:
        """live_leases is the number of this replica's unsettled shared grants in ``pool``."""
        return len(self._live.get(pool, ()))

    # --- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """start registers this replica and starts the refresher; degrades if Redis is away."""
        self._ensure_task()
        await self.refresh()

    def _ensure_task(self) -> None:
        """_ensure_task starts the refresher, or starts it again if it ever ended (it should not)."""
        if (self._task is None or self._task.done()) and not self._closed:
            if self._task is not None and not self._task.cancelled() and self._task.exception() is not None:
                self._survived("refresher task", self._task.exception())  # type: ignore[arg-type]
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._maintain(),
                                                                name="kvgate-redis-store")

    async def close(self) -> None:
        """close stops the refresher, applies queued settles if Redis answers, deregisters, disconnects."""
        if self._closed:
            return
        self._closed = True
        for task in (self._task, self._flusher, *self._checking.values()):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        # One last try for the queued settles, whatever the mode: what does not make it
        # is freed by the lease TTL.
        with contextlib.suppress(RoundTripError):
            await self._flush_pending()
        if self._fallback.shared:
            with contextlib.suppress(Exception):
                await self._client.forget(self._replicas_key, self.replica_id)
        await self._client.aclose()

    async def _maintain(self) -> None:
        """_maintain refreshes leases every min(BEAT_S, lease_ttl_s / 3) in shared mode, probes Redis otherwise.

        Nothing ends it but ``close``: an exception it did not expect (a client library's,
        or this store's own) is logged with its traceback, counted (``internal``), taken as
        a failed round trip, and the loop goes on after one probe interval.
        """
        wake = self._wake
        assert wake is not None
        while not self._closed:
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
                self._survived("refresher", exc)
                await asyncio.sleep(self._probe_every)

    def _survived(self, what: str, exc: BaseException) -> None:
        """_survived records an exception the store's background work ``what`` did not expect
        and carries on: logged with its traceback, counted, and taken as a failed round trip
        (the store degrades, or its probe starts again)."""
        log.error("shared store: the %s survived an unexpected %s; going on", what, type(exc).__name__,
                  exc_info=exc)
        failure = RoundTripError(ERROR_INTERNAL, f"{what}: {type(exc).__name__}: {exc}")
        if self._fallback.shared:
            self._degrade(failure)
        else:
            self._fallback.probe_failed(failure.reason)

    # --- modes -------------------------------------------------------------------

    def _degrade(self, failure: RoundTripError) -> None:
        if self._fallback.degrade(failure.reason, str(failure), self._caller_now()) and self._wake is not None:
            self._wake.set()

    async def probe(self) -> bool:
        """probe asks Redis whether it is back; if so, applies queued settles and re-takes live
        leases, and returns to shared mode once Redis has answered every probe for
        ``recover_s`` (the hysteresis rule, see the module doc). Returns True when the
        store is in shared mode afterwards."""
        if self._fallback.shared:
            return True
        try:
            # Leases first: what this replica admitted alone is in the ledger before the
            # room of what ended goes back, so the ledger never shows less than it holds.
            carried = await self._refresh_round_trip()
        except RoundTripError as f:
            self._fallback.probe_failed(f.reason)
            return False
        if not self._fallback.answered(self._caller_now()):
            # The settles wait for shared mode: until then the room of the leases they end
            # is what this replica admits within (``_within``); sent now, it would be gone
            # from both this replica and, while they are cut off too, every other.
            return False
        try:
            if self._alone_since(carried):
                # Granted alone while that refresh was on the wire, within the room the
                # settles end: they wait until another refresh carried it (no grant is made
                # alone any more, the store is shared).
                await self._carry_first()
            await self._flush_pending()
        except RoundTripError as f:
            self._degrade(f)
            return False
        return True

    async def _carry_first(self) -> None:
        """_carry_first is one refresh during which this replica's settles wait (``_batch``,
        which admissions and flushes wait for): what it carries is in Redis before they go."""
        while self._batch is not None:
            await asyncio.shield(self._batch)
        self._batch = done = asyncio.get_running_loop().create_future()
        try:
            await self._refresh_round_trip()
        finally:
            self._batch = None
            done.set_result(None)

    def _alone_since(self, carried: set[str]) -> bool:
        """_alone_since says whether a live grant made alone is not among the leases ``carried``
        by the latest refresh, so that Redis may not hold it yet."""
        return any(i.startswith(LOCAL_PREFIX) and i not in carried for live in self._live.values() for i in live)

    def _scripts_lost(self) -> list[tuple[Any, ...]]:
        """_scripts_lost hears that Redis lost the scripts: it restarted (empty, unless it
        persists) or was flushed. Views start again (their counters did), and the commands
        returned open every known pool's rebuild window before any script can run there
        again: no replica admits until every replica in shared mode had a refresh in which
        to take its live leases again (``_presence_ttl``)."""
        for view in self._views.values():
            view.at = -math.inf
            view.version = 0
        if self._views:
            log.warning("shared store: Redis at %s lost its scripts (a restart?): no admission for %.1fs "
                        "while every replica takes its live leases again", self._client.where, self._presence_ttl)
        ms = int(self._presence_ttl * 1000)
        # Only the pools this replica has heard of from Redis before: a server that never
        # ran the scripts (a new deployment) has no ledger to rebuild.
        return [("SET", keys.rb, self.replica_id, "PX", ms, "NX") for pool, keys in self._keys.items()
                if pool in self._views]

    def _now_arg(self, now: float) -> float | None:
        """_now_arg is the instant a script runs at: None (Redis TIME) or the caller's ``now`` (s)."""
        return None if self._clock is None else float(now)

    def _keys_of(self, pool: str) -> Keys:
        k = self._keys.get(pool)
        if k is None:
            k = self._keys[pool] = Keys(self._prefix, pool)
        return k

    # --- admit -------------------------------------------------------------------

    async def admit(self, plan: Plan, now: float) -> Grant | Refusal:
        """admit charges every budget of ``plan`` in Redis in one script, or refuses it.

        ``now`` (s, caller clock) is used only with an injected clock and in local mode.
        In local_share mode the plan is decided locally at this replica's share; in
        fail_closed mode ``StoreUnavailableError`` is raised.
        """
        if self._task is None or self._task.done():
            self._ensure_task()
        if not self._fallback.shared:
            # A local decision never suspends: yield once, so that callers admitting in a
            # tight loop cannot starve the probe that brings the store back.
            await asyncio.sleep(0)
            return self._admit_degraded(plan, now)
        self._next += 1
        lease_id = f"{self.replica_id}.{self._next}"
        pool = plan.limits.pool
        keys = self._keys_of(pool)
        cmd = self._admit_cmd(plan, keys, lease_id, now)
        # Settles of this replica go out before its next admission, in the same round
        # trip: a slot this replica released is free for the request it admits next.
        previous = self._batch
        if previous is not None:
            await asyncio.shield(previous)
            if not self._fallback.shared:
                # Those settles met a failure: decide alone now rather than spend a second
                # timeout, which together with the first would outlast Envoy's message timeout.
                return self._admit_degraded(plan, now)
        batch, self._pending = self._pending, []
        sent = self._caller_now()
        self._settles_sent(batch)
        try:
            results = await self._client.round_trip([p.cmd for p in batch] + [cmd])
        except BaseException as exc:
            # Failed or cancelled (the requester left) with the answer unknown: the
            # settles go again (they are idempotent) and the admission is cancelled.
            self._pending[:0] = batch
            if not isinstance(exc, RoundTripError):
                self._queue(_Pending(pool, self._settle_cmd(plan, keys, lease_id, 0, now), None))
                raise
            f = exc
            self._degrade(f)
            # The script may have run before the answer was lost: cancel the lease, so
            # that a grant nobody will refresh or settle does not hold a slot until it
            # expires (the tombstone also stops the admit if it is still on the wire).
            self._queue(_Pending(pool, self._settle_cmd(plan, keys, lease_id, 0, now), None))
            return self._admit_degraded(plan, now)
        self._read_settles(batch, results, now)
        try:
            return self._read_admit(plan, lease_id, results[-1], now, sent)
        except _Rebuilding as wait:
            # Take this replica's own leases again now rather than at the next refresh.
            await self.refresh()
            raise StoreUnavailableError(f"Redis lost its state (a restart?): the replicas take their leases "
                                        f"again for {wait.seconds:.1f}s more") from None
        except (IndexError, TypeError, ValueError, KeyError, AttributeError) as exc:
            self._degrade(RoundTripError(ERROR_RESPONSE, f"unexpected admit reply: {exc}"))
            self._queue(_Pending(pool, self._settle_cmd(plan, keys, lease_id, 0, now), None))
            return self._admit_degraded(plan, now)

    def _admit_degraded(self, plan: Plan, now: float) -> Grant | Refusal:
        """_admit_degraded decides in this replica alone (``Fallback.admit``), within what its
        leases hold in Redis beyond its live requests (``_within``). A grant made so is a
        live lease like any other: the refreshes of the probes take it into Redis (under its
        own id) before the store shares again."""
        pool = plan.limits.pool
        decision = self._fallback.admit(plan, now, self._within(plan, self._caller_now()))
        if isinstance(decision, Grant):
            self._next += 1
            decision.id = f"{LOCAL_PREFIX}{self.replica_id}.{self._next}"
            self._keys_of(pool)
            self._live.setdefault(pool, {})[decision.id] = decision
        return decision

    def _within(self, plan: Plan, now: float) -> Within:
        """_within is what this replica may admit alone in ``plan``'s pool at ``now`` (caller
        s): what its leases certainly hold in Redis (``_ledger``, each until a margin before
        its expiry) less what its live requests take (slots, KV tokens, tokens per node),
        and on each node less what it is short of (``_overcommit``).
        A replica that is the only one (``Fallback.share_replicas`` 1: none seen, none
        expected) has the pool's limits instead, and each node as it reads it."""
        pool = plan.limits.pool
        live = self._live.get(pool, {})
        if self._fallback.share_replicas == 1:
            return Within(plan.limits.limit - len(live),
                          (plan.limits.kv_budget or 0) - sum(g.plan.tokens for g in live.values()), None)
        slots = kv = 0
        nodes: dict[str, int] = {}
        for h in self._ledger.get(pool, {}).values():
            if h.until - self._margin > now:
                slots += 1
                kv += h.tokens
                if h.node is not None:
                    nodes[h.node] = nodes.get(h.node, 0) + h.hold
        for g in live.values():
            slots -= 1
            kv -= g.plan.tokens
            if g.picked is not None:
                nodes[g.picked] = nodes.get(g.picked, 0) - escrow_hold(g)
        if plan.nodes is not None:
            self._overcommit(plan, nodes)
        return Within(slots, kv, nodes)

    def _overcommit(self, plan: Plan, nodes: dict[str, int]) -> None:
        """_overcommit takes from this replica's room on each node (``nodes``, tokens) what the
        node's KV that is not kvgate's (as this replica reads it, net of the others' published
        requests, as the admit script nets it) leaves short of every replica's holds there
        at the last refresh: the shared rule's headroom, when it is below 0.

        Why: the ledger's holds fitted the node when they were taken; KV that is not
        kvgate's may have risen since, and then the shared rule admits nobody there while
        every replica alone would refill the room of its ended requests, each seeing the
        rise in its own reading but not what the others refill meanwhile. Each taking the
        whole shortfall from its own room, together they refill at most what is left.
        """
        ask = plan.nodes
        assert ask is not None
        pool = plan.limits.pool
        held = self._node_held.get(pool, {})
        for c in ask.candidates:
            if c.name not in nodes:
                continue
            foreign = max(c.rise, c.foreign - self.others_seen(pool, c.name, c.since, c.idle))
            short = node_headroom(c.cap, ask.reserve_fraction, foreign, held.get(c.name, 0))
            if short < 0:
                nodes[c.name] += short

    def _settles_sent(self, batch: list[_Pending]) -> None:
        """_settles_sent forgets what Redis holds for the leases of settles now on the wire:
        whether they land or not, their room is no longer certain."""
        for p in batch:
            if p.lease_id is not None:
                ledger = self._ledger.get(p.pool)
                if ledger is not None:
                    ledger.pop(p.lease_id, None)

    def _admit_cmd(self, plan: Plan, keys: Keys, lease_id: str, now: float) -> tuple[Any, ...]:
        """_admit_cmd is the admit script's call for ``plan`` as lease ``lease_id`` at ``now`` (s)."""
        lim = plan.limits
        pb = lim.bucket
        tb = plan.tenant_bucket
        cached = keys.limits
        if cached is None or cached[0] is not lim:
            # The pool's part of the argument changes only with its limits (the scale).
            if pb is not None:
                keys.pool_bucket = keys.bucket(pb)
            pool = AdmitPool(limit=lim.limit, kvb=lim.kv_budget, base_kv=lim.base_kv_budget,
                             est=float(lim.retry_estimate_s),
                             pcap=None if pb is None else float(pb.capacity),
                             prate=None if pb is None else float(pb.rate),
                             pbase=None if pb is None else float(pb.base_capacity))
            guarantees = pack(w for name, g in lim.guarantees.items() for w in Guarantee(name, g))
            cached = keys.limits = (lim, pack(pool), guarantees)
        ceiling = lim.kv_ceilings.get(plan.class_name) if lim.kv_ceilings else None
        arg = AdmitArg(now=self._now_arg(now), id=lease_id, ttl=self._ttl, cls=plan.class_name,
                       n=int(plan.tokens), pool=cached[1],
                       tcap=None if tb is None else float(tb.capacity),
                       trate=None if tb is None else float(tb.rate),
                       tbase=None if tb is None else float(tb.base_capacity),
                       texp=self._tenant_expire,
                       ckv=None if ceiling is None else ceiling[0],
                       cbase=None if ceiling is None else ceiling[1], guarantees=cached[2])
        if plan.nodes is None:
            return ADMIT.command(keys.of_plan(plan), pack(arg), "-", "-")
        return ADMIT.command(keys.of_plan(plan), pack(arg), node_arg(plan.nodes), chain_arg(plan.nodes))

    def _read_admit(self, plan: Plan, lease_id: str, reply: bytes, now: float, sent: float) -> Grant | Refusal:
        """_read_admit reads the admit script's reply to lease ``lease_id`` sent at ``sent`` (caller s)."""
        head, _, view = reply.partition(b"|")
        r = head.split()
        code = int(r[0])
        self._read_view(plan.limits.pool, view, now)
        if code == 3:
            raise _Rebuilding(float(r[1]))
        if code == 1:
            grant = Grant(lease_id, plan, int(r[1]))
            if r[2] != b"-":
                grant.bucket_tokens = float(r[2])
                grant.bucket_capacity = float(r[3])
                grant.bucket_rate = float(r[4])
            if plan.nodes is not None:
                if r[5] == b"-":
                    raise ValueError("admit picked no node for a plan that asked one")
                grant.picked = r[5].decode()
                grant.node_hold = plan.nodes.need
                grant.node_pooled = plan.nodes.pooled
                if r[6] != b"0" or r[7] != b"0" or r[8] != b"0":
                    grant.node_shared = Shared(keyed(plan.nodes, grant.picked, int(r[6])), int(r[7]), r[8] == b"1")
                if grant.node_pooled is not None:
                    self._quantile[plan.limits.pool] = grant.node_pooled.quantile
            self._live.setdefault(plan.limits.pool, {})[lease_id] = grant
            self._ledger.setdefault(plan.limits.pool, {})[lease_id] = _Held(
                int(plan.tokens), grant.picked, escrow_hold(grant), sent + self._ttl)
            return grant
        if code == 0:
            return Refusal(Budget(r[1].decode()), float(r[2]), r[3] == b"1", float(r[4]),
                           float(r[5]), float(r[6]))
        raise ValueError(f"admit answered code {code} for a fresh lease id")

    def _read_view(self, pool: str, text: bytes, now: float) -> None:
        """_read_view keeps what a script reported of ``pool`` (see ``view`` in the Lua prelude)."""
        v = text.split()
        store_now, version = float(v[0]), int(v[1])
        if store_now > self._store_at:
            self._store_at = store_now
        view = self._views.get(pool)
        if view is None:
            view = self._views[pool] = _View()
        if (store_now, version) < (view.at, view.version):
            return  # an older state that arrived late on another connection
        by_class: dict[str, int] = {}
        for item in v[8:]:
            name, _, n = item.partition(b"=")
            by_class[name.decode()] = int(n)
        view.at = store_now
        view.version = version
        view.inflight = int(v[2])
        view.kv = int(v[3])
        view.by_class = by_class
        if v[4] != b"-":
            view.tok, view.t, view.cap, view.rate = float(v[4]), float(v[5]), float(v[6]), float(v[7])
        view.offset = store_now - now

    # --- settle ------------------------------------------------------------------

    def settle(self, grant: Grant, charged_tokens: int, now: float) -> None:
        """settle releases ``grant`` with its buckets charged ``charged_tokens`` in the end.

        A local grant is settled in the local store at once; a shared one is queued and
        sent with this replica's next round trip (at the latest on the next loop turn),
        and kept while Redis is away. Never blocks, never raises.
        """
        plan = grant.plan
        pool = plan.limits.pool
        live = self._live.get(pool)
        if live is None or live.pop(grant.id, None) is None:
            return  # not ours, or settled already: nothing is refunded twice
        if grant.id.startswith(LOCAL_PREFIX):
            self._carried_local.discard(grant.id)
            # Its budgets were charged locally; in Redis (if a refresh took it there) it
            # holds its slot and KV only, so it goes with no refund, and its tombstone stops
            # a refresh on the wire from taking it again.
            self._fallback.local.settle(grant, charged_tokens, now)
            self._queue(_Pending(pool, self._settle_cmd(plan, self._keys_of(pool), grant.id,
                                                        int(plan.tokens), now), grant.id))
            return
        self._unconfirmed.setdefault(pool, {})[grant.id] = _Settled(
            plan.class_name, plan.tokens, plan.tokens - charged_tokens, now)
        self._queue(_Pending(pool, self._settle_cmd(plan, self._keys_of(pool), grant.id,
                                                    charged_tokens, now), grant.id))

    def _settle_cmd(self, plan: Plan, keys: Keys, lease_id: str, charged: int,
                    now: float) -> tuple[Any, ...]:
        """_settle_cmd is the settle script's call for lease ``lease_id`` of ``plan``, charged
        ``charged`` tokens in the end, at ``now`` (s)."""
        pb = plan.limits.bucket
        tb = plan.tenant_bucket
        arg = SettleArg(now=self._now_arg(now), id=lease_id, charged=int(charged), ttl=self._ttl,
                        pcap=None if pb is None else float(pb.capacity),
                        prate=None if pb is None else float(pb.rate),
                        tcap=None if tb is None else float(tb.capacity),
                        trate=None if tb is None else float(tb.rate), texp=self._tenant_expire)
        return SETTLE.command(keys.of_plan(plan), pack(arg))

    def _queue(self, pending: _Pending) -> None:
        self._pending.append(pending)
        if len(self._pending) > _MAX_PENDING:
            dropped = self._pending.pop(0)
            if dropped.lease_id is not None:
                self._unconfirmed.get(dropped.pool, {}).pop(dropped.lease_id, None)
            self._observer.store_error(ERROR_DROPPED)
        if self._fallback.shared and self._flusher is None and not self._closed:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop (a test settling by hand): the next round trip takes it
            self._flusher = loop.create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        """_flush_soon sends the settles no admission took along, one pipeline at a time."""
        try:
            while self._pending and self._fallback.shared:
                try:
                    await self._flush_pending()
                except RoundTripError as f:
                    self._degrade(f)
                except Exception as exc:  # noqa: BLE001 - queued settles stay queued
                    self._survived("settle flusher", exc)
        finally:
            self._flusher = None

    async def _flush_pending(self) -> None:
        """_flush_pending sends every queued settle in one round trip; re-queues them on failure."""
        while self._batch is not None:
            await asyncio.shield(self._batch)
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        self._batch = done = asyncio.get_running_loop().create_future()
        self._settles_sent(batch)
        try:
            results = await self._client.round_trip([p.cmd for p in batch])
        except BaseException:  # a failure, or a cancelled flush (close): send them again later
            self._pending[:0] = batch
            raise
        finally:
            self._batch = None
            done.set_result(None)
        self._read_settles(batch, results, self._caller_now())

    def _read_settles(self, batch: list[_Pending], results: list[Any], now: float) -> None:
        """_read_settles takes the confirmed settles out of the unconfirmed ones and keeps their views."""
        for p, r in zip(batch, results):
            if p.lease_id is not None:
                unconfirmed = self._unconfirmed.get(p.pool)
                if unconfirmed is not None:
                    unconfirmed.pop(p.lease_id, None)
            with contextlib.suppress(IndexError, TypeError, ValueError, AttributeError):
                self._read_view(p.pool, r.partition(b"|")[2], now)

    async def flush(self) -> None:
        """flush waits until every settle queued so far is applied in Redis (or Redis failed)."""
        while self._pending or self._batch is not None or self._flusher is not None:
            if not self._fallback.shared:
                return
            if self._flusher is not None:
                await asyncio.shield(self._flusher)
            elif self._batch is not None:
                await asyncio.shield(self._batch)
            else:
                try:
                    await self._flush_pending()
                except RoundTripError as f:
                    self._degrade(f)

    # --- refresh -----------------------------------------------------------------

    def _caller_now(self) -> float:
        return self._clock.now() if self._clock is not None else time.monotonic()

    async def refresh(self) -> bool:
        """refresh heartbeats, extends this replica's live leases and re-reads every known pool,
        in one round trip. Degrades the store when Redis fails; True on success."""
        if not self._fallback.shared:
            return False
        try:
            await self._refresh_round_trip()
        except RoundTripError as f:
            self._degrade(f)
            return False
        return True

    async def _refresh_round_trip(self) -> set[str]:
        """_refresh_round_trip is one refresh (see ``refresh``); returns the ids of the leases it
        carried, which Redis now holds. Raises RoundTripError."""
        now = self._caller_now()
        cmds, pools, sent = self._refresh_cmds(now)
        fresh = [i for grants in sent for i, _ in grants
                 if i.startswith(LOCAL_PREFIX) and i not in self._carried_local]
        self._carried_local.update(fresh)
        # and what every replica's leases hold on each node, for the metrics
        known = list(self._keys)
        cmds += [c for pool in known for c in (("HGETALL", self._keys[pool].nk), ("HGETALL", self._keys[pool].nm))]
        # and every replica's published generations, for this replica's readings net of them
        cmds += [c for pool in known for c in (("HGETALL", self._keys[pool].sr), ("HGETALL", self._keys[pool].sn))]
        # and the sums of the prefixes every replica's leases share on each node
        cmds += [("HGETALL", self._keys[pool].ps) for pool in known]
        results = await self._client.round_trip(cmds)
        try:
            beat = results[0]
            self._fallback.saw_replicas(int(beat[0]))
            gone = [(beat[i].decode(), beat[i + 1].decode()) for i in range(1, len(beat) - 1, 2)]
            restored = 0
            for pool, r in zip(pools, results[1:]):
                head, _, view = r.partition(b"|")
                restored += int(head)
                self._read_view(pool, view, now)
            rest = results[1 + len(pools):]
            for i, pool in enumerate(known):
                shares = self._shares[pool] = read_shares(rest[4 * len(known) + i])
                held = node_totals(rest[2 * i], rest[2 * i + 1], self._quantile.get(pool), shares)
                self._node_held[pool] = held
                self._observer.store_nodes(pool, held)
                self._gens[pool] = read_gens(rest[2 * len(known) + 2 * i], rest[2 * len(known) + 2 * i + 1])
        except (IndexError, TypeError, ValueError, AttributeError) as exc:
            raise RoundTripError(ERROR_RESPONSE, f"unexpected refresh reply: {exc}") from exc
        # Each fresh local grant is taken (nothing in Redis has its id); any other lease
        # taken was lost there, and then so may be the settled ones the ledger counts on.
        lost = restored - len(fresh)
        self._refreshed(pools, sent, now, lost=lost > 0)
        for replica, addr in gone:
            if replica != self.replica_id and addr != "-" and replica not in self._checking and not self._closed:
                self._checking[replica] = asyncio.get_running_loop().create_task(
                    self._check_gone(replica, addr), name=f"kvgate-check-{replica}")
        if fresh:
            log.info("shared store: %d leases this replica granted while Redis was away are in Redis now", len(fresh))
        if lost > 0:
            log.warning("shared store: Redis had lost %d live leases of this replica (restart or expiry): "
                        "taken again", lost)
        return {i for grants in sent for i, _ in grants}

    def _refreshed(self, pools: list[str], sent: list[list[tuple[str, _Held]]], at: float, lost: bool) -> None:
        """_refreshed keeps what a refresh sent at ``at`` (caller s) left in Redis: each lease
        it carried, still live or settled by a settle not yet sent, is held there with the
        hold it carried until ``at`` + TTL. ``lost``: Redis had lost some leases, so the
        settled ones it did not carry may be gone too and are no longer counted on."""
        until = at + self._ttl
        carried: dict[str, set[str]] = {}
        for pool, grants in zip(pools, sent):
            live = self._live.get(pool, {})
            ledger = self._ledger.setdefault(pool, {})
            ids = carried.setdefault(pool, set())
            for lease_id, held in grants:
                ids.add(lease_id)
                if lease_id in live or lease_id in ledger:
                    held.until = until
                    ledger[lease_id] = held
        if lost:
            for pool, ledger in self._ledger.items():
                ids = carried.get(pool, set())
                for lease_id in [i for i in ledger if i not in ids]:
                    del ledger[lease_id]

    def _refresh_cmds(self, now: float) -> tuple[list[tuple[Any, ...]], list[str], list[list[tuple[str, _Held]]]]:
        """_refresh_cmds is one refresh round trip at ``now`` (s): the heartbeat, then the
        refresh of every known pool's live leases in chunks; the pool of each refresh, and
        the leases it carries."""
        now_arg = self._now_arg(now)
        cmds = [HEARTBEAT.command(self._heartbeat_keys,
                                  *map(word, HeartbeatArg(now_arg, self.replica_id, self._presence_ttl,
                                                          self.advertise or "-", self._ttl)))]
        pools: list[str] = []
        sent: list[list[tuple[str, _Held]]] = []
        self._round += 1
        for pool, keys in self._keys.items():
            leases = list(self._live.get(pool, {}).values())
            chunks = [leases[i:i + _REFRESH_CHUNK] for i in range(0, len(leases), _REFRESH_CHUNK)] or [[]]
            lead = RefreshArg(now=now_arg, ttl=self._ttl, has_pb=1 if keys.pool_bucket else 0,
                              replica=self.replica_id, round=self._round)
            for chunk in chunks:
                argv: list[object] = [*lead]
                for g in chunk:
                    p = g.node_pooled
                    argv.extend(RefreshLease(id=g.id, cls=g.plan.class_name, tok=int(g.plan.tokens),
                                             node=g.picked or "-", hold=ledger_hold(g),
                                             seen=int(g.node.seen) if g.node is not None else 0,
                                             l=0 if p is None else int(p.left),
                                             m=0.0 if p is None else float(p.mean),
                                             v=0.0 if p is None else float(p.var)))
                cmds.append(REFRESH.command(keys.of_refresh(), *map(word, argv)))
                pools.append(pool)
                sent.append([(g.id, _Held(int(g.plan.tokens), g.picked, escrow_hold(g), 0.0)) for g in chunk])
        return cmds, pools, sent

    # --- replicas whose heartbeat is gone ------------------------------------------------

    async def _check_gone(self, replica: str, addr: str) -> None:
        """_check_gone asks the address of a replica whose heartbeat expired whether it still
        runs, and releases its leases in every known pool when it certainly does not: its
        port refuses connections, or another process (another replica id) answers there. A
        replica that answers, or does not answer in time (cut off from this one as well),
        keeps its leases until they expire: it may be admitting within them alone."""
        try:
            alive = await replica_runs(addr, replica, min(0.5, self.config.timeout_s))
            if alive is not False:
                return
            released = await self._release(replica)
            log.warning("shared store: replica %s at %s no longer runs (its heartbeat expired, its address "
                        "refuses it): released its %d leases", replica, addr, released)
        except RoundTripError as f:
            log.info("shared store: could not release the leases of replica %s: %s", replica, f)
        except Exception:  # noqa: BLE001 - a check must not take the store down
            log.exception("shared store: checking replica %s at %s failed", replica, addr)
        finally:
            self._checking.pop(replica, None)

    async def _release(self, replica: str) -> int:
        """_release takes every lease of ``replica`` out of every known pool, in one round trip."""
        now_arg = self._now_arg(self._caller_now())
        pools = list(self._keys)
        cmds: list[tuple[Any, ...]] = [
            RELEASE.command(self._keys[p].of_refresh(), *map(word, ReleaseArg(now_arg, self._ttl, replica)))
            for p in pools]
        cmds += [("ZREM", self._heartbeat_keys.gone, replica), ("HDEL", self._heartbeat_keys.addrs, replica)]
        results = await self._client.round_trip(cmds)
        released = 0
        for pool, r in zip(pools, results):
            head, _, view = r.partition(b"|")
            released += int(head)
            with contextlib.suppress(IndexError, TypeError, ValueError):
                self._read_view(pool, view, self._caller_now())
        return released

    # --- usage -------------------------------------------------------------------

    def usage(self, pool: str, now: float) -> PoolUsage:
        """usage is the pool's state as Redis last reported it (local state in local mode).

        The pool bucket's tokens are refilled from the last report to ``now`` (s).
        """
        if not self._fallback.shared:
            return self._fallback.local.usage(pool, now)
        view = self._views.get(pool)
        if view is None:
            return PoolUsage()
        inflight, kv, by_class = view.inflight, view.kv, dict(view.by_class)
        tok, t = view.tok, view.t
        for s in self._unconfirmed.get(pool, {}).values():
            # Queued settles are this replica's own releases: show them at once, as the
            # in-memory store does, rather than a round trip later.
            inflight -= 1
            kv -= s.tokens
            by_class[s.class_name] = by_class.get(s.class_name, 0) - 1
            if tok is not None and s.refund:
                tok, t = refilled(tok, t, s.now + view.offset, view.cap, view.rate)
                tok = min(tok + s.refund, view.cap)
        tokens = None
        if tok is not None:
            tokens, _ = refilled(tok, t, now + view.offset, view.cap, view.rate)
        return PoolUsage(inflight=max(0, inflight), kv_inflight=max(0, kv),
                         by_class={c: max(0, n) for c, n in by_class.items()},
                         bucket_tokens=tokens)


