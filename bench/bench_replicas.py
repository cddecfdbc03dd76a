"""bench_replicas: the conversation trace through one, two and three kvgate replicas that pick
among the same three simulated nodes and share them through one Redis, with Redis, or the
path to it, broken mid-run (issue 28).

Each replica is its own ``kvgate serve`` behind its own Envoy
(``deploy/envoy-endpoint-picker.yaml``, as bench_trace's picking policies), configured as
bench_trace's ``picker-learned`` policy (learned growth, reserve 0.1: the recommended
setting with the Redis store) plus the Redis store (``on_unavailable: local_share``,
``expected_replicas``: the row's replica count). The replicas share one Redis-protocol
server (``kvgate_testkit.redis_server``), and each reaches it through a TCP fault proxy of
its own (``kvgate_testkit.faultproxy``). Identical clients replay bench_trace's requests
(same window, same seed) through a load balancer in front of the replicas' Envoys
(``ReplicaClient``): request ``i``'s first try goes to replica ``i mod N``, a client's
retry (after a 429 or an error) to any replica alike (``lb_pick``), and a try that gets no
answer, a cut stream or a 502/503 goes on at once to another replica, as a balancer's
retry on another host does: a killed replica's share is served by the others, as in
production. Every row starts fresh nodes, replicas, proxies and Redis.

Faults (real seconds from the run's start; the fault begins at 20 % of the arrivals' span):

- ``stop2`` / ``stop10``: Redis stopped with SIGSTOP for 2 s / 10 s, then SIGCONT: the
  connections stay open and nothing answers (a hung server, not a crash; Redis keeps its
  memory);
- ``flap``: Redis stopped 2 s, answering 2 s, five times (20 s);
- ``reset``: every replica's connections to Redis reset (TCP RST, new ones too) for 0.5 s
  every 2 s, for 20 s;
- ``kill``: the last replica's kvgate SIGKILLed; its Envoy stays and answers without ext_proc,
  and the load balancer sends those tries on to the live replicas.

Per row (``replicas_report``): preemptions, goodput, the 429 split, TTFT and latency p99, the
time back to shared mode, each node's KV use; targets: the constants below.

    python bench/bench_replicas.py [--trace ../shared/traces/azure-conv-2023.csv] [--tiny]
                                   [--rows 1x-none,2x-*] [--speedup 3] [--seed 1] [--repeat N]
                                   [--baseline REF] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.replicas_passes import THIS, run_passes
from bench.bench_trace import Client, apply_background, close_results, parse_kvgate_metrics, sample, wait_signals
from bench.trace_policies import POLICIES, Policy, envoy_for, kvgate_config
from bench.trace_report import Run, Summary, summarize
from bench.trace_workload import (DEFAULT_TRACE, FULL, NODE, NODES, TRACE_SLICE, Background, Burst, Req,
                                  Scenario, build_requests, read_trace)
from extproc.configparse import parse_config
from kvgate_testkit.faultproxy import FaultProxy
from kvgate_testkit.load import Result
from kvgate_testkit.nodes_stack import Node
from kvgate_testkit.procs import LOOPBACK, Proc, VENV_BIN, exit_on_sigterm, free_port, print_tails
from kvgate_testkit.redis_server import RedisServer, _ping, redis_server_binary
from kvgate_testkit.revision import checkout, describe, worker_env
from kvgate_testkit.reports import percentile
from kvgate_testkit.sampling import preemptions as read_preemptions

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results" / "replicas.md"
# bench_trace's policies a replica may run: the growth settings the store takes.
REPLICA_POLICIES = {p.key: p for p in POLICIES if p.key in ("picker-learned", "picker-pooled")}
DEFAULT_POLICY = "picker-learned"
# Real seconds: the store's default. A dead replica's leases go once its heartbeat expires and
# its address refuses it, not after the TTL; a replica cut off from Redis admits within its
# leases until shortly before they expire, so the TTL is how long an outage it rides through.
LEASE_TTL_S = 30.0
# The fault starts at this share of the arrivals' span (real time).
FAULT_AT = 0.2
# How long (real s) after the run the benchmark still waits for every replica to be shared again.
RECOVERY_WAIT_S = 12.0
MODE_POLL_S = 0.1
NO_FAULT_GOODPUT = 0.97
FAULT_GOODPUT = 0.9
SHARED_WITHIN_S = 2.0
# 60/40 between two replicas: the largest share of the 429s may be 1.2 times the fair one.
SPLIT_SLACK = 1.2

# Thirty trace seconds: a smoke run with a burst and background load, a few real seconds a row.
TINY = Scenario(
    name="tiny", start_s=1560.0, window_s=30.0, compress=1.4, online_tenants=6,
    max_tokens_mix=FULL.max_tokens_mix, batch_max_tokens=64,
    bursts=(Burst(at=6.0, count=2, prompt=(6000, 8000), output=(20, 40)),),
    background=Background(node=2, tokens=16_384, start_s=5.0, end_s=14.0, ramp_s=2.0),
    drain_s=10.0)


# --- faults ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Fault:
    """Fault is what breaks during a row, in real seconds.

    ``kind``: ``none``, ``pause`` (Redis SIGSTOPped ``down_s``), ``flap`` (paused ``down_s``
    at the start of every ``period_s`` for ``span_s``), ``reset`` (every proxy resets its
    connections for ``down_s`` at the start of every ``period_s`` for ``span_s``) or ``kill``
    (the last replica's kvgate gets SIGKILL).
    """

    key: str
    title: str
    kind: str
    down_s: float = 0.0
    period_s: float = 0.0
    span_s: float = 0.0

    @property
    def redis(self) -> bool:
        """redis tells whether the fault cuts the replicas off Redis (so recovery is timed)."""
        return self.kind in ("pause", "flap", "reset")


FAULTS: tuple[Fault, ...] = (
    Fault("none", "no fault", "none"),
    Fault("stop2", "Redis stopped 2 s", "pause", down_s=2.0),
    Fault("stop10", "Redis stopped 10 s", "pause", down_s=10.0),
    Fault("flap", "Redis flapping (2 s stopped, 2 s up, 20 s)", "flap", down_s=2.0, period_s=4.0, span_s=20.0),
    Fault("reset", "connections reset (0.5 s every 2 s, 20 s)", "reset", down_s=0.5, period_s=2.0, span_s=20.0),
    Fault("kill", "one replica SIGKILLed", "kill"),
)


def fault_plan(fault: Fault, at_s: float) -> list[tuple[float, str]]:
    """fault_plan is the fault's actions in order as (real s from the run's start, action).

    Actions: ``down`` / ``up`` (Redis paused / resumed), ``reset`` / ``pass`` (the proxies'
    mode), ``kill``. The last ``up`` or ``pass`` is when Redis answers again.
    """
    if fault.kind == "pause":
        return [(at_s, "down"), (at_s + fault.down_s, "up")]
    if fault.kind in ("flap", "reset"):
        on, off = ("down", "up") if fault.kind == "flap" else ("reset", "pass")
        plan: list[tuple[float, str]] = []
        t = at_s
        while t < at_s + fault.span_s - 1e-9:
            plan += [(t, on), (t + fault.down_s, off)]
            t += fault.period_s
        return plan
    if fault.kind == "kill":
        return [(at_s, "kill")]
    return []


@dataclass(frozen=True, slots=True)
class Row:
    """Row is one line of the table: ``replicas`` kvgate replicas under ``fault``."""

    replicas: int
    fault: Fault

    @property
    def key(self) -> str:
        return f"{self.replicas}x-{self.fault.key}"


def all_rows() -> list[Row]:
    """all_rows is the full matrix: one replica without a fault (the reference), then two and
    three replicas under every fault."""
    return [Row(1, FAULTS[0]), *(Row(n, f) for n in (2, 3) for f in FAULTS)]


TINY_ROWS = ("1x-none", "2x-none", "2x-stop2", "2x-kill")


def select_rows(rows: Sequence[Row], patterns: Sequence[str]) -> list[Row]:
    """select_rows keeps the rows whose key matches one of the shell patterns (``2x-*``), in order."""
    return [r for r in rows if any(fnmatch.fnmatchcase(r.key, p) for p in patterns)]


# --- the pure figures of a row -------------------------------------------------------------

def max_share(counts: Sequence[int]) -> float | None:
    """max_share is the largest count's share of the total (a ratio), None when the total is 0."""
    total = sum(counts)
    return max(counts) / total if total > 0 else None


