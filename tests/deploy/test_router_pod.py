"""The router pod of deploy/k8s, run here: the ConfigMaps' Envoy bootstrap and kvgate file,
the Deployment's command lines, with loopback ports instead of the pod's. Requests from the
real openai client go through the real Envoy and kvgate to a fake vLLM."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.deploy.support import K8S, container, envoy_binary, flag, one, resources
from tests.support.procs import Proc, free_port, wait_until

pytestmark = pytest.mark.e2e


class Pod:
    """Pod runs the fake upstream, kvgate and Envoy as the Deployment describes them."""

    def __init__(self, tmp: Path) -> None:
        objs = resources(K8S)
        spec = one(objs, "Deployment")["spec"]["template"]["spec"]
        envoy_ctr, kvgate_ctr = container(spec, "envoy"), container(spec, "kvgate")
        self.procs: list[Proc] = []
        self.upstream = free_port()
        self.grpc, self.admin, self.listen, self.envoy_admin = (free_port() for _ in range(4))

        kv = yaml.safe_load(one(objs, "ConfigMap", "kvgate-config")["data"]["kvgate.yaml"])
        for pool in kv["pools"].values():
            for backend in pool.get("backends", []):
                backend["metrics_url"] = f"http://127.0.0.1:{self.upstream}/metrics"
        kv["server"].update(drain_s=0, grace_s=2)  # tests stop at once
        kv_path = tmp / "kvgate.yaml"
        kv_path.write_text(yaml.safe_dump(kv))

        boot = yaml.safe_load(one(objs, "ConfigMap", "llm-router-envoy")["data"]["envoy.yaml"])
        boot["admin"]["address"]["socket_address"]["port_value"] = self.envoy_admin
        boot["static_resources"]["listeners"][0]["address"]["socket_address"] = {
            "address": "127.0.0.1", "port_value": self.listen}
        ports = {"kvgate": self.grpc, "inference": self.upstream}
        for cluster in boot["static_resources"]["clusters"]:
            cluster["type"] = "STATIC"
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] = {
                "socket_address": {"address": "127.0.0.1", "port_value": ports[cluster["name"]]}}
        boot_path = tmp / "envoy.yaml"
        boot_path.write_text(yaml.safe_dump(boot))

        self.start([sys.executable, "-m", "tests.support.upstream", "--port", str(self.upstream)],
                   tmp / "upstream.log", self.upstream)
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


def test_router_pod_admits_through_envoy_and_applies_per_route_settings(pod: Pod) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{pod.listen}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="m", max_tokens=8,
                                           messages=[{"role": "user", "content": "Hello"}])
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert requests_of_class(pod.metrics(), "standard") == 1
    # The route matched by `x-tier: batch` sets tenant_class batch, a sheddable class. The
    # fake upstream has no /metrics, so the pool's signals are missing, which counts as
    # saturated: the same request is refused on that route and admitted on the other.
    wait_until(lambda: 'kvgate_pool_signals_stale{pool="default"} 1.0' in pod.metrics(),
               timeout=20, what="the pool's signals reported stale")
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="m", max_tokens=8, extra_headers={"x-tier": "batch"},
                                       messages=[{"role": "user", "content": "Hello"}])
    assert refused.value.response.headers["x-kvgate-reason"] == "shed"
    metrics = pod.metrics()
    assert requests_of_class(metrics, "batch") == 1
    assert requests_of_class(metrics, "standard") == 1
    assert "kvgate_route_metadata_errors_total{" not in metrics
    # Envoy's readiness path is answered by Envoy itself, never counted by kvgate.
    ready = urllib.request.urlopen(f"http://127.0.0.1:{pod.listen}/envoy-ready", timeout=5)
    assert ready.status == 200
    assert requests_of_class(pod.metrics(), "standard") + requests_of_class(pod.metrics(), "batch") == 2
