"""prefix_trace: a window of the Mooncake conversation trace over three simulated nodes with
prefix caching, row by row: Envoy round robin, kvgate prefix-blind, kvgate prefix-aware and an
oracle that knows every node's cache (issue 29); ``bench_prefix.py --mode trace`` runs it.

The trace (Mooncake FAST'25, ``../shared/traces/README.md``) gives each request its arrival,
prompt and output lengths and the hash ids of its prompt's 512-token blocks. Each hash id
becomes its own deterministic 512 words of the simulator's vocabulary (one cl100k token
each, ``sim.api.words``), so requests with the same first k ids share their first k x 512
prompt tokens for kvgate's tokenizer and for the node's prefix cache alike; the last block
is cut to the trace's exact prompt length. A request is one user message (the chat
template adds 7 tokens); its trace output length reaches the node in
``x-sim-output-tokens`` (kvgate never reads it) and the client caps it at ``MAX_TOKENS``.

Scale. The trace is a whole cluster's traffic; three nodes see a sample of its
conversations: a request is kept when its first block after the shared block 0 (the
conversation's start, which every later turn resends) falls in the sample, so a kept
conversation keeps all its turns. The window is compressed ``compress`` times (trace
seconds per simulated second) and run ``speedup`` times faster than real time, so that
two shared cores can drive it; the nodes' KV is sized to come under pressure at that
rate. Every row replays the same requests on three fresh nodes, through the real Envoy.

Rows:
- ``round-robin``: no kvgate, Envoy (deploy/envoy.yaml without ext_proc) round robin;
- ``kvgate-blind``: kvgate picking nodes (deploy/envoy-endpoint-picker.yaml),
  ``picking.shared_prefix: false`` (today's default, blind to prefixes);
- ``kvgate-prefix``: the same with ``shared_prefix: true``, ``prefix_affinity`` and
  ``prefix_record_keys`` (the sweep's rows vary those two);
- ``oracle``: no kvgate; the benchmark places each request itself, through Envoy by a
  header, knowing each request's true output length and each node's cache exactly
  (``CacheOracle``).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import aiohttp
import orjson

from bench.bench_trace import drive
from bench.trace_policies import Policy
from bench.trace_report import Run, kv_for_requests
from bench.trace_workload import NODE, Background, Req, Scenario
from kvgate_testkit.load import CHAT_OVERHEAD, NODE_HEADER
from kvgate_testkit.nodes_stack import MODEL, NodesStack
from kvgate_testkit.reports import percentile
from kvgate_testkit.sampling import fetch_readings
from sim.api import OUTPUT_TOKENS_HEADER, words
from sim.blocks import blocks_for

HASH_BLOCK = 512          # tokens per Mooncake hash id
MAX_TOKENS = 2048         # the clients' cap (the trace's longest output is 2,000)
CONTEXT = 32_768          # the nodes' max_model_len (NodesStack's)
SIM_BLOCK = 16            # the nodes' KV block (tokens), vLLM's default
TTFT_SLO_S = 5.0          # a request counts in goodput if completed with a first token within this (simulated s)
WAIT_S = 10.0             # how long kvgate lets a request wait for room (simulated s)
RESERVE = 0.02            # the share of a node the oracle keeps free, as kvgate's default reserve_fraction
TENANTS = 8


# --- the trace ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceRequest:
    """TraceRequest is one line of a Mooncake trace: arrival (trace seconds), prompt and output
    tokens, and the hash ids of the prompt's 512-token blocks, in order."""

    at_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: Path, start_s: float, window_s: float) -> list[TraceRequest]:
    """read_mooncake returns the requests of a Mooncake trace (JSON lines) that arrive in
    [start_s, start_s + window_s) trace seconds.

    Raises ValueError naming the line of a malformed one: not a JSON object, a missing or
    non-integer field, a negative time, hash ids that do not cover the prompt in 512-token
    blocks, arrivals out of order.
    """
    out: list[TraceRequest] = []
    last = -math.inf
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                raise ValueError(f"{path}:{line_no}: not JSON") from None
            r = _trace_request(row)
            if r is None:
                raise ValueError(f"{path}:{line_no}: expected timestamp (ms), input_length, output_length >= 1 "
                                 "and one hash id per 512 prompt tokens")
            if r.at_s < last:
                raise ValueError(f"{path}:{line_no}: arrivals go backwards ({r.at_s} s after {last} s)")
            last = r.at_s
            if r.at_s >= start_s + window_s:
                break
            if r.at_s >= start_s:
                out.append(r)
    return out


