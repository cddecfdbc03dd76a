"""localstack: `make run` — three simulated nodes, kvgate and Envoy on loopback, stopped on Ctrl-C.

The stack uses the repository's own files: ``deploy/envoy-endpoint-picker-log.yaml`` (kvgate
picks the node of every request, the recommended picker file; ports rewritten for loopback) and
``deploy/local/kvgate.yaml`` (one pool whose backends are the simulated nodes, each with
its address). ``--pool-level`` runs the pool-level setup instead: ``deploy/envoy.yaml``,
Envoy's round robin over the nodes, kvgate without the addresses. Generated files go to
``run/`` (ignored by git).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from extproc.configparse import load_config

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"
# The API key of tenant online-1 in deploy/local/kvgate.yaml (a local key, for trying it out).
LOCAL_KEY = "sk-local-online-1"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def pick_port(preferred: int) -> int:
    """pick_port returns ``preferred`` when it is free on loopback, else any free port."""
    if _port_free(preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _endpoint(port: int) -> dict[str, Any]:
    return {"endpoint": {"address": {"socket_address": {"address": LOOPBACK, "port_value": port}}}}


def is_processor_cluster(cluster: dict[str, Any]) -> bool:
    """is_processor_cluster tells the ext_proc (gRPC, HTTP/2) cluster from the inference upstreams."""
    name = cluster.get("name", "")
    return "kvgate" in name or "ext_proc" in name or "extproc" in name


def render_envoy(template: dict[str, Any], *, listen: int, admin: int, grpc: int,
                 upstream: int) -> dict[str, Any]:
    """render_envoy points a copy of an Envoy bootstrap at loopback ports.

    Every listener binds 127.0.0.1:``listen``; the ext_proc cluster reaches kvgate on
    ``grpc``; every other cluster reaches the simulator on ``upstream``, except an
    ORIGINAL_DST cluster (deploy/envoy-endpoint-picker.yaml), which goes where kvgate says.
    """
    cfg = yaml.safe_load(yaml.safe_dump(template))
    if "admin" in cfg:
        cfg["admin"]["address"] = {"socket_address": {"address": LOOPBACK, "port_value": admin}}
    for listener in cfg.get("static_resources", {}).get("listeners", []):
        listener["address"] = {"socket_address": {"address": LOOPBACK, "port_value": listen}}
    for cluster in cfg.get("static_resources", {}).get("clusters", []):
        if cluster.get("type") == "ORIGINAL_DST":
            continue
        port = grpc if is_processor_cluster(cluster) else upstream
        cluster["type"] = "STATIC"
        cluster.pop("dns_lookup_family", None)
        cluster["load_assignment"] = {"cluster_name": cluster["name"],
                                      "endpoints": [{"lb_endpoints": [_endpoint(port)]}]}
        cluster.pop("transport_socket", None)
    return cfg


def render_kvgate(path: Path, *, sim_ports: list[int], picking: bool = True) -> dict[str, Any]:
    """render_kvgate reads the local kvgate config and points its backends at the simulators.

    Backend i gets simulator i's metrics and (``picking``) its address; without
    ``picking`` the addresses and the picking settings are left out, so kvgate admits at the
    pool level, and the nodes' usages combine by ``max`` (the default): Envoy's round robin
    sends a share of every burst to the fullest node, so it must shrink the pool's limits,
    where a mean over the nodes would hide it.
    """
    data = yaml.safe_load(path.read_text())
    for pool in data.get("pools", {}).values():
        backends = pool.get("backends", []) or []
        for backend, port in zip(backends, sim_ports):
            backend["metrics_url"] = f"http://{LOOPBACK}:{port}/metrics"
            if picking:
                backend["address"] = f"{LOOPBACK}:{port}"
            else:
                backend.pop("address", None)
        del backends[len(sim_ports):]
        if not picking:
            pool.pop("picking", None)
            (pool.get("signals") or {}).pop("aggregate", None)
    return data


def spread_upstream(cfg: dict[str, Any], ports: list[int]) -> None:
    """spread_upstream gives every inference cluster of a rendered Envoy config all ``ports``."""
    for cluster in cfg.get("static_resources", {}).get("clusters", []):
        if is_processor_cluster(cluster) or cluster.get("type") == "ORIGINAL_DST":
            continue
        cluster["load_assignment"] = {"cluster_name": cluster["name"], "endpoints": [
            {"lb_endpoints": [_endpoint(p) for p in ports]}]}


class Stack:
    """Stack starts the three processes in order and stops them in reverse."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], ready_port: int, timeout: float = 30.0) -> None:
        log = open(self.run_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        self.procs.append((name, proc))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.run_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
            try:
                with socket.create_connection((LOOPBACK, ready_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{name} did not listen on {ready_port} within {timeout}s "
                           f"(log: {self.run_dir / (name + '.log')})")

    def stop(self) -> None:
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()

    def dead(self, known: Collection[str] = ()) -> str | None:
        """dead is the name of a process that has stopped, other than those ``known``."""
        for name, proc in self.procs:
            if name not in known and proc.poll() is not None:
                return name
        return None


def banner(envoy: int, admin: int, sims: list[int], envoy_admin: int, model: str,
           picking: bool = True) -> str:
    """banner is what `make run` prints: where to send requests and where to look."""
    base = f"http://{LOOPBACK}:{envoy}"
    sim = sims[0]
    nodes = "\n".join(f"  node-{i} (simulated vLLM)     http://{LOOPBACK}:{p}/metrics"
                      + ("   (POST /sim/config to add pressure)" if i == 0 else "")
                      for i, p in enumerate(sims))
    how = ("kvgate picks the node of every request (deploy/envoy-endpoint-picker-log.yaml)" if picking
           else "Envoy's round robin picks the node, kvgate guards the pool (deploy/envoy.yaml)")
    watch = ("kvgate_backend_(kv_foreign_tokens|kv_headroom_tokens|picks_total)" if picking
             else "kvgate_(admission_scale|concurrency_limit)")
    return f"""
kvgate local stack is up (Ctrl-C stops everything): {how}

  Envoy (send requests here)   {base}/v1
  kvgate metrics               http://{LOOPBACK}:{admin}/metrics   (also /healthz, /readyz)
{nodes}
  Envoy admin                  http://{LOOPBACK}:{envoy_admin}/

Try it:

  curl -s {base}/v1/chat/completions -H 'content-type: application/json' \\
       -H 'authorization: Bearer {LOCAL_KEY}' \\
       -d '{{"model": "{model}", "max_tokens": 16, "messages": [{{"role": "user", "content": "Hello"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="{LOCAL_KEY}")  # tenant online-1
  reply = client.chat.completions.create(model="{model}", max_tokens=16,
                                         messages=[{{"role": "user", "content": "Hello"}}])
  print(reply.choices[0].message.content, reply.usage)

Fill node-0's KV cache with traffic kvgate did not admit, and watch kvgate see it
(and, picking, send new requests to the other nodes):

  curl -s {LOOPBACK}:{sim}/sim/config -d '{{"background_kv_tokens": 120000}}'
  curl -s {LOOPBACK}:{admin}/metrics | grep -E '^{watch}'
"""


def _wait_nodes_up(admin: int, nodes: int, timeout: float = 10.0) -> None:
    """_wait_nodes_up waits until kvgate has read every node once (before that it picks none)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{admin}/metrics", timeout=2) as resp:
                text = resp.read().decode()
            up = sum(1 for line in text.splitlines()
                     if line.startswith("kvgate_backend_pickable{") and line.endswith(" 1.0"))
            if up >= nodes:
                return
        except OSError:
            pass
        time.sleep(0.2)


def _parser() -> argparse.ArgumentParser:
    """_parser is the command line of ``main``."""
    ap = argparse.ArgumentParser(prog="kvgate-localstack", description=__doc__)
    ap.add_argument("--envoy-port", type=int, default=int(os.environ.get("KVGATE_PORT", 8080)))
    ap.add_argument("--check", action="store_true",
                    help="start the stack, send the printed request once, stop (for tests)")
    ap.add_argument("--nodes", type=int, default=3, choices=range(1, 9), metavar="N",
                    help="simulated nodes (default 3)")
    ap.add_argument("--pool-level", action="store_true",
                    help="Envoy's round robin picks the node and kvgate guards the pool "
                         "(deploy/envoy.yaml) instead of kvgate picking")
    return ap


def _check_once(envoy: int, admin: int, model: str) -> None:
    """_check_once sends one chat request through Envoy on port ``envoy`` and prints the answer and
    the class that admitted it, from kvgate's metrics on port ``admin`` (``--check``)."""
    body = (b'{"model": "%s", "max_tokens": 16, "messages": '
            b'[{"role": "user", "content": "Hello"}]}' % model.encode())
    req = urllib.request.Request(f"http://{LOOPBACK}:{envoy}/v1/chat/completions",
                                 data=body, headers={"content-type": "application/json",
                                                     "authorization": f"Bearer {LOCAL_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer = f"{resp.status} {resp.read().decode()[:300]}"
    # Which class admitted it: the key's tenant's (online), not the default.
    with urllib.request.urlopen(f"http://{LOOPBACK}:{admin}/metrics", timeout=10) as resp:
        print(*(line for line in resp.read().decode().splitlines()
                if line.startswith("kvgate_requests_total{") and 'outcome="admitted"' in line
                and not line.endswith(" 0.0")), sep="\n")
    print(answer)


def main(argv: list[str] | None = None) -> int:
    """main runs the local stack until Ctrl-C (or ``--check``: start, send one request, stop)."""
    args = _parser().parse_args(argv)

    run_dir = ROOT / "run"
    run_dir.mkdir(exist_ok=True)
    bin_dir = Path(sys.executable).parent
    envoy_bin = shutil.which("envoy", path=str(bin_dir)) or shutil.which("envoy")
    if not envoy_bin:
        print("error: the envoy binary is missing; run `make install`", file=sys.stderr)
        return 2

    envoy = pick_port(args.envoy_port)
    envoy_admin = pick_port(9901)
    grpc = pick_port(50051)
    admin = pick_port(9464)
    sims: list[int] = []
    for i in range(args.nodes):
        port = pick_port(8000 + i)
        while port in sims:
            port = pick_port(0)
        sims.append(port)
    sim = sims[0]
    model = "sim-llama-3-8b"
    picking = not args.pool_level

    kv_cfg = render_kvgate(ROOT / "deploy/local/kvgate.yaml", sim_ports=sims, picking=picking)
    kv_path = run_dir / "kvgate.yaml"
    kv_path.write_text(yaml.safe_dump(kv_cfg, sort_keys=False))
    load_config(kv_path)  # fail here, with the key named, rather than in a child's log
    envoy_file = "deploy/envoy-endpoint-picker-log.yaml" if picking else "deploy/envoy.yaml"
    envoy_cfg = render_envoy(yaml.safe_load((ROOT / envoy_file).read_text()),
                             listen=envoy, admin=envoy_admin, grpc=grpc, upstream=sim)
    spread_upstream(envoy_cfg, sims)
    envoy_path = run_dir / "envoy.yaml"
    envoy_path.write_text(yaml.safe_dump(envoy_cfg, sort_keys=False))

    py = sys.executable
    stack = Stack(run_dir)
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for i, port in enumerate(sims):
            stack.start(f"node-{i}", [py, "-m", "sim", "--listen", f"{LOOPBACK}:{port}",
                                      "--model", model, "--max-model-len", "32768",
                                      "--kv-capacity-tokens", "131072", "--seed", str(i),
                                      "--speedup", "1", "--enable-prefix-caching"], port)
        stack.start("kvgate", [py, "-m", "extproc", "serve", "--config", str(kv_path),
                               "--grpc-listen", f"{LOOPBACK}:{grpc}",
                               "--admin-listen", f"{LOOPBACK}:{admin}"], admin)
        stack.start("envoy", [envoy_bin, "-c", str(envoy_path), "--log-level", "warn",
                              "--base-id", str(os.getpid() % 60000)], envoy)
        if picking:
            _wait_nodes_up(admin, len(sims))
        print(banner(envoy, admin, sims, envoy_admin, model, picking), flush=True)
        if args.check:
            _check_once(envoy, admin, model)
            return 0
        gone: set[str] = set()  # nodes that stopped: the stack goes on without them
        while not stopping:
            dead = stack.dead(gone)
            if dead and dead.startswith("node-"):
                # What kvgate is for: it marks the node down and picks the others.
                print(f"warning: {dead} stopped (see {run_dir / (dead + '.log')}); kvgate marks it "
                      "down and sends new requests to the other nodes", file=sys.stderr, flush=True)
                gone.add(dead)
            elif dead:
                print(f"error: {dead} stopped; see {run_dir / (dead + '.log')}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print("\nstopping...", flush=True)
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
