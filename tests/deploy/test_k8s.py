"""Tests of deploy/k8s: manifests parse into the Kubernetes typed models, validate with the
real Envoy and kvgate's config loader, and agree with each other on names, ports and timing."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kubernetes.client import ApiClient

from extproc.configparse import load_config
from kvgate_testkit.procs import free_port
from tests.deploy.support import (ISTIO, K8S, NOT_RESOURCES, ROOT, container, docs, envoy_bootstrap,
                                  envoy_validate, envoy_version, flag, http_filters,
                                  kustomize_resources, one, resources, walk)

KVGATE_IMAGE_REPO = "ghcr.io/kvgate/kvgate"


# --- typed models --------------------------------------------------------------------

def unknown_fields(src: Any, out: Any, path: str = "") -> list[str]:
    """unknown_fields lists what a typed round trip lost or changed in ``src``.

    The Kubernetes client drops fields it does not know without a word, so a misspelled
    key shows up only as a key missing from the re-serialized object.
    """
    if isinstance(src, dict):
        if not isinstance(out, dict):
            return [f"{path or '<root>'}: became {type(out).__name__}"]
        problems = []
        for key, value in src.items():
            if key not in out:
                problems.append(f"{path}.{key}: unknown field")
            else:
                problems += unknown_fields(value, out[key], f"{path}.{key}")
        return problems
    if isinstance(src, list):
        if not isinstance(out, list) or len(out) != len(src):
            return [f"{path}: list changed"]
        return [p for i, (a, b) in enumerate(zip(src, out)) for p in unknown_fields(a, b, f"{path}[{i}]")]
    return [] if src == out else [f"{path}: {src!r} became {out!r}"]


def typed_problems(obj: dict[str, Any], klass: str) -> list[str]:
    """typed_problems deserializes ``obj`` into the client's ``klass`` and reports losses."""
    with ApiClient() as api:
        model = api._ApiClient__deserialize(copy.deepcopy(obj), klass)
        back = api.sanitize_for_serialization(model)
    return unknown_fields(obj, back)


def model_name(obj: dict[str, Any]) -> str:
    version = obj["apiVersion"].split("/")[-1]
    return f"{version.capitalize()}{obj['kind']}"


def all_manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml"))


def test_every_manifest_parses() -> None:
    files = all_manifest_files()
    assert {p.name for p in files} >= {"kustomization.yaml", "deployment.yaml", "service.yaml",
                                       "kvgate-config.yaml", "envoy-config.yaml",
                                       "envoyfilter.yaml", "ingressgateway-patch.yaml"}
    for path in files:
        assert docs(path), f"{path} holds no YAML document"


@pytest.mark.parametrize("directory", [K8S, ISTIO], ids=["base", "istio"])
def test_kustomization_names_every_manifest_of_its_directory(directory: Path) -> None:
    listed = kustomize_resources(directory)
    for path in listed:
        assert path.is_file(), f"{path} is listed but missing"
    present = {p for p in directory.glob("*.yaml") if p.name != "kustomization.yaml"} - NOT_RESOURCES
    assert set(listed) == present


def test_core_objects_deserialize_into_typed_models_without_unknown_fields() -> None:
    objs = resources(K8S) + [o for o in resources(ISTIO) if o["apiVersion"] == "v1"]
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ConfigMap", "ConfigMap", "ConfigMap", "Deployment", "Service", "Service"]
    for obj in objs:
        assert typed_problems(obj, model_name(obj)) == [], obj["metadata"]["name"]


