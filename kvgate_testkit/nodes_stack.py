"""nodes_stack: several simulated inference nodes, kvgate picking among them, and the real Envoy.

For the end-to-end tests of per-node admission and for ``bench/``: ``NodesStack`` starts
``n`` simulators (``python -m sim``) on free loopback ports, kvgate configured with one
pool whose backends are those nodes (each with its ``address`` when ``picking``), and
Envoy from an Envoy file of ``deploy/`` pointed at loopback (by default
deploy/envoy-endpoint-picker.yaml, whose ORIGINAL_DST cluster goes where kvgate says;
deploy/envoy.yaml's inference cluster is then given every node, round robin). Without
kvgate (``kvgate=False``) it is plain Envoy round robin over the nodes: deploy/envoy.yaml without
its ext_proc filter, the control that a benchmark compares kvgate with. ``Node`` is one
simulated node as the replay benchmarks start it, ``adaptive_for`` kvgate's ``adaptive``
section for nodes run faster than real time.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from extproc.envoyconf import HEADER_MUTATION_TYPE
from extproc.localstack import is_processor_cluster, render_envoy
from kvgate_testkit.kvmetrics import LoopbackStack
from kvgate_testkit.procs import LOOPBACK, ROOT, VENV_BIN, Proc, free_port
from kvgate_testkit.stack import without_processor
from sim.engine import EngineParams

PICKER_ENVOY = ROOT / "deploy" / "envoy-endpoint-picker.yaml"
POOL_ENVOY = ROOT / "deploy" / "envoy.yaml"
MODEL = "sim-llama-3-8b"


def _endpoint(port: int) -> dict[str, Any]:
    return {"endpoint": {"address": {"socket_address": {"address": LOOPBACK, "port_value": port}}}}


def cluster_endpoints(cluster: dict[str, Any], ports: Sequence[int]) -> None:
    """cluster_endpoints points an Envoy cluster at the loopback ``ports``."""
    cluster["load_assignment"] = {"cluster_name": cluster["name"], "endpoints": [
        {"lb_endpoints": [_endpoint(p) for p in ports]}]}


def header_routes(cfg: dict[str, Any], header: str, ports: Sequence[int]) -> None:
    """header_routes adds to an Envoy file rendered for loopback one cluster per node, a copy
    of its inference cluster named ``node-i``, and routes before the file's own that send a
    request whose ``header`` is ``i`` to node ``i``: how a benchmark's oracle places requests."""
    clusters = cfg["static_resources"]["clusters"]
    inference = next(c for c in clusters if not is_processor_cluster(c))
    vhost = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]
    routes = []
    for i, port in enumerate(ports):
        node_cluster = {**yaml.safe_load(yaml.safe_dump(inference)), "name": f"node-{i}"}
        node_cluster.pop("lb_policy", None)
        cluster_endpoints(node_cluster, [port])
        clusters.append(node_cluster)
        routes.append({"match": {"prefix": "/", "headers": [{"name": header, "string_match": {"exact": str(i)}}]},
                       "route": {"cluster": f"node-{i}", "timeout": "0s"}})
    vhost["routes"] = [*routes, *vhost["routes"]]



def mutation_filters(cfg: dict[str, Any], *, after: Sequence[str] = (),
                     before: Sequence[str] = ()) -> dict[str, Any]:
    """mutation_filters inserts header_mutation filters that do nothing until a route
    configures them (``header_set``): those named ``after`` right after kvgate's ext_proc
    filter (a gateway's fallback to another endpoint), ``before`` right before it (an
    authentication filter). Returns the connection manager's config."""
    hcm: dict[str, Any] = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    at = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.ext_proc")
    for name in after:
        filters.insert(at + 1, {"name": name, "typed_config": {"@type": HEADER_MUTATION_TYPE, "mutations": {}}})
    for name in before:
        filters.insert(at, {"name": name, "typed_config": {"@type": HEADER_MUTATION_TYPE, "mutations": {}}})
    return hcm


