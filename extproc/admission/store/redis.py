"""redis: the shared store: the admissions of every kvgate replica charge one budget in Redis.

With per-replica state, N replicas admit N times the budget. ``RedisStore`` keeps each
pool's slots, in-flight KV tokens and token buckets in Redis and applies the admission
rule (``extproc.admission.rules.decide``, mirrored line for line in Lua) in ONE script per
admission and ONE per settle, so a decision is atomic across replicas. Time inside the
scripts is Redis ``TIME``: replicas' clocks never meet.

Crash safety: every grant is a lease with an expiry (Redis time + ``lease_ttl_s``). A
background task of each replica extends its live leases every ``refresh_s`` (default
``min(BEAT_S, lease_ttl_s / 3)``, ``beats``) in one pipelined round trip with its
heartbeat (and re-takes any that Redis lost, e.g. after a restart). Every script first
purges the expired leases of its pool, returning their slots and KV tokens. A heartbeat
lives PRESENCE_BEATS default refreshes plus ``timeout_s`` and carries where the replica answers ``/healthz`` (``advertise``); a
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

Replicas share a saturated pool fairly (``fairshare``): a replica re-tries its own waiters
the moment its own request ends, so without a rule the room a request frees goes back to
the replica that ran it and the shares drift apart; the admit script makes a replica that
holds more of the pool's leases leave the room to one whose waiting request was refused
for lack of it (``Plan.waits``: a 429 answered at once claims nothing).

Key layout: ``redis_ledger``, with the readers of the ledger's hashes.

Tenant buckets expire once they would be full again (a full bucket and a missing one are
the same), so names that come and go leave nothing behind.

The parts: the scripts and the one definition of their arguments (``redis_lua``), their
calls built from a plan (``redis_commands``), the round trips (``redis_client``), the
modes (``fallback``), the queued settles (``redis_settles``), the room held for admitting
alone (``redis_escrow``) and the usage view (``redis_view``); this module composes them:
leases, the refresher and its mode machine (probe, degrade, recover).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from extproc.admission.store.base import Store
from extproc.admission.store.fallback import (LOCAL_PREFIX, MODES, Fallback, UnobservedStore, StoreObserver,
                                              StoreUnavailableError, Within)
from extproc.admission.store.redis_client import MAX_CONNECTIONS, RedisClient, RoundTripError
from extproc.admission.store.redis_commands import Rebuilding, admit_cmd, read_admit, refresh_cmds, settle_cmd
from extproc.admission.store.redis_escrow import Escrow, Held
from extproc.admission.store.redis_gone import GoneReplicas
from extproc.admission.store.redis_lengths import SharedLengths
from extproc.admission.store.redis_ledger import Keys, escrow_hold
from extproc.admission.store.redis_lua import HEARTBEAT, HeartbeatArg, HeartbeatKeys, word
from extproc.admission.store.redis_nodes import NodeReadings
from extproc.admission.store.redis_settles import Pending, SettleQueue
from extproc.admission.store.redis_upkeep import Upkeep
from extproc.admission.store.redis_view import PoolViews, Settled
from extproc.admission.types import ERROR_DROPPED, ERROR_RESPONSE, Grant, Plan, PoolUsage, Refusal
from extproc.clock import Clock
from extproc.config import RedisStoreConfig

# What callers outside the store use of the Redis store: the store, its errors and the
# label values of its metrics.
__all__ = ["LOCAL_PREFIX", "MODES", "RedisStore", "StoreObserver", "StoreUnavailableError"]

log = logging.getLogger("kvgate.store")

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


def beats(config: RedisStoreConfig) -> tuple[float, float]:
    """beats is a replica's refresh interval (s: ``refresh_s``, else min(BEAT_S, lease TTL / 3))
    and how long its heartbeat says present (s): PRESENCE_BEATS of the default interval or
    of a longer one, plus ``timeout_s``, so that a shorter ``refresh_s`` freshens what the
    replicas read of each other without declaring a slow replica dead sooner. The ledger
    is rebuilt that long after Redis lost it: every replica in shared mode refreshes
    within it."""
    default = min(BEAT_S, config.lease_ttl_s / 3.0)
    every = default if config.refresh_s is None else config.refresh_s
    return every, PRESENCE_BEATS * max(every, default) + config.timeout_s


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
        self._refresh_every, self._presence_ttl = beats(config)
        self._probe_every = min(0.5, self._refresh_every)
        self._prefix = config.key_prefix
        self._replicas_key = f"{config.key_prefix}replicas"
        self._heartbeat_keys = HeartbeatKeys(self._replicas_key, f"{config.key_prefix}replica_addrs",
                                             f"{config.key_prefix}replicas_gone")
        # Where this replica answers whether it runs (its admin /healthz, host:port), for the
        # others once its heartbeat is gone; None: nowhere (then its leases wait their TTL).
        self.advertise: str | None = None
        # Tenant buckets expire a minute after they would be full; with caller instants
        # Redis's own expiry would run on another clock, so they are kept.
        self._tenant_expire = -1.0 if clock is not None else 60.0
        self._client = RedisClient(config, self.replica_id, self._scripts_lost, max_connections)
        self._keys: dict[str, Keys] = {}
        self._views = PoolViews()
        self._live: dict[str, dict[str, Grant]] = {}
        # what Redis holds for this replica's leases: the room it may admit in alone
        self._escrow = Escrow(min(ESCROW_MARGIN_S, config.lease_ttl_s / 2.0))
        # the local grants some refresh has carried to Redis: one never carried is new
        # there, so a refresh that takes it is not a sign that Redis lost anything
        self._carried_local: set[str] = set()
        # what every replica's leases hold on each node, as the last refresh read it, and the
        # completion lengths they learned
        self._nodes, self._lengths = NodeReadings(), SharedLengths()
        self._settles = SettleQueue(self._client.round_trip, lambda: self._fallback.shared, self._escrow.sent,
                                    self._read_settles, self._dropped, lambda f: self._upkeep.degrade(f),
                                    lambda what, exc: self._upkeep.survived(what, exc), lambda: self._closed)
        self._fallback = Fallback(config.on_unavailable, config.expected_replicas, self._observer,
                                  self._client.where, config.recover_s)
        self._next = 0
        # The refresh round (one per round trip): stamps this replica's published generations.
        self._round = 0
        self._gone = GoneReplicas(self._client.round_trip, self._keys, self._heartbeat_keys,
                                  lambda: self._now_arg(self._caller_now()),
                                  lambda pool, view: self._views.read(pool, view, self._caller_now()),
                                  self._ttl, config.timeout_s)
        self._upkeep = Upkeep(self._fallback, self._settles, self._refresh_round_trip, self._alone_since,
                              self._caller_now, lambda: self._closed, self._refresh_every, self._probe_every)
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
        return len(self._settles.pending)

    def instant(self) -> float | None:
        """instant is the store's instant (s) of the latest reply received (None: none yet)."""
        return self._views.instant()

    def others_seen(self, pool: str, node: str, since: float | None, idle: bool) -> int:
        """others_seen is ``shared_nodes.others_seen`` over the other replicas' generations in
        ``pool`` as the last refresh read them, beyond the node's cross-replica sharing then
        (tokens; as the admit script subtracts it, ``shared_nodes.pick_shared``)."""
        return self._nodes.others_seen(self.replica_id, pool, node, since, idle)

    def node_holds(self, pool: str) -> Mapping[str, int] | None:
        # as the last refresh read them, or the last node refusal (``NodeReadings.admitted``), the later
        return self._nodes.held.get(pool)

    def teach(self, pool: str, class_name: str, completion_tokens: int) -> None:
        self._lengths.teach(pool, class_name, completion_tokens)

    def learned(self, pool: str) -> Mapping[str, Sequence[int]] | None:
        return self._lengths.learned(pool)

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
        self._upkeep.ensure()
        await self.refresh()

    async def close(self) -> None:
        """close stops the refresher, applies queued settles if Redis answers, deregisters, disconnects."""
        if self._closed:
            return
        self._closed = True
        for task in (self._upkeep.task, self._settles.flusher, *self._gone.checking.values()):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        # One last try for the queued settles, whatever the mode: what does not make it
        # is freed by the lease TTL.
        with contextlib.suppress(RoundTripError):
            await self._settles.flush_pending()
        if self._fallback.shared:
            with contextlib.suppress(Exception):
                await self._client.forget(self._replicas_key, self.replica_id)
        await self._client.aclose()

    # --- modes -------------------------------------------------------------------

    async def probe(self) -> bool:
        """probe asks Redis whether it is back (``Upkeep.probe``); True when the store is in
        shared mode afterwards."""
        return await self._upkeep.probe()

    def _alone_since(self, carried: set[str]) -> bool:
        """_alone_since says whether a live grant made alone is not among the leases ``carried``
        by the latest refresh, so that Redis may not hold it yet."""
        return any(i.startswith(LOCAL_PREFIX) and i not in carried for live in self._live.values() for i in live)

    def _scripts_lost(self) -> list[tuple[Any, ...]]:
        """_scripts_lost hears that Redis lost its scripts (``PoolViews.lost``; the rebuild window
        lasts a heartbeat's life, ``_presence_ttl``)."""
        return self._views.lost(self._keys, self.replica_id, self._presence_ttl, self._client.where)

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
        self._upkeep.ensure()
        if not self._fallback.shared:
            # A local decision never suspends: yield once, so that callers admitting in a
            # tight loop cannot starve the probe that brings the store back.
            await asyncio.sleep(0)
            return self._admit_degraded(plan, now)
        self._next += 1
        lease_id = f"{self.replica_id}.{self._next}"
        pool = plan.limits.pool
        keys = self._keys_of(pool)
        cmd = admit_cmd(plan, keys, lease_id, self._now_arg(now), self._ttl, self._tenant_expire)
        # Settles of this replica go out before its next admission, in the same round
        # trip: a slot this replica released is free for the request it admits next.
        previous = self._settles.batch
        if previous is not None:
            await asyncio.shield(previous)
            if not self._fallback.shared:
                # Those settles met a failure: decide alone now rather than spend a second
                # timeout, which together with the first would outlast Envoy's message timeout.
                return self._admit_degraded(plan, now)
        sent = self._caller_now()
        batch = self._settles.take()
        try:
            results = await self._client.round_trip([p.cmd for p in batch] + [cmd])
        except BaseException as exc:
            # Failed or cancelled (the requester left) with the answer unknown: the
            # settles go again (they are idempotent) and the admission is cancelled.
            self._settles.put_back(batch)
            if not isinstance(exc, RoundTripError):
                self._cancel(plan, keys, lease_id, now)
                raise
            f = exc
            self._upkeep.degrade(f)
            # The script may have run before the answer was lost: cancel the lease, so
            # that a grant nobody will refresh or settle does not hold a slot until it
            # expires (the tombstone also stops the admit if it is still on the wire).
            self._cancel(plan, keys, lease_id, now)
            return self._admit_degraded(plan, now)
        self._read_settles(batch, results, now)
        try:
            return self._read_admit(plan, lease_id, results[-1], now, sent)
        except Rebuilding as wait:
            # Take this replica's own leases again now rather than at the next refresh.
            await self.refresh()
            raise StoreUnavailableError(f"Redis lost its state (a restart?): the replicas take their leases "
                                        f"again for {wait.seconds:.1f}s more") from None
        except (IndexError, TypeError, ValueError, KeyError, AttributeError) as exc:
            self._upkeep.degrade(RoundTripError(ERROR_RESPONSE, f"unexpected admit reply: {exc}"))
            self._cancel(plan, keys, lease_id, now)
            return self._admit_degraded(plan, now)

    def _cancel(self, plan: Plan, keys: Keys, lease_id: str, now: float) -> None:
        """_cancel queues the settle of an admission whose answer is unknown, charged nothing."""
        self._settles.queue(Pending(plan.limits.pool, self._settle_cmd(plan, keys, lease_id, 0, now), None))

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
        s): ``Escrow.within``. A replica that is the only one (``Fallback.share_replicas`` 1:
        none seen, none expected) has the pool's limits instead, and each node as it reads it."""
        pool = plan.limits.pool
        live = self._live.get(pool, {})
        if self._fallback.share_replicas == 1:
            return Within(plan.limits.limit - len(live),
                          (plan.limits.kv_budget or 0) - sum(g.plan.tokens for g in live.values()), None)
        return self._escrow.within(plan, live, now, self._nodes.held.get(pool, {}))

    def _dropped(self, dropped: Pending) -> None:
        """_dropped hears of a settle the queue's bound dropped: its lease expires by itself."""
        if dropped.lease_id is not None:
            self._views.confirmed(dropped.pool, dropped.lease_id)
        self._observer.store_error(ERROR_DROPPED)

    def _read_admit(self, plan: Plan, lease_id: str, reply: bytes, now: float, sent: float) -> Grant | Refusal:
        """_read_admit reads the admit script's reply to lease ``lease_id`` sent at ``sent`` (caller s),
        and keeps a grant as a live lease this replica's leases hold in Redis."""
        head, _, view = reply.partition(b"|")
        self._views.read(plan.limits.pool, view, now)
        decision = read_admit(plan, lease_id, head)
        self._nodes.admitted(plan.limits.pool, decision, head)
        if isinstance(decision, Grant):
            self._live.setdefault(plan.limits.pool, {})[lease_id] = decision
            self._escrow.held(plan.limits.pool, lease_id,
                              Held(int(plan.tokens), decision.picked, escrow_hold(decision), sent + self._ttl))
        return decision

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
            self._settles.queue(Pending(pool, self._settle_cmd(plan, self._keys_of(pool), grant.id,
                                                               int(plan.tokens), now), grant.id))
            return
        self._views.settled(pool, grant.id, Settled(plan.class_name, plan.tokens, plan.tokens - charged_tokens, now))
        self._settles.queue(Pending(pool, self._settle_cmd(plan, self._keys_of(pool), grant.id,
                                                           charged_tokens, now), grant.id))

    def _settle_cmd(self, plan: Plan, keys: Keys, lease_id: str, charged: int, now: float) -> tuple[Any, ...]:
        return settle_cmd(plan, keys, lease_id, charged, self._now_arg(now), self._ttl, self._tenant_expire)

    def _read_settles(self, batch: list[Pending], results: list[Any], now: float | None = None) -> None:
        """_read_settles takes the confirmed settles out of the unconfirmed ones and keeps their views."""
        at = self._caller_now() if now is None else now
        for p, r in zip(batch, results):
            if p.lease_id is not None:
                self._views.confirmed(p.pool, p.lease_id)
            with contextlib.suppress(IndexError, TypeError, ValueError, AttributeError):
                self._views.read(p.pool, r.partition(b"|")[2], at)

    async def flush(self) -> None:
        """flush waits until every settle queued so far is applied in Redis (or Redis failed)."""
        await self._settles.flush()

    # --- refresh -----------------------------------------------------------------

    def _caller_now(self) -> float:
        return self._clock.now() if self._clock is not None else time.monotonic()

    async def refresh(self) -> bool:
        """refresh heartbeats, extends this replica's live leases and re-reads every known pool,
        in one round trip. Degrades the store when Redis fails; True on success."""
        return await self._upkeep.refresh()

    async def _refresh_round_trip(self) -> set[str]:
        """_refresh_round_trip is one refresh (see ``refresh``); returns the ids of the leases it
        carried, which Redis now holds. Raises RoundTripError."""
        now = self._caller_now()
        cmds, pools, sent = self._refresh_cmds(now)
        fresh = [i for grants in sent for i, _ in grants
                 if i.startswith(LOCAL_PREFIX) and i not in self._carried_local]
        self._carried_local.update(fresh)
        # and what every replica's leases hold on each node (``NodeReadings``)
        known = list(self._keys)
        cmds += NodeReadings.cmds([self._keys[pool] for pool in known])
        results = await self._client.round_trip(cmds)
        try:
            beat = results[0]
            self._fallback.saw_replicas(int(beat[0]))
            gone = [(beat[i].decode(), beat[i + 1].decode()) for i in range(1, len(beat) - 1, 2)]
            restored = 0
            for pool, r in zip(pools, results[1:]):
                head, _, view = r.partition(b"|")
                restored += int(head)
                self._views.read(pool, view, now)
            self._nodes.read(known, results[1 + len(pools):])
            for pool in known:
                self._observer.store_nodes(pool, self._nodes.held[pool])
        except (IndexError, TypeError, ValueError, AttributeError) as exc:
            raise RoundTripError(ERROR_RESPONSE, f"unexpected refresh reply: {exc}") from exc
        # Each fresh local grant is taken (nothing in Redis has its id); any other lease
        # taken was lost there, and then so may be the settled ones the ledger counts on.
        lost = restored - len(fresh)
        self._escrow.refreshed(pools, sent, self._live, now + self._ttl, lost=lost > 0)
        for replica, addr in gone:
            if replica != self.replica_id and not self._closed:
                self._gone.gone(replica, addr)
        if fresh:
            log.info("shared store: %d leases this replica granted while Redis was away are in Redis now", len(fresh))
        if lost > 0:
            log.warning("shared store: Redis had lost %d live leases of this replica (restart or expiry): "
                        "taken again", lost)
        await self._lengths.sync(self._client.round_trip, self._keys)
        return {i for grants in sent for i, _ in grants}

    def _refresh_cmds(self, now: float) -> tuple[list[tuple[Any, ...]], list[str], list[list[tuple[str, Held]]]]:
        """_refresh_cmds is one refresh round trip at ``now`` (s): the heartbeat, then the
        refresh of every known pool's live leases in chunks; the pool of each refresh, and
        the leases it carries."""
        now_arg = self._now_arg(now)
        cmds = [HEARTBEAT.command(self._heartbeat_keys,
                                  *map(word, HeartbeatArg(now_arg, self.replica_id, self._presence_ttl,
                                                          self.advertise or "-", self._ttl)))]
        self._round += 1
        leases, pools, chunks = refresh_cmds(self._keys, self._live, now_arg, self._ttl, self.replica_id, self._round)
        sent = [[(g.id, Held(int(g.plan.tokens), g.picked, escrow_hold(g), 0.0)) for g in chunk] for chunk in chunks]
        return cmds + leases, pools, sent

    # --- usage -------------------------------------------------------------------

    def usage(self, pool: str, now: float) -> PoolUsage:
        """usage is the pool's state as Redis last reported it (``PoolViews.usage``; local
        state in local mode). The pool bucket's tokens are refilled to ``now`` (s)."""
        if not self._fallback.shared:
            return self._fallback.local.usage(pool, now)
        return self._views.usage(pool, now)
