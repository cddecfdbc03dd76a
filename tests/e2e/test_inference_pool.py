"""kvgate as an InferencePool's endpoint picker through the real Envoy, configured the way
InferencePool gateways configure the picker (deploy/envoy-inference-pool.yaml: both bodies
FULL_DUPLEX_STREAMED, trailers sent), three simulated nodes. A set_metadata filter before
kvgate sets the protocol's subset hint per route (as a gateway would); one route also
overrides kvgate's choice after it (as a gateway's fallback would), so the node that serves
is not the node picked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc import picker_protocol as epp
from extproc.envoyconf import SET_METADATA_TYPE
from kvgate_testkit.nodes_stack import MODEL, NodesStack, header_set, mutation_filters
from kvgate_testkit.procs import ROOT, wait_until

pytestmark = pytest.mark.e2e

POOL_ENVOY = ROOT / "deploy" / "envoy-inference-pool.yaml"
ROUTE_HEADER = "x-test-route"
OVERRIDE_FILTER = "test.fallback"
VERIFIED_FILTER = "test.verified"
OBJECTIVE = "x-llm-d-inference-objective"


class PoolStack(NodesStack):
    """PoolStack is the nodes stack under deploy/envoy-inference-pool.yaml, with test routes:
    ``two`` hints nodes 0 and 1, ``nowhere`` hints an address of no node, ``empty`` an empty
    hint, ``fallback`` hints node 0 but sends the request to node 2 after kvgate, and
    ``verified`` sets the objective header after the client's copy was stripped (as an
    authentication filter would)."""

    def envoy_config(self) -> dict[str, Any]:
        cfg = super().envoy_config()
        hcm = mutation_filters(cfg, after=[OVERRIDE_FILTER], before=[VERIFIED_FILTER])
        vhost = hcm["route_config"]["virtual_hosts"][0]
        default = vhost["routes"][-1]
        hinted = {"two": [self.address(0), self.address(1)], "nowhere": ["127.0.0.1:1"],
                  "empty": [], "fallback": [self.address(0)], "verified": [self.address(1)]}
        routes = []
        for name, hint in hinted.items():
            route = {**default, "name": name,
                     "match": {"prefix": "/", "headers": [{"name": ROUTE_HEADER,
                                                           "string_match": {"exact": name}}]}}
            metadata = [*default["typed_per_filter_config"]["envoy.filters.http.set_metadata"]["metadata"],
                        {"metadata_namespace": epp.SUBSET_NAMESPACE, "value": {epp.SUBSET_KEY: hint}}]
            per = {"envoy.filters.http.set_metadata": {"@type": SET_METADATA_TYPE, "metadata": metadata}}
            if name == "fallback":
                per[OVERRIDE_FILTER] = header_set(epp.DESTINATION_KEY, self.address(2))
            if name == "verified":
                per[VERIFIED_FILTER] = header_set(OBJECTIVE, "batch")
            route["typed_per_filter_config"] = per
            routes.append(route)
        vhost["routes"][-1:-1] = routes
        return cfg


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolStack]:
    s = PoolStack(tmp_path_factory.mktemp("inference-pool"), nodes=3, kv_capacity_tokens=100_000,
                  envoy_template=POOL_ENVOY, sim_args=["--speedup", "4"],
                  pool={"picking": {"growth": "worst_case", "reserve_fraction": 0.02}},
                  config={"tenants": {"classes": {"standard": {"max_wait_s": 30.0}, "batch": {}}}}).start()
    wait_until(lambda: sum(s.per_node("kvgate_backend_pickable").values()) == 3, timeout=10,
               what="three nodes up")
    yield s
    s.stop()


def client(stack: NodesStack, route: str | None = None) -> Any:
    from openai import OpenAI
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=30,
                  default_headers={ROUTE_HEADER: route} if route else None)


def idle(stack: NodesStack) -> None:
    wait_until(lambda: stack.metric("kvgate_inflight_requests") == 0, timeout=10, what="nothing in flight")
    wait_until(lambda: sum(stack.per_node("kvgate_backend_kv_inflight_tokens").values()) == 0,
               timeout=5, what="no KV held on any node")


def test_requests_flow_through_both_streamed_bodies_and_land_only_on_hinted_nodes(stack):
    picks0 = stack.per_node("kvgate_backend_picks_total")
    c = client(stack, "two")
    for i in range(2):
        reply = c.chat.completions.create(model=MODEL, max_tokens=20,
                                          messages=[{"role": "user", "content": f"hello {i}"}])
        assert reply.usage.completion_tokens == 20
    # A body of ~72 KB: more than one chunk each way between Envoy and kvgate.
    long = c.chat.completions.create(model=MODEL, max_tokens=5,
                                     messages=[{"role": "user", "content": "hello " * 12_000}])
    assert long.usage.prompt_tokens > 12_000
    stream = c.chat.completions.create(model=MODEL, max_tokens=30, stream=True,
                                       messages=[{"role": "user", "content": "stream it"}])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text
    picks = stack.per_node("kvgate_backend_picks_total")
    assert picks["node-2"] == picks0["node-2"]
    assert picks["node-0"] + picks["node-1"] == picks0["node-0"] + picks0["node-1"] + 4
    idle(stack)


@pytest.mark.parametrize("route", ["nowhere", "empty"])
def test_a_hint_that_allows_no_node_is_the_protocols_503(stack, route):
    import openai
    with pytest.raises(openai.InternalServerError) as err:
        client(stack, route).chat.completions.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 503
    assert err.value.body["code"] == "no_eligible_endpoint"
    # The hint names no node of the pool: a retry would be refused alike, and the client is
    # told so (a hinted node that is only down gets x-should-retry: true and retry-after).
    headers = err.value.response.headers
    assert headers["x-should-retry"] == "false" and "retry-after" not in headers
    assert stack.metric("kvgate_requests_total", outcome="rejected_no_endpoint") >= 1
    idle(stack)


def test_the_node_that_served_is_the_one_charged(stack):
    picks0 = stack.per_node("kvgate_backend_picks_total")
    stream = client(stack, "fallback").chat.completions.create(
        model=MODEL, max_tokens=300, stream=True, messages=[{"role": "user", "content": "go"}])
    chunks = iter(stream)
    next(chunks)
    # Mid-stream: kvgate picked node-0 (the only hinted node), Envoy sent it to node-2, and
    # the request's KV is held on node-2's ledger, not node-0's.
    wait_until(lambda: stack.per_node("kvgate_backend_kv_inflight_tokens")["node-2"] > 0,
               timeout=5, what="node-2 charged")
    inflight = stack.per_node("kvgate_backend_kv_inflight_tokens")
    assert inflight["node-0"] == 0 and inflight["node-1"] == 0
    assert stack.node_state(2)["running"] == 1
    picks = stack.per_node("kvgate_backend_picks_total")
    assert picks["node-0"] == picks0["node-0"] + 1
    assert sum(1 for _ in chunks) > 0
    idle(stack)
    assert stack.metric("kvgate_served_unknown_endpoint_total") == 0


def test_the_objective_header_counts_only_as_envoy_sets_it(stack):
    def batch() -> float:
        return stack.metric("kvgate_requests_total", outcome="admitted", **{"class": "batch"})

    before = batch()
    ask = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    # A client's own copy is removed by the first filter: the request stays in its class.
    client(stack, "two").chat.completions.create(**ask, extra_headers={OBJECTIVE: "batch"})
    assert batch() == before
    # Set by a filter after the stripping one (a verified source): honoured.
    client(stack, "verified").chat.completions.create(**ask)
    assert batch() == before + 1
    idle(stack)


def test_a_burst_waits_for_room_on_the_hinted_nodes_and_a_client_gone_mid_stream_frees_its_node(stack):
    from concurrent.futures import ThreadPoolExecutor

    prompt = "hello" + " hello" * 28_990  # 29k tokens: three fit on a node of 100k
    picks0 = stack.per_node("kvgate_backend_picks_total")

    def chat(_: int) -> int:
        return client(stack, "two").chat.completions.create(
            model=MODEL, max_tokens=50, messages=[{"role": "user", "content": prompt}]).usage.completion_tokens

    # Eight on two hinted nodes that hold six: two wait in the class's queue (the message
    # timeout kvgate asks for holds in this mode too), none goes to node-2, none preempts.
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(chat, range(8))) == [50] * 8
    picks = stack.per_node("kvgate_backend_picks_total")
    assert picks["node-2"] == picks0["node-2"]
    assert all(stack.node_state(i)["preemptions"] == 0 for i in range(3))
    assert stack.metric("kvgate_backend_passed_over_total", reason="no_room") > 0  # some waited
    released = stack.metric("kvgate_releases_total", cause="client_disconnect")
    stream = client(stack, "two").chat.completions.create(
        model=MODEL, max_tokens=2_000, stream=True, messages=[{"role": "user", "content": "long"}])
    next(iter(stream))
    stream.close()
    wait_until(lambda: stack.metric("kvgate_releases_total", cause="client_disconnect") == released + 1,
               timeout=5, what="the lease released on disconnect")
    idle(stack)
