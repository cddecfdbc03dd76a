"""Tests of deploy/k8s/istio: the EnvoyFilter's structure, its Envoy configuration validated
by the real Envoy, and the gateway patch's agreement with the base deployment."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from extproc.configparse import load_config
from tests.deploy.support import (ISTIO, K8S, ROOT, container, docs, envoy_validate, http_filters, one,
                                  resources)

HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"


def envoyfilter() -> dict[str, Any]:
    return one(resources(ISTIO), "EnvoyFilter", "kvgate-ext-proc")


def patches(kind: str) -> list[dict[str, Any]]:
    return [p for p in envoyfilter()["spec"]["configPatches"] if p["applyTo"] == kind]


def test_envoyfilter_structure() -> None:
    ef = envoyfilter()
    assert ef["apiVersion"] == "networking.istio.io/v1alpha3"
    assert ef["metadata"]["namespace"] == "istio-system"
    assert ef["spec"]["workloadSelector"] == {"labels": {"istio": "ingressgateway"}}
    assert {p["applyTo"] for p in ef["spec"]["configPatches"]} == {"CLUSTER", "HTTP_FILTER", "HTTP_ROUTE",
                                                                    "NETWORK_FILTER", "VIRTUAL_HOST"}
    for p in ef["spec"]["configPatches"]:
        assert p["match"]["context"] == "GATEWAY"
    filters = patches("HTTP_FILTER")
    assert [f["patch"]["value"]["name"] for f in filters] == [
        "envoy.filters.http.set_metadata", "envoy.filters.http.ext_proc",
        "envoy.filters.http.buffer", "envoy.filters.http.header_mutation"]
    for f in filters[:3]:
        assert f["patch"]["operation"] == "INSERT_BEFORE"
        assert f["match"]["listener"]["filterChain"]["filter"] == {"name": HCM, "subFilter": {"name": ROUTER}}
    # The stripping runs before every other filter, Istio's jwt_authn included.
    assert filters[3]["patch"]["operation"] == "INSERT_FIRST"
    assert filters[3]["match"]["listener"]["filterChain"]["filter"] == {"name": HCM}
    reference = yaml.safe_load((ROOT / "deploy" / "envoy.yaml").read_text())
    for name in ("envoy.filters.http.header_mutation", "envoy.filters.http.buffer"):
        ref = next(f for f in http_filters(reference) if f["name"] == name)
        assert next(f["patch"]["value"] for f in filters if f["patch"]["value"]["name"] == name) == ref
    (cluster,) = patches("CLUSTER")
    assert cluster["patch"]["operation"] == "ADD"
    value = cluster["patch"]["value"]
    options = value["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]
    ext_proc = filters[1]["patch"]["value"]["typed_config"]
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == value["name"]
    (route,) = patches("HTTP_ROUTE")
    assert route["patch"]["operation"] == "MERGE"
    # The upstream is asked for an uncompressed body, as by deploy/envoy.yaml's virtual host
    # (tests/e2e/test_hardening.py shows the header gone upstream there).
    (vhost,) = patches("VIRTUAL_HOST")
    assert vhost["patch"]["operation"] == "MERGE" and "routeConfiguration" not in vhost["match"]
    ref_vhost = reference["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]
    assert vhost["patch"]["value"] == {"request_headers_to_remove": ref_vhost["request_headers_to_remove"]}
    # The access log that tells kvgate a dead upstream from a client that left, to kvgate.
    (hcm,) = patches("NETWORK_FILTER")
    assert hcm["patch"]["operation"] == "MERGE"
    (log,) = hcm["patch"]["value"]["typed_config"]["access_log"]
    assert log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == value["name"]


def test_ext_proc_settings_are_those_of_deploy_envoy_yaml() -> None:
    reference = yaml.safe_load((ROOT / "deploy" / "envoy.yaml").read_text())
    ref = next(f for f in http_filters(reference) if f["name"] == "envoy.filters.http.ext_proc")
    ours = patches("HTTP_FILTER")[1]["patch"]["value"]
    assert ours == ref


def gateway_bootstrap(filter_patches: list[dict[str, Any]], cluster: dict[str, Any],
                      route_config: dict[str, Any]) -> dict[str, Any]:
    """gateway_bootstrap places the EnvoyFilter's pieces in a minimal gateway-like bootstrap
    (the connection manager's MERGE patch merged in)."""
    filters = [p["patch"]["value"] for p in filter_patches if p["patch"]["operation"] == "INSERT_FIRST"]
    filters += [p["patch"]["value"] for p in filter_patches if p["patch"]["operation"] != "INSERT_FIRST"]
    filters.append({"name": ROUTER, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    route = {"name": "llm-batch", "match": {"prefix": "/"},
             "route": {"cluster": "inference", "timeout": "0s"}}
    route.update(route_config)
    upstream = {"name": "inference", "type": "STATIC", "connect_timeout": "1s",
                "load_assignment": {"cluster_name": "inference", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                 "port_value": 8000}}}}]}]}}
    return {"static_resources": {
        "listeners": [{"name": "gateway",
                       "address": {"socket_address": {"address": "127.0.0.1", "port_value": 8080}},
                       "filter_chains": [{"filters": [{"name": HCM, "typed_config": {
                           "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                    "http_connection_manager.v3.HttpConnectionManager",
                           "stat_prefix": "gateway",
                           "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                                                               "routes": [route],
                                                               **{k: v for p in patches("VIRTUAL_HOST")
                                                                  for k, v in p["patch"]["value"].items()}}]},
                           "http_filters": filters,
                           **{k: v for p in patches("NETWORK_FILTER")
                              for k, v in p["patch"]["value"]["typed_config"].items() if k != "@type"},
                           }}]}]}],
        "clusters": [cluster, upstream]}}


