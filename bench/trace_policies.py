"""trace_policies: bench_trace's policies (how Envoy balances and what kvgate does) rendered as
kvgate's and Envoy's configuration files, and the oracle that bounds them: true output lengths
and true KV per node.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.trace_workload import NODE, Background, Req, Scenario
from extproc.configparse import parse_config
from extproc.localstack import is_processor_cluster
from kvgate_testkit.load import NODE_HEADER
from kvgate_testkit.nodes_stack import Node, adaptive_for, cluster_endpoints, header_routes
from kvgate_testkit.procs import LOOPBACK
from kvgate_testkit.stack import envoy_config
from sim.blocks import blocks_for

ROOT = Path(__file__).resolve().parents[1]
PICKER_ENVOY = ROOT / "deploy" / "envoy-endpoint-picker.yaml"
# The batch class's kv_watermark: a document is admitted only where the node stays below it.
BATCH_WATERMARK = 0.7
# How long (simulated s) kvgate lets an online chat wait for room before its 429.
ONLINE_WAIT_S = 2.0
# The oracle keeps room for the background load from this many simulated seconds before it
# comes: longer than almost every chat of the trace runs, so work placed earlier is gone by then.
ORACLE_LEAD_S = 10.0


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
        "adaptive": adaptive_for(speedup),
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
