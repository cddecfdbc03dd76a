"""The Envoy side of ``picking.fallbacks``: `kvgate envoy-filter` writes the listed ``nodes``
cluster that honours kvgate's list (STATIC, override_host, a fallback policy that selects
nothing, the route's retry), the real Envoy accepts it, and `check-config --envoy` refuses a
fallback count beside the shipped ORIGINAL_DST files (every list would be a 503)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from extproc.configparse import parse_config
from extproc.envoycheck import check_envoy
from extproc.envoyconf import envoy_bootstrap, envoy_filter
from extproc.errors import ConfigError
from extproc.picker_protocol import LB_NAMESPACE
from tests.deploy.support import ROOT, docs, envoy_validate

PICKER_MODES = ("endpoint-picker", "endpoint-picker-log", "inference-pool")
A, B, C = "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"


def kvgate_config(fallbacks: int, addresses: tuple[str, ...] = (A, B, C)) -> dict[str, Any]:
    return {"pools": {"default": {
        "backends": [{"name": f"n{i}", "metrics_url": f"http://{a}/metrics", "address": a}
                     for i, a in enumerate(addresses)],
        "picking": {"fallbacks": fallbacks}}}}


def nodes_cluster(piece: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in piece["clusters"] if c["name"] == "nodes")


def listed(cluster: dict[str, Any]) -> list[str]:
    return [f"{e['endpoint']['address']['socket_address']['address']}:"
            f"{e['endpoint']['address']['socket_address']['port_value']}"
            for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]


def main_route(piece: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in piece["virtual_host"]["routes"] if r["match"] == {"prefix": "/"})


@pytest.mark.parametrize("mode", PICKER_MODES)
def test_fallbacks_get_the_listed_cluster_and_a_retry_per_fallback(mode: str, tmp_path: Path) -> None:
    config = parse_config(kvgate_config(2))
    piece = envoy_filter(config, mode)
    cluster = nodes_cluster(piece)
    assert cluster["type"] == "STATIC" and listed(cluster) == [A, B, C]
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    fallback = policy["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]
    assert fallback["typed_config"]["fallback_policy"] == "NO_FALLBACK"  # never a node not named
    retry = main_route(piece)["route"]["retry_policy"]
    assert retry["num_retries"] == 2 and "connect-failure" in retry["retry_on"]
    # Every route a request may take retries the same way (those that send headers for bodiless requests).
    for route in piece["virtual_host"]["routes"]:
        if "route" in route:
            assert route["route"]["retry_policy"] == retry
    # The endpoint that served reaches kvgate with the response headers where it sees them.
    ext = next(f for f in piece["http_connection_manager"]["http_filters"]
               if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    forwarded = ext["metadata_options"]["forwarding_namespaces"]["untyped"]
    assert (LB_NAMESPACE in forwarded) == (mode != "endpoint-picker-log")  # -log: the access log's host
    checked = envoy_validate(envoy_bootstrap(config, mode), tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert check_envoy(config, envoy_bootstrap(config, mode)) == []


@pytest.mark.parametrize("mode", PICKER_MODES)
def test_without_fallbacks_the_cluster_stays_original_dst_without_a_retry(mode: str) -> None:
    piece = envoy_filter(parse_config(kvgate_config(0)), mode)
    assert nodes_cluster(piece)["type"] == "ORIGINAL_DST"
    assert "retry_policy" not in main_route(piece)["route"]


@pytest.mark.parametrize("mode", PICKER_MODES)
def test_check_config_refuses_fallbacks_beside_a_shipped_original_dst_file(mode: str) -> None:
    shipped = docs(ROOT / "deploy" / f"envoy-{mode}.yaml")[0]
    found = check_envoy(parse_config(kvgate_config(1)), shipped)
    assert [d.key for d in found] == ["pools.default.picking.fallbacks"]
    assert "ORIGINAL_DST" in found[0].reason and "503" in found[0].reason
    assert check_envoy(parse_config(kvgate_config(0)), shipped) == []


def test_check_config_names_a_node_the_listed_cluster_lacks_and_too_few_retries() -> None:
    config = parse_config(kvgate_config(2))
    doc = envoy_bootstrap(config, "endpoint-picker")
    short = copy.deepcopy(doc)
    nodes_cluster(short["static_resources"])["load_assignment"]["endpoints"][0]["lb_endpoints"].pop()
    found = check_envoy(config, short)
    assert [(d.key, C in d.reason) for d in found] == [("pools.default.backends", True)]
    fewer = copy.deepcopy(doc)
    hcm = fewer["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        if "route" in route:
            route["route"]["retry_policy"]["num_retries"] = 1
    found = check_envoy(config, fewer)
    assert [d.key for d in found] == ["pools.default.picking.fallbacks"] and "retries 1" in found[0].reason


def test_a_picking_pool_discovered_in_dns_beside_fallbacks_is_never_written() -> None:
    data = kvgate_config(1)
    data["pools"]["other"] = {"discovery": {"dns": "vllm", "port": 8000}, "picking": {}}
    with pytest.raises(ConfigError, match="'other' discovers its nodes in DNS"):
        envoy_filter(parse_config(data), "endpoint-picker")
