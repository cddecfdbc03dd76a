"""bench_trace: a window of Azure's 2023 conversation trace replayed over three simulated nodes, policy by policy.

Real chat traffic stops long before ``max_tokens``, is spread over several nodes, and
shares them with load the gateway never saw. This benchmark replays that: a window of
the conversation trace (arrival instants, prompt and output tokens), time-compressed to
load the pool, goes through the real Envoy to three simulated vLLM nodes (``sim``), one
of which carries background KV load kvgate did not admit for part of the run. Every
policy gets the same requests, in one run:

1. ``none``:        no admission control, Envoy round robin;
2. ``pool-rr``:     kvgate at the pool level (one KV budget for the three nodes), Envoy round robin;
3. ``pool-lr``:     the same kvgate, Envoy least-request;
4. ``oracle``:      the upper bound: the benchmark knows each request's true output length and
                    each node's true KV (background included) and sends a request, through
                    Envoy, to the node with the most room as soon as its final size fits there;
   ``oracle-classes``: the same bound under the class policy kvgate is given: a batch
                    document goes only where the node stays within the class's kv_watermark;
5. ``picker-worst``: kvgate picking the node (``picking: {growth: worst_case}``);
6. ``picker-learned``: kvgate picking the node where other load shares the nodes
   (``picking: {growth: learned, quantile: 0.9, reserve_fraction: 0.1}``), the recommended
   setting with the Redis store (which refuses pooled growth);
7. ``picker-pooled``: the same with the quantile of each node's summed growth
   (``growth: pooled``), the recommended setting for one replica;
8. ``picker-thin``: learned growth with the default reserve (0.02): what the reserve buys.

Policies 5-8 need ``deploy/envoy-endpoint-picker.yaml`` (kvgate's endpoint picking) and
are skipped, with a line saying so, while that file is missing.

Prompts are built to the trace's exact token counts (one cl100k token per word plus the
chat template's 7 tokens, as kvgate and the node count them); the output length reaches
the node in the header ``x-sim-output-tokens`` (the node stops there, ``finish_reason:
"stop"``); kvgate never reads it. Clients set ``max_tokens`` by a stated mix (1,024,
4,096 or none). Online chats are spread over several tenants and streamed; a batch
tenant sends long documents in bursts. Reported per policy: preemptions per node and in
total, KV utilization while demand was unserved, goodput and its share of the oracle's,
online TTFT p50/p99 and the share of online requests with a first token within 2 s,
refusals per class. Writes ``bench/results/trace.md``.

    python bench/bench_trace.py [--trace ../shared/traces/azure-conv-2023.csv] [--tiny]
                                [--policies none,oracle] [--speedup 3] [--seed 1] [--raw DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from the repository root
    sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import csv  # noqa: E402
import hashlib  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import aiohttp  # noqa: E402
import orjson  # noqa: E402
import yaml  # noqa: E402

from bench import load  # noqa: E402
from bench.bench_protection import CHAT_OVERHEAD, MODEL, Node  # noqa: E402
from bench.load import NODE_HEADER, Placer, Result, by_class, goodput, replay, result_rows, session  # noqa: E402
from bench import reports  # noqa: E402
from bench.reports import cell, machine, percentile  # noqa: E402
from bench.sampling import node_state, readings, scraped, wait_fresh  # noqa: E402
from bench.sampling import preemptions as read_preemptions  # noqa: E402
from bench.stacks import Procs, failure  # noqa: E402
from extproc.configparse import parse_config  # noqa: E402
from extproc.localstack import is_processor_cluster  # noqa: E402
from sim.api import OUTPUT_TOKENS_HEADER, words  # noqa: E402
from sim.blocks import blocks_for  # noqa: E402
from kvgate_testkit.stack import envoy_config  # noqa: E402
from kvgate_testkit.nodes_stack import cluster_endpoints, header_routes  # noqa: E402
from kvgate_testkit.procs import LOOPBACK, exit_on_sigterm, free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# The full trace lives beside a user's clone, not in it; the committed slice holds the
# default window (trace seconds 1560-1680) so tests and a fresh clone can run it.
DEFAULT_TRACE = Path("..") / "shared" / "traces" / "azure-conv-2023.csv"
TRACE_SLICE = ROOT / "bench" / "traces" / "azure-conv-2023-slice.csv"
PICKER_ENVOY = ROOT / "deploy" / "envoy-endpoint-picker.yaml"
# The batch class's kv_watermark: a document is admitted only where the node stays below it.
BATCH_WATERMARK = 0.7
# How long (simulated s) kvgate lets an online chat wait for room before its 429.
ONLINE_WAIT_S = 2.0
TTFT_TARGET_S = 2.0
NODES = 3
# The oracle keeps room for the background load from this many simulated seconds before it
# comes: longer than almost every chat of the trace runs, so work placed earlier is gone by then.
ORACLE_LEAD_S = 10.0


# --- the trace --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceRow:
    """TraceRow is one request of the trace: arrival (trace seconds), prompt and output tokens."""

    at: float
    prompt_tokens: int
    output_tokens: int


TRACE_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


def read_trace(path: Path, start_s: float, window_s: float) -> list[TraceRow]:
    """read_trace returns the trace's requests that arrive in [start_s, start_s + window_s) trace seconds.

    Raises ValueError naming the line of a malformed row (a missing column, a negative or
    non-numeric value, arrivals out of order).
    """
    rows: list[TraceRow] = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != TRACE_COLUMNS:
            raise ValueError(f"{path}: the first line must be the columns {','.join(TRACE_COLUMNS)}")
        last = -math.inf
        for line, cells in enumerate(reader, start=2):
            if len(cells) != 3:
                raise ValueError(f"{path}:{line}: expected 3 columns, got {len(cells)}")
            try:
                at, prompt, output = float(cells[0]), int(cells[1]), int(cells[2])
            except ValueError:
                raise ValueError(f"{path}:{line}: not numbers: {','.join(cells)[:80]!r}") from None
            if not (math.isfinite(at) and at >= 0 and prompt >= 1 and output >= 1):
                raise ValueError(f"{path}:{line}: arrival must be >= 0 s and token counts >= 1")
            if at < last:
                raise ValueError(f"{path}:{line}: arrivals go backwards ({at} after {last})")
            last = at
            if at >= start_s + window_s:
                break
            if at >= start_s:
                rows.append(TraceRow(at, prompt, output))
    return rows


# --- the workload -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Burst:
    """Burst is ``count`` batch documents sent at ``at`` (simulated s): prompts and outputs in tokens."""

    at: float
    count: int
    prompt: tuple[int, int]
    output: tuple[int, int]


RAMP_STEPS = 4


@dataclass(frozen=True, slots=True)
class Background:
    """Background is load on node ``node`` that no gateway admitted: ``tokens`` KV tokens
    from ``start_s`` (reached ``ramp_s`` later) to ``end_s`` (simulated seconds)."""

    node: int
    tokens: int
    start_s: float
    end_s: float
    ramp_s: float = 0.0

    def steps(self) -> list[tuple[float, int]]:
        """steps are the (simulated s, background tokens) settings in order: the load rises in
        ``RAMP_STEPS`` equal steps over ``ramp_s`` (at once when 0) and leaves at ``end_s``."""
        n = RAMP_STEPS if self.ramp_s > 0 else 1
        rise = [(self.start_s + self.ramp_s * i / n, self.tokens * (i + 1) // n) for i in range(n)]
        return [*rise, (self.end_s, 0)]

    def arriving(self, t: float, settle_s: float = 3.0) -> bool:
        """arriving tells whether ``t`` (simulated s) falls while the load rises or ``settle_s`` after."""
        return self.start_s <= t <= self.start_s + self.ramp_s + settle_s


@dataclass(frozen=True, slots=True)
class Scenario:
    """Scenario is what is replayed and how hard; times in simulated seconds unless named trace seconds.

    The trace window [``start_s``, ``start_s + window_s``) (trace seconds) is compressed
    ``compress`` times (a trace second lasts 1/compress simulated s). ``max_tokens_mix``
    is the clients' policy: (max_tokens or None, weight). Batch documents come in
    ``bursts`` with ``batch_max_tokens``; ``drain_s`` after the last arrival, batch
    retries stop.
    """

    name: str
    start_s: float
    window_s: float
    compress: float
    online_tenants: int
    max_tokens_mix: tuple[tuple[int | None, float], ...]
    bursts: tuple[Burst, ...]
    batch_max_tokens: int
    background: Background
    drain_s: float

    @property
    def duration_s(self) -> float:
        """duration_s is the arrivals' span in simulated seconds."""
        return self.window_s / self.compress


