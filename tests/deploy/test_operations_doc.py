"""Tests of docs/operations.md and the references beside it: docs/configuration.md covers every
key of the schema and names only keys the loader accepts, docs/metrics.md every outcome;
refusals, per-route keys and Envoy settings are in the guide."""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

import pytest
import yaml

from extproc import config as cfg
from extproc.configparse import parse_config
from extproc.errors import ConfigError
from tests.deploy.support import ROOT

GUIDE = ROOT / "docs" / "operations.md"
REFERENCE = ROOT / "docs" / "configuration.md"  # the configuration table; the guide links to it
METRICS = ROOT / "docs" / "metrics.md"  # every series kvgate exports

# How the schema's dataclasses map onto the file's keys, where the names differ.
SKIPPED = {(cfg.PoolConfig, "name"), (cfg.ClassConfig, "name"), (cfg.TenantConfig, "name"),
           (cfg.StoreConfig, "kind")}  # mapping keys, and the kind derived from `store`
RENAMED = {(cfg.TenantConfig, "class_name"): "class"}
PLACEHOLDERS = {(cfg.Config, "pools"): "<pool>", (cfg.TenantsConfig, "classes"): "<class>",
                (cfg.TenantsConfig, "tenants"): "<tenant>"}
# Concrete names for the placeholders, as in BASE below.
CONCRETE = {"<pool>": "default", "<class>": "standard", "<tenant>": "t1"}
BASE: dict[str, Any] = {
    "pools": {"default": {"backends": [{"name": "b", "metrics_url": "http://127.0.0.1:1/metrics"}]}},
    "tenants": {"classes": {"standard": {}}, "tenants": {"t1": {"class": "standard"}}},
    "store": {"redis": {}},
}


def schema_keys(klass: type = cfg.Config, prefix: str = "") -> list[str]:
    """schema_keys walks the config dataclasses and lists every file key, dotted."""
    keys = []
    hints = typing.get_type_hints(klass)
    for f in dataclasses.fields(klass):
        if (klass, f.name) in SKIPPED:
            continue
        name = prefix + RENAMED.get((klass, f.name), f.name)
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        origin = typing.get_origin(hint)
        if dataclasses.is_dataclass(hint):
            keys += schema_keys(hint, name + ".")
        elif origin in (types.UnionType, typing.Union) and len(args) == 1 and dataclasses.is_dataclass(args[0]):
            keys += schema_keys(args[0], name + ".")
        elif origin is tuple and args and dataclasses.is_dataclass(args[0]):
            keys += schema_keys(args[0], name + "[].")
        elif origin in (Mapping, dict) or (isinstance(origin, type) and issubclass(origin, Mapping)):
            placeholder = PLACEHOLDERS.get((klass, f.name))
            assert placeholder, f"{klass.__name__}.{f.name}: a new mapping needs a placeholder here"
            keys += schema_keys(args[1], f"{name}.{placeholder}.")
        else:
            keys.append(name)
    return keys


def documented_keys() -> list[str]:
    return re.findall(r"^\| `([^`]+)` \|", REFERENCE.read_text(), re.M)


def probe(key: str) -> ConfigError:
    """probe sets ``key`` to a value of the wrong type in a valid config and returns the error."""
    data = copy.deepcopy(BASE)
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts):
        part = CONCRETE.get(part, part)
        last = i == len(parts) - 1
        if part.endswith("[]"):
            node = node.setdefault(part[:-2], [{}])[0]
            continue
        if last:
            node[part] = {"wrong": "type"}
        else:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                nxt = node[part] = {}
            node = nxt
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    return err.value


def concrete(key: str) -> str:
    for placeholder, name in CONCRETE.items():
        key = key.replace(placeholder, name)
    return key.replace("[]", "[0]")


def test_base_config_for_probes_is_valid() -> None:
    parse_config(copy.deepcopy(BASE))


def test_every_schema_key_is_documented() -> None:
    documented = set(documented_keys())
    keys = schema_keys()
    assert len(keys) > 40
    assert [k for k in keys if k not in documented] == []


def test_every_documented_key_is_read_by_the_loader() -> None:
    documented = documented_keys()
    assert len(documented) == len(set(documented)), "a key is documented twice"
    for key in documented:
        err = probe(key)
        assert err.reason != "unknown key", f"{key} is documented but the loader does not know it"
        assert err.key == concrete(key), f"{key}: the loader complained about {err.key} ({err.reason})"


def test_probe_catches_an_undocumented_or_misspelled_key() -> None:
    err = probe("pools.<pool>.max_concurency")
    assert err.reason == "unknown key"


def test_every_refusal_and_release_cause_is_explained() -> None:
    from extproc.metrics import CAUSES, OUTCOMES

    text = GUIDE.read_text()
    section = text.split("## Refusals: what clients get", 1)[1].split("\n## ", 1)[0]
    for outcome in OUTCOMES:
        if outcome.startswith("rejected_"):
            assert f"`{outcome.removeprefix('rejected_')}` (`{outcome}`)" in section, outcome
    for cause in CAUSES:
        assert f"`{cause}`" in section, cause
    for status in ("429", "400", "413", "503", "504"):
        assert f"| {status}" in section
    for header in ("retry-after", "retry-after-ms", "x-should-retry", "x-ratelimit-"):
        assert header in section


def test_every_outcome_that_is_no_refusal_is_in_the_metrics_table() -> None:
    from extproc.metrics import OUTCOMES

    rows = [line for line in GUIDE.read_text().splitlines() if line.startswith("| `kvgate_requests_total")]
    assert len(rows) == 1
    for outcome in OUTCOMES:
        if not outcome.startswith("rejected_"):
            assert f"`{outcome}`" in rows[0], outcome


def test_per_route_keys_are_documented() -> None:
    from extproc.gate import ROUTE_KEYS

    section = GUIDE.read_text().split("## Per-route settings", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \|", section, re.M)
    assert rows == list(ROUTE_KEYS)


def test_envoy_snippets_are_the_shipped_settings() -> None:
    """The guide's ext_proc snippet is deploy/envoy.yaml's filter, value for value."""
    text = GUIDE.read_text()
    snippets = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    filters = [f for s in snippets if isinstance(s, dict) and "http_filters" in s for f in s["http_filters"]]
    shipped = yaml.safe_load((ROOT / "deploy" / "envoy.yaml").read_text())
    hcm = shipped["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc in filters
    clusters = [c for s in snippets if isinstance(s, dict) for c in s.get("clusters", [])]
    kvgate_cluster = next(c for c in shipped["static_resources"]["clusters"] if c["name"] == "kvgate")
    assert kvgate_cluster in clusters


def test_guide_names_the_operator_topics() -> None:
    text = GUIDE.read_text()
    for topic in ("## Attach to an existing Envoy", "## Attach to Istio", "## Configuration reference",
                  "## Refusals: what clients get", "## Failure modes", "## Hot reload",
                  "failure_mode_allow", "max_message_timeout", "BUFFERED", "STREAMED",
                  "circuit_breakers", "timeout: 0s", "ghcr.io/kvgate/kvgate:0.1.0", "placeholder",
                  "min_scale", "kvgate_config_reload_errors_total"):
        assert topic in text, topic


def test_the_metrics_reference_names_every_outcome_of_kvgate_requests_total() -> None:
    from extproc.outcomes import RequestOutcome
    (row,) = [line for line in METRICS.read_text().splitlines() if line.startswith("| `kvgate_requests_total` |")]
    assert [o.value for o in RequestOutcome if o.value not in row] == []
