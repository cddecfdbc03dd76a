"""`kvgate envoy-filter` and `kvgate check-config --envoy`: the Envoy file written from kvgate's
configuration validates with the real Envoy, matches the shipped files, and every value an
operator can get wrong by hand is reported by the kvgate key it breaks."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.configparse import load_config, parse_config
from extproc.envoycheck import check_envoy
from extproc.envoyconf import MODES, envoy_bootstrap, envoy_filter, picks_by_mode
from extproc.errors import ConfigError
from extproc.request.profile import PROFILES
from tests.deploy.support import K8S, ROOT, docs, envoy_binary, envoy_validate

KVGATE = ROOT / "deploy" / "kvgate.yaml"  # pool level: backends without addresses
LOCAL = ROOT / "deploy" / "local" / "kvgate.yaml"  # picking: every backend has an address
SHIPPED = {name: row.file for name, row in PROFILES.items()}


def fitting(mode: str) -> Path:
    """fitting is the shipped kvgate file a mode's Envoy file goes with: the picking one for a
    mode that routes by the node kvgate names, the pool-level one otherwise."""
    return LOCAL if picks_by_mode(mode) else KVGATE


def kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extproc", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


@pytest.mark.parametrize("mode", MODES)
def test_the_printed_file_validates_with_envoy_and_is_the_shipped_one(mode: str, tmp_path: Path) -> None:
    out = kvgate("envoy-filter", "--config", str(fitting(mode)), "--mode", mode, "--bootstrap")
    assert out.returncode == 0, out.stderr
    path = tmp_path / "envoy.yaml"
    path.write_text(out.stdout)
    checked = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error",
                              "--disable-hot-restart"], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The shipped file for the mode is the written one plus comments: one source of truth.
    assert yaml.safe_load(out.stdout) == yaml.safe_load((ROOT / "deploy" / SHIPPED[mode]).read_text())


@pytest.mark.parametrize("mode", MODES)
def test_the_blocks_alone_make_a_file_envoy_accepts(mode: str, tmp_path: Path) -> None:
    """Without --bootstrap: every block placed where its key says, into a listener of one's
    own that adds only its name, address and stat_prefix, is a file Envoy accepts: the
    upstream cluster the routes name, the connection limit, the timeouts, the paths' rules and
    Envoy's OpenAI-shaped answers all come with the blocks."""
    out = kvgate("envoy-filter", "--config", str(fitting(mode)), "--mode", mode)
    assert out.returncode == 0, out.stderr
    piece = yaml.safe_load(out.stdout)
    assert set(piece) == {"overload_manager", "listener", "http_connection_manager", "virtual_host",
                          "clusters"}
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "mine", **piece["http_connection_manager"],
        "route_config": {"virtual_hosts": [{"name": "mine", "domains": ["*"], **piece["virtual_host"]}]}}
    mine = {"overload_manager": piece["overload_manager"], "static_resources": {
        "listeners": [{"name": "mine", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
                       **piece["listener"], "filter_chains": [{"filters": [{"name": "hcm", "typed_config": hcm}]}]}],
        "clusters": piece["clusters"]}}
    checked = envoy_validate(mine, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert check_envoy(load_config(fitting(mode)), mine) == []
    # The blocks are the whole file's: the same file, but for the names and addresses.
    whole = yaml.safe_load(kvgate("envoy-filter", "--config", str(fitting(mode)), "--mode", mode,
                                  "--bootstrap").stdout)
    listener = whole["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == piece["listener"]["per_connection_buffer_limit_bytes"]
    assert hcm_of(whole)["http_filters"] == piece["http_connection_manager"]["http_filters"]
    assert whole["static_resources"]["clusters"] == piece["clusters"]


def test_the_values_follow_the_kvgate_file() -> None:
    data = yaml.safe_load(KVGATE.read_text())
    data["tenants"]["header"] = "x-team"
    data["tenants"]["classes"]["interactive"]["max_wait_s"] = 90.0
    data["server"]["grpc_listen"] = "127.0.0.1:6001"
    data["limits"]["max_body_bytes"] = 2_000_000
    config = parse_config(data)
    piece = envoy_filter(config)
    filters = {f["name"]: f["typed_config"] for f in piece["http_connection_manager"]["http_filters"]}
    ext = filters["envoy.filters.http.ext_proc"]
    assert "request.headers['x-team']" in ext["request_attributes"]
    assert filters["envoy.filters.http.header_mutation"]["mutations"]["request_mutations"][0] == {
        "remove": "x-team"}
    assert filters["envoy.filters.http.buffer"]["max_request_bytes"] == 8_000_000
    assert ext["max_message_timeout"] == "91s"  # 90 s of waiting + kvgate's 1 s margin
    assert piece["listener"]["per_connection_buffer_limit_bytes"] == 8_000_000
    assert piece["virtual_host"]["routes"][0]["match"]["headers"][0]["range_match"]["start"] == 2_000_001
    address = piece["clusters"][1]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "127.0.0.1", "port_value": 6001}
    boot = envoy_bootstrap(config)
    # The upload's 60 s on top of the longest wait kvgate may ask for: a waiting request is
    # not cut by request_timeout before its class's max_wait_s.
    assert hcm_of(boot)["request_timeout"] == "151s"
    assert check_envoy(config, boot) == []


def test_every_shipped_envoy_file_agrees_with_the_kvgate_file_of_its_kind_and_no_other() -> None:
    """A picking kvgate file beside a pool-level Envoy file, or a pool-level one beside a
    picker file, fails every request at run time (500 gateway_misconfigured, or Envoy's
    plain-text 503): the check names that one disagreement, by the pool's backends."""
    for mode, envoy_file in SHIPPED.items():
        doc = yaml.safe_load((ROOT / "deploy" / envoy_file).read_text())
        for path in (KVGATE, LOCAL):
            found = check_envoy(load_config(path), doc)
            if path == fitting(mode):
                assert found == [], (envoy_file, path)
            else:
                assert [d.key for d in found] == ["pools.default.backends"], (envoy_file, path, found)
    out = kvgate("check-config", str(KVGATE), "--envoy", str(ROOT / "deploy" / "envoy.yaml"))
    assert out.returncode == 0 and "agrees" in out.stdout, out.stderr


@pytest.mark.parametrize(("config", "envoy_file", "said"), [
    (LOCAL, "envoy.yaml", ["picks its nodes", "gateway_misconfigured", "deploy/envoy-endpoint-picker.yaml"]),
    (KVGATE, "envoy-endpoint-picker.yaml", ["does not pick", "plain-text 503", "deploy/envoy.yaml"]),
    (KVGATE, "envoy-inference-pool.yaml", ["does not pick", "plain-text 503", "deploy/envoy.yaml"]),
])
def test_check_config_refuses_a_picking_pair_that_disagrees(config: Path, envoy_file: str, said: list[str]) -> None:
    out = kvgate("check-config", str(config), "--envoy", str(ROOT / "deploy" / envoy_file))
    assert out.returncode == 2 and "agrees" not in out.stdout, out.stdout
    assert "error: pools.default.backends:" in out.stderr
    assert all(s in out.stderr for s in said), out.stderr


@pytest.mark.parametrize("mode", MODES)
def test_envoy_filter_never_writes_a_pair_that_disagrees(mode: str) -> None:
    for path in (KVGATE, LOCAL):
        config = load_config(path)
        if path == fitting(mode):
            assert check_envoy(config, envoy_bootstrap(config, mode)) == []
        else:
            with pytest.raises(ConfigError) as err:
                envoy_bootstrap(config, mode)
            assert err.value.key == "pools.default.backends"
            with pytest.raises(ConfigError):
                envoy_filter(config, mode)


def test_envoy_filter_without_mode_writes_the_one_that_fits_and_refuses_one_that_does_not() -> None:
    assert check_envoy(load_config(LOCAL), envoy_bootstrap(load_config(LOCAL))) == []
    assert check_envoy(load_config(KVGATE), envoy_bootstrap(load_config(KVGATE))) == []
    out = kvgate("envoy-filter", "--config", str(LOCAL), "--bootstrap")
    assert out.returncode == 0 and "--mode endpoint-picker`" in out.stdout, out.stderr
    out = kvgate("envoy-filter", "--config", str(LOCAL), "--mode", "three-message")
    assert out.returncode == 2 and out.stdout == ""
    assert "error: pools.default.backends: pool 'default' picks its nodes" in out.stderr


def test_a_second_pool_that_picks_behind_a_route_of_the_pool_level_file_is_named() -> None:
    """Per route: a route that names a picking pool (route metadata) in a pool-level file."""
    cfg = yaml.safe_load(KVGATE.read_text())
    cfg["pools"]["llama"] = {"backends": [{"name": "n0", "metrics_url": "http://10.0.0.1:8000/metrics",
                                            "address": "10.0.0.1:8000"}]}
    doc = copy.deepcopy(shipped("envoy.yaml"))
    for route in hcm_of(doc)["route_config"]["virtual_hosts"][0]["routes"]:
        for entry in route.get("typed_per_filter_config", {}).get(
                "envoy.filters.http.set_metadata", {}).get("metadata", []):
            entry["value"]["pool"] = "llama"
    found = check_envoy(parse_config(cfg), doc)
    assert [d.key for d in found] == ["pools.llama.backends"], found


def test_the_kubernetes_envoy_file_agrees_with_the_kubernetes_kvgate_file() -> None:
    envoy = yaml.safe_load(docs(K8S / "envoy-config.yaml")[0]["data"]["envoy.yaml"])
    kv = yaml.safe_load(docs(K8S / "kvgate-config.yaml")[0]["data"]["kvgate.yaml"])
    assert check_envoy(parse_config(kv), envoy) == []


def shipped(name: str = "envoy.yaml") -> dict[str, Any]:
    return yaml.safe_load((ROOT / "deploy" / name).read_text())


def hcm_of(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def ext_of(doc: dict[str, Any]) -> dict[str, Any]:
    return next(f["typed_config"] for f in hcm_of(doc)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")


def _tenant_header(doc: dict, cfg: dict) -> None:
    cfg["tenants"]["header"] = "x-org"


def _grpc_port(doc: dict, cfg: dict) -> None:
    cfg["server"]["grpc_listen"] = "0.0.0.0:50052"


def _cluster_name(doc: dict, cfg: dict) -> None:
    ext_of(doc)["grpc_service"]["envoy_grpc"]["cluster_name"] = "kvgat"


def _long_wait(doc: dict, cfg: dict) -> None:
    cfg["tenants"]["classes"]["interactive"]["max_wait_s"] = 120.0  # Envoy's ceiling is 60 s


def _base_timeout(doc: dict, cfg: dict) -> None:
    ext_of(doc)["message_timeout"] = "0.2s"


def _bigger_bodies(doc: dict, cfg: dict) -> None:
    cfg["limits"]["max_body_bytes"] = 8 * 1024 * 1024


def _route_pool(doc: dict, cfg: dict) -> None:
    hcm_of(doc)["route_config"]["virtual_hosts"][0]["routes"][-1]["typed_per_filter_config"][
        "envoy.filters.http.set_metadata"]["metadata"][0]["value"] = {"pool": "llama", "tier": "gold"}


def _no_set_metadata(doc: dict, cfg: dict) -> None:
    hcm_of(doc)["http_filters"][:] = [f for f in hcm_of(doc)["http_filters"]
                                      if f["name"] != "envoy.filters.http.set_metadata"]


def _mutations(doc: dict) -> list:
    strip = next(f for f in hcm_of(doc)["http_filters"] if f["name"] == "envoy.filters.http.header_mutation")
    return strip["typed_config"]["mutations"]["request_mutations"]


def _no_tenant_strip(doc: dict, cfg: dict) -> None:
    _mutations(doc).pop(0)


def _no_objective_strip(doc: dict, cfg: dict) -> None:
    _mutations(doc).remove({"remove": "x-llm-d-inference-objective"})


def _strip_names_another_header(doc: dict, cfg: dict) -> None:
    _mutations(doc)[0] = {"remove": "x-tenant"}


def _strip_after_ext_proc(doc: dict, cfg: dict) -> None:
    filters = hcm_of(doc)["http_filters"]
    filters.insert(-2, filters.pop(0))  # still there, but ext_proc reads the client's copy first


def _no_forwarding(doc: dict, cfg: dict) -> None:
    del ext_of(doc)["metadata_options"]


def _no_access_log(doc: dict, cfg: dict) -> None:
    del hcm_of(doc)["access_log"]


# (what breaks, the Envoy file it starts from, the kvgate keys reported)
BREAKS = [
    (_tenant_header, "envoy.yaml", ["tenants.header", "tenants.header"]),  # attributes, strip
    (_grpc_port, "envoy.yaml", ["server.grpc_listen"]),
    (_cluster_name, "envoy.yaml", ["server.grpc_listen"]),
    (_long_wait, "envoy.yaml", ["tenants.classes.interactive.max_wait_s"]),
    (_base_timeout, "envoy.yaml", ["server.envoy_message_timeout_s"]),
    (_bigger_bodies, "envoy.yaml", ["limits.max_body_bytes", "limits.max_body_bytes"]),
    (_bigger_bodies, "envoy-four-message.yaml", ["limits.max_body_bytes"]),  # no 413 route there
    (_route_pool, "envoy.yaml", ["pools", "pools"]),
    (_no_set_metadata, "envoy.yaml", ["pools"]),
    (_no_forwarding, "envoy.yaml", ["pools"]),
    # Named at each route that says release: access_log (the default one and the two that
    # send the headers of requests without a body).
    (_no_access_log, "envoy-access-log.yaml", ["server.access_log_ttl_s"] * 3),
    (_no_tenant_strip, "envoy.yaml", ["tenants.header"]),
    (_no_tenant_strip, "envoy-endpoint-picker.yaml", ["tenants.header"]),
    (_strip_names_another_header, "envoy-four-message.yaml", ["tenants.header"]),
    (_strip_after_ext_proc, "envoy.yaml", ["tenants.header", "tenants.fairness_header",
                                           "tenants.objective_header"]),
    (_no_objective_strip, "envoy-inference-pool.yaml", ["tenants.objective_header"]),
]


@pytest.mark.parametrize(("brk", "start", "keys"), BREAKS, ids=[f"{b[0].__name__[1:]}-{b[1]}" for b in BREAKS])
def test_each_disagreement_is_reported_by_its_kvgate_key(brk, start: str, keys: list[str]) -> None:
    doc = copy.deepcopy(shipped(start))
    mode = next(m for m, f in SHIPPED.items() if f == start)
    cfg = yaml.safe_load(fitting(mode).read_text())
    brk(doc, cfg)
    found = check_envoy(parse_config(cfg), doc)
    assert sorted(d.key for d in found) == sorted(keys), found
    assert all(d.where and d.reason for d in found)


def test_the_504_that_bit_twice_is_named_with_what_to_set(tmp_path: Path) -> None:
    cfg = yaml.safe_load(KVGATE.read_text())
    cfg["tenants"]["classes"]["interactive"]["max_wait_s"] = 120.0
    (tmp_path / "kvgate.yaml").write_text(yaml.safe_dump(cfg))
    out = kvgate("check-config", str(tmp_path / "kvgate.yaml"), "--envoy", str(ROOT / "deploy" / "envoy.yaml"))
    assert out.returncode == 2
    assert "error: tenants.classes.interactive.max_wait_s:" in out.stderr
    assert "504" in out.stderr and "at least 121s" in out.stderr


def test_an_envoy_file_without_ext_proc_or_unreadable_is_an_error(tmp_path: Path) -> None:
    assert [d.key for d in check_envoy(load_config(KVGATE), {"static_resources": {}})] == ["-"]
    (tmp_path / "bad.yaml").write_text("static_resources: [unclosed\n")
    out = kvgate("check-config", str(KVGATE), "--envoy", str(tmp_path / "bad.yaml"))
    assert out.returncode == 2 and "cannot read" in out.stderr
