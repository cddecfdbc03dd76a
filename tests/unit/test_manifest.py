"""Tests of extproc.manifest and `kvgate check-config` on ConfigMap manifests: the shipped
ConfigMaps' comments tell the operator to run check-config on them."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc import cli
from extproc.errors import ConfigError
from extproc.manifest import unwrap

ROOT = Path(__file__).resolve().parents[2]
CONFIGMAPS = ["deploy/k8s/kvgate-config.yaml", "deploy/k8s/istio/kvgate-config.yaml",
              "deploy/k8s/inferencepool/kvgate-config.yaml"]


def configmap(data: dict[str, str]) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": data}


def test_a_configmap_gives_the_file_it_carries_and_any_other_document_stays():
    doc, where = unwrap(configmap({"kvgate.yaml": "pools: {a: {}}\n"}), "kvgate.yaml")
    assert doc == {"pools": {"a": {}}} and where == "ConfigMap cm, data.kvgate.yaml"
    plain = {"pools": {"a": {}}, "kind": "ConfigMap"}  # no data: a (bad) kvgate file, not a manifest
    assert unwrap(plain, "kvgate.yaml") == (plain, "")


@pytest.mark.parametrize("data, reason", [
    ({"other.yaml": "a: 1"}, "carries no such file (its data keys: other.yaml)"),
    ({"kvgate.yaml": "a: 1\na: 2\n"}, "is not valid YAML"),
    ({"kvgate.yaml": "a: [1\n"}, "is not valid YAML"),
])
def test_a_configmap_without_a_readable_entry_is_refused_by_key(data, reason):
    with pytest.raises(ConfigError) as err:
        unwrap(configmap(data), "kvgate.yaml")
    assert err.value.key == "data.kvgate.yaml" and reason in err.value.reason


@pytest.mark.parametrize("path", CONFIGMAPS)
def test_check_config_takes_each_shipped_configmap(path, capsys):
    assert cli.main(["check-config", str(ROOT / path)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.endswith(": ok\n")


def test_check_config_compares_the_router_pods_two_configmaps(capsys):
    argv = ["check-config", str(ROOT / "deploy/k8s/kvgate-config.yaml"),
            "--envoy", str(ROOT / "deploy/k8s/envoy-config.yaml")]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "agrees with it" in capsys.readouterr().out


def test_check_config_names_the_entry_a_configmap_lacks(tmp_path, capsys):
    path = tmp_path / "cm.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {envoy.yaml: 'a: 1'}\n")
    assert cli.main(["check-config", str(path)]) == cli.EXIT_CONFIG
    assert "error: data.kvgate.yaml: ConfigMap x carries no such file" in capsys.readouterr().err