def header_set(key: str, value: str) -> dict[str, Any]:
    """header_set is a route's config of a ``mutation_filters`` filter: set ``key`` to ``value``."""
    return {"@type": HEADER_MUTATION_TYPE + "PerRoute",
            "mutations": {"request_mutations": [{"append": {
                "header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]}}

class NodesStack(LoopbackStack):
    """NodesStack is ``nodes`` simulators, kvgate and Envoy, each a child process.

    ``kv_capacity_tokens`` is every node's KV cache; ``sim_args`` go to every simulator;
    ``pool`` updates kvgate's pool settings; ``config`` updates the rest of kvgate's file.
    ``nodes_of``: another stack whose nodes this one's kvgate and Envoy use (a second
    gateway replica in front of the same nodes); they are then neither started nor
    stopped here. ``kvgate`` False: no kvgate at all, Envoy (deploy/envoy.yaml without
    ext_proc) balances the nodes round robin (``picking`` is then ignored);
    ``route_header`` also sends a request whose header of that name is ``i`` to node ``i``
    (``header_routes``).
    """

    def __init__(self, workdir: Path, *, nodes: int = 3, kv_capacity_tokens: int = 100_000,
                 picking: bool = True, envoy_template: Path | None = None,
                 sim_args: Sequence[str] = (), pool: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None, lb_policy: str | None = None,
                 discover: bool = False, nodes_of: NodesStack | None = None, kvgate: bool = True,
                 route_header: str | None = None) -> None:
        super().__init__()
        self.route_header = route_header
        self.workdir = workdir
        self.kvgate = kvgate
        self.picking = picking and kvgate
        self.envoy_template = envoy_template or (PICKER_ENVOY if self.picking else POOL_ENVOY)
        self.kv_capacity_tokens = kv_capacity_tokens
        self.sim_args = list(sim_args)
        self.pool = pool or {}
        self.extra = config or {}
        self.lb_policy = lb_policy
        self.discover = discover  # one node, found by kvgate's DNS discovery of "localhost"
        self.own_nodes = nodes_of is None
        self.node_ports = list(nodes_of.node_ports) if nodes_of is not None else \
            [free_port() for _ in range(nodes)]

    def node_url(self, i: int) -> str:
        return f"http://{LOOPBACK}:{self.node_ports[i]}"

    def node_name(self, i: int) -> str:
        if self.discover:
            return f"{LOOPBACK}_{self.node_ports[i]}"  # as discovery names a node
        return f"node-{i}"

    def address(self, i: int) -> str:
        return f"{LOOPBACK}:{self.node_ports[i]}"

    def kvgate_config(self) -> dict[str, Any]:
        backends = []
        for i, port in enumerate(self.node_ports):
            b: dict[str, Any] = {"name": self.node_name(i), "engine": "vllm",
                                 "metrics_url": f"http://{LOOPBACK}:{port}/metrics"}
            if self.picking:
                b["address"] = self.address(i)
            backends.append(b)
        pool: dict[str, Any] = {"max_concurrency": 256, "context_window": 32768,
                                "default_max_tokens": 1024, "backends": backends,
                                "signals": {"aggregate": "max", "waiting_threshold": 64}}
        if self.discover:
            del pool["backends"]
            pool["discovery"] = {"dns": "localhost", "port": self.node_ports[0], "interval_s": 0.5}
        pool.update(self.pool)
        cfg: dict[str, Any] = {
            "pools": {"default": pool},
            "adaptive": {"poll_interval_s": 0.25, "stale_after_s": 1.5, "scrape_timeout_s": 0.25},
            "tenants": {"classes": {"standard": {"max_wait_s": 30.0}}},
            # Stopped at once when the test or benchmark is done: nothing to drain for.
            "server": {"drain_s": 0, "grace_s": 2},
        }
        cfg.update(self.extra)
        return cfg

    def start(self) -> NodesStack:
        """start launches the nodes, kvgate and Envoy, each waited for on its port."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        py = sys.executable
        try:
            for i, port in enumerate(self.node_ports if self.own_nodes else ()):
                self._spawn(self.node_name(i), [
                    py, "-m", "sim", "--listen", f"{LOOPBACK}:{port}", "--model", MODEL,
                    "--max-model-len", "32768", "--kv-capacity-tokens", str(self.kv_capacity_tokens),
                    "--seed", str(i), *self.sim_args])
            for i, port in enumerate(self.node_ports if self.own_nodes else ()):
                self.procs[self.node_name(i)].wait_port(port)
            if self.kvgate:
                self._start_kvgate()
            envoy_yaml = self.workdir / "envoy.yaml"
            envoy_yaml.write_text(yaml.safe_dump(self.envoy_config(), sort_keys=False))
            self._spawn("envoy", [str(VENV_BIN / "envoy"), "-c", str(envoy_yaml), "--log-level",
                                  "warn", "--disable-hot-restart", "--concurrency", "1"]
                        ).wait_port(self.envoy_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_kvgate(self) -> None:
        path = self.workdir / "kvgate.yaml"
        path.write_text(yaml.safe_dump(self.kvgate_config(), sort_keys=False))
        kv = self._spawn("kvgate", [sys.executable, "-m", "extproc", "serve", "--config", str(path),
                                    "--grpc-listen", f"{LOOPBACK}:{self.grpc_port}",
                                    "--admin-listen", f"{LOOPBACK}:{self.admin_port}",
                                    "--log-level", "info"])
        kv.wait_port(self.admin_port)
        kv.wait_port(self.grpc_port)

    def envoy_config(self) -> dict[str, Any]:
        """envoy_config is the Envoy file pointed at loopback; a round-robin upstream gets every node."""
        cfg = render_envoy(yaml.safe_load(self.envoy_template.read_text()), listen=self.envoy_port,
                           admin=0, grpc=self.grpc_port, upstream=self.node_ports[0])
        cfg.pop("admin", None)
        for cluster in cfg["static_resources"]["clusters"]:
            if cluster["name"] == "kvgate" or cluster.get("type") == "ORIGINAL_DST":
                continue
            cluster_endpoints(cluster, self.node_ports)
            if self.lb_policy:
                cluster["lb_policy"] = self.lb_policy
        if self.route_header is not None:
            header_routes(cfg, self.route_header, self.node_ports)
        if not self.kvgate:
            without_processor(cfg)
        return cfg

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(argv, self.workdir / f"{name}.log")
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        """stop ends Envoy first, then kvgate and the nodes."""
        for name in ["envoy", "kvgate", *(self.node_name(i) for i in range(len(self.node_ports)))]:
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop()

    # --- looking inside -------------------------------------------------------------------

    def node_state(self, i: int) -> dict[str, Any]:
        """node_state is simulator ``i``'s /sim/state (preemptions, usage, running, ...)."""
        with urllib.request.urlopen(f"{self.node_url(i)}/sim/state", timeout=5) as resp:
            return json.loads(resp.read())

    def node_config(self, i: int, changes: dict[str, Any]) -> None:
        """node_config changes simulator ``i``'s runtime parameters (e.g. background_kv_tokens)."""
        req = urllib.request.Request(f"{self.node_url(i)}/sim/config", data=json.dumps(changes).encode())
        with urllib.request.urlopen(req, timeout=5):
            pass


    def per_node(self, name: str, **labels: str) -> dict[str, float]:
        """per_node is ``name``'s value per backend label."""
        return {self.node_name(i): self.metric(name, backend=self.node_name(i), **labels)
                for i in range(len(self.node_ports))}


@dataclass(slots=True)
class Node(EngineParams):
    """Node is the simulated vLLM node the benchmark starts: the simulator's engine settings
    (capacities in tokens, speeds in tokens/s) plus the model's context length (tokens)."""

    max_model_len: int = 32_768

    def argv(self, port: int, speedup: float, seed: int, overflow: str) -> list[str]:
        """argv is the simulator's command line for this node."""
        return [sys.executable, "-m", "sim", "--listen", f"{LOOPBACK}:{port}", "--model", MODEL,
                "--max-model-len", str(self.max_model_len),
                "--kv-capacity-tokens", str(self.kv_capacity_tokens),
                "--block-size", str(self.block_size), "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--prefill-tokens-per-s", str(self.prefill_tokens_per_s),
                "--decode-tokens-per-s", str(self.decode_tokens_per_s),
                "--batch-slowdown", str(self.batch_slowdown), "--speedup", str(speedup),
                "--seed", str(seed), "--overflow", overflow,
                # Streams write every 8 tokens (the first at once): TTFT is exact and Envoy,
                # kvgate and the client see 8x fewer chunks on 2 shared cores.
                "--stream-interval", "8", "--log-level", "WARNING"]


def adaptive_for(speedup: float) -> dict[str, Any]:
    """adaptive_for is kvgate's ``adaptive`` section for simulated nodes run ``speedup`` times
    faster than real time: watermarks 0.70/0.85, each duration divided by the speedup (and the
    recovery rate multiplied by it), so that kvgate acts at the same simulated instants."""
    return {"high_watermark": 0.85, "low_watermark": 0.70, "min_scale": 0.6,
            "recovery_per_s": 0.1 * speedup,
            "poll_interval_s": max(0.01, 1.0 / speedup),
            "scrape_timeout_s": max(0.005, 0.5 / speedup),
            "stale_after_s": 3.0 / speedup, "early_scrape_gap_s": 0.2 / speedup}