def test_unknown_field_check_catches_a_misspelled_field() -> None:
    dep = copy.deepcopy(one(resources(K8S), "Deployment"))
    dep["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 60
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/"
    problems = typed_problems(dep, "V1Deployment")
    assert any("terminationGracePeriodSecond: unknown field" in p for p in problems)
    assert any("httpGet.paht: unknown field" in p for p in problems)


def test_istio_gateway_patch_is_a_valid_pod_template() -> None:
    patch = docs(ISTIO / "ingressgateway-patch.yaml")[0]
    assert set(patch) == {"spec"} and set(patch["spec"]) == {"template"}
    assert typed_problems(patch["spec"]["template"], "V1PodTemplateSpec") == []


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")
@pytest.mark.parametrize("directory", [K8S, ISTIO], ids=["base", "istio"])
def test_kubectl_kustomize_builds_the_same_objects(directory: Path) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(built, key=key) == sorted(resources(directory), key=key)


# --- kvgate and Envoy configurations inside the ConfigMaps ----------------------------

@pytest.mark.parametrize("directory", [K8S, ISTIO], ids=["base", "istio"])
def test_kvgate_configmap_passes_load_config(directory: Path, tmp_path: Path) -> None:
    cm = one(resources(directory), "ConfigMap", "kvgate-config")
    path = tmp_path / "kvgate.yaml"
    path.write_text(cm["data"]["kvgate.yaml"])
    config = load_config(path)
    assert config.server.grpc_listen == "127.0.0.1:50051"


def test_envoy_bootstrap_validates_with_the_real_envoy(tmp_path: Path) -> None:
    result = envoy_validate(envoy_bootstrap(), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_validation_catches_a_bad_bootstrap(tmp_path: Path) -> None:
    bad = envoy_bootstrap()
    ext_proc = next(f for f in http_filters(bad) if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc["typed_config"]["processing_mode"]["request_body_mode"] = "BUFFERD"
    assert envoy_validate(bad, tmp_path).returncode != 0


def cluster_problems(bootstrap: dict[str, Any]) -> list[str]:
    """cluster_problems lists cluster names used by routes and filters that no cluster has.

    ``envoy --mode validate`` accepts a route to a misspelled cluster, so check it here.
    """
    clusters = bootstrap["static_resources"]["clusters"]
    defined = {c["name"] for c in clusters}
    # An ORIGINAL_DST cluster has no endpoints of its own: it goes where the request says.
    problems = [f"cluster {c['name']}: load_assignment names {c['load_assignment']['cluster_name']}"
                for c in clusters if c.get("type") != "ORIGINAL_DST"
                and c["load_assignment"]["cluster_name"] != c["name"]]
    for key, value, parent in walk(bootstrap["static_resources"]["listeners"]):
        if key == "cluster" and isinstance(value, str) and value not in defined:
            problems.append(f"route to unknown cluster {value!r}")
        if key == "envoy_grpc" and value["cluster_name"] not in defined:
            problems.append(f"gRPC service on unknown cluster {value['cluster_name']!r}")
    return problems


def test_envoy_bootstrap_names_only_defined_clusters() -> None:
    bootstrap = envoy_bootstrap()
    assert cluster_problems(bootstrap) == []
    routes = [v for k, v, _ in walk(bootstrap) if k == "cluster" and isinstance(v, str)]
    assert routes, "no route found"
    broken = copy.deepcopy(bootstrap)
    for key, value, parent in walk(broken["static_resources"]["listeners"]):
        if key == "envoy_grpc":
            value["cluster_name"] = "kvgat"
    # the ext_proc filter's and the access log's
    assert cluster_problems(broken) == ["gRPC service on unknown cluster 'kvgat'"] * 2


def test_ext_proc_settings_are_those_of_the_endpoint_picker_file() -> None:
    reference = yaml.safe_load((ROOT / "deploy" / "envoy-endpoint-picker.yaml").read_text())
    ref_filter = next(f for f in http_filters(reference) if f["name"] == "envoy.filters.http.ext_proc")
    ours = next(f for f in http_filters(envoy_bootstrap()) if f["name"] == "envoy.filters.http.ext_proc")
    assert ours == ref_filter


def test_http_filter_order() -> None:
    names = [f["name"] for f in http_filters(envoy_bootstrap())]
    # Client-sent identity and destination headers stripped first; probes answered before
    # kvgate; set_metadata before ext_proc; the buffer before the router, as in every shipped
    # file (kvgate sees the request headers, so Envoy holds the request anyway: no round trip).
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.health_check",
                     "envoy.filters.http.set_metadata", "envoy.filters.http.ext_proc",
                     "envoy.filters.http.buffer", "envoy.filters.http.router"]


def test_the_bootstrap_is_the_endpoint_picker_file_with_the_probe_filter() -> None:
    """Every hardening block of the picker file (limits, timeouts, stripping, the 503 body)
    is in the pod's bootstrap too: the two differ by the health_check filter only."""
    reference = yaml.safe_load((ROOT / "deploy" / "envoy-endpoint-picker.yaml").read_text())
    ours = copy.deepcopy(envoy_bootstrap())
    filters = http_filters(ours)
    filters[:] = [f for f in filters if f["name"] != "envoy.filters.http.health_check"]
    assert ours == reference


def test_per_route_settings_name_real_keys_pools_and_classes(tmp_path: Path) -> None:
    from extproc.gate import ROUTE_KEYS

    cm = one(resources(K8S), "ConfigMap", "kvgate-config")
    (tmp_path / "k.yaml").write_text(cm["data"]["kvgate.yaml"])
    config = load_config(tmp_path / "k.yaml")
    settings = [entry["value"] for key, value, _ in walk(envoy_bootstrap())
                if key == "typed_per_filter_config"
                for entry in value.get("envoy.filters.http.set_metadata", {}).get("metadata", [])
                if entry["metadata_namespace"] == "kvgate"]
    assert len(settings) >= 1
    for value in settings:
        assert set(value) <= set(ROUTE_KEYS)
        assert value.get("pool", config.default_pool) in config.pools
        assert value.get("tenant_class", config.tenants.default_class) in config.tenants.classes
    for route in [v for k, v, _ in walk(envoy_bootstrap()) if k == "route" and isinstance(v, dict)
                  and "cluster" in v]:
        assert route["timeout"] == "0s", "a route timeout cuts long generations"


# --- the pod: names, ports, paths, images ---------------------------------------------

def pod() -> dict[str, Any]:
    return one(resources(K8S), "Deployment", "llm-router")["spec"]["template"]


def hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def listener_port(bootstrap: dict[str, Any]) -> int:
    return bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]


def cluster_endpoint(bootstrap: dict[str, Any], name: str) -> tuple[str, int]:
    cluster = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == name)
    addr = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    return addr["socket_address"]["address"], addr["socket_address"]["port_value"]


