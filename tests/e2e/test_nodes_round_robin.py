"""The benchmarks' control without kvgate (``NodesStack(kvgate=False)``): deploy/envoy.yaml
without its ext_proc filter, the access log sent to kvgate or the kvgate cluster, Envoy's round
robin over two simulated nodes, and no kvgate process."""

from __future__ import annotations

from pathlib import Path

import pytest

from prometheus_client.parser import text_string_to_metric_families

from kvgate_testkit.nodes_stack import MODEL, NodesStack
from kvgate_testkit.procs import port_open

pytestmark = pytest.mark.e2e


def served(stack: NodesStack, i: int) -> float:
    import urllib.request
    with urllib.request.urlopen(f"{stack.node_url(i)}/metrics", timeout=5) as resp:
        return sum(s.value for family in text_string_to_metric_families(resp.read().decode())
                   for s in family.samples if s.name == "vllm:request_success_total")


def test_plain_envoy_spreads_requests_over_the_nodes_round_robin(tmp_path: Path) -> None:
    from openai import OpenAI

    stack = NodesStack(tmp_path, nodes=2, kvgate=False, sim_args=["--speedup", "50"])
    cfg = stack.envoy_config()
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"] if "ext_proc" in f["name"]] == []
    assert "access_log" not in hcm and "kvgate" not in str(cfg["static_resources"]["clusters"])
    stack.start()
    try:
        assert "kvgate" not in stack.procs and not port_open(stack.grpc_port)
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=30)
        for _ in range(6):
            reply = client.completions.create(model=MODEL, prompt="hello there", max_tokens=4)
            assert reply.usage is not None and reply.usage.completion_tokens == 4
        assert [served(stack, 0), served(stack, 1)] == [3, 3]
    finally:
        stack.stop()
