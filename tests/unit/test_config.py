"""Tests of config loading: every bad key is named with its reason."""

from __future__ import annotations

import pytest

from extproc.configparse import load_config, parse_config
from extproc.errors import ConfigError

MINIMAL = {"pools": {"default": {"max_concurrency": 8}}}


def with_(**sections):
    data = {"pools": {"default": {"max_concurrency": 8, "tpm": 100000}}}
    data.update(sections)
    return data


def test_defaults_fill_in():
    cfg = parse_config(MINIMAL)
    pool = cfg.pool(None)
    assert pool.name == "default" and pool.max_concurrency == 8
    assert pool.tpm is None and pool.kv_budget_tokens is None
    assert cfg.adaptive.high_watermark == 0.85 and cfg.adaptive.low_watermark == 0.70
    assert cfg.adaptive.min_scale == 0.6
    assert cfg.adaptive.early_scrape_gap_s == 0.2
    assert cfg.limits.max_body_bytes == 1_048_576
    assert cfg.store.kind == "memory"
    assert cfg.class_of("anyone").name == "standard"


def test_grpc_binds_loopback_by_default_and_in_the_shipped_example():
    # Anyone who can open ext_proc streams can hold admission slots: only Envoy, beside it.
    from pathlib import Path
    assert parse_config(MINIMAL).server.grpc_listen == "127.0.0.1:50051"
    example = Path(__file__).parents[2] / "deploy" / "kvgate.yaml"
    assert load_config(example).server.grpc_listen.startswith("127.0.0.1:")


def test_a_pool_read_from_dcgm_alone_is_refused_unless_said_on_purpose():
    gpu = {"name": "g", "metrics_url": "http://127.0.0.1:9400/metrics", "engine": "dcgm"}
    with pytest.raises(ConfigError) as info:
        parse_config({"pools": {"default": {"backends": [gpu]}}})
    assert info.value.key == "pools.default.backends" and "reserve" in info.value.reason
    ok = parse_config({"pools": {"default": {"backends": [gpu],
                                             "signals": {"framebuffer_only": True}}}})
    assert ok.pool("default").backends[0].engine == "dcgm"


def test_the_documented_example_loads(tmp_path):
    path = tmp_path / "kvgate.yaml"
    path.write_text("""
pools:
  default:
    max_concurrency: 64
    tpm: 2000000
    kv_budget_tokens: 400000
    context_window: 32768
    default_max_tokens: 1024
    tokenizer: cl100k_base
    backends:
      - {name: node-a, metrics_url: "http://127.0.0.1:8000/metrics", engine: vllm}
      - {name: node-a-gpu, metrics_url: "http://127.0.0.1:9400/metrics", engine: dcgm}
    signals: {aggregate: max, waiting_threshold: 8, kv_budget_fraction: 0.9}
limits:
  max_body_bytes: 1048576
adaptive: {high_watermark: 0.85, low_watermark: 0.70, min_scale: 0.6, poll_interval_s: 1.0, scrape_timeout_s: 0.5, stale_after_s: 3.0}
tenants:
  header: X-Tenant-Id
  default_class: standard
  classes:
    standard: {priority: 0}
    online: {priority: 10, guaranteed_slots: 16, max_wait_s: 2}
    batch: {priority: -1, sheddable: true, tpm: 500000}
  tenants:
    acme: {class: online, api_key_sha256: ["%s"]}
store:
  redis: {url: "redis://127.0.0.1:6379/0", key_prefix: "kvgate:", lease_ttl_s: 30, timeout_s: 0.05, on_unavailable: local_share}
""" % ("ab" * 32))
    cfg = load_config(path)
    assert cfg.tenants.header == "x-tenant-id"  # header names compare lower-case
    assert [b.engine for b in cfg.pool("default").backends] == ["vllm", "dcgm"]
    assert cfg.class_of("acme").guaranteed_slots == 16
    assert cfg.tenants.tenants["acme"].api_key_sha256 == ("ab" * 32,)
    assert cfg.store.kind == "redis" and cfg.store.redis.lease_ttl_s == 30


