"""The shipped alert rules: a valid Prometheus rules file (promtool, and a PromQL parser from
PyPI), the same groups in the PrometheusRule, and only metrics kvgate exports."""

from __future__ import annotations

import re
import subprocess

import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from extproc.metrics import Metrics
from tests.deploy.support import K8S, ROOT, docs
from kvgate_testkit.promtool import Unavailable, promtool_binary

RULES = ROOT / "deploy" / "prometheus" / "kvgate-rules.yaml"
OPERATOR = K8S / "prometheusrule.yaml"


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def exported_names() -> set[str]:
    """exported_names is every sample name kvgate's registry can expose (with suffixes)."""
    metrics = Metrics(CollectorRegistry())
    names = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    # Pool gauges are read from the admission core at scrape time: named in metrics.py.
    source = (ROOT / "extproc" / "metrics.py").read_text()
    names.update(re.findall(r'GaugeMetricFamily\("(kvgate_[a-z_]+)"', source))
    assert generate_latest(metrics.registry)  # the registry exposes without error
    return names


def test_promtool_accepts_the_rules_file() -> None:
    try:
        promtool = promtool_binary()
    except Unavailable as why:
        pytest.skip(str(why))
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_promtool_refuses_a_broken_rule(tmp_path) -> None:
    """The check above can fail: a rule with a bad expression is refused."""
    try:
        promtool = promtool_binary()
    except Unavailable as why:
        pytest.skip(str(why))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "A", "expr": "sum(rate(x[5m])"}]}]}))
    assert subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True, timeout=60).returncode != 0


def test_every_expression_parses_and_names_only_exported_metrics() -> None:
    names = exported_names()
    assert rules()
    for rule in rules():
        promql_parser.parse(rule["expr"])  # raises ValueError on a syntax error
        used = set(re.findall(r"\b(kvgate_[a-z_]+)", rule["expr"]))
        assert used and used <= names, (rule["alert"], used - names)
        assert re.fullmatch(r"Kvgate[A-Z][A-Za-z]+", rule["alert"]) and rule["labels"]["severity"]
        assert rule["annotations"]["summary"]
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(kvgate_requests_total[5m])")


def test_the_prometheusrule_holds_the_same_groups() -> None:
    (obj,) = docs(OPERATOR)
    assert (obj["apiVersion"], obj["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert obj["spec"] == yaml.safe_load(RULES.read_text())


def test_the_operations_guide_names_every_alert() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    missing = [r["alert"] for r in rules() if r["alert"] not in guide]
    assert not missing, f"docs/operations.md does not describe {missing}"