def split_limit(replicas: int) -> float:
    """split_limit is the largest share of the 429s one of ``replicas`` identical replicas may get."""
    return min(1.0, SPLIT_SLACK / replicas)


def shared_again_s(answered_at: float, polls: Sequence[tuple[float, Sequence[str | None]]],
                   live: Sequence[bool]) -> float | None:
    """shared_again_s is how long (s) after ``answered_at`` the first poll came in which every
    replica marked ``live`` reported mode ``shared``; None if none did.

    ``polls``: (instant, each replica's mode or None when its metrics did not answer), in order.
    """
    for t, modes in polls:
        if t >= answered_at and all(m == "shared" for m, up in zip(modes, live) if up):
            return t - answered_at
    return None


def degraded_s(polls: Sequence[tuple[float, Sequence[str | None]]], replica: int) -> float:
    """degraded_s is how long (s) ``replica`` reported a mode other than ``shared``, by the polls."""
    total = 0.0
    for (t, modes), (t_next, _) in zip(polls, polls[1:]):
        if modes[replica] not in ("shared", None):
            total += t_next - t
    return total


def mode_from_metrics(text: str) -> str | None:
    """mode_from_metrics is the mode ``kvgate_store_mode`` marks 1 in an exposition, or None."""
    for line in text.splitlines():
        if line.startswith('kvgate_store_mode{mode="'):
            name, _, value = line.partition("} ")
            if float(value) == 1.0:
                return name[len('kvgate_store_mode{mode="'):-1]
    return None