@pytest.mark.parametrize("data, key, words", [
    ({"pools": {}}, "pools", "at least one pool"),
    ({"pools": {"default": {"max_concurrency": 0}}}, "pools.default.max_concurrency", ">= 1"),
    ({"pools": {"default": {"max_concurrency": -3}}}, "pools.default.max_concurrency", ">= 1"),
    ({"pools": {"default": {"max_concurrency": 2.5}}}, "pools.default.max_concurrency", "integer"),
    ({"pools": {"default": {"max_concurrency": True}}}, "pools.default.max_concurrency", "integer"),
    ({"pools": {"default": {"tpm": 0}}}, "pools.default.tpm", ">= 1"),
    ({"pools": {"default": {"kv_budget_tokens": -1}}}, "pools.default.kv_budget_tokens", ">= 1"),
    ({"pools": {"default": {"tmp": 5}}}, "pools.default.tmp", "unknown key"),
    ({"pools": {"default": {"context_window": 100, "default_max_tokens": 100}}},
     "pools.default.default_max_tokens", "below context_window"),
    ({"pools": {"default": {"backends": [{"name": "a", "metrics_url": "ftp://x"}]}}},
     "pools.default.backends[0].metrics_url", "http"),
    ({"pools": {"default": {"backends": [{"name": "a", "metrics_url": "http://127.0.0.1/m",
                                          "engine": "trt"}]}}},
     "pools.default.backends[0].engine", "one of"),
    ({"pools": {"default": {"backends": [{"name": "a", "metrics_url": "http://127.0.0.1/m"},
                                         {"name": "a", "metrics_url": "http://127.0.0.1/n"}]}}},
     "pools.default.backends[1].name", "duplicate"),
    (with_(adaptive={"low_watermark": 0.9}), "adaptive.low_watermark", "below high_watermark"),
    (with_(adaptive={"low_watermark": 0.85}), "adaptive.low_watermark", "below high_watermark"),
    (with_(adaptive={"min_scale": 0}), "adaptive.min_scale", "> 0"),
    (with_(adaptive={"min_scale": 1.5}), "adaptive.min_scale", "<= 1"),
    (with_(adaptive={"high_watermark": float("nan")}), "adaptive.high_watermark", "finite"),
    (with_(adaptive={"early_scrape_gap_s": -0.1}), "adaptive.early_scrape_gap_s", ">= 0"),
    (with_(adaptive={"early_scrape_gap_s": "0.2"}), "adaptive.early_scrape_gap_s", "a number"),
    (with_(tenants={"default_class": "gold"}), "tenants.default_class", "no class"),
    (with_(tenants={"classes": {"a": {}}, "default_class": "a", "tenants": {"t": {"class": "b"}}}),
     "tenants.tenants.t.class", "no class"),
    (with_(tenants={"classes": {"a": {"guaranteed_slots": 9}}, "default_class": "a"}),
     "tenants.classes", "above pools.default.max_concurrency"),
    (with_(tenants={"classes": {"a": {"guaranteed_slots": -1}}, "default_class": "a"}),
     "tenants.classes.a.guaranteed_slots", ">= 0"),
    (with_(tenants={"classes": {"a": {"kv_watermark": 0}}, "default_class": "a"}),
     "tenants.classes.a.kv_watermark", "> 0.0"),
    (with_(tenants={"classes": {"a": {"kv_watermark": 1.2}}, "default_class": "a"}),
     "tenants.classes.a.kv_watermark", "<= 1.0"),
    (with_(tenants={"classes": {"a": {"kv_watermark": "70%"}}, "default_class": "a"}),
     "tenants.classes.a.kv_watermark", "number"),
    (with_(tenants={"classes": {"a": {"kv_watermark": True}}, "default_class": "a"}),
     "tenants.classes.a.kv_watermark", "number"),
    (with_(tenants={"classes": {"a": {"kv_watermark": float("inf")}}, "default_class": "a"}),
     "tenants.classes.a.kv_watermark", "finite"),
    (with_(tenants={"tenants": {"t": {"api_key_sha256": "secret"}}}),
     "tenants.tenants.t.api_key_sha256", "64 hex"),
    (with_(tenants={"classes": {"a": {"fairness": "drr"}}, "default_class": "a"}),
     "tenants.classes.a.fairness", "one of tenant, fifo"),
    (with_(tenants={"tenants": {"t": {"weight": 0}}}), "tenants.tenants.t.weight", "> 0.0"),
    (with_(tenants={"tenants": {"t": {"weight": -2}}}), "tenants.tenants.t.weight", "> 0.0"),
    (with_(tenants={"tenants": {"t": {"weight": "heavy"}}}), "tenants.tenants.t.weight", "number"),
    (with_(tenants={"tenants": {"t": {"weight": float("nan")}}}), "tenants.tenants.t.weight", "finite"),
    (with_(tenants={"tenants": {"t": {"weight": 5000}}}), "tenants.tenants.t.weight", "<= 1000.0"),
    (with_(store={"redis": {"url": "http://x"}}), "store.redis.url", "redis://"),
    (with_(store={"redis": {"on_unavailable": "pray"}}), "store.redis.on_unavailable", "one of"),
    (with_(store={"redis": {"refresh_s": 0.01}}), "store.redis.refresh_s", ">= 0.05"),
    (with_(store={"redis": {"refresh_s": "1s"}}), "store.redis.refresh_s", "number"),
    (with_(store={"redis": {"lease_ttl_s": 6, "refresh_s": 3}}), "store.redis.refresh_s", "lease_ttl_s / 3"),
    (with_(store="etcd"), "store", "memory"),
    (with_(server={"grpc_listen": "nowhere"}), "server.grpc_listen", "HOST:PORT"),
    (with_(limits={"max_body_bytes": "1MB"}), "limits.max_body_bytes", "integer"),
    (with_(surprise=1), "surprise", "unknown key"),
    ([1, 2], "<root>", "mapping"),
])
def test_bad_values_name_the_key(data, key, words):
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert exc.value.key == key
    assert words in exc.value.reason


