"""localstack.render_envoy: a file of deploy/ pointed at loopback ports, as the local stack,
the tests and the benchmarks run it."""

from __future__ import annotations

from pathlib import Path

import yaml

from extproc.localstack import render_envoy
from kvgate_testkit.procs import ROOT
from tests.deploy.support import envoy_validate

POOL_ENVOY = ROOT / "deploy" / "envoy.yaml"


def test_render_envoy_points_the_pool_file_at_loopback(tmp_path: Path) -> None:
    cfg = render_envoy(yaml.safe_load(POOL_ENVOY.read_text()), listen=18080, admin=18081, grpc=15051, upstream=18000)
    assert cfg["admin"]["address"] == {"socket_address": {"address": "127.0.0.1", "port_value": 18081}}
    listener = cfg["static_resources"]["listeners"][0]
    assert listener["address"] == {"socket_address": {"address": "127.0.0.1", "port_value": 18080}}
    ports = {c["name"]: c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
             ["socket_address"] for c in cfg["static_resources"]["clusters"]}
    assert ports == {"inference": {"address": "127.0.0.1", "port_value": 18000},
                     "kvgate": {"address": "127.0.0.1", "port_value": 15051}}
    done = envoy_validate(cfg, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_render_envoy_leaves_an_original_dst_cluster_alone() -> None:
    picked = {"name": "picked", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
              "original_dst_lb_config": {"use_http_header": True,
                                         "http_header_name": "x-gateway-destination-endpoint"}}
    template = {"static_resources": {
        "listeners": [{"name": "l", "address": {"socket_address": {"address": "0.0.0.0", "port_value": 8080}}}],
        "clusters": [dict(picked), {"name": "kvgate", "type": "STRICT_DNS"}]}}
    cfg = render_envoy(template, listen=1, admin=4, grpc=2, upstream=3)
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert clusters["picked"] == picked
    assert clusters["kvgate"]["type"] == "STATIC"
