"""What Envoy 1.40 does with a fallback endpoint list (``x-gateway-destination-endpoint:
ip:port,ip:port``), the facts docs/endpoint-picker-protocol.md ("Fallback endpoints") rests on.

No kvgate here: the client sets the header kvgate would set, in front of the real Envoy and
real upstream processes (node A answers, node B's port refuses connections, node C answers but
is in no cluster). Two clusters side by side:

- ``original``: the shipped picker files' ORIGINAL_DST cluster (``use_http_header``). A list
  is refused with 503 even when its first entry is up: it cannot carry fallbacks.
- ``listed``: a STATIC cluster listing the nodes, with the
  ``envoy.load_balancing_policies.override_host`` policy and a route that retries a connection
  failure. The first entry is tried, then the next on each retry; the endpoint that served is
  written to ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` (``selected_host_key``),
  where a picker reads it at the response. Its required ``fallback_policy``, made a subset
  policy that matches no host, keeps Envoy from sending a request to a node kvgate did not
  name: an exhausted list or an unlisted node is a 503.
"""

from __future__ import annotations

import http.client
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate_testkit.procs import LOOPBACK, VENV_BIN, Proc, free_port

pytestmark = pytest.mark.e2e

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
ROUTER = {"name": "envoy.filters.http.router", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
ROUND_ROBIN = {"policies": [{"typed_extension_config": {
    "name": "envoy.load_balancing_policies.round_robin",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"}}}]}


def endpoint(port: int) -> dict[str, Any]:
    return {"endpoint": {"address": {"socket_address": {"address": LOOPBACK, "port_value": port}}}}


def listed_cluster(ports: list[int]) -> dict[str, Any]:
    """listed_cluster is every node in Envoy's cluster, the picker's list honoured in order."""
    return {
        "name": "listed", "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "listed", "endpoints": [{"lb_endpoints": [endpoint(p) for p in ports]}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"header": DESTINATION},
                                          {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}}],
                "selected_host_key": {"key": "envoy.lb", "path": [{"key": SERVED}]},
                # Required; a subset that no host is in: never a node the list did not name.
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.subset",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.subset.v3.Subset",
                        "fallback_policy": "NO_FALLBACK",
                        "subset_selectors": [{"keys": ["no-host-has-this"]}],
                        "subset_lb_policy": ROUND_ROBIN}}}]}}}}]},
    }


def route(cluster: str, retries: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "match": {"prefix": "/", "headers": [{"name": "x-test-cluster", "string_match": {"exact": cluster}}]},
        "route": {"cluster": cluster, "timeout": "0s", **({"retry_policy": retries} if retries else {})},
        # What the router connected to, and what the load balancer reported, back to the client.
        "response_headers_to_add": [
            {"header": {"key": "x-upstream", "value": "%UPSTREAM_REMOTE_ADDRESS%"}},
            {"header": {"key": "x-served", "value": f"%DYNAMIC_METADATA(envoy.lb:{SERVED})%"}}]}
    return out


def envoy_config(listen: int, listed: list[int]) -> dict[str, Any]:
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager",
           "stat_prefix": "t", "http_filters": [ROUTER],
           "route_config": {"virtual_hosts": [{"name": "t", "domains": ["*"], "routes": [
               route("original"),
               route("listed", {"retry_on": "connect-failure,refused-stream,reset-before-request",
                                "num_retries": 2})]}]}}
    original = {"name": "original", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "1s",
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}}
    return {"static_resources": {
        "listeners": [{"name": "t", "address": {"socket_address": {"address": LOOPBACK, "port_value": listen}},
                       "filter_chains": [{"filters": [{"name": "hcm", "typed_config": hcm}]}]}],
        "clusters": [original, listed_cluster(listed)]}}


class Nodes:
    """Nodes is the Envoy and the nodes: ``a`` and ``c`` answer, ``b`` refuses connections."""

    def __init__(self, work: Path) -> None:
        self.a, self.b, self.c, self.listen = free_port(), free_port(), free_port(), free_port()
        self.procs: list[Proc] = []
        for port in (self.a, self.c):
            proc = Proc([sys.executable, "-m", "kvgate_testkit.upstream", "--port", str(port)],
                        work / f"node-{port}.log")
            self.procs.append(proc)
            proc.wait_port(port)
        path = work / "envoy.yaml"
        path.write_text(yaml.safe_dump(envoy_config(self.listen, [self.a, self.b])))
        envoy = Proc([str(VENV_BIN / "envoy"), "-c", str(path), "--log-level", "warn", "--disable-hot-restart",
                      "--concurrency", "1"], work / "envoy.log")
        self.procs.append(envoy)
        envoy.wait_port(self.listen)

    def get(self, cluster: str, *ports: int) -> tuple[int, str, str]:
        """get asks /v1/models through ``cluster`` with the list of ``ports``; returns the status
        and the x-upstream and x-served headers."""
        conn = http.client.HTTPConnection(LOOPBACK, self.listen, timeout=10)
        try:
            conn.request("GET", "/v1/models", headers={
                "x-test-cluster": cluster, DESTINATION: ",".join(f"{LOOPBACK}:{p}" for p in ports)})
            resp = conn.getresponse()
            resp.read()
            return resp.status, resp.getheader("x-upstream", ""), resp.getheader("x-served", "")
        finally:
            conn.close()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    n = Nodes(tmp_path_factory.mktemp("fallback"))
    yield n
    n.stop()


def test_the_original_dst_cluster_refuses_a_list_even_when_its_first_entry_is_up(nodes: Nodes) -> None:
    assert nodes.get("original", nodes.a)[0] == 200
    assert nodes.get("original", nodes.a, nodes.c)[0] == 503
    assert nodes.get("original", nodes.b, nodes.a)[0] == 503


def test_a_listed_cluster_tries_the_next_entry_when_the_first_refuses_and_reports_it(nodes: Nodes) -> None:
    a = f"{LOOPBACK}:{nodes.a}"
    assert nodes.get("listed", nodes.a) == (200, a, a)
    assert nodes.get("listed", nodes.b, nodes.a) == (200, a, a)  # B refused: A served, and says so


def test_a_listed_cluster_never_sends_a_request_where_the_list_did_not_say(nodes: Nodes) -> None:
    assert nodes.get("listed", nodes.b)[0] == 503  # the list exhausted: not A, which is up
    assert nodes.get("listed", nodes.c)[0] == 503  # C answers, but is not in the cluster
    assert nodes.get("listed")[0] == 503  # no list at all
