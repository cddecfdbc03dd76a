"""Tests of extproc.configdiff: what a reload changes, said without secrets, and which changes
the reload guard refuses unless the new file allows them; over every line prefix of the local
stack's configuration, none reloads silently destructive."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc import yamlload
from extproc.configparse import load_config, parse_config
from extproc.configdiff import DestructiveReload, config_change, guard
from extproc.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "deploy" / "local" / "kvgate.yaml"
KEY_A = "a" * 64
KEY_B = "b" * 64
KEY_C = "c" * 64

BASE: dict[str, Any] = {
    "pools": {
        "default": {"max_concurrency": 8, "backends": [
            {"name": "n0", "metrics_url": "http://10.0.0.1:8000/metrics", "address": "10.0.0.1:8000"},
            {"name": "n1", "metrics_url": "http://10.0.0.2:8000/metrics", "address": "10.0.0.2:8000"},
            {"name": "n2", "metrics_url": "http://10.0.0.3:8000/metrics", "address": "10.0.0.3:8000"}]},
        "small": {"max_concurrency": 2},
    },
    "tenants": {
        "classes": {"gold": {"priority": 10}, "standard": {}},
        "tenants": {"acme": {"class": "gold", "api_key_sha256": [KEY_A, KEY_B]},
                    "beta": {"class": "gold", "api_key_sha256": [KEY_C]},
                    "named": {"class": "standard"}},
    },
}


def edited(**edits: Any) -> dict[str, Any]:
    """edited is BASE with each edit applied: a dotted path to a value, or to None to delete."""
    data = copy.deepcopy(BASE)
    for path, value in edits.items():
        *parents, last = path.split("__")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return data


def change_of(**edits: Any):
    return config_change(parse_config(BASE), parse_config(edited(**edits)))


# (what the new file does, the edits, phrases among the changes, how many are destructive)
CASES = [
    ("nothing", {}, [], 0),
    ("a setting", {"pools__default__max_concurrency": 4}, ["pools.default.max_concurrency 8 -> 4"], 0),
    ("a pool added", {"pools__extra": {"max_concurrency": 1}}, ["pools added: extra"], 0),
    ("a pool removed", {"pools__small": None}, ["remove pool 'small'"], 1),
    ("one backend of three removed", {"pools__default__backends": BASE["pools"]["default"]["backends"][:2]},
     ["pools.default: backends removed: n2 (2 left)"], 0),
    ("two backends of three removed: a file cut in its backends list",
     {"pools__default__backends": BASE["pools"]["default"]["backends"][:1]},
     ["remove 2 of the 3 backends of pool 'default': n1, n2 (1 left)"], 1),
    ("two of three replaced by two others: no capacity lost",
     {"pools__default__backends": BASE["pools"]["default"]["backends"][:1] + [
         {"name": "m1", "metrics_url": "http://10.0.0.8:8000/metrics", "address": "10.0.0.8:8000"},
         {"name": "m2", "metrics_url": "http://10.0.0.9:8000/metrics", "address": "10.0.0.9:8000"}]},
     ["pools.default: backends removed: n1, n2 (3 left)", "pools.default: backends added: m1, m2"], 0),
    ("every backend removed", {"pools__default__backends": None},
     ["remove every backend of pool 'default' (3)"], 1),
    ("the backends lose their addresses: the pool stops picking",
     {"pools__default__backends": [{"name": "n0", "metrics_url": "http://10.0.0.1:8000/metrics"},
                                   {"name": "n1", "metrics_url": "http://10.0.0.2:8000/metrics"},
                                   {"name": "n2", "metrics_url": "http://10.0.0.3:8000/metrics"}]},
     ["pools.default: backend n1 changed (address)", "make pool 'default' stop picking its nodes"], 1),
    ("a pool-level pool starts picking",
     {"pools__small__backends": [{"name": "s0", "metrics_url": "http://10.0.1.1:8000/metrics",
                                  "address": "10.0.1.1:8000"}]},
     ["pools.small: backends added: s0", "make pool 'small' pick its nodes"], 1),
    ("a picking pool starts naming fallbacks: the shipped ORIGINAL_DST files would 503 every list",
     {"pools__default__picking": {"fallbacks": 1}},
     ["make pool 'default' name 1 fallback(s)", "pools.default.picking.fallbacks 0 -> 1"], 1),
    ("a keyed tenant removed", {"tenants__tenants__beta": None},
     ["remove tenant 'beta' and its 1 API key"], 1),
    ("a tenant without keys removed", {"tenants__tenants__named": None}, ["tenants removed: named"], 0),
    ("every key of a tenant removed", {"tenants__tenants__acme": {"class": "gold"}},
     ["remove every API key of tenant 'acme' (2;"], 1),
    ("one key of two removed", {"tenants__tenants__acme": {"class": "gold", "api_key_sha256": [KEY_A]}},
     ["tenant acme: API keys 2 -> 1 (0 added, 1 removed)"], 0),
    ("a tenant's class changed", {"tenants__tenants__named": {"class": "gold"}},
     ["tenants.tenants.named.class_name standard -> gold"], 0),
    ("a class removed: its tenants are served in another",
     {"tenants__classes": {"gold": {"priority": 10}}, "tenants__default_class": "gold",
      "tenants__tenants__named": {"class": "gold"}},
     ["remove class 'standard'"], 1),
    ("a class added and a setting of one changed",
     {"tenants__classes": {"gold": {"priority": 20}, "standard": {}, "batch": {"priority": -5}}},
     ["classes added: batch", "tenants.classes.gold.priority 10 -> 20"], 0),
    ("the store (its URL may carry a password)", {"store": {"redis": {"url": "redis://:hunter2@r:6379/0"}}},
     ["store changed (applies at a restart)"], 0),
]


@pytest.mark.parametrize(("what", "edits", "said", "destructive"), CASES, ids=[c[0] for c in CASES])
def test_each_change_is_named_and_only_the_destructive_ones_are_refused(
        what: str, edits: dict[str, Any], said: list[str], destructive: int) -> None:
    change = change_of(**edits)
    for phrase in said:
        assert any(phrase in c for c in change.changes), (phrase, change.changes)
    assert len(change.destructive) == destructive, change.destructive
    assert set(change.destructive) <= set(change.changes)
    if not edits:
        assert change.changes == () and change.summary() == "no change in effect"
    # Never a key digest, nor a password of the store's URL, in what is logged.
    text = change.summary()
    assert not any(secret in text for secret in (KEY_A, KEY_B, KEY_C, "hunter2"))
    _, refusal = guard(parse_config(BASE), parse_config(edited(**edits)))
    assert (refusal is not None) == bool(destructive)


def test_fewer_fallbacks_pass_and_a_node_added_beside_them_is_told_to_go_into_envoys_list_too() -> None:
    with_fallbacks = parse_config(edited(pools__default__picking={"fallbacks": 2}))
    fewer = config_change(with_fallbacks, parse_config(edited(pools__default__picking={"fallbacks": 0})))
    assert fewer.destructive == () and fewer.changes == ("pools.default.picking.fallbacks 2 -> 0",)
    more = [*BASE["pools"]["default"]["backends"],
            {"name": "n3", "metrics_url": "http://10.0.0.4:8000/metrics", "address": "10.0.0.4:8000"}]
    added = config_change(with_fallbacks, parse_config(edited(pools__default__picking={"fallbacks": 2},
                                                              pools__default__backends=more)))
    assert added.destructive == () and "nodes cluster too" in added.changes[0]


def test_the_refusal_says_what_would_change_and_how_to_mean_it() -> None:
    new = parse_config(edited(pools__default__backends=None, tenants__tenants__beta=None,
                              pools__small__max_concurrency=3))
    change, refusal = guard(parse_config(BASE), new)
    assert isinstance(refusal, DestructiveReload) and isinstance(refusal, ConfigError)
    assert refusal.key == "allow_destructive_reload"
    assert "remove every backend of pool 'default' (3)" in refusal.reason
    assert "remove tenant 'beta' and its 1 API key" in refusal.reason
    assert "pools.small.max_concurrency 2 -> 3" in refusal.reason  # the rest of the change too
    assert "allow_destructive_reload: true" in refusal.reason and "restart" in refusal.reason
    assert KEY_C not in refusal.reason


def test_a_file_that_allows_it_is_applied_and_the_flag_is_not_a_change() -> None:
    allowed = {**edited(pools__small=None), "allow_destructive_reload": True}
    change, refusal = guard(parse_config(BASE), parse_config(allowed))
    assert refusal is None and change.destructive == ("remove pool 'small' (a route or default_pool may name it)",)
    assert config_change(parse_config(BASE), parse_config({**BASE, "allow_destructive_reload": True})).changes == ()
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, "allow_destructive_reload": "yes"})
    assert err.value.key == "allow_destructive_reload"


def test_the_key_lets_through_only_the_reload_that_sets_it() -> None:
    """A file left with the key is guarded again: the next destructive reload is refused, and
    the refusal says how to mean it (take the key out, then set it again)."""
    allowed = {**BASE, "allow_destructive_reload": True}
    in_force = parse_config(allowed)
    again = {**edited(pools__small=None), "allow_destructive_reload": True}
    change, refusal = guard(in_force, parse_config(again))
    assert isinstance(refusal, DestructiveReload) and "already set" in refusal.reason
    assert "take the key out" in refusal.reason
    _, refusal = guard(in_force, parse_config(edited(pools__small=None)))
    assert refusal is not None                                   # without it: refused as always
    _, refusal = guard(in_force, parse_config(BASE))             # taking it out is no change
    assert refusal is None
    _, refusal = guard(parse_config(BASE), parse_config(again))  # set anew: applied
    assert refusal is None


def test_discovery_pools_are_compared_by_their_discovery_not_their_dns_answers() -> None:
    disc = {"pools": {"default": {"discovery": {"dns": "vllm", "port": 8000}}}}
    old = parse_config(disc)
    assert config_change(old, parse_config(disc)).changes == ()
    gone = config_change(old, parse_config({"pools": {"default": {}}}))
    assert gone.destructive == ("remove every backend of pool 'default' (0)",)
    slower = copy.deepcopy(disc)
    slower["pools"]["default"]["discovery"]["interval_s"] = 10
    assert config_change(old, parse_config(slower)).changes == ("pools.default.discovery.interval_s 5 -> 10",)


def prefixes(path: Path) -> list[tuple[int, str]]:
    lines = path.read_text().splitlines(keepends=True)
    return [(n, "".join(lines[:n])) for n in range(len(lines) + 1)]


def test_no_line_prefix_of_the_local_config_reloads_silently_destructive() -> None:
    """Every prefix of deploy/local/kvgate.yaml that is valid YAML and a valid configuration is
    what a reload could read while an editor rewrites the file in place. Each is either refused
    by the guard, or identical in effect to the whole file but for the server's shutdown timing
    (the last section), and then that difference is what the reload line says."""
    full = load_config(LOCAL)
    valid = refused = 0
    for n, text in prefixes(LOCAL):
        try:
            cut = parse_config(yamlload.load(text))
        except (ConfigError, yaml.YAMLError):
            continue  # not valid YAML, or not a valid configuration: refused as it always was
        valid += 1
        change, refusal = guard(full, cut)
        if refusal is not None:
            refused += 1
            continue
        # Accepted: only the server section may differ, and the reload says how.
        assert dataclasses.replace(cut, server=full.server) == full, (n, change.summary())
        said = change.summary()
        for f in dataclasses.fields(full.server):
            if getattr(full.server, f.name) != getattr(cut.server, f.name):
                assert f"server.{f.name} " in said, (n, said)
    assert valid > 40 and refused >= valid - 3, (valid, refused)
    # The two cuts the issue met: after `backends:` (every request a plain 503) and before the
    # tenant keys (every keyed tenant anonymous).
    text = LOCAL.read_text()
    after_backends = text[: text.index("backends:\n") + len("backends:\n")]
    before_keys = text[: text.index("    online-1:")]
    for cut_text in (after_backends, before_keys):
        _, refusal = guard(full, parse_config(yamlload.load(cut_text)))
        assert refusal is not None
    _, refusal = guard(full, parse_config(yamlload.load(after_backends)))
    assert refusal is not None and "remove every backend of pool 'default' (8)" in refusal.reason
