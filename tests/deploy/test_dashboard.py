"""Tests of deploy/grafana/kvgate.json: every query names metrics and labels that kvgate
exports (read from the real registry), and the panels the operators need are there."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.deploy.support import ROOT, exported_metrics

DASHBOARD = ROOT / "deploy" / "grafana" / "kvgate.json"

# PromQL words that are not metric names.
FUNCTIONS = {"rate", "irate", "increase", "sum", "max", "min", "avg", "count", "histogram_quantile",
             "clamp_min", "clamp_max", "abs", "delta", "deriv", "topk", "bottomk", "quantile",
             "label_values", "time", "vector", "scalar", "absent", "max_over_time",
             "min_over_time", "avg_over_time", "changes", "resets"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
            "and", "or", "unless"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_RANGE = re.compile(r"\[[^\]]*\]")
_VARIABLE = re.compile(r"\$\{?\w+\}?")
_SELECTOR = re.compile(r"\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def query_problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """query_problems lists unknown metrics, functions and labels in one PromQL query."""
    text = _VARIABLE.sub("", _RANGE.sub("", expr))
    labels: set[str] = set()
    # Grafana's label_values(metric, label): the second argument is a label.
    for lv in re.finditer(r"label_values\(\s*([^,()]+?)\s*,\s*(\w+)\s*\)", text):
        labels.add(lv.group(2))
    text = re.sub(r"label_values\(\s*([^,()]+?)\s*,\s*\w+\s*\)", r"\1", text)
    for body in _SELECTOR.findall(_STRING.sub('""', text)):
        labels.update(m.group(1) for m in re.finditer(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", body))
    text = _SELECTOR.sub(" ", _STRING.sub('""', text))
    for body in _GROUPING.findall(text):
        labels.update(x.strip() for x in body.split(",") if x.strip())
    text = _GROUPING.sub(" ", text)
    problems, metrics = [], []
    for m in _IDENT.finditer(text):
        word = m.group(0)
        followed_by_paren = text[m.end():].lstrip().startswith("(")
        if word in KEYWORDS:
            continue
        if followed_by_paren:
            if word not in FUNCTIONS:
                problems.append(f"unknown function {word}")
            continue
        if word not in exported:
            problems.append(f"metric {word} is not exported by kvgate")
        else:
            metrics.append(word)
    if not metrics:
        return problems + ["names no kvgate metric"]
    known = set().union(*(exported[m] for m in metrics))
    problems += [f"label {lab} is on none of {metrics}" for lab in sorted(labels - known)]
    return problems


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def all_queries() -> list[tuple[str, str]]:
    queries = [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            queries.append((f"variable {var['name']}", var["query"]["query"]))
    return queries


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    return exported_metrics()


def test_dashboard_is_importable_grafana_json() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "pool"} <= names
    for p in panels():
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"])
        assert p.get("description"), f"panel {p['title']!r} says nothing of what it shows"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24


def test_every_query_names_exported_metrics_and_labels(exported: dict[str, set[str]]) -> None:
    problems = [f"{title}: {p}" for title, expr in all_queries() for p in query_problems(expr, exported)]
    assert problems == []


def test_query_check_catches_unknown_metrics_labels_and_functions(exported: dict[str, set[str]]) -> None:
    assert query_problems('sum by (pool) (kvgate_inflight_request{pool=~"$pool"})', exported) == [
        "metric kvgate_inflight_request is not exported by kvgate", "names no kvgate metric"]
    assert query_problems('sum by (tenant) (rate(kvgate_requests_total[5m]))', exported) == [
        "label tenant is on none of ['kvgate_requests_total']"]
    assert query_problems('kvgate_admission_scale{backend="x"}', exported) == [
        "label backend is on none of ['kvgate_admission_scale']"]
    assert query_problems('ratee(kvgate_requests_total[1m])', exported) == ["unknown function ratee"]
    assert query_problems("label_values(kvgate_concurrency_limit, pool)", exported) == []
    assert query_problems("label_values(kvgate_concurrency_limit, backend)", exported) == [
        "label backend is on none of ['kvgate_concurrency_limit']"]
    assert query_problems('histogram_quantile(0.99, sum by (le) (rate(kvgate_decision_seconds_bucket'
                          '[$__rate_interval])))', exported) == []


def test_the_panels_operators_need_are_there() -> None:
    by_title = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels()}

    def panel_with(*needles: str) -> str:
        found = [t for t, e in by_title.items() if all(n in e for n in needles)]
        assert found, f"no panel shows {needles}"
        return found[0]

    panel_with("kvgate_inflight_requests", "kvgate_concurrency_limit")     # in-flight vs limit
    panel_with("kvgate_admission_scale")                                   # admission scale
    panel_with("kvgate_backend_kv_cache_usage_ratio", "backend")           # KV usage per backend
    panel_with("kvgate_requests_total", "by (outcome)", 'outcome=~"rejected_.*"')  # by reason
    panel_with("kvgate_requests_total", 'outcome="passed"')                     # let through
    panel_with("kvgate_requests_total", "by (class, outcome)", "rejected_")     # by tenant class
    panel_with("kvgate_tpm_available_tokens")                              # TPM available
    panel_with("histogram_quantile", "kvgate_decision_seconds_bucket")     # decision latency
    panel_with("kvgate_kv_inflight_tokens", "kvgate_kv_budget_tokens")
    panel_with("kvgate_config_reload_errors_total")


def test_no_panel_counts_a_request_let_through_as_a_refusal() -> None:
    """``passed`` (a GET to /v1/models) is neither admitted nor refused: a refusal panel that
    selected "not admitted" would show every model listing as a refusal."""
    for title, expr in all_queries():
        assert 'outcome!="admitted"' not in expr, title


def test_template_variables_carry_a_valid_current_value() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["current"]["value"]  # a datasource to start on
    pool = variables["pool"]
    # "All" is selectable (includeAll), so $__all is a valid start; multi-value wants a list.
    assert pool["includeAll"] and pool["multi"] and pool["current"]["value"] == ["$__all"]


def test_every_series_with_a_pool_label_follows_the_pool_selector(exported: dict[str, set[str]]) -> None:
    """A panel that shows a metric labelled by pool filters it by $pool: choosing a pool
    changes every panel, the latency and scrape ones included."""
    unfiltered = []
    for title, expr in all_queries():
        if expr.startswith("label_values("):
            continue
        for name, braces in re.findall(r"\b(kvgate_[a-z_]+)(\{[^}]*\})?", expr):
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            labels = exported.get(name) or exported.get(family) or set()
            if "pool" in labels and 'pool=~"$pool"' not in (braces or ""):
                unfiltered.append(f"{title}: {name}")
    assert unfiltered == []