def test_envoyfilter_configuration_validates_with_the_real_envoy(tmp_path: Path) -> None:
    (cluster,) = patches("CLUSTER")
    (route,) = patches("HTTP_ROUTE")
    boot = gateway_bootstrap(patches("HTTP_FILTER"), cluster["patch"]["value"], route["patch"]["value"])
    result = envoy_validate(boot, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # The check can fail: a misspelled field in the route patch is refused.
    bad_route = copy.deepcopy(route["patch"]["value"])
    bad_route["typed_per_filter_config"]["envoy.filters.http.set_metadata"]["metdata"] = []
    bad = gateway_bootstrap(patches("HTTP_FILTER"), cluster["patch"]["value"], bad_route)
    assert envoy_validate(bad, tmp_path, "bad.yaml").returncode != 0


def test_route_settings_name_real_keys_and_classes(tmp_path: Path) -> None:
    from extproc.gate import ROUTE_KEYS

    cm = one(resources(ISTIO), "ConfigMap", "kvgate-config")
    (tmp_path / "k.yaml").write_text(cm["data"]["kvgate.yaml"])
    config = load_config(tmp_path / "k.yaml")
    (route,) = patches("HTTP_ROUTE")
    for entry in route["patch"]["value"]["typed_per_filter_config"]["envoy.filters.http.set_metadata"]["metadata"]:
        assert entry["metadata_namespace"] == "kvgate"
        assert set(entry["value"]) <= set(ROUTE_KEYS)
        assert entry["value"].get("pool", config.default_pool) in config.pools
        assert entry["value"].get("tenant_class", config.tenants.default_class) in config.tenants.classes


def test_gateway_patch_runs_the_same_kvgate_with_its_config() -> None:
    base = one(resources(K8S), "Deployment")["spec"]["template"]["spec"]
    patch = docs(ISTIO / "ingressgateway-patch.yaml")[0]["spec"]["template"]
    spec = patch["spec"]
    assert [c["name"] for c in spec["containers"]] == ["kvgate"]
    kvgate = container(spec, "kvgate")
    assert kvgate == container(base, "kvgate")
    volumes = {v["name"]: v for v in spec["volumes"]}
    configmaps = {o["metadata"]["name"] for o in resources(ISTIO) if o["kind"] == "ConfigMap"}
    for mount in kvgate["volumeMounts"]:
        vol = volumes[mount["name"]]
        if "configMap" in vol:
            assert vol["configMap"]["name"] in configmaps
    for obj in resources(ISTIO):
        assert obj["metadata"]["namespace"] == "istio-system"
    # The gateway's grace outlasts kvgate's preStop, drain and grace periods.
    cm = one(resources(ISTIO), "ConfigMap", "kvgate-config")
    server = yaml.safe_load(cm["data"]["kvgate.yaml"])["server"]
    kv_sleep = int(kvgate["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] > kv_sleep + server["drain_s"] + server["grace_s"]
    # The cluster in the EnvoyFilter reaches the port kvgate listens on.
    (cluster,) = patches("CLUSTER")
    sock = cluster["patch"]["value"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"]
    grpc_listen = kvgate["args"][kvgate["args"].index("--grpc-listen") + 1]
    assert f"{sock['address']}:{sock['port_value']}" == grpc_listen == server["grpc_listen"]