# Clients seen in the field ask for 1,024-4,096 tokens or for nothing at all; the trace
# does not say which, so this mix is the benchmark's stated assumption.
MAX_TOKENS_MIX: tuple[tuple[int | None, float], ...] = ((1024, 0.5), (4096, 0.25), (None, 0.25))

FULL = Scenario(
    name="full", start_s=1560.0, window_s=120.0, compress=1.4, online_tenants=6,
    max_tokens_mix=MAX_TOKENS_MIX,
    bursts=(Burst(at=15.0, count=4, prompt=(8000, 12000), output=(200, 500)),
            Burst(at=50.0, count=4, prompt=(8000, 12000), output=(200, 500))),
    batch_max_tokens=512,
    # Load that no gateway admitted grows as its own requests do: over 4 s, not in one jump.
    background=Background(node=2, tokens=16_384, start_s=25.0, end_s=55.0, ramp_s=4.0),
    drain_s=40.0)

TINY = Scenario(
    name="tiny", start_s=1560.0, window_s=10.0, compress=2.5, online_tenants=2,
    max_tokens_mix=MAX_TOKENS_MIX,
    bursts=(Burst(at=1.0, count=2, prompt=(6000, 8000), output=(20, 40)),),
    batch_max_tokens=64,
    background=Background(node=2, tokens=16_384, start_s=0.5, end_s=4.0),
    drain_s=6.0)

# One node: 32k KV tokens (a small GPU's worth at this scale), a 16k context.
NODE = Node(kv_capacity_tokens=32_768, max_model_len=16_384)


@dataclass(frozen=True, slots=True)
class Req:
    """Req is one request of the replay: when (simulated s), who, its sizes (tokens) and its JSON body.

    ``output_tokens`` is what the model would generate before stopping (the trace's
    count, sent as ``x-sim-output-tokens``); ``max_tokens`` the client's cap (None: no
    cap); ``true_output`` what the node will generate: the output, capped.
    """

    id: int
    at: float
    tenant: str
    klass: str
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None
    true_output: int
    body: bytes

    @property
    def stream(self) -> bool:
        return self.klass == "online"