@dataclass(slots=True)
class RowRun:
    """RowRun is what one row measured; instants in real seconds from the run's start."""

    row: Row
    run: Run
    replica_of: list[int] = field(default_factory=list)   # by request id: the replica its last try went to
    refusals_at: list[int] = field(default_factory=list)  # 429 answers per replica, retries included
    failovers: int = 0                                      # tries sent on to another replica
    polls: list[tuple[float, list[str | None]]] = field(default_factory=list)
    live: list[bool] = field(default_factory=list)         # replicas alive at the end
    answered_at: float | None = None                        # Redis answering again after the fault
    plan: list[tuple[float, str]] = field(default_factory=list)
    done: list[tuple[float, str]] = field(default_factory=list)   # the plan as carried out
    resets: int = 0
    # per replica alive at the end: kvgate's decisions (``kvgate_requests_total``) as
    # ``class/outcome`` -> count, which says why a replica refused more than another
    decisions: list[dict[str, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Figures:
    """Figures are one row's results: counts per replica, shares, seconds (latencies simulated)."""

    summary: Summary
    preemptions: int
    goodput_ratio: float | None
    refusals: tuple[int, ...]       # 429 answers per replica, retries included
    ok: tuple[int, ...]
    refused: tuple[int, ...]
    errors: tuple[int, ...]
    share: float | None             # the largest share of the 429s among the replicas alive at the end
    alive: int                      # how many replicas that share is among
    latency_p99: float | None
    shared_again: float | None
    degraded: tuple[float, ...]
    kv_max: tuple[float, ...]       # each node's highest KV use / capacity (requests + background)


def figures(rr: RowRun, background: Background, reference: float | None) -> Figures:
    """figures turns a row's run into its figures; ``reference`` is the one-replica goodput."""
    s = summarize(rr.run, background)
    n = rr.row.replicas
    per: list[list[Result]] = [[] for _ in range(n)]
    for r in rr.run.results:
        per[rr.replica_of[r.req.id]].append(r)
    refusals = tuple(rr.refusals_at)
    # A killed replica's Envoy answers 503, never 429: the split is the survivors'.
    alive = [c for c, up in zip(refusals, rr.live) if up]
    ok = [r for r in rr.run.results if r.status == "ok" and r.done_at is not None]
    kv_max = tuple(max(((row["nodes"][i]["used_blocks"] + row["nodes"][i]["background_blocks"])
                        / row["nodes"][i]["total_blocks"] for row in rr.run.timeline), default=0.0)
                   for i in range(NODES))
    again = None
    if rr.row.fault.redis and rr.answered_at is not None:
        again = shared_again_s(rr.answered_at, rr.polls, rr.live)
    return Figures(
        summary=s, preemptions=sum(rr.run.preemptions),
        goodput_ratio=s.goodput / reference if reference else None,
        refusals=refusals,
        ok=tuple(sum(r.status == "ok" for r in rs) for rs in per),
        refused=tuple(sum(r.status == "refused" for r in rs) for rs in per),
        errors=tuple(sum(r.status == "error" for r in rs) for rs in per),
        share=max_share(alive) if len(alive) > 1 else None, alive=len(alive),
        latency_p99=percentile([r.done_at - r.req.at for r in ok if r.done_at is not None], 0.99),
        shared_again=again, degraded=tuple(degraded_s(rr.polls, i) for i in range(n)), kv_max=kv_max)


def error_answers(results: Sequence[Result]) -> dict[str, int]:
    """error_answers counts the requests that ended in an error by the last answer they got
    (an HTTP status, or ``no answer`` when the connection failed), most frequent first."""
    counts: dict[str, int] = {}
    for r in results:
        if r.status == "error":
            key = "no answer" if r.last_status is None else str(r.last_status)
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def verdict(row: Row, f: Figures) -> dict[str, bool | None]:
    """verdict is each target's outcome for a row: True (PASS), False (FAIL), None (does not apply)."""
    goal = NO_FAULT_GOODPUT if row.fault.kind == "none" else FAULT_GOODPUT
    return {
        "0 preemptions": f.preemptions == 0,
        "goodput": None if f.goodput_ratio is None or row.key == "1x-none" else f.goodput_ratio >= goal,
        "429 split": None if f.alive < 2 else (f.share is None or f.share <= split_limit(f.alive)),
        f"shared within {SHARED_WITHIN_S:g} s": (None if not row.fault.redis
                                                  else f.shared_again is not None
                                                  and f.shared_again <= SHARED_WITHIN_S),
    }


# --- one row ----------------------------------------------------------------------------------

FAILOVER_STATUSES = frozenset({502, 503})
"""FAILOVER_STATUSES are the answers a load balancer in front of the replicas retries on another
replica at once (as Envoy's ``retry_on: connect-failure,reset,5xx`` with the ``previous_hosts``
predicate does), besides no answer and a stream cut after its 200: what a dead replica's
Envoy gives. A 429 is the replica's decision and goes back to the client; the client's retry
is a new request to the load balancer (``lb_pick``)."""


def fails_over(status: int | None, ok: bool) -> bool:
    """fails_over says whether a try that ended with HTTP ``status`` (None: no answer) and did
    not succeed (``ok`` False) is sent on to another replica: no answer, a stream cut after
    its 200, or one of FAILOVER_STATUSES."""
    return not ok and (status is None or status == 200 or status in FAILOVER_STATUSES)


def next_replica(tried: Sequence[int], replicas: int, req_id: int) -> int | None:
    """next_replica is the replica a request's try goes to after failing on every replica in
    ``tried`` (the last one most recently): the others in turn, starting from one chosen by
    ``req_id`` so that a dead replica's share spreads over the live ones; None when every
    replica was tried."""
    others = [(tried[-1] + 1 + k) % replicas for k in range(replicas - 1)]
    left = [k for k in others if k not in tried]
    return left[req_id % len(left)] if left else None


def lb_pick(req_id: int, attempt: int, replicas: int) -> int:
    """lb_pick is the replica a load balancer sends a request's ``attempt``-th try to (1: the
    first): request i's first try to replica i mod N, as the identical clients split the
    trace; a client's retry, a new request to the balancer, to any replica alike (a hash
    of the request and the attempt: the same in every run, as round robin over everyone's
    requests is to one request)."""
    if attempt <= 1:
        return req_id % replicas
    return zlib.crc32(f"{req_id}:{attempt}".encode()) % replicas


class ReplicaClient(Client):
    """ReplicaClient is a client behind a load balancer in front of every replica's Envoy:
    each try goes where the balancer sends it (``lb_pick``), and one that fails there
    (``fails_over``) goes on at once to another replica (``next_replica``) without counting
    as a retry. Each try's answer is counted for the replica that gave it
    (``RowRun.replica_of``, ``RowRun.refusals_at``)."""

    def __init__(self, urls: Sequence[str], rr: RowRun, speedup: float, t0: float, batch_deadline: float) -> None:
        super().__init__(urls[0], speedup, t0, batch_deadline, None)
        self.urls = list(urls)
        self.rr = rr

    def target(self, r: Result) -> str:
        return self.urls[self.rr.replica_of[r.req.id]]

    async def _attempt(self, session: aiohttp.ClientSession, r: Result, headers: dict[str, str],
                       first: float) -> tuple[bool, float]:
        rr = self.rr
        rr.replica_of[r.req.id] = lb_pick(r.req.id, r.attempts, len(self.urls))
        tried = [rr.replica_of[r.req.id]]
        while True:
            r.last_status = None
            retryable, delay = await super()._attempt(session, r, headers, first)
            if r.last_status == 429:
                rr.refusals_at[tried[-1]] += 1
            nxt = next_replica(tried, len(self.urls), r.req.id)
            if not fails_over(r.last_status, r.status == "ok") or nxt is None:
                return retryable, delay
            rr.failovers += 1
            rr.replica_of[r.req.id] = nxt
            tried.append(nxt)

class Clients:
    """Clients are the replicas' clients seen as one, for bench_trace's sampler and background load."""

    def __init__(self, clients: Sequence[Client]) -> None:
        self.clients = list(clients)
        self.speedup = clients[0].speedup

    def sim_now(self) -> float:
        return self.clients[0].sim_now()

    @property
    def open(self) -> dict[str, int]:
        return {k: sum(c.open[k] for c in self.clients) for k in ("online", "batch")}

    @property
    def refusals(self) -> dict[str, int]:
        return {k: sum(c.refusals[k] for c in self.clients) for k in ("online", "batch")}


async def _poll_modes(session: aiohttp.ClientSession, admin_urls: Sequence[str], t0: float,
                      polls: list[tuple[float, list[str | None]]], live: list[bool]) -> None:
    """_poll_modes reads every live replica's store mode every MODE_POLL_S real seconds."""
    timeout = aiohttp.ClientTimeout(total=1.0)

    async def one(i: int, url: str) -> str | None:
        if not live[i]:
            return None
        try:
            async with session.get(f"{url}/metrics", timeout=timeout) as resp:
                return mode_from_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    tick = time.monotonic()
    while True:
        modes = await asyncio.gather(*(one(i, u) for i, u in enumerate(admin_urls)))
        polls.append((time.monotonic() - t0, list(modes)))
        tick += MODE_POLL_S
        await asyncio.sleep(max(0.0, tick - time.monotonic()))


async def _decisions(session: aiohttp.ClientSession, admin_urls: Sequence[str],
                     live: Sequence[bool]) -> list[dict[str, int]]:
    """_decisions is every replica's ``kvgate_requests_total`` by ``class/outcome`` ({} for a dead one)."""
    out: list[dict[str, int]] = []
    for url, alive in zip(admin_urls, live):
        seen: dict[str, int] = {}
        if alive:
            try:
                async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                    for k, v in parse_kvgate_metrics(await resp.text()).items():
                        if k.startswith("kvgate_requests_total/"):
                            seen[k.removeprefix("kvgate_requests_total/")] = int(v)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass
        out.append(seen)
    return out


async def _answers(port: int, timeout: float = 30.0) -> bool:
    """_answers waits until the Redis server on ``port`` answers PING (True), or gives up after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(_ping, port):
            return True
        await asyncio.sleep(0.01)
    return False


async def _inject(rr: RowRun, t0: float, redis: RedisServer, proxies: Sequence[FaultProxy],
                  victim: Proc | None) -> None:
    """_inject carries out the row's plan at its instants and notes when Redis answers again."""
    for at, action in rr.plan:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        if action == "down":
            redis.pause()
        elif action == "up":
            redis.resume()
        elif action in ("reset", "pass"):
            for p in proxies:
                p.set_mode(action)
        elif action == "kill" and victim is not None:
            victim.popen.kill()  # SIGKILL: no settle, no goodbye
            rr.live[-1] = False
        rr.done.append((time.monotonic() - t0, action))
        if action == "up":
            if await _answers(redis.port):
                rr.answered_at = time.monotonic() - t0
        elif action == "pass":
            rr.answered_at = time.monotonic() - t0


async def drive_row(rr: RowRun, reqs: list[Req], sc: Scenario, speedup: float, envoy_ports: Sequence[int],
                    sim_urls: Sequence[str], admin_urls: Sequence[str], redis: RedisServer,
                    proxies: Sequence[FaultProxy], victim: Proc | None, label: str) -> None:
    """drive_row sends each request to its replica's Envoy, places the background load, samples
    the nodes, polls the replicas' store modes and injects the fault, until every request has
    ended and every replica is shared again (or RECOVERY_WAIT_S has passed)."""
    n = rr.row.replicas
    t0 = time.monotonic() + 0.2
    deadline = t0 + (sc.duration_s + sc.drain_s) / speedup
    urls = [f"http://{LOOPBACK}:{p}/v1/chat/completions" for p in envoy_ports]
    # One client per replica (their open and refused counts feed the background load); request
    # i's first try goes to replica i mod N.
    clients = [ReplicaClient(urls, rr, speedup, t0, deadline) for _ in urls]
    together = Clients(clients)
    run = rr.run
    run.results = [Result(r) for r in reqs]
    rr.replica_of = [r.id % n for r in reqs]
    rr.refusals_at = [0] * n
    rr.live = [True] * n
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(sample(session, together, sim_urls, None, run.timeline,  # type: ignore[arg-type]
                                             0.5 / speedup, None)),
                 asyncio.create_task(apply_background(session, together,  # type: ignore[arg-type]
                                                      sim_urls, sc.background, run.background)),
                 asyncio.create_task(_poll_modes(session, admin_urls, t0, rr.polls, rr.live))]
        inject = asyncio.create_task(_inject(rr, t0, redis, proxies, victim))
        try:
            limit = (sc.duration_s + sc.drain_s) / speedup + 60.0
            await asyncio.wait_for(asyncio.gather(
                *(clients[rr.replica_of[r.req.id]].send(session, r) for r in run.results)), timeout=limit)
            await asyncio.wait_for(inject, timeout=60.0)
            if rr.row.fault.redis and rr.answered_at is not None:
                until = time.monotonic() + RECOVERY_WAIT_S
                while time.monotonic() < until and shared_again_s(rr.answered_at, rr.polls, rr.live) is None:
                    await asyncio.sleep(MODE_POLL_S)
        except TimeoutError:
            run.error = "the run did not end within its time limit; unfinished requests count as errors"
        finally:
            for task in (*tasks, inject):
                if not task.done():
                    task.cancel()
            for task in (*tasks, inject):
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        run.preemptions = await read_preemptions(session, sim_urls)
        rr.decisions = await _decisions(session, admin_urls, rr.live)
    close_results(run, label)


def replica_config(policy: Policy, sc: Scenario, speedup: float, sim_ports: Sequence[int], redis_url: str,
                   replicas: int, node: Node = NODE) -> dict[str, Any]:
    """replica_config is one replica's kvgate configuration: bench_trace's ``policy`` with the Redis store
    at ``redis_url`` (lease TTL LEASE_TTL_S real seconds, the default round-trip timeout, ``local_share``
    while Redis is unavailable, the default 1 s refresh divided by ``speedup`` as every kvgate duration)."""
    cfg = kvgate_config(policy, sc, speedup, sim_ports, node)
    cfg["store"] = {"redis": {"url": redis_url, "key_prefix": "bench-replicas:", "lease_ttl_s": LEASE_TTL_S,
                              "refresh_s": 1.0 / speedup, "on_unavailable": "local_share",
                              "expected_replicas": replicas}}
    parse_config(cfg)
    return cfg


def run_row(row: Row, policy: Policy, reqs: list[Req], sc: Scenario, speedup: float, seed: int, workdir: Path,
            label: str, source: Path | None = None) -> RowRun:
    """run_row starts Redis, three nodes and the row's replicas (a fault proxy, kvgate with its
    ``extproc`` from ``source`` or this tree's, and Envoy each), replays the requests under the
    row's fault and stops everything."""
    rr = RowRun(row, Run(policy))
    workdir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    proxies: list[FaultProxy] = []
    redis = RedisServer(workdir / "redis")
    (workdir / "redis").mkdir(exist_ok=True)
    started = time.monotonic()
    try:
        redis.start()
        sim_ports = [free_port() for _ in range(NODES)]
        sims = [Proc([*NODE.argv(port, speedup, seed + i, "preempt"),
                      "--default-max-tokens", str(NODE.max_model_len)], workdir / f"sim-{i}.log")
                for i, port in enumerate(sim_ports)]
        procs.extend(sims)
        kvgates: list[Proc] = []
        admin_ports, grpc_ports, envoy_ports = [], [], []
        for k in range(row.replicas):
            proxy = FaultProxy(redis.port).start()
            proxies.append(proxy)
            grpc_port, admin_port = free_port(), free_port()
            cfg_path = workdir / f"kvgate-{k}.yaml"
            cfg_path.write_text(yaml.safe_dump(replica_config(policy, sc, speedup, sim_ports,
                                                              f"redis://{LOOPBACK}:{proxy.port}/0", row.replicas),
                                               sort_keys=False))
            kv = Proc([sys.executable, "-m", "extproc", "serve", "--config", str(cfg_path),
                       "--grpc-listen", f"{LOOPBACK}:{grpc_port}", "--admin-listen", f"{LOOPBACK}:{admin_port}",
                       "--log-level", "warning"], workdir / f"kvgate-{k}.log",
                      env=None if source is None else worker_env(source), cwd=source)
            kvgates.append(kv)
            grpc_ports.append(grpc_port)
            admin_ports.append(admin_port)
        procs.extend(kvgates)
        for sim, port in zip(sims, sim_ports):
            sim.wait_port(port)
        envoys = []
        for k in range(row.replicas):
            envoy_port = free_port()
            envoy_yaml = workdir / f"envoy-{k}.yaml"
            envoy_yaml.write_text(yaml.safe_dump(envoy_for(policy, listen=envoy_port, grpc=grpc_ports[k],
                                                           sim_ports=sim_ports), sort_keys=False))
            envoys.append(Proc([str(VENV_BIN / "envoy"), "-c", str(envoy_yaml), "--log-level", "error",
                                "--disable-hot-restart", "--concurrency", "1"], workdir / f"envoy-{k}.log"))
            envoy_ports.append(envoy_port)
        procs.extend(envoys)
        for kv, admin_port, grpc_port in zip(kvgates, admin_ports, grpc_ports):
            kv.wait_port(admin_port)
            kv.wait_port(grpc_port)
            wait_signals(f"http://{LOOPBACK}:{admin_port}", timeout=20.0)
        for envoy, port in zip(envoys, envoy_ports):
            envoy.wait_port(port)
        rr.plan = fault_plan(row.fault, FAULT_AT * sc.duration_s / speedup)
        asyncio.run(drive_row(rr, reqs, sc, speedup, envoy_ports, [f"http://{LOOPBACK}:{p}" for p in sim_ports],
                              [f"http://{LOOPBACK}:{p}" for p in admin_ports], redis, proxies,
                              kvgates[-1] if row.fault.kind == "kill" else None, label))
        rr.resets = sum(p.resets for p in proxies)
        victim = kvgates[-1] if row.fault.kind == "kill" else None
        for p in procs:
            if p is not victim and not p.alive():
                rr.run.error = (rr.run.error or "") + f" {Path(p.argv[0]).name} exited during the run"
    except Exception as exc:  # one row failing must not lose the others' results
        rr.run.error = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        for p in reversed(procs):
            p.stop()
        for proxy in proxies:
            proxy.stop()
        redis.stop()
    rr.run.wall_s = time.monotonic() - started
    return rr


def main(argv: list[str] | None = None) -> int:
    """main runs the chosen rows in turn and writes the report; returns 1 if a row failed to run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help=f"the trace CSV (default {DEFAULT_TRACE}, relative to the repository; "
                         f"{TRACE_SLICE.relative_to(ROOT)} holds the default window)")
    ap.add_argument("--tiny", action="store_true",
                    help=f"30 trace seconds and the rows {','.join(TINY_ROWS)} (a smoke run)")
    ap.add_argument("--rows", default=None,
                    help="comma-separated row keys or shell patterns (e.g. 1x-none,2x-*); rows: "
                         + ", ".join(r.key for r in all_rows()))
    ap.add_argument("--speedup", type=float, default=3.0, help="simulated seconds per real second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policy", choices=sorted(REPLICA_POLICIES), default=DEFAULT_POLICY,
                    help=f"bench_trace's policy each replica runs (default {DEFAULT_POLICY})")
    ap.add_argument("--repeat", type=int, default=1, choices=range(1, 6), metavar="N",
                    help="run the rows N times (1-5), in turn; the report adds each row's runs and medians")
    ap.add_argument("--baseline", metavar="REF", help="also run every row with kvgate as it is at this git "
                    "revision, back to back with this tree's, and compare them (replicas_passes)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="the markdown report's path")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    if not 0 < args.speedup <= 100:
        ap.error("--speedup must be in (0, 100]")
    patterns = [p.strip() for p in args.rows.split(",") if p.strip()] if args.rows else (
        list(TINY_ROWS) if args.tiny else ["*"])
    rows = select_rows(all_rows(), patterns)
    if not rows:
        ap.error(f"no row matches {args.rows!r}; rows: {', '.join(r.key for r in all_rows())}")
    sc = TINY if args.tiny else FULL
    policy = REPLICA_POLICIES[args.policy]
    trace = args.trace if args.trace.is_absolute() else (ROOT / args.trace)
    if not trace.exists():
        ap.error(f"no trace at {args.trace}; pass --trace {TRACE_SLICE.relative_to(ROOT)} for the committed slice")
    try:
        trace_rows = read_trace(trace, sc.start_s, sc.window_s)
    except (OSError, ValueError) as exc:
        ap.error(str(exc))
    reqs = build_requests(trace_rows, sc, args.seed)
    redis_binary = redis_server_binary()
    print(f"replicas benchmark: scenario {sc.name} ({len(reqs)} requests, {sc.duration_s:.1f} s simulated), "
          f"speedup {args.speedup:g}x, rows {', '.join(r.key for r in rows)}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-replicas-") as tmp:
        baseline = None if args.baseline is None else (args.baseline, checkout(args.baseline, Path(tmp) / "baseline"))
        trees = run_passes(rows, args.repeat, Path(tmp), sc, baseline, lambda row, workdir, label, source: run_row(
            row, policy, reqs, sc, args.speedup, args.seed, workdir, label, source))
    repeats = trees[THIS]
    from bench.replicas_report import against, command_line, report  # the report imports this module's figures
    lines = report(repeats, policy, sc, shown(args.trace), len(trace_rows), reqs, args.speedup, args.seed,
                   time.monotonic() - started, command_line(args), redis_binary)
    if baseline is not None:
        lines += against(repeats, trees[args.baseline], sc, describe(args.baseline))
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"report: {args.out}")
    return 1 if any(r.run.error for passes in trees.values() for runs in passes for r in runs) else 0


def shown(path: Path) -> str:
    """shown is ``path`` as a report may print it: relative to the repository, never this machine's absolute path."""
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


if __name__ == "__main__":
    sys.exit(main())