def mounted_file(spec: dict[str, Any], ctr: dict[str, Any], path: str,
                 objs: list[dict[str, Any]]) -> str:
    """mounted_file returns the content a container sees at ``path`` from a ConfigMap volume."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in ctr["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
            cm_name = volumes[mount["name"]]["configMap"]["name"]
            return one(objs, "ConfigMap", cm_name)["data"][path[len(prefix):]]
    raise AssertionError(f"{path} is on no volume of container {ctr['name']}")


def test_selectors_match_the_pod() -> None:
    objs = resources(K8S)
    dep = one(objs, "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = one(objs, "Service", "llm-router")
    assert svc["spec"]["selector"].items() <= labels.items()
    port_names = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in port_names


def test_kvgate_discovers_the_pods_of_the_headless_vllm_service(tmp_path: Path) -> None:
    objs = resources(K8S)
    svc = one(objs, "Service", "vllm")
    assert svc["spec"]["clusterIP"] == "None" and not svc["spec"]["publishNotReadyAddresses"]
    cm = one(objs, "ConfigMap", "kvgate-config")
    (tmp_path / "k.yaml").write_text(cm["data"]["kvgate.yaml"])
    pool = load_config(tmp_path / "k.yaml").pools["default"]
    assert pool.picks and pool.discovery is not None
    assert (pool.discovery.dns, pool.discovery.port) == (svc["metadata"]["name"], svc["spec"]["ports"][0]["port"])


def test_volumes_and_mounts_agree() -> None:
    spec = pod()["spec"]
    configmaps = {o["metadata"]["name"] for o in resources(K8S) if o["kind"] == "ConfigMap"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for vol in volumes.values():
        if "configMap" in vol:
            assert vol["configMap"]["name"] in configmaps
    for ctr in spec["containers"]:
        for mount in ctr.get("volumeMounts", []):
            assert mount["name"] in volumes


def test_containers_find_their_files_and_each_other() -> None:
    objs = resources(K8S)
    spec = pod()["spec"]
    envoy, kvgate = container(spec, "envoy"), container(spec, "kvgate")
    bootstrap = yaml.safe_load(mounted_file(spec, envoy, flag(envoy["args"], "--config-path"), objs))
    assert bootstrap == envoy_bootstrap()
    kv_text = mounted_file(spec, kvgate, flag(kvgate["args"], "--config"), objs)
    assert kv_text == one(objs, "ConfigMap", "kvgate-config")["data"]["kvgate.yaml"]
    prestop = envoy["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "/bin/bash"
    assert mounted_file(spec, envoy, prestop[1], objs).startswith("#!/bin/bash")

    # kvgate's gRPC port: the flag, the config, Envoy's cluster, the probes.
    grpc_listen = flag(kvgate["args"], "--grpc-listen")
    assert hostport(grpc_listen) == ("127.0.0.1", 50051)
    assert cluster_endpoint(bootstrap, "kvgate") == hostport(grpc_listen)
    assert yaml.safe_load(kv_text)["server"]["grpc_listen"] == grpc_listen
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert kvgate[probe]["exec"]["command"][3] == grpc_listen
    # kvgate's admin port: the flag, the config, the container port, Prometheus' annotation.
    admin_host, admin_port = hostport(flag(kvgate["args"], "--admin-listen"))
    assert admin_host == "0.0.0.0"
    assert yaml.safe_load(kv_text)["server"]["admin_listen"] == f"{admin_host}:{admin_port}"
    assert {"name": "metrics", "containerPort": admin_port, "protocol": "TCP"} in kvgate["ports"]
    assert pod()["metadata"]["annotations"]["prometheus.io/port"] == str(admin_port)
    # Envoy: listener = container port "http"; admin on loopback at the hook's port.
    assert {"name": "http", "containerPort": listener_port(bootstrap), "protocol": "TCP"} in envoy["ports"]
    env = {e["name"]: e["value"] for e in envoy["env"]}
    admin_addr = bootstrap["admin"]["address"]["socket_address"]
    assert admin_addr["address"] == "127.0.0.1"
    assert env["ENVOY_ADMIN_PORT"] == str(admin_addr["port_value"])
    # Envoy's readiness path is the one its health_check filter answers.
    health = next(f for f in http_filters(bootstrap) if f["name"] == "envoy.filters.http.health_check")
    path_match = next(h for h in health["typed_config"]["headers"] if h["name"] == ":path")
    assert envoy["readinessProbe"]["httpGet"]["path"] == path_match["string_match"]["exact"]
    assert envoy["readinessProbe"]["httpGet"]["port"] == "http"
    assert envoy["livenessProbe"]["tcpSocket"]["port"] == "http"


def test_images_are_the_versions_built_and_tested_here() -> None:
    spec = pod()["spec"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container(spec, "kvgate")["image"] == f"{KVGATE_IMAGE_REPO}:{version}"
    assert container(spec, "envoy")["image"] == f"envoyproxy/envoy:v{envoy_version()}"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "/opt/venv" in dockerfile
    assert container(spec, "kvgate")["startupProbe"]["exec"]["command"][0] == "/opt/venv/bin/python"
    assert "args" in container(spec, "kvgate") and "command" not in container(spec, "kvgate")
    assert re.search(r'^ENTRYPOINT \["kvgate"\]$', dockerfile, re.M)
    assert container(spec, "kvgate")["args"][0] == "serve"


def test_pod_runs_non_root_read_only_with_resources() -> None:
    spec = pod()["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False
    for ctr in spec["containers"]:
        sc = ctr["securityContext"]
        assert sc["runAsUser"] > 0 and sc["runAsGroup"] > 0
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= set(ctr["resources"]["requests"])
        assert {"cpu", "memory"} <= set(ctr["resources"]["limits"])
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = container(spec, "kvgate")["securityContext"]["runAsUser"]
    assert re.search(rf"^USER {uid}(:\d+)?$", dockerfile, re.M), "the image's user is the pod's"


def test_termination_timings_are_consistent(tmp_path: Path) -> None:
    """Envoy drains first; kvgate serves every request Envoy may still take; all before SIGKILL."""
    objs = resources(K8S)
    spec = pod()["spec"]
    envoy, kvgate = container(spec, "envoy"), container(spec, "kvgate")
    env = {e["name"]: int(e["value"]) for e in envoy["env"] if e["name"] != "ENVOY_ADMIN_PORT"}
    delay, drain_max = env["ENVOY_PRESTOP_DELAY_S"], env["ENVOY_DRAIN_MAX_S"]
    drain_time = int(flag(envoy["args"], "--drain-time-s"))
    assert flag(envoy["args"], "--drain-strategy") == "immediate"
    sleep_cmd = kvgate["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep_cmd[0] == "sleep"
    kv_sleep = int(sleep_cmd[1])
    (tmp_path / "k.yaml").write_text(one(objs, "ConfigMap", "kvgate-config")["data"]["kvgate.yaml"])
    server = load_config(tmp_path / "k.yaml").server
    grace = spec["terminationGracePeriodSeconds"]
    # kvgate takes new streams as long as Envoy's listener may take new requests.
    assert kv_sleep + server.drain_s >= delay + drain_time
    # kvgate keeps serving streams as long as Envoy waits for its requests.
    assert kv_sleep + server.drain_s + server.grace_s >= delay + drain_max
    # Both are done before the kubelet's SIGKILL.
    assert grace > kv_sleep + server.drain_s + server.grace_s
    assert grace > delay + drain_max
    # Rolling updates never take the only ready pod away first.
    dep = one(objs, "Deployment")
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


# --- the kvgate probes, run against a real gRPC health service ----------------------

def run_probe(command: list[str], address: str) -> int:
    argv = [sys.executable] + command[1:3] + [address] + command[4:]
    return subprocess.run(argv, capture_output=True, timeout=60).returncode


def test_probe_commands_ask_the_grpc_health_service() -> None:
    kvgate = container(pod()["spec"], "kvgate")
    probes = {name: kvgate[name]["exec"]["command"]
              for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert {n: run_probe(c, address) for n, c in probes.items()} == \
            {"startupProbe": 0, "readinessProbe": 0, "livenessProbe": 0}
        # Draining: not ready, but alive (a liveness failure would kill streams in flight).
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        results = {n: run_probe(c, address) for n, c in probes.items()}
        assert results["readinessProbe"] != 0 and results["startupProbe"] != 0
        assert results["livenessProbe"] == 0
    finally:
        server.stop(None)
    # Nothing listening: every probe fails.
    assert all(run_probe(c, address) != 0 for c in probes.values())