def test_kv_watermark_defaults_to_the_whole_budget_and_reads_a_ratio():
    cfg = parse_config(with_(tenants={"classes": {"standard": {}, "batch": {"kv_watermark": 0.7},
                                                  "full": {"kv_watermark": 1}}}))
    classes = cfg.tenants.classes
    assert classes["standard"].kv_watermark == 1.0
    assert classes["batch"].kv_watermark == 0.7
    assert classes["full"].kv_watermark == 1.0 and isinstance(classes["full"].kv_watermark, float)


def test_fairness_defaults_to_tenants_in_turn_with_weight_one():
    cfg = parse_config(with_(tenants={"classes": {"standard": {}, "bulk": {"fairness": "fifo"}},
                                      "tenants": {"a": {}, "b": {"weight": 2.5}}}))
    assert cfg.tenants.classes["standard"].fairness == "tenant"
    assert cfg.tenants.classes["bulk"].fairness == "fifo"
    assert cfg.tenants.tenants["a"].weight == 1.0 and cfg.tenants.tenants["b"].weight == 2.5


def test_shared_api_key_is_refused():
    key = "cd" * 32
    data = with_(tenants={"tenants": {"a": {"api_key_sha256": key}, "b": {"api_key_sha256": [key]}}})
    with pytest.raises(ConfigError, match="already belongs to tenant 'a'"):
        parse_config(data)


def test_unreadable_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools: {default: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError):
        load_config(binary)


# --- duplicate keys, header names, classes the file must name ------------------------

def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("pools:\n  default:\n    max_concurrency: 8\n    tpm: 1000\n    max_concurrency: 64\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "'max_concurrency' appears twice" in err.value.reason and "lines 3 and 5" in err.value.reason
    # The same key in two different mappings is fine.
    path.write_text("pools:\n  a: {max_concurrency: 8}\n  b: {max_concurrency: 8}\ndefault_pool: a\n")
    assert load_config(path).pools["b"].max_concurrency == 8


@pytest.mark.parametrize("header", ["x tenant", "x-tenant:", "", "x-t\u00e9nant", "x-tenant\n"])
def test_a_tenant_header_that_is_no_header_name_is_an_error(header):
    with pytest.raises(ConfigError) as err:
        parse_config({"pools": {"default": {}}, "tenants": {"header": header}})
    assert err.value.key == "tenants.header"


def test_a_missing_default_class_says_what_to_do():
    with pytest.raises(ConfigError) as err:
        parse_config({"pools": {"default": {}}, "tenants": {"classes": {"online": {}, "batch": {}}}})
    assert err.value.key == "tenants.default_class"
    assert "no class is named 'standard'" in err.value.reason and "batch, online" in err.value.reason
    cfg = parse_config({"pools": {"default": {}},
                        "tenants": {"default_class": "online", "classes": {"online": {}, "batch": {}}}})
    assert cfg.tenants.default_class == "online"


def _keyed(classes: dict, default: str = "standard", **extra) -> dict:
    return {"pools": {"default": {"max_concurrency": 4}},
            "tenants": {"default_class": default, "classes": classes, **extra,
                        "tenants": {"k": {"class": default, "api_key_sha256": "a" * 64}}}}


def test_without_a_valid_key_a_request_gets_the_lowest_class_where_tenants_have_keys():
    cfg = parse_config(_keyed({"online": {"priority": 10}, "batch": {"priority": -1},
                               "bulk": {"priority": -1, "guaranteed_slots": 1}}, default="online"))
    assert cfg.tenants.unauthenticated == "batch"
    assert cfg.class_of("nobody").name == "batch" and cfg.class_of("k").name == "online"
    # Among the lowest, the default class when it is one of them.
    cfg = parse_config(_keyed({"standard": {}, "gold": {}}))
    assert cfg.tenants.unauthenticated == "standard"
    # Without keys nothing changes: the default class.
    plain = parse_config({"pools": {"default": {"max_concurrency": 4}},
                          "tenants": {"classes": {"standard": {"priority": 5}, "low": {"priority": 0}}}})
    assert plain.class_of("nobody").name == "standard"


def test_the_unauthenticated_is_set_or_refused_and_checked():
    classes = {"online": {"priority": 10}, "batch": {}}
    assert parse_config(_keyed(classes, default="online", unauthenticated="online")).class_of("x").name == "online"
    assert parse_config(_keyed(classes, default="online", unauthenticated="reject")).tenants.unauthenticated is None
    with pytest.raises(ConfigError, match="tenants.unauthenticated"):
        parse_config(_keyed(classes, default="online", unauthenticated="gold"))