def _body(i: int, prompt: int, max_tokens: int | None, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": MODEL,
                            "messages": [{"role": "user", "content": words(i, 0, prompt - CHAT_OVERHEAD)}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def _pick(rng: random.Random, mix: Sequence[tuple[int | None, float]]) -> int | None:
    x = rng.random() * sum(w for _, w in mix)
    for value, weight in mix:
        x -= weight
        if x < 0:
            return value
    return mix[-1][0]


def build_requests(rows: Sequence[TraceRow], sc: Scenario, seed: int, node: Node = NODE) -> list[Req]:
    """build_requests turns trace rows and the scenario into requests drawn from ``seed``: the same list every run.

    A prompt shorter than the chat template (8 tokens) is lengthened to 8; a request
    whose prompt and cap could not fit the context even with the smallest cap is left out.
    """
    rng = random.Random(seed)
    specs: list[tuple[float, str, str, int, int, int | None]] = []
    origin = rows[0].at if rows else sc.start_s
    for row in rows:
        prompt = max(CHAT_OVERHEAD + 1, row.prompt_tokens)
        tenant = f"online-{rng.randrange(sc.online_tenants) + 1}"
        max_tokens = _pick(rng, sc.max_tokens_mix)
        if max_tokens is not None and prompt + max_tokens > node.max_model_len:
            max_tokens = None  # a client that knows its context window sends no cap rather than a 400
        if prompt >= node.max_model_len:
            continue
        specs.append(((row.at - origin) / sc.compress, tenant, "online", prompt, row.output_tokens, max_tokens))
    for b in sc.bursts:
        for _ in range(b.count):
            specs.append((b.at, "batch", "batch", rng.randint(*b.prompt), rng.randint(*b.output),
                          sc.batch_max_tokens))
    specs.sort(key=lambda s: s[0])
    reqs = []
    for i, (at, tenant, klass, prompt, output, max_tokens) in enumerate(specs):
        # Without a cap the node may use the rest of the context, as vLLM does.
        cap = node.max_model_len - prompt if max_tokens is None else max_tokens
        reqs.append(Req(i, at, tenant, klass, prompt, output, max_tokens, min(output, cap),
                        _body(i, prompt, max_tokens, klass == "online")))
    return reqs


# --- the policies -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Policy:
    """Policy is one setup: how Envoy balances (``rr``, ``least_request``, ``oracle``: by
    the benchmark's header, ``picker``: by kvgate's header) and kvgate's role (None,
    ``pool``, or a picking section for the pool)."""

    key: str
    title: str
    balance: str
    kvgate: str | None = None
    picking: dict[str, Any] | None = None
    keeps_classes: bool = False   # an oracle that keeps the class watermarks kvgate is given


POLICIES: tuple[Policy, ...] = (
    Policy("none", "1. no admission control, Envoy round robin", "rr"),
    Policy("pool-rr", "2. kvgate at the pool level, Envoy round robin", "rr", "pool"),
    Policy("pool-lr", "3. kvgate at the pool level, Envoy least-request", "least_request", "pool"),
    Policy("oracle", "4. oracle: true output lengths and true KV per node", "oracle"),
    Policy("oracle-classes", "4b. oracle that keeps the batch class's kv_watermark, as kvgate does", "oracle",
           keeps_classes=True),
    Policy("picker-worst", "5. kvgate picking nodes, worst-case growth", "picker", "picker",
           {"growth": "worst_case"}),
    Policy("picker-learned", "6. kvgate picking nodes, learned growth, reserve 0.1 (recommended with the Redis store)",
           "picker",
           "picker", {"growth": "learned", "quantile": 0.9, "reserve_fraction": 0.1}),
    Policy("picker-pooled", "7. kvgate picking nodes, recommended for one replica: pooled growth (q of each "
           "node's sum), reserve 0.1",
           "picker", "picker", {"growth": "pooled", "quantile": 0.9, "reserve_fraction": 0.1}),
    Policy("picker-thin", "8. kvgate picking nodes, learned growth, default reserve (0.02)", "picker", "picker",
           {"growth": "learned", "quantile": 0.9}),
)


def api_key(tenant: str) -> str:
    """api_key is the API key the bench's clients of ``tenant`` send (``authorization: Bearer``)."""
    return f"sk-bench-{tenant}"


def key_digest(tenant: str) -> str:
    """key_digest is the SHA-256 (hex) of ``tenant``'s API key, as kvgate's config names it."""
    return hashlib.sha256(api_key(tenant).encode()).hexdigest()


def kvgate_config(policy: Policy, sc: Scenario, speedup: float, sim_ports: Sequence[int],
                  node: Node = NODE, batch_watermark: float = BATCH_WATERMARK,
                  online_wait_s: float = ONLINE_WAIT_S) -> dict[str, Any]:
    """kvgate_config is kvgate's configuration for a policy; every duration is divided by
    ``speedup`` so that kvgate acts at the same simulated instants as on a real node.
    ``batch_watermark`` is the batch class's ``kv_watermark``; ``online_wait_s`` the online
    class's ``max_wait_s`` (simulated s).

    The pool has the three nodes as backends; a picking policy adds each node's
    inference ``address`` and the pool's ``picking`` section (the picker's contract).
    """
    backends: list[dict[str, Any]] = []
    for i, port in enumerate(sim_ports):
        backend: dict[str, Any] = {"name": f"node-{i}", "metrics_url": f"http://{LOOPBACK}:{port}/metrics",
                                   "engine": "vllm"}
        if policy.picking is not None:
            backend["address"] = f"{LOOPBACK}:{port}"
        backends.append(backend)
    pool: dict[str, Any] = {"max_concurrency": 512, "context_window": node.max_model_len,
                            "default_max_tokens": 1024, "tokenizer": "cl100k_base",
                            "chat_template": "openai", "backends": backends,
                            "signals": {"aggregate": "max", "waiting_threshold": 8 * len(sim_ports),
                                        "kv_budget_fraction": 0.9}}
    if policy.picking is not None:
        pool["picking"] = dict(policy.picking)
    cfg: dict[str, Any] = {
        "pools": {"default": pool},
        "limits": {"max_body_bytes": 1_048_576},
        "adaptive": {"high_watermark": 0.85, "low_watermark": 0.70, "min_scale": 0.6,
                     "recovery_per_s": 0.1 * speedup,
                     "poll_interval_s": max(0.01, 1.0 / speedup),
                     "scrape_timeout_s": max(0.005, 0.5 / speedup),
                     "stale_after_s": 3.0 / speedup},
        "server": {"drain_s": 0, "grace_s": 1},
        "tenants": {
            "header": "x-tenant-id", "default_class": "standard",
            "classes": {
                "online": {"priority": 10, "guaranteed_slots": 64, "max_wait_s": online_wait_s / speedup},
                "standard": {"priority": 0},
                "batch": {"priority": -10, "sheddable": True, "max_wait_s": 10.0 / speedup,
                          "kv_watermark": batch_watermark},
            },
            # Envoy's files strip a client's x-tenant-id: tenants are known by their API keys.
            "tenants": {**{f"online-{i + 1}": {"class": "online", "api_key_sha256": key_digest(f"online-{i + 1}")}
                           for i in range(sc.online_tenants)},
                        "batch": {"class": "batch", "api_key_sha256": key_digest("batch")}},
        },
    }
    parse_config(cfg)  # a bad benchmark config fails here, with the key named
    return cfg


def envoy_for(policy: Policy, *, listen: int, grpc: int | None, sim_ports: Sequence[int],
              picker_template: Path = PICKER_ENVOY) -> dict[str, Any]:
    """envoy_for renders the policy's Envoy file for loopback.

    ``rr`` / ``least_request``: deploy/envoy.yaml with the three nodes in its inference
    cluster; ``oracle``: the same file without ext_proc, plus one cluster per node chosen
    by the header ``x-bench-node``; ``picker``: ``picker_template``
    (deploy/envoy-endpoint-picker.yaml) with its listener and ext_proc ports rewritten
    (its ORIGINAL_DST cluster needs no address).
    """
    if policy.balance == "picker":
        cfg = yaml.safe_load(picker_template.read_text())
        cfg.pop("admin", None)
        for listener in cfg["static_resources"]["listeners"]:
            listener["address"] = {"socket_address": {"address": LOOPBACK, "port_value": listen}}
        for cluster in cfg["static_resources"]["clusters"]:
            if is_processor_cluster(cluster):
                cluster["type"] = "STATIC"
                cluster.pop("dns_lookup_family", None)
                cluster_endpoints(cluster, [grpc or 1])
        return cfg
    cfg = envoy_config(listen=listen, upstream=sim_ports[0], grpc=grpc)
    inference = next(c for c in cfg["static_resources"]["clusters"] if not is_processor_cluster(c))
    cluster_endpoints(inference, sim_ports)
    if policy.balance == "least_request":
        inference["lb_policy"] = "LEAST_REQUEST"
    if policy.balance == "oracle":
        header_routes(cfg, NODE_HEADER, sim_ports)
    return cfg


# --- the oracle -----------------------------------------------------------------------------

class Oracle:
    """Oracle admits a request to a node as soon as its final KV (prompt + true output, in
    blocks) fits beside what that node already holds, background included.

    It knows the background schedule and keeps its room from ``lead_s`` simulated seconds
    before the load arrives, so work it placed earlier is not caught by it. Online
    requests go first, FIFO within a class; nothing is refused. ``watermarks`` (class ->
    share of a node's KV, as a class's ``kv_watermark``): a request of such a class is
    admitted only where the node, everything counted, stays within that share.
    """

    def __init__(self, node: Node, nodes: int, background: Background, lead_s: float,
                 now: Callable[[], float], watermarks: dict[str, float] | None = None) -> None:
        self.total = node.kv_capacity_tokens // node.block_size
        # Blocks a class may fill a node up to, everything the node holds counted (its kv_watermark).
        self.ceilings = {k: math.floor(w * self.total) for k, w in (watermarks or {}).items() if w < 1.0}
        self.block_size = node.block_size
        self.held = [0] * nodes
        self.background = background
        self.lead_s = lead_s
        self.now = now
        self.queues: dict[str, deque[tuple[int, asyncio.Future[int]]]] = {"online": deque(), "batch": deque()}

    def _room(self, i: int) -> int:
        bg = self.background
        t = self.now()
        reserved = 0
        if i == bg.node and bg.start_s - self.lead_s <= t < bg.end_s:
            reserved = blocks_for(bg.tokens, self.block_size)
        return self.total - reserved - self.held[i]

    def _dispatch(self) -> None:
        for klass in ("online", "batch"):
            queue = self.queues[klass]
            kept: deque[tuple[int, asyncio.Future[int]]] = deque()
            while queue:
                blocks, fut = queue.popleft()
                if fut.done():
                    continue
                best = max(range(len(self.held)), key=self._room)
                above = self.total - self.ceilings.get(klass, self.total)  # blocks the class leaves alone
                if self._room(best) - above >= blocks:
                    self.held[best] += blocks
                    fut.set_result(best)
                else:
                    kept.append((blocks, fut))
            self.queues[klass] = kept

    async def acquire(self, req: Req) -> tuple[int, int]:
        """acquire waits until ``req`` fits a node; returns (node, blocks held for it)."""
        blocks = blocks_for(req.prompt_tokens + req.true_output, self.block_size)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.queues[req.klass].append((blocks, fut))
        self._dispatch()
        return await fut, blocks

    def release(self, node: int, blocks: int) -> None:
        """release gives a finished request's blocks back and admits what now fits."""
        self.held[node] -= blocks
        self._dispatch()

    def tick(self) -> None:
        """tick re-checks the queues (the background window may have closed)."""
        self._dispatch()


# --- one run ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Run:
    """Run is one policy's outcome: per-request results, the timeline, each node's counters."""

    policy: Policy
    results: list[Result] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    preemptions: list[int] = field(default_factory=list)
    background: list[tuple[float, int]] = field(default_factory=list)  # (simulated s, tokens) applied
    wall_s: float = 0.0
    error: str | None = None
    skipped: str | None = None


class Client(load.Client):
    """Client replays the requests through Envoy; each request names its tenant by its API key
    and tells the node its true output length (``x-sim-output-tokens``)."""

    def headers(self, req: Req) -> dict[str, str]:
        return {"content-type": "application/json", "authorization": f"Bearer {api_key(req.tenant)}",
                OUTPUT_TOKENS_HEADER: str(req.output_tokens)}


_GAUGES = {"kvgate_inflight_requests", "kvgate_kv_inflight_tokens", "kvgate_kv_budget_tokens",
           "kvgate_admission_scale", "kvgate_pool_alarm"}
# The picker's per-node readings (issue 13's contract), kept per backend label; kvgate's
# decisions per class and outcome (which class a tenant's requests landed in).
_LABELLED = {**dict.fromkeys(("kvgate_backend_kv_inflight_tokens", "kvgate_backend_kv_expected_tokens",
                              "kvgate_backend_kv_foreign_tokens", "kvgate_backend_kv_headroom_tokens",
                              "kvgate_backend_picks_total"), ("backend",)),
             "kvgate_requests_total": ("class", "outcome")}


def parse_kvgate_metrics(text: str) -> dict[str, float]:
    """parse_kvgate_metrics sums kvgate's pool gauges over labels and keeps the per-backend
    series as ``name/backend`` entries, its decisions as ``name/class/outcome`` (those seen)."""
    return {k: v for k, v in readings(text, _GAUGES, _LABELLED).items()
            if v or not k.startswith("kvgate_requests_total/")}


async def _sample(session: aiohttp.ClientSession, client: Client, sim_urls: Sequence[str],
                  admin_url: str | None, timeline: list[dict[str, Any]], period_s: float,
                  oracle: Placer | None) -> None:
    """_sample records every node's state, the client's open requests and kvgate's gauges every ``period_s`` real s."""
    while True:
        row: dict[str, Any] = {"t": client.sim_now(), "open_online": client.open["online"],
                               "open_batch": client.open["batch"], "refused_online": client.refusals["online"],
                               "refused_batch": client.refusals["batch"], "nodes": []}
        try:
            for url in sim_urls:
                st = await node_state(session, url)
                row["nodes"].append({k: st[k] for k in ("used_blocks", "total_blocks", "background_blocks",
                                                        "running", "waiting", "preemptions")})
            if admin_url is not None:
                async with session.get(f"{admin_url}/metrics") as resp:
                    row["kvgate"] = parse_kvgate_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
            pass  # a missed sample is a gap in the timeline, nothing more
        if len(row["nodes"]) == len(sim_urls):
            timeline.append(row)
        if oracle is not None:
            oracle.tick()
        await asyncio.sleep(period_s)


async def _background(session: aiohttp.ClientSession, client: Client, sim_urls: Sequence[str],
                      bg: Background, applied: list[tuple[float, int]]) -> None:
    """_background puts the unadmitted load on its node for its window, then takes it away;
    ``applied`` gets (simulated s, tokens) as the node confirms each setting."""
    url = f"{sim_urls[bg.node]}/sim/config"
    for at, tokens in bg.steps():
        await asyncio.sleep(max(0.0, (at - client.sim_now()) / client.speedup))
        async with session.post(url, data=orjson.dumps({"background_kv_tokens": tokens})) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the node refused its background load: {await resp.text()}")
            applied.append((client.sim_now(), (await resp.json(loads=orjson.loads))["background_kv_tokens"]))


async def drive(run: Run, reqs: list[Req], sc: Scenario, speedup: float, envoy_port: int,
                sim_urls: Sequence[str], admin_url: str | None, label: str, node: Node,
                batch_watermark: float = BATCH_WATERMARK, placer: Placer | None = None) -> None:
    """drive sends the requests, places the background load and samples until every request has
    ended; ``batch_watermark`` is what an oracle that keeps the classes gives the batch class.
    ``placer``: another benchmark's oracle, used instead of this one's."""
    t0 = time.monotonic() + 0.2
    client = Client(f"http://{LOOPBACK}:{envoy_port}/v1/chat/completions", speedup, t0,
                    t0 + (sc.duration_s + sc.drain_s) / speedup, placer)
    if placer is None and run.policy.balance == "oracle":
        client.oracle = Oracle(node, len(sim_urls), sc.background, lead_s=ORACLE_LEAD_S, now=client.sim_now,
                               watermarks={"batch": batch_watermark} if run.policy.keeps_classes else None)
    run.results = [Result(r) for r in reqs]
    async with session() as s:
        run.error = await replay([client.send(s, r) for r in run.results],
                                 (sc.duration_s + sc.drain_s) / speedup + 60.0,
                                 [_sample(s, client, sim_urls, admin_url, run.timeline, 0.5 / speedup, client.oracle),
                                  _background(s, client, sim_urls, sc.background, run.background)])
        run.preemptions = await read_preemptions(s, sim_urls)
    close_results(run, label)


def close_results(run: Run, label: str) -> None:
    """close_results counts a run's unfinished requests as errors and prints how many completed."""
    load.close_results(run.results, label)


def skip_reason(policy: Policy) -> str | None:
    """skip_reason says why a policy cannot run on this checkout, or None."""
    if policy.balance == "picker" and not PICKER_ENVOY.exists():
        return (f"skipped: {PICKER_ENVOY.relative_to(ROOT)} is missing (kvgate's endpoint picking, "
                "issue 13, has not landed on this branch)")
    return None


def _wait_signals(admin_url: str, timeout: float = 10.0) -> None:
    """_wait_signals waits until kvgate has scraped the nodes, so a run does not start while
    kvgate still counts them as stale."""
    wait_fresh(admin_url, scraped, timeout)


def run_policy(policy: Policy, reqs: list[Req], sc: Scenario, node: Node, speedup: float, seed: int,
               workdir: Path, label: str, picker_envoy: Path = PICKER_ENVOY,
               batch_watermark: float = BATCH_WATERMARK, online_wait_s: float = ONLINE_WAIT_S) -> Run:
    """run_policy starts three fresh nodes (+ kvgate) + Envoy, replays the requests, stops them;
    the picking policies run behind ``picker_envoy``."""
    run = Run(policy)
    run.skipped = skip_reason(policy)
    if run.skipped is not None:
        return run
    started = time.monotonic()
    with Procs(workdir) as procs:
        try:
            sim_ports = [free_port() for _ in range(NODES)]
            # No cap from the node itself: a request without max_tokens may run to the end of
            # the context, as on vLLM.
            sims = [procs.start(f"sim-{i}", [*node.argv(port, speedup, seed + i, "preempt"),
                                             "--default-max-tokens", str(node.max_model_len)])
                    for i, port in enumerate(sim_ports)]
            for sim, port in zip(sims, sim_ports):
                sim.wait_port(port)
            kv = None
            if policy.kvgate is not None:
                kv = procs.kvgate(kvgate_config(policy, sc, speedup, sim_ports, node, batch_watermark,
                                                online_wait_s))
                _wait_signals(kv.admin_url)
            envoy_port = free_port()
            procs.envoy(envoy_for(policy, listen=envoy_port, grpc=None if kv is None else kv.grpc_port,
                                  sim_ports=sim_ports, picker_template=picker_envoy), envoy_port)
            asyncio.run(drive(run, reqs, sc, speedup, envoy_port, [f"http://{LOOPBACK}:{p}" for p in sim_ports],
                              None if kv is None else kv.admin_url, label, node, batch_watermark))
            run.error = ((run.error or "") + procs.died()) or None
        except Exception as exc:  # one policy failing must not lose the others' results
            run.error = failure(exc)
    run.wall_s = time.monotonic() - started
    return run


# --- the report -----------------------------------------------------------------------------

# bench_replicas reads the report's percentiles and cells under these names.
_pct = percentile
_fmt = cell


@dataclass(frozen=True, slots=True)
class Summary:
    """Summary is one policy's row: counts, TTFT (simulated s), goodput (tokens per simulated s).

    ``kv_utilization``: the mean over samples, taken while some arrived request was not
    running on a node (queued in kvgate, the oracle or a node, or backing off after a
    429), of the KV blocks requests hold / the blocks the background load leaves them,
    over the three nodes; None when demand never went unserved. ``under_target``: share of all online requests
    (refused ones included) whose first token came within 2 s.
    """

    preemptions: tuple[int, ...]
    at_arrival: int
    by_class: dict[str, dict[str, int]]
    ttft_p50: float | None
    ttft_p99: float | None
    under_target: float | None
    kv_utilization: float | None
    goodput: float
    span_s: float
    tokens: int = 0


def kv_for_requests(row: dict[str, Any]) -> float:
    """kv_for_requests is the share of the KV blocks left by the background load that requests hold
    in a sample, over the nodes (a ratio)."""
    nodes = row["nodes"]
    room = sum(n["total_blocks"] - n["background_blocks"] for n in nodes)
    return sum(n["used_blocks"] for n in nodes) / room if room > 0 else 1.0


def preemptions_at_arrival(run: Run, bg: Background) -> int:
    """preemptions_at_arrival counts the preemptions (all nodes) the timeline saw while ``bg`` arrived."""
    count = 0
    prev: list[int] | None = None
    for row in run.timeline:
        now = [n["preemptions"] for n in row["nodes"]]
        if prev is not None and bg.arriving(row["t"]):
            count += sum(b - a for a, b in zip(prev, now))
        prev = now
    return count


def summarize(run: Run, background: Background) -> Summary:
    """summarize turns a run's results and timeline into its row of the table."""
    online = [r for r in run.results if r.req.klass == "online"]
    ttfts = [r.ttft for r in online if r.status == "ok" and r.ttft is not None]
    under = sum(1 for t in ttfts if t <= TTFT_TARGET_S) / len(online) if online else None
    tokens, span = goodput(run.results)
    starved = [row for row in run.timeline
               if row["open_online"] + row["open_batch"] > sum(n["running"] for n in row["nodes"])]
    util = (sum(kv_for_requests(row) for row in starved) / len(starved)) if starved else None
    return Summary(preemptions=tuple(run.preemptions), at_arrival=preemptions_at_arrival(run, background),
                   by_class=by_class(run.results),
                   ttft_p50=_pct(ttfts, 0.50), ttft_p99=_pct(ttfts, 0.99), under_target=under,
                   kv_utilization=util, goodput=tokens / span, span_s=span, tokens=tokens)


def plot(run: Run, path: Path) -> None:
    """plot draws one policy over simulated time: KV usage per node, requests open and running, 429s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = run.timeline
    t = [row["t"] for row in tl]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    colors = ("tab:blue", "tab:green", "tab:red")
    for i, color in enumerate(colors[:len(tl[0]["nodes"]) if tl else 0]):
        ax1.plot(t, [(row["nodes"][i]["used_blocks"] + row["nodes"][i]["background_blocks"])
                     / row["nodes"][i]["total_blocks"] for row in tl], color=color, label=f"node {i}: KV usage")
        bg = [row["nodes"][i]["background_blocks"] / row["nodes"][i]["total_blocks"] for row in tl]
        if any(bg):
            ax1.fill_between(t, 0, bg, color=color, alpha=0.15, label=f"node {i}: background load")
        marks, prev = [], 0
        for row in tl:
            if row["nodes"][i]["preemptions"] > prev:
                marks.append(row["t"])
                prev = row["nodes"][i]["preemptions"]
        if marks:
            ax1.vlines(marks, -0.06 - 0.04 * i, -0.02 - 0.04 * i, color=color, linewidth=0.8)
    ax1.set_ylim(-0.2, 1.05)
    ax1.set_ylabel("ratio of node KV")
    ax1.legend(loc="upper right", fontsize=7, ncol=2)
    ax1.set_title(f"{run.policy.title}: {sum(run.preemptions)} preemptions (ticks below 0)", fontsize=10)
    ax2.plot(t, [row["open_online"] for row in tl], color="tab:blue", label="client: online open")
    ax2.plot(t, [row["open_batch"] for row in tl], color="tab:orange", label="client: batch open")
    ax2.plot(t, [sum(n["running"] for n in row["nodes"]) for row in tl], color="black", linewidth=1,
             label="nodes: running")
    ax2.plot(t, [sum(n["waiting"] for n in row["nodes"]) for row in tl], color="tab:gray", linewidth=1,
             label="nodes: waiting")
    if any("kvgate" in row for row in tl):
        ax2.plot(t, [row.get("kvgate", {}).get("kvgate_inflight_requests", math.nan) for row in tl],
                 color="tab:purple", linestyle="--", label="kvgate: admitted in flight")
    ax2.set_ylabel("requests")
    ax2.legend(loc="upper right", fontsize=7)
    ax3.plot(t, [row["refused_online"] for row in tl], color="tab:blue", label="429s to online (cumulative)")
    ax3.plot(t, [row["refused_batch"] for row in tl], color="tab:orange", label="429s to batch (cumulative)")
    ax3.set_ylabel("429 answers")
    ax3.set_xlabel("simulated time (s)")
    ax3.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_summary(runs: list[Run], sums: dict[str, Summary], path: Path) -> None:
    """plot_summary draws the policies side by side: goodput share of the oracle, preemptions,
    share of online requests with a first token within 2 s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in runs if r.skipped is None]
    oracle = sums.get("oracle")
    keys = [r.policy.key for r in ran]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    share = [sums[k].goodput / oracle.goodput if oracle and oracle.goodput > 0 else 0.0 for k in keys]
    panels = ((share, "goodput / oracle's", "tab:green"),
              ([float(sum(sums[k].preemptions)) for k in keys], "preemptions (3 nodes)", "tab:red"),
              ([sums[k].under_target or 0.0 for k in keys], "online TTFT <= 2 s", "tab:blue"))
    for ax, (values, title, color) in zip(axes, panels):
        ax.bar(range(len(keys)), values, color=color)
        ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _pct_fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def report(runs: list[Run], sc: Scenario, node: Node, trace: Path, rows: int, reqs: list[Req],
           speedup: float, seed: int, wall_s: float, out: Path, command: str) -> list[str]:
    """report writes ``trace.md`` to ``out`` and returns its verdict lines."""
    ran = [r for r in runs if r.skipped is None]
    sums = {r.policy.key: summarize(r, sc.background) for r in ran}
    oracle = sums.get("oracle")
    kept = sums.get("oracle-classes")
    lines = [
        "# Trace replay: Azure LLM inference trace 2023 (conversation) over three nodes",
        "",
        f"Generated by `{command}` (`make bench-trace`), scenario `{sc.name}`, seed {seed}, "
        f"speedup {speedup:g}x, {len(ran)} policies run in {wall_s:.0f} s wall time on {machine()}.",
        "",
        "| policy | preemptions: node 0 / 1 / 2 = total (as the background arrived) | KV utilization while demand waits "
        "| goodput (tok/s) | share of the oracle's | share of the class-keeping oracle's "
        "| online TTFT p50 / p99 (s) | online TTFT <= 2 s "
        "| online ok / refused / error | batch ok / refused / error | 429s seen (online, batch) |",
        "|---|---|---:|---:|---:|---:|---|---:|---|---|---|",
    ]
    for run in runs:
        if run.skipped is not None:
            lines.append(f"| {run.policy.title} | {run.skipped} | | | | | | | | | |")
            continue
        s = sums[run.policy.key]
        o, b = s.by_class["online"], s.by_class["batch"]
        share = _pct_fmt(s.goodput / oracle.goodput) if oracle and oracle.goodput > 0 else "n/a"
        share_kept = _pct_fmt(s.goodput / kept.goodput) if kept and kept.goodput > 0 else "n/a"
        name = run.policy.title + (f" (**error**: {run.error})" if run.error else "")
        pre = " / ".join(str(p) for p in s.preemptions) + f" = {sum(s.preemptions)} ({s.at_arrival})"
        lines.append(f"| {name} | {pre} | {_pct_fmt(s.kv_utilization)} | {s.goodput:,.0f} | {share} | {share_kept} "
                     f"| {_fmt(s.ttft_p50)} / {_fmt(s.ttft_p99)} | {_pct_fmt(s.under_target)} "
                     f"| {o['ok']} / {o['refused']} / {o['error']} | {b['ok']} / {b['refused']} / {b['error']} "
                     f"| {o['429s']}, {b['429s']} |")
    verdict = verdicts(runs, sums)
    online = [r for r in reqs if r.klass == "online"]
    mix = ", ".join(f"{'none' if v is None else f'{v:,}'} ({sum(r.max_tokens == v for r in online)})"
                    for v, _ in sc.max_tokens_mix)
    bg = sc.background
    lines += ["", *verdict, "",
              "## Setup", "",
              f"- Trace: `{trace}` (Azure LLM inference trace 2023, conversation, as processed by the "
              "Vidur project; CC-BY-4.0 / MIT, see `bench/traces/README.md`), trace seconds "
              f"{sc.start_s:g}-{sc.start_s + sc.window_s:g}: {rows} requests, compressed {sc.compress:g}x "
              f"into {sc.duration_s:.1f} simulated s. Prompts are built to the trace's token counts "
              "(cl100k words + the OpenAI chat template's 7 tokens; shorter prompts are padded to 8); each "
              f"request carries its trace output length in `{OUTPUT_TOKENS_HEADER}`, so the node stops there "
              "(`finish_reason: stop`) unless max_tokens comes first. kvgate does not read that header.",
              f"- Online: {len(online)} streamed chats over {sc.online_tenants} tenants, retried twice on 429/5xx "
              f"(openai-python's default). Clients' max_tokens, drawn per request: {mix}; without a cap the "
              "node may run to the end of the context (as vLLM) and kvgate reserves its pool's "
              "`default_max_tokens` (1,024).",
              "- Batch (one tenant, not streamed, retried until "
              f"{sc.drain_s:g} s after the last arrival): "
              + "; ".join(f"{b.count} documents of {b.prompt[0]:,}-{b.prompt[1]:,} tokens at t={b.at:g} s, "
                          f"outputs {b.output[0]}-{b.output[1]}" for b in sc.bursts)
              + f"; max_tokens {sc.batch_max_tokens}.",
              f"- Nodes: {NODES} simulated vLLM V1 nodes, each {node.kv_capacity_tokens:,} KV tokens in blocks of "
              f"{node.block_size}, max_model_len {node.max_model_len:,}, chunked prefill "
              f"{node.max_num_batched_tokens} tokens/step, prefill {node.prefill_tokens_per_s:,.0f} tok/s, decode "
              f"{node.decode_tokens_per_s:g} tok/s per sequence (+{node.batch_slowdown:.0%} per extra sequence). "
              f"Node {bg.node} holds {bg.tokens:,} tokens of background load (not admitted by any gateway) from "
              f"t={bg.start_s:g} s to t={bg.end_s:g} s"
              + (f", rising in {RAMP_STEPS} steps over {bg.ramp_s:g} s" if bg.ramp_s > 0 else "")
              + "; preemptions in parentheses are those seen while it rose and 3 s after.",
              "- kvgate (policies 2, 3, 5-8): the three nodes as backends, KV budget 0.9 x their reported "
              "capacity, adaptive scale on the fullest node (watermarks 0.70/0.85), classes `online` "
              f"(priority 10, may wait {ONLINE_WAIT_S:g} s unless the command gives `--online-wait`) and `batch` (priority -10, sheddable, may wait 10 s, "
              f"kv_watermark {BATCH_WATERMARK:g} unless the command gives `--batch-watermark`). Policies 5-8 add "
              "each node's `address` and the pool's `picking` section, "
              f"with `{PICKER_ENVOY.relative_to(ROOT)}` unless the command gives `--picker-envoy`.",
              "- Oracle (policy 4): knows each request's true output and each node's true KV; admits a "
              "request to the node with the most room once prompt + true output fits there (keeping room "
              f"for the background load from {ORACLE_LEAD_S:g} s before it comes, since it knows when); online first; "
              "never refuses. It lets a small request pass a large one that does not fit yet: it maximizes "
              "goodput, not tail latency (hence its TTFT p99). Routed through the same Envoy, by a header "
              "matched to one cluster per node. Policy 4b is the same oracle bound by the batch class's "
              "kv_watermark, as kvgate is (a document goes only where the node, everything counted, stays "
              "within it): the upper bound under the operator's class policy; 4 ignores that policy.",
              "- KV utilization: mean, over the samples taken while some arrived request was not running on a "
              "node, of the KV blocks requests held / the blocks the background load left them (three nodes). "
              "Goodput: prompt + "
              "completion tokens of completed requests per simulated second, until the last completion. "
              "TTFT from the first attempt (retries and queueing included); the 2 s share counts every "
              "online request, refused ones as misses.",
              "- Limits of this evidence: the nodes are simulated (vLLM V1's scheduling rules, speeds as "
              "parameters); each policy runs once in real time on a shared machine, so figures move between "
              "runs; the max_tokens mix is an assumption the trace cannot confirm.",
              ""]
    out.mkdir(parents=True, exist_ok=True)
    lines += ["## Over time", ""]
    pictures: list[tuple[str, Callable[[Path], None]]] = [
        ("trace_summary.png", lambda p: plot_summary(runs, sums, p)),
        *((f"trace_{r.policy.key}.png", (lambda p, r=r: plot(r, p))) for r in ran)]
    for name, draw in pictures:
        try:
            draw(out / name)
            lines += [f"![{name}]({name})", ""]
        except Exception as exc:  # a plot failing must not lose the table
            lines += [f"(plot {name} failed: {exc})", ""]
    (out / "trace.md").write_text("\n".join(lines))
    return verdict


def verdicts(runs: list[Run], sums: dict[str, Summary]) -> list[str]:
    """verdicts compares each policy with issue 14's targets."""
    oracle = sums.get("oracle")
    out = []
    for run in runs:
        if run.skipped is not None:
            out.append(f"- {run.policy.title}: {run.skipped}.")
            continue
        s = sums[run.policy.key]
        total = sum(s.preemptions)
        share = s.goodput / oracle.goodput if oracle and oracle.goodput > 0 else None
        text = f"- {run.policy.title}: {total} preemptions ({s.at_arrival} as the background load arrived)"
        if share is not None and oracle is not None and run.policy.key != "oracle":
            text += (f", goodput {share:.0%} of the oracle's ({s.tokens / max(1, oracle.tokens):.0%} of its "
                     f"tokens, the last done at {s.span_s:.0f} s against its {oracle.span_s:.0f} s)")
        kept = sums.get("oracle-classes")
        if kept is not None and kept.goodput > 0 and not run.policy.key.startswith("oracle"):
            text += f", {s.goodput / kept.goodput:.0%} of the class-keeping oracle's"
        if run.policy.key in ("picker-learned", "picker-pooled"):
            met = total == 0 and share is not None and share >= 0.9
            text += f"; target (0 preemptions, >= 90% of the oracle) **{'met' if met else 'NOT met'}**"
        elif run.policy.key == "picker-worst":
            text += f"; target (0 preemptions) **{'met' if total == 0 else 'NOT met'}**"
        out.append(text + ".")
    return out


def dump_raw(run: Run, path: Path) -> None:
    """dump_raw writes a run's per-request results and timeline as JSON (for analysis and tests)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    requests = result_rows(run.results, "prompt_tokens", "output_tokens", "max_tokens", "true_output")
    path.write_bytes(orjson.dumps({"policy": run.policy.key, "preemptions": run.preemptions,
                                   "error": run.error, "skipped": run.skipped, "background": run.background,
                                   "requests": requests, "timeline": run.timeline}))


def main(argv: list[str] | None = None) -> int:
    """main runs the chosen policies in turn and writes the report; returns 1 if a run failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help="the trace CSV (arrived_at,num_prefill_tokens,num_decode_tokens); default "
                         f"{DEFAULT_TRACE}, relative to the repository; {TRACE_SLICE.relative_to(ROOT)} "
                         "holds the default window")
    ap.add_argument("--tiny", action="store_true", help="10 trace seconds, a few real seconds per policy (smoke test)")
    ap.add_argument("--policies", default=",".join(p.key for p in POLICIES),
                    help="comma-separated subset of: " + ", ".join(p.key for p in POLICIES))
    ap.add_argument("--speedup", type=float, default=3.0, help="simulated seconds per real second")
    ap.add_argument("--compress", type=float, default=None,
                    help="trace seconds per simulated second (default: the scenario's)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reserve", type=float, default=None,
                    help="override every picking policy's reserve_fraction (to weigh the reserve's cost)")
    ap.add_argument("--picker-envoy", type=Path, default=PICKER_ENVOY,
                    help="the Envoy file of the picking policies (e.g. deploy/envoy-endpoint-picker-log.yaml)")
    ap.add_argument("--batch-watermark", type=float, default=BATCH_WATERMARK,
                    help="the batch class's kv_watermark (what it costs the documents' goodput)")
    ap.add_argument("--online-wait", type=float, default=ONLINE_WAIT_S,
                    help="simulated seconds kvgate lets an online chat wait for room before its 429 "
                         "(the oracle never refuses)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where trace.md goes")
    ap.add_argument("--raw", type=Path, default=None,
                    help="also write each policy's requests and timeline as JSON to this folder")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    keys = [k.strip() for k in args.policies.split(",") if k.strip()]
    known = {p.key: p for p in POLICIES}
    unknown = [k for k in keys if k not in known]
    if unknown or not keys:
        ap.error(f"unknown policies {unknown}; choose from {', '.join(known)}")
    if not 0 < args.speedup <= 100:
        ap.error("--speedup must be in (0, 100]")
    if not 0 < args.online_wait <= 60:
        ap.error("--online-wait must be in (0, 60]")
    if args.reserve is not None:
        if not 0 <= args.reserve <= 0.5:
            ap.error("--reserve must be in [0, 0.5]")
        known = {k: p if p.picking is None else Policy(p.key, f"{p.title} (reserve {args.reserve:g} by --reserve)",
                                                        p.balance, p.kvgate,
                                                        {**p.picking, "reserve_fraction": args.reserve})
                 for k, p in known.items()}
    sc = TINY if args.tiny else FULL
    if args.compress is not None:
        if not 0 < args.compress <= 100:
            ap.error("--compress must be in (0, 100]")
        sc = Scenario(**{**{f: getattr(sc, f) for f in Scenario.__slots__}, "compress": args.compress})
    trace = args.trace if args.trace.is_absolute() else (ROOT / args.trace)
    if not trace.exists():
        ap.error(f"no trace at {args.trace} (relative to the repository); pass --trace "
                 f"{TRACE_SLICE.relative_to(ROOT)} for the committed slice")
    try:
        rows = read_trace(trace, sc.start_s, sc.window_s)
    except (OSError, ValueError) as exc:
        ap.error(str(exc))
    if not rows:
        ap.error(f"the trace has no request in trace seconds {sc.start_s:g}-{sc.start_s + sc.window_s:g}")
    reqs = build_requests(rows, sc, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"trace benchmark: scenario {sc.name} ({len(reqs)} requests, {sc.duration_s:.1f} s simulated), "
          f"speedup {args.speedup:g}x, policies {', '.join(keys)}", flush=True)
    started = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-trace-") as tmp:
        for i, key in enumerate(keys):
            policy = known[key]
            label = f"{i + 1}/{len(keys)} {key}"
            print(f"- {policy.title}", flush=True)
            run = run_policy(policy, reqs, sc, NODE, args.speedup, args.seed, Path(tmp) / key, label,
                             args.picker_envoy if args.picker_envoy.is_absolute() else ROOT / args.picker_envoy,
                             args.batch_watermark, args.online_wait)
            if run.skipped is not None:
                print(f"  [{label}] {run.skipped}", flush=True)
            else:
                s = summarize(run, sc.background)
                print(f"  [{label}] {run.wall_s:.0f} s: preemptions {list(s.preemptions)}, online ok "
                      f"{s.by_class['online']['ok']}/{s.by_class['online']['n']}, batch ok "
                      f"{s.by_class['batch']['ok']}/{s.by_class['batch']['n']}, TTFT p99 {_fmt(s.ttft_p99)} s, "
                      f"goodput {s.goodput:,.0f} tok/s" + (f"  ERROR: {run.error}" if run.error else ""),
                      flush=True)
                if run.error:
                    for log in sorted((Path(tmp) / key).glob("*.log")):
                        print(f"  --- {log.name} (tail) ---\n{log.read_text(errors='replace')[-1500:]}",
                              file=sys.stderr)
            runs.append(run)
            if args.raw is not None:
                dump_raw(run, args.raw / f"trace_{key}.json")
    command = reports.command("bench/bench_trace.py", ap, args)
    for line in report(runs, sc, NODE, args.trace, len(rows), reqs, args.speedup, args.seed,
                       time.monotonic() - started, args.out, command):
        print(line)
    print(f"report: {args.out / 'trace.md'}")
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
