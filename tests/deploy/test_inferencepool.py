"""Tests of deploy/k8s/inferencepool: the InferencePool conforms to the published CRD's schema
facts, points at kvgate's Service and port, selects the pods kvgate picks among, and the
other objects deserialize into the Kubernetes models and agree with each other."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.configparse import load_config
from tests.deploy.support import K8S, container, docs, flag, kustomize_resources, one, resources
from tests.deploy.test_k8s import model_name, typed_problems

POOL_DIR = K8S / "inferencepool"

# The InferencePool schema's facts (types, required fields, enums, bounds, patterns; no
# descriptions), as published by kubernetes-sigs/gateway-api-inference-extension in
# config/crd/bases/inference.networking.k8s.io_inferencepools.yaml, version v1, at commit
# 84436a96b9e6ce2b59ddacd3d04c31b4fbd442de (the schema is the same at tag v1.6.0; the file
# last changed in 80e21c3c, "Make endpointPickerRef optional", #2898). The CRD's CEL rules
# (x-kubernetes-validations) are checked by ``cel_problems`` below.
API_VERSION = "inference.networking.k8s.io/v1"
KIND = "InferencePool"
_PORT = {"type": "object", "required": ["number"], "properties": {
    "number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
_DNS_SUBDOMAIN = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SPEC_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["selector", "targetPorts"],
    "properties": {
        "appProtocol": {"type": "string", "enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": {"type": "object", "required": ["name"], "properties": {
            "failureMode": {"type": "string", "enum": ["FailOpen", "FailClose"]},
            "group": {"type": "string", "minLength": 0, "maxLength": 253, "pattern": _DNS_SUBDOMAIN},
            "kind": {"type": "string", "minLength": 1, "maxLength": 63,
                     "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
            "name": {"type": "string", "minLength": 1, "maxLength": 253},
            "port": _PORT}},
        "selector": {"type": "object", "required": ["matchLabels"], "properties": {
            "matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64,
                            "additionalProperties": {
                                "type": "string", "minLength": 0, "maxLength": 63,
                                "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}}}},
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
    },
}
_TYPES = {"object": dict, "array": list, "string": str, "integer": int}


def schema_problems(value: Any, schema: dict[str, Any], path: str = "spec") -> list[str]:
    """schema_problems lists where ``value`` breaks ``schema`` (the OpenAPI subset above).

    A field the schema does not name is a problem too: the API server prunes unknown fields
    of a structural schema without a word, so a misspelled key would silently vanish.
    """
    want = _TYPES[schema["type"]]
    if not isinstance(value, want) or isinstance(value, bool):
        return [f"{path}: must be {schema['type']}, got {type(value).__name__}"]
    out = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    for key, check in (("minimum", lambda v, b: v >= b), ("maximum", lambda v, b: v <= b),
                       ("minLength", lambda v, b: len(v) >= b), ("maxLength", lambda v, b: len(v) <= b),
                       ("minItems", lambda v, b: len(v) >= b), ("maxItems", lambda v, b: len(v) <= b),
                       ("minProperties", lambda v, b: len(v) >= b),
                       ("maxProperties", lambda v, b: len(v) <= b)):
        if key in schema and not check(value, schema[key]):
            out.append(f"{path}: breaks {key} {schema[key]}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        out.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if want is dict:
        for req in schema.get("required", []):
            if req not in value:
                out.append(f"{path}.{req}: required")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                out += schema_problems(item, props[key], f"{path}.{key}")
            elif extra is not None:
                out += schema_problems(item, extra, f"{path}.{key}")
            else:
                out.append(f"{path}.{key}: unknown field")
    if want is list:
        for i, item in enumerate(value):
            out += schema_problems(item, schema["items"], f"{path}[{i}]")
    return out


def cel_problems(spec: dict[str, Any]) -> list[str]:
    """cel_problems checks the CRD's two CEL rules: a Service reference needs a port (kind
    defaults to Service), and target port numbers are unique."""
    out = []
    ref = spec.get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
        out.append("spec.endpointPickerRef: port is required when kind is 'Service' or unspecified")
    numbers = [p.get("number") for p in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        out.append("spec.targetPorts: port number must be unique")
    return out


def pool() -> dict[str, Any]:
    return one(resources(POOL_DIR), KIND)


def test_the_kustomization_names_every_manifest_of_its_directory() -> None:
    listed = kustomize_resources(POOL_DIR)
    assert all(p.is_file() for p in listed)
    assert set(listed) == {p for p in POOL_DIR.glob("*.yaml") if p.name != "kustomization.yaml"}


def test_the_inference_pool_conforms_to_the_published_schema() -> None:
    obj = pool()
    assert obj["apiVersion"] == API_VERSION and obj["kind"] == KIND
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])
    assert schema_problems(obj["spec"], SPEC_SCHEMA) == []
    assert cel_problems(obj["spec"]) == []


@pytest.mark.parametrize("path, value, problem", [
    (["appProtocol"], "grpc", "is not one of"),
    (["endpointPickerRef", "failureMode"], "FailSafe", "is not one of"),
    (["endpointPickerRef", "port", "number"], 70000, "breaks maximum"),
    (["endpointPickerRef", "port", "number"], "9002", "must be integer"),
    (["targetPorts"], [], "breaks minItems"),
    (["selector", "matchLabels"], {}, "breaks minProperties"),
    (["selector", "matchLabels", "app"], "-bad-", "does not match"),
    (["endpointPickerRef", "nmae"], "kvgate-epp", "unknown field"),
])
def test_the_schema_check_catches_what_the_api_server_would_refuse(path: list[str], value: Any,
                                                                    problem: str) -> None:
    spec = copy.deepcopy(pool()["spec"])
    holder = spec
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    assert any(problem in p for p in schema_problems(spec, SPEC_SCHEMA)), schema_problems(spec, SPEC_SCHEMA)


def test_the_cel_rules_catch_a_service_without_port_and_repeated_ports() -> None:
    spec = copy.deepcopy(pool()["spec"])
    del spec["endpointPickerRef"]["port"]
    spec["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    assert len(cel_problems(spec)) == 2
    assert schema_problems({"targetPorts": [{"number": 8000}]}, SPEC_SCHEMA) == ["spec.selector: required"]


def test_the_picker_reference_is_kvgates_service_and_grpc_port(tmp_path: Path) -> None:
    objs = resources(POOL_DIR)
    ref = pool()["spec"]["endpointPickerRef"]
    svc = one(objs, "Service", ref["name"])
    port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert port["appProtocol"] == "kubernetes.io/h2c"  # ext_proc is gRPC: HTTP/2 in the clear
    dep = one(objs, "Deployment", "kvgate-epp")
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    kv = container(pod["spec"], "kvgate")
    named = {p["name"]: p["containerPort"] for p in kv["ports"]}
    listen = flag(kv["args"], "--grpc-listen")
    assert listen == f"0.0.0.0:{named[port['targetPort']]}"
    cm = one(objs, "ConfigMap", kv and pod["spec"]["volumes"][0]["configMap"]["name"])
    path = tmp_path / "kvgate.yaml"
    path.write_text(cm["data"]["kvgate.yaml"])
    assert load_config(path).server.grpc_listen == listen


def test_kvgate_picks_among_the_pods_the_pool_selects(tmp_path: Path) -> None:
    objs = resources(POOL_DIR)
    spec = pool()["spec"]
    cm = one(objs, "ConfigMap", "kvgate-epp-config")
    path = tmp_path / "kvgate.yaml"
    path.write_text(cm["data"]["kvgate.yaml"])
    discovery = load_config(path).pools["default"].discovery
    assert discovery is not None
    nodes = one(objs, "Service", discovery.dns)
    assert nodes["spec"]["clusterIP"] == "None"  # one DNS record per ready pod
    assert nodes["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert [p["number"] for p in spec["targetPorts"]] == [discovery.port]


def test_only_the_gateway_reaches_the_grpc_port() -> None:
    objs = resources(POOL_DIR)
    policy = one(objs, "NetworkPolicy")
    grpc_rules = [r for r in policy["spec"]["ingress"] if {"port": 9002, "protocol": "TCP"} in r["ports"]]
    assert len(grpc_rules) == 1
    (source,) = grpc_rules[0]["from"]
    assert source["podSelector"]["matchLabels"]  # never every pod
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kvgate-epp"}


def test_core_objects_deserialize_into_typed_models_without_unknown_fields() -> None:
    objs = [o for o in resources(POOL_DIR) if o["kind"] != KIND]
    assert sorted(o["kind"] for o in objs) == ["ConfigMap", "Deployment", "NetworkPolicy", "Service", "Service"]
    for obj in objs:
        assert typed_problems(obj, model_name(obj)) == [], obj["metadata"]["name"]


def test_every_file_parses() -> None:
    for path in POOL_DIR.glob("*.yaml"):
        assert docs(path) and all(isinstance(d, dict) for d in yaml.safe_load_all(path.read_text()) if d)
