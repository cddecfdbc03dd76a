"""DNS discovery of a pool's nodes: what each lookup result does to the pool's backends."""

from __future__ import annotations

import pytest

from extproc.errors import ConfigError
from extproc.configparse import parse_config
from extproc.signals.discovery import Discovery, resolve_a


def cfg(dns: str = "vllm.inference.svc.cluster.local", port: int = 8000):
    return parse_config({"pools": {"default": {"discovery": {"dns": dns, "port": port}}}})


class Lookups:
    """Lookups answers each lookup from a script: a list of addresses or an OSError."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.asked: list[tuple[str, int]] = []

    def __call__(self, name: str, port: int) -> list[str]:
        self.asked.append((name, port))
        got = self.answers.pop(0)
        if isinstance(got, OSError):
            raise got
        return got


def test_nodes_appear_and_vanish_with_the_records_and_a_failed_lookup_keeps_them():
    seen = []
    lookups = Lookups(["10.0.0.2", "10.0.0.1"], ["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"],
                      OSError("Temporary failure in name resolution"), [], ["10.0.0.3"])
    d = Discovery(cfg(), lambda pool, backends: seen.append((pool, [b.address for b in backends])),
                  resolve=lookups)
    for _ in range(6):
        d.poll_once()
    assert seen == [("default", ["10.0.0.1:8000", "10.0.0.2:8000"]),   # first answer
                    ("default", ["10.0.0.2:8000", "10.0.0.3:8000"]),   # one gone, one new
                    ("default", ["10.0.0.3:8000"])]                    # after a failure and an empty answer
    assert lookups.asked[0] == ("vllm.inference.svc.cluster.local", 8000)


def test_discovered_backends_are_picking_nodes_with_their_metrics_on_the_same_port():
    (b,) = cfg().pools["default"].discovery.backends(["10.1.2.3"])
    assert (b.name, b.address, b.metrics_url, b.engine) == (
        "10.1.2.3_8000", "10.1.2.3:8000", "http://10.1.2.3:8000/metrics", "vllm")
    assert cfg().pools["default"].picks


def test_a_real_lookup_of_a_loopback_name():
    assert resolve_a("localhost", 80) == ["127.0.0.1"] or "127.0.0.1" in resolve_a("localhost", 80)


@pytest.mark.parametrize(("section", "key"), [
    ({"dns": "not a name", "port": 8000}, "discovery.dns"),
    ({"dns": "svc", "port": 70000}, "discovery.port"),
    ({"dns": "svc", "port": 8000, "engine": "dcgm"}, "discovery.engine"),
    ({"dns": "svc", "port": 8000, "metrics_path": "metrics"}, "discovery.metrics_path"),
])
def test_bad_discovery_settings_name_their_key(section, key):
    with pytest.raises(ConfigError) as err:
        parse_config({"pools": {"default": {"discovery": section}}})
    assert err.value.key == f"pools.default.{key}"


def test_a_pool_lists_its_backends_or_discovers_them():
    with pytest.raises(ConfigError, match="not both"):
        parse_config({"pools": {"default": {
            "discovery": {"dns": "svc", "port": 8000},
            "backends": [{"name": "a", "metrics_url": "http://127.0.0.1:1/m", "address": "127.0.0.1:1"}]}}})
