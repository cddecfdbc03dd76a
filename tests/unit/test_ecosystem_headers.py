"""The endpoint picker ecosystem's fairness and objective headers (llm-d's
x-llm-d-inference-fairness-id and x-llm-d-inference-objective): a tenant when the tenant
header is absent, a class, under the tenant header's rules; and every Envoy file kvgate
writes strips the client's copies, so only a header Envoy sets reaches kvgate."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import struct_pb2

from extproc.configparse import parse_config
from extproc.envoycheck import check_envoy
from extproc.envoyconf import MODES, envoy_bootstrap, header_strip, picks_by_mode
from extproc.errors import ConfigError
from kvgate_testkit.stream import Stream
from tests.unit.test_exchange import API_KEY, BASE_CONFIG, Rig, body_msg, chat, headers_msg, route_metadata

FAIRNESS = "x-llm-d-inference-fairness-id"
OBJECTIVE = "x-llm-d-inference-objective"


async def admitted_class(rig: Rig, extra: list[tuple[str, str]], metadata: Any = None) -> tuple[str, str]:
    ex = Stream(rig.gate)
    resp = ex.request_headers(headers_msg(extra=extra), metadata)
    assert not resp.HasField("immediate_response"), resp
    await ex.request_body(body_msg(chat()))
    assert ex.ending is not None
    got = (ex.admitted.lease.demand.tenant, ex.admitted.lease.demand.class_name)
    ex.finish()
    return got


def refused(rig: Rig, extra: list[tuple[str, str]]) -> int:
    resp = Stream(rig.gate).request_headers(headers_msg(extra=extra))
    return resp.immediate_response.status.code


async def test_the_fairness_header_names_the_tenant_when_the_tenant_header_is_absent():
    rig = Rig()
    assert await admitted_class(rig, [(FAIRNESS, "acme")]) == ("acme", "standard")
    # The tenant header, when given, wins.
    assert await admitted_class(rig, [(FAIRNESS, "nobody"), ("x-tenant-id", "acme")]) == ("acme", "standard")
    assert await admitted_class(rig, [(FAIRNESS, "nobody")]) == ("_anonymous", "standard")


async def test_the_fairness_header_follows_the_tenant_headers_rules():
    rig = Rig()
    # A tenant with keys is reachable only with one of them, whichever header names it.
    assert refused(rig, [(FAIRNESS, "gold-1")]) == 401
    assert await admitted_class(rig, [(FAIRNESS, "acme"), ("authorization", f"Bearer {API_KEY}")]) \
        == ("gold-1", "gold")
    assert refused(rig, [(FAIRNESS, "acme"), (FAIRNESS, "acme")]) == 400
    assert rig.inflight() == 0


async def flow_of(rig: Rig, extra: list[tuple[str, str]]) -> str | None:
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg(extra=extra))
    await ex.request_body(body_msg(chat()))
    assert ex.ending is not None
    flow = ex.admitted.lease.demand.fairness_id
    ex.finish()
    return flow


async def test_the_fairness_header_names_an_anonymous_requests_flow_in_the_wait_queue():
    rig = Rig()
    # Anonymous requests share one flow unless the fairness header names one each.
    assert await flow_of(rig, []) is None
    assert await flow_of(rig, [(FAIRNESS, "user-7")]) == "_anonymous:user-7"
    assert await flow_of(rig, [(FAIRNESS, " ")]) is None
    assert await flow_of(rig, [(FAIRNESS, "u" * 500)]) == "_anonymous:" + "u" * 128
    # A configured tenant is one flow, whichever header names it.
    assert await flow_of(rig, [(FAIRNESS, "acme")]) is None
    assert await flow_of(rig, [(FAIRNESS, "user-7"), ("x-tenant-id", "acme")]) is None
    assert await flow_of(rig, [(FAIRNESS, "user-7"), ("authorization", f"Bearer {API_KEY}")]) is None
    assert rig.inflight() == 0


async def test_the_objective_header_names_the_class():
    rig = Rig()
    assert await admitted_class(rig, [(OBJECTIVE, "gold")]) == ("_anonymous", "gold")
    assert await admitted_class(rig, [(OBJECTIVE, " patient "), ("x-tenant-id", "acme")]) == ("acme", "patient")
    # A name of no class keeps the tenant's class; the route's class wins over the header.
    assert await admitted_class(rig, [(OBJECTIVE, "platinum"), ("x-tenant-id", "acme")]) == ("acme", "standard")
    assert await admitted_class(rig, [(OBJECTIVE, "gold")], route_metadata(tenant_class="patient")) \
        == ("_anonymous", "patient")
    assert refused(rig, [(OBJECTIVE, "gold"), (OBJECTIVE, "gold")]) == 400
    assert rig.inflight() == 0


async def test_headers_set_to_null_are_not_read():
    rig = Rig({"tenants": {**BASE_CONFIG["tenants"], "fairness_header": None, "objective_header": None}})
    assert await admitted_class(rig, [(FAIRNESS, "acme"), (OBJECTIVE, "gold")]) == ("_anonymous", "standard")


async def test_other_names_can_be_configured():
    rig = Rig({"tenants": {**BASE_CONFIG["tenants"], "fairness_header": "X-Gateway-Inference-Fairness-Id",
                           "objective_header": "x-gateway-inference-objective"}})
    assert await admitted_class(rig, [("x-gateway-inference-fairness-id", "acme"),
                                      ("x-gateway-inference-objective", "gold")]) == ("acme", "gold")
    assert await admitted_class(rig, [(FAIRNESS, "acme")]) == ("_anonymous", "standard")


async def test_both_headers_are_read_from_request_attributes_when_envoy_skips_headers():
    rig = Rig()
    attrs = struct_pb2.Struct()
    attrs.update({"request.path": "/v1/chat/completions", "request.method": "POST",
                  f"request.headers['{FAIRNESS}']": "acme", f"request.headers['{OBJECTIVE}']": "gold"})
    ex = Stream(rig.gate)
    await ex.request_body(body_msg(chat()), attributes={"envoy.filters.http.ext_proc": attrs})
    assert ex.ending is not None and (ex.admitted.lease.demand.tenant, ex.admitted.lease.demand.class_name) == ("acme", "gold")
    ex.finish()
    assert rig.count("kvgate_tenant_header_unseen_total", reason="other_header") == 0


@pytest.mark.parametrize("tenants, key", [
    ({"fairness_header": "x-tenant-id"}, "tenants.fairness_header"),
    ({"objective_header": FAIRNESS}, "tenants.objective_header"),
    ({"objective_header": "bad header"}, "tenants.objective_header"),
    ({"fairness_header": 7}, "tenants.fairness_header"),
])
def test_a_bad_header_setting_is_refused_by_its_key(tenants: dict[str, Any], key: str):
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE_CONFIG, "tenants": {**BASE_CONFIG["tenants"], **tenants}})
    assert err.value.key == key


@pytest.mark.parametrize("mode", MODES)
def test_every_envoy_file_kvgate_writes_strips_the_clients_copies(mode: str):
    base = BASE_CONFIG
    if picks_by_mode(mode):  # a picker file is written only for a pool that picks its nodes
        default = {**base["pools"]["default"], "backends": [
            {"name": "n0", "metrics_url": "http://10.0.0.1:8000/metrics", "address": "10.0.0.1:8000"}]}
        base = {**base, "pools": {**base["pools"], "default": default}}
    config = parse_config(base)
    removed = [m.get("remove") for m in header_strip(config)]
    assert removed[:3] == ["x-tenant-id", FAIRNESS, OBJECTIVE]
    assert check_envoy(config, envoy_bootstrap(config, mode)) == []
    off = parse_config({**BASE_CONFIG, "tenants": {**BASE_CONFIG["tenants"], "objective_header": None}})
    assert OBJECTIVE not in [m.get("remove") for m in header_strip(off)]