def _trace_request(row: Any) -> TraceRequest | None:
    if not isinstance(row, dict):
        return None
    ts, n_in, n_out, ids = (row.get(k) for k in ("timestamp", "input_length", "output_length", "hash_ids"))
    if not (_whole(ts) and _whole(n_in) and _whole(n_out) and isinstance(ids, list)):
        return None
    if ts < 0 or n_in < 1 or n_out < 1 or len(ids) != blocks_for(n_in, HASH_BLOCK):
        return None
    if not all(_whole(h) and h >= 0 for h in ids):
        return None
    return TraceRequest(ts / 1000.0, n_in, n_out, tuple(ids))


def _whole(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def sampled(r: TraceRequest, sample: int) -> bool:
    """sampled tells whether ``r`` belongs to the 1-in-``sample`` conversations kept: by its
    first block after block 0 (a one-block prompt by its only one), mixed so that neighbouring
    ids do not fall together."""
    key = r.hash_ids[1] if len(r.hash_ids) > 1 else r.hash_ids[0]
    return (key * 2654435761) % 4294967296 % sample == 0


def prompt_text(ids: Sequence[int], tokens: int) -> str:
    """prompt_text is ``tokens`` words: each hash id's own 512 words in order (the last cut)."""
    parts = []
    for i, h in enumerate(ids):
        parts.append(words(h, 0, min(HASH_BLOCK, tokens - i * HASH_BLOCK)))
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class Window:
    """Window is what is replayed and how fast: trace seconds [``start_s``, ``start_s +
    window_s``), 1 conversation in ``sample`` kept, ``compress`` trace seconds per
    simulated second, ``drain_s`` simulated seconds after the last arrival to finish."""

    start_s: float
    window_s: float
    sample: int
    compress: float
    drain_s: float = 60.0

    def scenario(self) -> Scenario:
        """scenario is the window as bench_trace's replay takes it: online chats only, no
        background load."""
        return Scenario(name="mooncake", start_s=self.start_s, window_s=self.window_s, compress=self.compress,
                        online_tenants=TENANTS, max_tokens_mix=((MAX_TOKENS, 1.0),), bursts=(),
                        batch_max_tokens=0, background=Background(node=0, tokens=0, start_s=0.0, end_s=0.0),
                        drain_s=self.drain_s)


@dataclass(frozen=True, slots=True)
class Replay:
    """Replay is the requests of a window and what was left out: ``ids`` each request's hash
    ids (by request id), ``too_long`` the sampled requests whose prompt and cap exceed the
    context."""

    reqs: list[Req]
    ids: dict[int, tuple[int, ...]]
    too_long: int
    kept: int


def build_replay(rows: Sequence[TraceRequest], w: Window) -> Replay:
    """build_replay turns the window's sampled trace requests into streamed chats, the same
    every run; tenants in turn."""
    reqs: list[Req] = []
    ids: dict[int, tuple[int, ...]] = {}
    too_long = kept = 0
    origin = w.start_s
    for r in rows:
        if not sampled(r, w.sample):
            continue
        kept += 1
        prompt = r.input_length + CHAT_OVERHEAD
        if prompt + MAX_TOKENS > CONTEXT:
            too_long += 1
            continue
        i = len(reqs)
        body = orjson.dumps({"model": MODEL, "max_tokens": MAX_TOKENS, "stream": True,
                             "stream_options": {"include_usage": True},
                             "messages": [{"role": "user", "content": prompt_text(r.hash_ids, r.input_length)}]})
        reqs.append(Req(i, (r.at_s - origin) / w.compress, f"online-{i % TENANTS + 1}", "online", prompt,
                        r.output_length, MAX_TOKENS, min(r.output_length, MAX_TOKENS), body))
        ids[i] = r.hash_ids
    return Replay(reqs, ids, too_long, kept)


# --- the oracle -------------------------------------------------------------------------------

@dataclass(slots=True)
class _Held:
    node: int
    full: tuple[int, ...]   # the hash ids of its whole 512-token blocks
    own: int                # blocks of its own: the rest of its prompt, its whole output


class CacheOracle:
    """CacheOracle places each request by kvgate's rule with the truth in place of kvgate's
    estimates: among the nodes where it fits, the one with the most room left after it plus
    the tokens of its prompt that the node's cache holds (kvgate's ranking at
    ``prefix_affinity`` 1). A request that fits no node waits for the oracle's requests to
    end; waiters are placed in arrival order as they fit, smaller ones past a larger one,
    until a waiter has waited ``patience_s`` (real seconds): it then holds back those behind
    it, so that no request waits much longer than kvgate lets one wait.

    It knows what no gateway can: every node's cache (``POST /sim/cached`` on each node, the
    engine's own hash chain, asked once as the request arrives) and each request's true
    output. A request fits a node when its blocks (prompt + true output, less the whole
    512-token blocks it shares with the oracle's requests running there, which the node holds
    once) fit beside theirs within ``1 - reserve`` of the node. Ties go to the node with the
    most room. Greedy: the most informed placement, not a proven optimum schedule.
    """

    def __init__(self, session: aiohttp.ClientSession, node_urls: Sequence[str], capacity_tokens: int,
                 ids: dict[int, tuple[int, ...]], patience_s: float, reserve: float = RESERVE) -> None:
        self.session = session
        self.node_urls = list(node_urls)
        self.limit = math.floor(capacity_tokens // SIM_BLOCK * (1 - reserve))
        self.ids = ids
        self.refs: list[Counter[int]] = [Counter() for _ in node_urls]
        self.own = [0] * len(node_urls)
        self.held: dict[int, _Held] = {}
        self.queue: deque[tuple[Req, list[int], float, asyncio.Future[int]]] = deque()
        self.patience_s = patience_s
        self.lookup_s: list[float] = []   # real seconds each request's lookups took
        self.placed_s: list[float] = []   # real seconds from each request's arrival to its placement

    def blocks(self, node: int) -> int:
        """blocks is what the oracle's requests hold on ``node`` (KV blocks, shared ones once)."""
        return len(self.refs[node]) * (HASH_BLOCK // SIM_BLOCK) + self.own[node]

    def need(self, node: int, req: Req) -> tuple[int, tuple[int, ...], int]:
        """need is (blocks ``req`` adds on ``node``, its whole blocks' ids, its own blocks)."""
        full = self.ids[req.id][:(req.prompt_tokens - CHAT_OVERHEAD) // HASH_BLOCK]
        per = HASH_BLOCK // SIM_BLOCK
        own = blocks_for(req.prompt_tokens + req.true_output, SIM_BLOCK) - len(full) * per
        shared = 0
        for h in full:
            if h not in self.refs[node]:
                break
            shared += 1
        return own + (len(full) - shared) * per, full, own

    def choose(self, req: Req, cached: Sequence[int]) -> int | None:
        """choose is the node for ``req`` given each node's cached tokens of it, or None."""
        best: tuple[int, int] | None = None
        for i in range(len(self.node_urls)):
            room = self.limit - self.blocks(i)
            need = self.need(i, req)[0]
            if need > room:
                continue
            score = (room - need + cached[i], -i)
            if best is None or score > best:
                best = score
        return None if best is None else -best[1]

    def hold(self, node: int, req: Req) -> None:
        """hold counts ``req`` on ``node``."""
        _, full, own = self.need(node, req)
        self.refs[node].update(full)
        self.own[node] += own
        self.held[req.id] = _Held(node, full, own)

    async def _cached(self, req: Req) -> list[int]:
        async def one(url: str) -> int:
            async with self.session.post(f"{url}/sim/cached", data=req.body) as resp:
                resp.raise_for_status()
                return int((await resp.json(loads=orjson.loads))["cached_tokens"])
        t0 = time.monotonic()
        got = list(await asyncio.gather(*(one(u) for u in self.node_urls)))
        self.lookup_s.append(time.monotonic() - t0)
        return got

    async def acquire(self, req: Req) -> tuple[int, int]:
        """acquire waits for ``req``'s turn and a node where it fits; returns (node, token)."""
        t0 = time.monotonic()
        cached = await self._cached(req)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.queue.append((req, cached, t0, fut))
        self._dispatch()
        node = await fut
        self.placed_s.append(time.monotonic() - t0)
        return node, req.id

    def _dispatch(self) -> None:
        # Every waiter that fits goes, in arrival order, smaller ones past a larger one; but a
        # waiter that has waited ``patience_s`` stops the ones behind it, so no request waits
        # much longer than kvgate would let it.
        now = time.monotonic()
        kept: deque[tuple[Req, list[int], float, asyncio.Future[int]]] = deque()
        blocked = False
        while self.queue:
            entry = self.queue.popleft()
            req, cached, since, fut = entry
            if fut.done():
                continue
            node = None if blocked else self.choose(req, cached)
            if node is None:
                blocked = blocked or now - since >= self.patience_s
                kept.append(entry)
                continue
            self.hold(node, req)
            fut.set_result(node)
        self.queue = kept

    def release(self, node: int, token: int) -> None:
        """release gives an ended request's blocks back and places the waiters that now fit."""
        h = self.held.pop(token)
        self.refs[node].subtract(h.full)
        self.refs[node] = +self.refs[node]   # drop ids no request holds any more
        self.own[node] -= h.own
        self._dispatch()

    def tick(self) -> None:
        """tick: nothing to re-check on a timer (every change comes with a release)."""


# --- rows ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceRow:
    """TraceRow is one setup of the replay: ``kvgate`` None for no kvgate (``oracle`` places,
    or Envoy's round robin), else the pool's picking section."""

    key: str
    title: str
    kvgate: dict[str, Any] | None = None
    oracle: bool = False


def prefix_row(affinity: float, record: int, key: str | None = None) -> TraceRow:
    """prefix_row is kvgate prefix-aware with ``prefix_affinity`` and ``prefix_record_keys``."""
    return TraceRow(key or f"prefix-a{affinity:g}-r{record}",
                    f"kvgate prefix-aware (affinity {affinity:g}, record {record:,} keys)",
                    {"shared_prefix": True, "prefix_affinity": affinity, "prefix_record_keys": record})


def main_rows(affinity: float, record: int) -> tuple[TraceRow, ...]:
    """main_rows is the four rows of the issue's evidence, the prefix-aware one with kvgate's
    defaults (``affinity``, ``record``)."""
    return (TraceRow("round-robin", "no kvgate, Envoy round robin"),
            TraceRow("kvgate-blind", "kvgate picking nodes, prefix-blind (shared_prefix: false)",
                     {"shared_prefix": False}),
            prefix_row(affinity, record, "kvgate-prefix"),
            TraceRow("oracle", "oracle: every node's cache and true outputs", oracle=True))


@dataclass(slots=True)
class RowResult:
    """RowResult is what one row measured (times in simulated seconds, tokens)."""

    row: TraceRow
    run: Run
    preemptions: int = 0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    affinity_picks: float = 0.0
    kvgate_credit: float = 0.0
    kvgate_prompt: float = 0.0
    wall_s: float = 0.0
    oracle_lookup_s: list[float] = field(default_factory=list)
    oracle_placed_s: list[float] = field(default_factory=list)
    error: str | None = None
    node_preemptions: list[int] = field(default_factory=list)


def run_row(row: TraceRow, replay: Replay, w: Window, kv_tokens: int, speedup: float, workdir: Path,
            label: str) -> RowResult:
    """run_row starts three fresh nodes (and kvgate) behind Envoy, replays the window, stops them."""
    sim_args = ["--enable-prefix-caching", "--block-size", str(SIM_BLOCK), "--speedup", f"{speedup:g}",
                "--stream-interval", "32", "--default-max-tokens", str(MAX_TOKENS), "--log-level", "WARNING"]
    cfg = {"tenants": {"classes": {"standard": {"max_wait_s": WAIT_S / speedup}}},
           "adaptive": {"poll_interval_s": max(0.05, 0.5 / speedup), "stale_after_s": 3.0 / speedup,
                        "scrape_timeout_s": max(0.05, 0.5 / speedup)}}
    stack = NodesStack(workdir, nodes=3, kv_capacity_tokens=kv_tokens, sim_args=sim_args,
                       picking=row.kvgate is not None, kvgate=row.kvgate is not None,
                       route_header=NODE_HEADER if row.oracle else None,
                       pool={"picking": row.kvgate} if row.kvgate is not None else None, config=cfg)
    policy = Policy(row.key, row.title, "oracle" if row.oracle else ("picker" if row.kvgate else "rr"))
    result = RowResult(row, Run(policy))
    started = time.monotonic()
    stack.start()
    try:
        urls = [stack.node_url(i) for i in range(3)]
        if row.kvgate is not None:
            deadline = time.monotonic() + 10
            while stack.metric("kvgate_backend_pickable") < 3:
                if time.monotonic() > deadline:
                    raise RuntimeError("kvgate never saw the three nodes")
                time.sleep(0.1)
        admin = stack.admin_url if row.kvgate is not None else None

        async def replay_all() -> tuple[list[float], list[float]]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                oracle = CacheOracle(session, urls, kv_tokens, replay.ids, WAIT_S / speedup) if row.oracle else None
                await drive(result.run, replay.reqs, w.scenario(), speedup, stack.envoy_port, urls, admin,
                            label, NODE, placer=oracle)
                return (oracle.lookup_s, oracle.placed_s) if oracle is not None else ([], [])

        result.oracle_lookup_s, result.oracle_placed_s = asyncio.run(replay_all())
        for url in urls:
            c = fetch_readings(f"{url}/metrics")
            result.node_preemptions.append(int(c.get("vllm:num_preemptions_total", 0)))
            result.prefix_queries += c.get("vllm:prefix_cache_queries_total", 0.0)
            result.prefix_hits += c.get("vllm:prefix_cache_hits_total", 0.0)
        result.preemptions = sum(result.node_preemptions)
        if row.kvgate is not None:
            result.affinity_picks = stack.metric("kvgate_backend_prefix_affinity_picks_total")
            result.kvgate_credit = stack.metric("kvgate_backend_prefix_credit_tokens_total")
            result.kvgate_prompt = stack.metric("kvgate_backend_prompt_tokens_total")
        for name, proc in stack.procs.items():
            if not proc.alive():
                result.error = f"{name} exited during the run"
    except Exception as exc:  # one row failing must not lose the others
        result.error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        stack.stop()
    result.error = result.error or result.run.error
    result.wall_s = time.monotonic() - started
    return result


# --- figures ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Figures:
    """Figures is one row's line: counts, goodput (tokens per simulated second of the requests
    that completed with a first token within TTFT_SLO_S, prompt + completion, from the first
    arrival to the last completion), TTFT (simulated s, completed requests), the nodes' prefix
    hit rate (hits / queries, tokens) and KV usage while requests waited (ratio)."""

    completed: int
    total: int
    within_slo: int
    goodput: float
    ttft_p50: float | None
    ttft_p99: float | None
    preemptions: int
    hit_rate: float | None
    kv_waiting: float | None
    refused: int
    affinity_picks: float
    kvgate_hit: float | None


def figures(r: RowResult) -> Figures:
    """figures sums up a row."""
    results = r.run.results
    ok = [x for x in results if x.status == "ok"]
    good = [x for x in ok if x.ttft is not None and x.ttft <= TTFT_SLO_S]
    start = min((x.req.at for x in results), default=0.0)
    end = max((x.done_at for x in ok if x.done_at is not None), default=start)
    span = max(1e-9, end - start)
    ttfts = [x.ttft for x in ok if x.ttft is not None]
    waiting = [row for row in r.run.timeline if row["open_online"] > sum(n["running"] for n in row["nodes"])]
    return Figures(
        completed=len(ok), total=len(results), within_slo=len(good),
        goodput=sum(x.prompt_tokens + x.completion_tokens for x in good) / span,
        ttft_p50=percentile(ttfts, 0.5), ttft_p99=percentile(ttfts, 0.99), preemptions=r.preemptions,
        hit_rate=r.prefix_hits / r.prefix_queries if r.prefix_queries else None,
        kv_waiting=sum(kv_for_requests(row) for row in waiting) / len(waiting) if waiting else None,
        refused=sum(x.status != "ok" for x in results), affinity_picks=r.affinity_picks,
        kvgate_hit=r.kvgate_credit / r.kvgate_prompt if r.kvgate_prompt else None)


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(results: Sequence[RowResult]) -> list[str]:
    """table is the report's markdown table, one line per row; shares are of the oracle's goodput."""
    figs = {r.row.key: figures(r) for r in results}
    oracle = figs.get("oracle")
    lines = ["| row | completed | within SLO | goodput (tok/s) | of the oracle's | TTFT p50 / p99 (s) | "
             "preemptions | nodes' prefix hit rate | kvgate's credit rate | KV usage while requests wait | "
             "affinity picks |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        f = figs[r.row.key]
        share = f.goodput / oracle.goodput if oracle is not None and oracle.goodput > 0 else None
        name = r.row.title + (f" (**error**: {r.error})" if r.error else "")
        lines.append(f"| {name} | {f.completed}/{f.total} | {f.within_slo} | {f.goodput:,.0f} | {_f(share, '.0%')} | "
                     f"{_f(f.ttft_p50, '.2f')} / {_f(f.ttft_p99, '.2f')} | {f.preemptions} | "
                     f"{_f(f.hit_rate, '.1%')} | {_f(f.kvgate_hit, '.1%')} | {_f(f.kv_waiting, '.0%')} | "
                     f"{f.affinity_picks:g} |")
    return lines


def verdicts(results: Sequence[RowResult]) -> list[tuple[str, bool]]:
    """verdicts judges the prefix-aware row against the issue's targets: 0 preemptions, goodput
    >= 90% of the oracle's, TTFT p50 at most half the prefix-blind row's."""
    figs = {r.row.key: figures(r) for r in results}
    aware, blind, oracle = figs.get("kvgate-prefix"), figs.get("kvgate-blind"), figs.get("oracle")
    if aware is None:
        return []
    out = [(f"kvgate prefix-aware: 0 preemptions ({aware.preemptions})", aware.preemptions == 0)]
    if oracle is not None and oracle.goodput > 0:
        share = aware.goodput / oracle.goodput
        out.append((f"kvgate prefix-aware: goodput >= 90% of the oracle's ({share:.0%})", share >= 0.9))
    if blind is not None and blind.ttft_p50 and aware.ttft_p50 is not None:
        x = aware.ttft_p50 / blind.ttft_p50
        out.append((f"kvgate prefix-aware: TTFT p50 <= 0.5x prefix-blind's ({aware.ttft_p50:.2f} s vs "
                    f"{blind.ttft_p50:.2f} s: {x:.2f}x)", x <= 0.5))
    return out


def sweep_rows(affinities: Sequence[float], records: Sequence[int], affinity: float,
               record: int) -> list[TraceRow]:
    """sweep_rows is prefix-aware rows over ``affinities`` (record at its default ``record``) and
    over ``records`` (affinity at ``affinity``), each setting once."""
    rows = [prefix_row(a, record) for a in affinities]
    rows += [prefix_row(affinity, r) for r in records if prefix_row(affinity, r).key not in {x.key for x in rows}]
    return rows


def describe(w: Window, replay: Replay, trace: Path, kv_tokens: int, speedup: float) -> list[str]:
    """describe is the report's setup section."""
    reqs = replay.reqs
    prompts = sorted(float(r.prompt_tokens) for r in reqs)
    outs = sorted(float(r.output_tokens) for r in reqs)
    return [
        f"- Trace: `{trace.name}` (Mooncake FAST'25 traces, Apache-2.0), trace seconds "
        f"{w.start_s:g}-{w.start_s + w.window_s:g}; 1 conversation in {w.sample} kept (by the first block "
        f"after block 0, so a kept conversation keeps every turn): {replay.kept} requests, of which "
        f"{replay.too_long} left out (prompt + max_tokens over the {CONTEXT:,}-token context): {len(reqs)} "
        f"replayed; prompt tokens p50 {_f(percentile(prompts, 0.5), ',.0f')}, p99 {_f(percentile(prompts, 0.99), ',.0f')}; "
        f"output p50 {_f(percentile(outs, 0.5), ',.0f')}, p99 {_f(percentile(outs, 0.99), ',.0f')}.",
        f"- Time: compressed {w.compress:g}x (a trace second lasts 1/{w.compress:g} simulated s), the nodes run "
        f"{speedup:g}x faster than real time: {w.window_s / w.compress:.0f} simulated s of arrivals, "
        f"{w.window_s / w.compress / speedup:.0f} real s. All times below are simulated seconds.",
        f"- Nodes: three `kvgate sim --enable-prefix-caching`, each {kv_tokens:,} KV tokens in blocks of "
        f"{SIM_BLOCK}, max_model_len {CONTEXT:,}, prefill 20,000 tok/s in chunks of 8,192, decode 50 tok/s a "
        "sequence (+1% per extra sequence); a fresh set for every row.",
        f"- Requests: one user message of the hash ids' words (the chat template adds {CHAT_OVERHEAD} tokens), "
        f"streamed, max_tokens {MAX_TOKENS:,}; the trace's output length in `{OUTPUT_TOKENS_HEADER}`. The "
        "client retries a 429/5xx twice, honouring retry-after (openai-python's default).",
        f"- kvgate rows: the real Envoy (deploy/envoy-endpoint-picker.yaml) and kvgate picking among the three "
        f"nodes (learned growth, reserve 0.02), class `standard` waiting up to {WAIT_S:g} s for room.",
        "- Oracle: no kvgate; through the same Envoy by a header. Places each request on the node whose cache "
        "holds most of its prompt (asks every node as the request arrives, `POST /sim/cached`: the engine's own "
        "hash chain), among the nodes where its prompt + true output fits beside the oracle's requests running "
        f"there (whole 512-token blocks they share counted once, {RESERVE:.0%} of each node kept free), the one "
        "with the most room left plus cached tokens (kvgate's ranking at affinity 1, with the truth in place of "
        f"kvgate's estimates). A request that fits no node waits; waiters go in arrival order as they fit, smaller "
        f"ones past a larger one, until one has waited {WAIT_S:g} s (kvgate's wait): it then holds back those "
        "behind it. Greedy: the most informed placement, not a proven optimum.",
        f"- Goodput: prompt + completion tokens of the requests completed with a first token within "
        f"{TTFT_SLO_S:g} s (the SLO), per simulated second from the first arrival to the last completion. TTFT "
        "from the first attempt (kvgate's or the oracle's queueing and retries included), completed requests. "
        "Hit rate: the nodes' `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` (tokens); "
        "kvgate's credit rate: the prompt tokens kvgate counted once / all it counted. KV usage while requests "
        "wait: the mean, over samples where some arrived request was not running on a node, of the blocks "
        "requests held / all blocks (three nodes). Affinity picks: kvgate sent the request to a node for its "
        "prefix although another had more room.",
        f"- Limits: the nodes are simulated; each row runs once in real time on {os.cpu_count()} shared cores, so "
        "figures move between runs: compare rows of one run.",
    ]



# --- the report -------------------------------------------------------------------------------

def report(results: Sequence[RowResult], sweep: Sequence[RowResult], setup: Sequence[str], command: str,
           head: str, affinity: float, record: int) -> str:
    """report is the markdown of a trace run: the rows, the verdicts, the sweep, the setup."""
    lines = ["# The Mooncake conversation trace over three nodes with prefix caching (bench/bench_prefix.py)", "",
             head.replace("{command}", command), "", *table(results), "",
             "Targets (issue 29), for kvgate prefix-aware:", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in verdicts(results)]
    figs = {r.row.key: figures(r) for r in results}
    oracle = figs.get("oracle")
    if oracle is not None and any(f.goodput > oracle.goodput for k, f in figs.items() if k != "oracle"):
        lines += ["", "A row above 100% of the oracle's goodput means that on this window the oracle is no upper "
                  "bound: it reserves each request's whole final size from its placement and serves its waiters "
                  "in arrival order (see its definition below), so the goodput target against it is a floor, "
                  "not a proof of near-optimal placement."]
    for r in results:
        if r.oracle_lookup_s:
            lines += ["", f"The oracle's lookups of a request's cached prefix on the three nodes took p50 "
                      f"{_f(percentile(r.oracle_lookup_s, 0.5), '.3f')} s, p99 {_f(percentile(r.oracle_lookup_s, 0.99), '.3f')} s; "
                      f"from arrival to placement (lookups and its queue) p50 {_f(percentile(r.oracle_placed_s, 0.5), '.3f')} "
                      f"s, p99 {_f(percentile(r.oracle_placed_s, 0.99), '.3f')} s (real time; part of its TTFT)."]
    if sweep:
        lines += ["", f"## Sweep: prefix_affinity (record {record:,} keys) and prefix_record_keys (affinity "
                  f"{affinity:g}), same window, same run", "",
                  "Each line is kvgate prefix-aware with that setting; the oracle's goodput is the main table's.",
                  "", *table([*sweep, *(r for r in results if r.row.key == "oracle")])]
    lines += ["", "## Setup", "", *setup]
    return "\n".join(lines)
