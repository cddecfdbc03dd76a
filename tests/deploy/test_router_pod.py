"""The router pod of deploy/k8s, run here: the ConfigMaps' Envoy bootstrap and kvgate file,
the Deployment's command lines, with loopback ports instead of the pod's and the vLLM
Service's name replaced by `localhost`. Requests from the real openai client go through the
real Envoy and kvgate, which finds the node in DNS and picks it, to a simulated vLLM."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.deploy.support import K8S, container, envoy_binary, flag, one, resources
from kvgate_testkit.procs import Proc, free_port, wait_until

pytestmark = pytest.mark.e2e


class Pod:
    """Pod runs a simulated vLLM node, kvgate and Envoy as the Deployment describes them."""

    def __init__(self, tmp: Path) -> None:
        objs = resources(K8S)
        spec = one(objs, "Deployment")["spec"]["template"]["spec"]
        envoy_ctr, kvgate_ctr = container(spec, "envoy"), container(spec, "kvgate")
        self.procs: list[Proc] = []
        self.upstream = free_port()
        self.grpc, self.admin, self.listen, self.envoy_admin = (free_port() for _ in range(4))

        kv = yaml.safe_load(one(objs, "ConfigMap", "kvgate-config")["data"]["kvgate.yaml"])
        for pool in kv["pools"].values():
            pool["discovery"].update(dns="localhost", port=self.upstream, interval_s=0.5)
        kv["adaptive"].update(poll_interval_s=0.25, scrape_timeout_s=0.25)
        kv["server"].update(drain_s=0, grace_s=2)  # tests stop at once
        kv_path = tmp / "kvgate.yaml"
        kv_path.write_text(yaml.safe_dump(kv))

        boot = yaml.safe_load(one(objs, "ConfigMap", "llm-router-envoy")["data"]["envoy.yaml"])
        boot["admin"]["address"]["socket_address"]["port_value"] = self.envoy_admin
        boot["static_resources"]["listeners"][0]["address"]["socket_address"] = {
            "address": "127.0.0.1", "port_value": self.listen}
        for cluster in boot["static_resources"]["clusters"]:
            if cluster["name"] == "kvgate":  # the node's cluster goes where kvgate says
                cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] = {
                    "socket_address": {"address": "127.0.0.1", "port_value": self.grpc}}
        boot_path = tmp / "envoy.yaml"
        boot_path.write_text(yaml.safe_dump(boot))

        self.start([sys.executable, "-m", "sim", "--listen", f"127.0.0.1:{self.upstream}",
                    "--model", "m", "--max-model-len", "32768", "--kv-capacity-tokens", "100000",
                    "--speedup", "20"], tmp / "node.log", self.upstream)
        args = list(kvgate_ctr["args"])
        args[args.index(flag(args, "--config"))] = str(kv_path)
        args[args.index(flag(args, "--grpc-listen"))] = f"127.0.0.1:{self.grpc}"
        args[args.index(flag(args, "--admin-listen"))] = f"127.0.0.1:{self.admin}"
        self.start([str(Path(sys.executable).parent / "kvgate"), *args], tmp / "kvgate.log", self.grpc)
        args = list(envoy_ctr["args"])
        args[args.index(flag(args, "--config-path"))] = str(boot_path)
        self.start([envoy_binary(), *args, "--concurrency", "1"], tmp / "envoy.log", self.listen)

    def start(self, argv: list[str], log: Path, port: int) -> None:
        proc = Proc(argv, log)
        self.procs.append(proc)
        proc.wait_port(port, timeout=60)

    def metrics(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/metrics", timeout=5).read().decode()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Pod]:
    p = Pod(tmp_path)
    yield p
    p.stop()


def requests_of_class(metrics: str, cls: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("kvgate_requests_total{") and f'class="{cls}"' in line)


def test_router_pod_finds_the_node_in_dns_picks_it_and_answers_probes_itself(pod: Pod) -> None:
    node = f"127.0.0.1_{pod.upstream}"
    wait_until(lambda: f'kvgate_backend_pickable{{backend="{node}",pool="default"}} 1.0' in pod.metrics(),
               timeout=20, what="the discovered node pickable")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{pod.listen}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="m", max_tokens=8,
                                           messages=[{"role": "user", "content": "Hello"}])
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    metrics = pod.metrics()
    assert requests_of_class(metrics, "standard") == 1
    assert f'kvgate_backend_picks_total{{backend="{node}",pool="default"}} 1.0' in metrics
    assert "kvgate_route_metadata_errors_total{" not in metrics
    # Envoy's readiness path is answered by Envoy itself, never counted by kvgate.
    ready = urllib.request.urlopen(f"http://127.0.0.1:{pod.listen}/envoy-ready", timeout=5)
    assert ready.status == 200
    assert requests_of_class(pod.metrics(), "standard") == 1
