"""picking.kv_events: where a picking pool's engines publish their KV cache events, validated
when loaded with errors that name the key."""

from __future__ import annotations

import pytest

from extproc.config import KvEventsConfig, KvEventsEndpoint
from extproc.configparse import parse_config, warnings
from extproc.errors import ConfigError


def pool(kv_events: object, backends: int = 2) -> dict:
    return {"pools": {"p": {
        "backends": [{"name": f"n{i}", "metrics_url": f"http://127.0.0.1:9/{i}", "address": f"10.0.0.{i + 1}:8000"}
                     for i in range(backends)],
        "picking": {"kv_events": kv_events}}}}


def test_a_port_gives_every_node_its_endpoints_and_endpoints_override_it():
    cfg = parse_config(pool({"port": 5557, "replay_port": 5558, "topic": "kv",
                             "endpoints": [{"backend": "n1", "endpoint": "tcp://127.0.0.1:6000"}]}))
    ke = cfg.pools["p"].picking.kv_events
    assert ke == KvEventsConfig(5557, 5558, (KvEventsEndpoint("n1", "tcp://127.0.0.1:6000"),), "kv")
    assert ke.endpoint_of("n0", "10.0.0.1:8000") == ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")
    assert ke.endpoint_of("n1", "10.0.0.2:8000") == ("tcp://127.0.0.1:6000", None)
    assert ke.endpoint_of("n9", "[fd00::1]:8000") == ("tcp://[fd00::1]:5557", "tcp://[fd00::1]:5558")
    assert parse_config(pool({"port": 5557})).pools["p"].picking.kv_events.topic == ""
    local = parse_config(pool({"endpoints": [{"backend": "n0", "endpoint": "ipc://run/kv.sock"}]}))
    assert local.pools["p"].picking.kv_events.endpoint_of("n0", "10.0.0.1:8000") == ("ipc://run/kv.sock", None)
    assert local.pools["p"].picking.kv_events.endpoint_of("n1", "10.0.0.2:8000") is None


@pytest.mark.parametrize(("kv_events", "key", "says"), [
    ({}, "kv_events.port", "required unless endpoints"),
    ({"port": 70000}, "kv_events.port", "TCP port"),
    ({"replay_port": 5558}, "kv_events.replay_port", "needs port"),
    ({"port": 5557, "max_blocks": 0}, "kv_events.max_blocks", ""),
    ({"port": 5557, "bogus": 1}, "kv_events.bogus", "unknown key"),
    ({"endpoints": {"n0": "tcp://x:1"}}, "kv_events.endpoints", "must be a list"),
    ({"endpoints": [{"backend": "n0"}]}, "kv_events.endpoints[0].endpoint", "is required"),
    ({"endpoints": [{"endpoint": "tcp://127.0.0.1:1"}]}, "kv_events.endpoints[0].backend", "is required"),
    ({"endpoints": [{"backend": "n0", "endpoint": "http://127.0.0.1:1"}]}, "kv_events.endpoints[0].endpoint",
     "tcp://HOST:PORT"),
    ({"endpoints": [{"backend": "n0", "endpoint": "ipc:// x"}]}, "kv_events.endpoints[0].endpoint", "ipc://PATH"),
    ({"endpoints": [{"backend": "n0", "endpoint": "tcp://127.0.0.1:0"}]}, "kv_events.endpoints[0].endpoint",
     "tcp://HOST:PORT"),
    ({"endpoints": [{"backend": "n0", "endpoint": "tcp://h:1", "replay_endpoint": "tcp://h"}]},
     "kv_events.endpoints[0].replay_endpoint", "tcp://HOST:PORT"),
    ({"endpoints": [{"backend": "n0", "endpoint": "tcp://h:1"}, {"backend": "n0", "endpoint": "tcp://h:2"}]},
     "kv_events.endpoints[1].backend", "duplicate"),
    ({"endpoints": [{"backend": "nx", "endpoint": "tcp://h:1"}]}, "kv_events.endpoints[0].backend",
     "names no backend"),
])
def test_a_wrong_value_is_refused_with_its_key(kv_events, key, says):
    with pytest.raises(ConfigError) as err:
        parse_config(pool(kv_events))
    assert err.value.key == f"pools.p.picking.{key}"
    assert says in str(err.value)


def test_check_config_says_the_redis_store_does_not_use_them_yet():
    raw = pool({"port": 5557})
    raw["store"] = {"redis": {"url": "redis://127.0.0.1:6379/0", "expected_replicas": 2}}
    assert any("kv_events has no effect with the Redis store" in w for w in warnings(parse_config(raw)))
    assert not any("kv_events" in w for w in warnings(parse_config(pool({"port": 5557}))))
