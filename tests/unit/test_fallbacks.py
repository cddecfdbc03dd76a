"""Fallback endpoints (``picking.fallbacks``): after the node it charges, kvgate names the next
best nodes that also fit, in the endpoint picker protocol's list; the charge stays on the first
until the proxy says another served. The setting is checked when the config is loaded."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from extproc.admission import rules
from extproc.admission.types import NodeReport
from extproc.config import MAX_FALLBACKS
from extproc.configparse import parse_config
from extproc.errors import ConfigError
from kvgate_testkit.stream import Stream
from tests.unit.test_exchange import Rig, body_msg, chat, headers_msg, response_headers_msg
from tests.unit.test_exchange_picker_protocol import served
from tests.unit.test_exchange_picking import node_of

A, B, C, D = (f"127.0.0.1:{7000 + i}" for i in range(4))


def pool(fallbacks: int | None, nodes: int = 4) -> dict[str, Any]:
    picking: dict[str, Any] = {"growth": "worst_case", "reserve_fraction": 0.0}
    if fallbacks is not None:
        picking["fallbacks"] = fallbacks
    return {"pools": {"default": {
        "max_concurrency": 8, "context_window": 4096, "default_max_tokens": 256,
        "backends": [{"name": f"n{i}", "metrics_url": f"http://127.0.0.1:9/{i}",
                      "address": f"127.0.0.1:{7000 + i}", "kv_capacity_tokens": 10_000}
                     for i in range(nodes)],
        "picking": picking}}}


def rig_with(fallbacks: int | None, usage: tuple[float, ...]) -> Rig:
    rig = Rig(pool(fallbacks, len(usage)))
    for i, u in enumerate(usage):
        rig.admission.report_node("default", f"n{i}", NodeReport(kv_usage=u, capacity_tokens=None,
                                                                 at=rig.clock.now()))
    return rig


def held(rig: Rig) -> dict[str, int]:
    return {n.address: n.requests for n in rig.admission.nodes("default")}


@pytest.mark.parametrize(("most", "expected"), [
    (0, []), (1, ["c"]), (2, ["c", "a"]), (5, ["c", "a"]),
])
def test_the_next_best_are_the_nodes_that_fit_besides_the_chosen_best_first(most, expected):
    # rooms: a 300, b 900 (chosen), c 500, d 50 (does not fit 100)
    verdict = rules.choose_node([("a", 300, None), ("b", 900, None), ("c", 500, None), ("d", 50, None)], 100)
    assert verdict.chosen == "b"
    assert verdict.next_best(most) == expected


def test_the_next_best_follow_the_score_affinity_included_and_ties_go_in_candidate_order():
    verdict = rules.choose_node([("a", 400, None), ("b", 400, None), ("c", 100, None), ("d", 900, None)],
                                50, affinity={"c": 600})
    assert verdict.chosen == "d"
    assert verdict.next_best(3) == ["c", "a", "b"]  # c: 100 + 600; a and b tie at 400
    refused = rules.choose_node([("a", 100, 10)], 50)  # beyond the class's watermark
    assert refused.chosen is None and refused.next_best(2) == []


async def test_an_answer_names_the_node_charged_then_the_next_best_that_fit():
    rig = rig_with(2, (0.5, 0.1, 0.999, 0.3))  # room: B, then D, then A; C has no room
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg())
    resp = await ex.request_body(body_msg(chat(max_tokens=100)))
    assert node_of(resp) == (f"{B},{D},{A}", f"{B},{D},{A}", True)
    assert held(rig) == {A: 0, B: 1, C: 0, D: 0}  # the charge is on the first alone


async def test_without_fallbacks_or_with_no_other_node_that_fits_one_node_is_named():
    for fallbacks, usage in ((None, (0.5, 0.1, 0.3)), (0, (0.5, 0.1, 0.3)), (3, (0.999, 0.1, 0.999))):
        rig = rig_with(fallbacks, usage)
        ex = Stream(rig.gate)
        ex.request_headers(headers_msg())
        resp = await ex.request_body(body_msg(chat(max_tokens=100)))
        assert node_of(resp)[:2] == (B, B)


async def test_the_charge_moves_to_the_fallback_that_served_and_nothing_is_left_after():
    rig = rig_with(1, (0.5, 0.1))
    ex = Stream(rig.gate)
    ex.request_headers(headers_msg())
    resp = await ex.request_body(body_msg(chat(max_tokens=100)))
    assert node_of(resp)[0] == f"{B},{A}"
    ex.response_headers(response_headers_msg(), metadata=served(A))
    assert held(rig) == {A: 1, B: 0}
    ex.response_body(body_msg(b'{"choices": [], "usage": {"completion_tokens": 3}}', eos=True))
    assert held(rig) == {A: 0, B: 0} and rig.inflight() == 0


def test_fallbacks_default_to_none():
    assert parse_config(pool(None)).pools["default"].picking.fallbacks == 0
    assert parse_config(pool(3)).pools["default"].picking.fallbacks == 3


@pytest.mark.parametrize(("value", "message"), [
    (-1, "must be >= 0"), (1.5, "must be an integer"), ("two", "must be an integer"), (True, "must be an integer"),
    (MAX_FALLBACKS + 1, f"must be at most {MAX_FALLBACKS}"),
])
def test_a_bad_fallback_count_is_refused_with_its_key(value, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(pool(value))
    assert "pools.default.picking.fallbacks" in str(info.value)


def test_fallbacks_need_backends_listed_by_ip_address():
    named = copy.deepcopy(pool(1))
    named["pools"]["default"]["backends"][1]["address"] = "node-1:8000"
    with pytest.raises(ConfigError, match=r"backends\[1\].address.*must be an IP address"):
        parse_config(named)
    named["pools"]["default"]["picking"]["fallbacks"] = 0
    parse_config(named)  # one node named: a name Envoy resolves is fine
    ipv6 = copy.deepcopy(pool(1))
    ipv6["pools"]["default"]["backends"][1]["address"] = "[::1]:8000"
    parse_config(ipv6)


def test_a_pool_discovered_in_dns_cannot_name_fallbacks():
    discovered = {"pools": {"default": {"discovery": {"dns": "vllm", "port": 8000},
                                        "picking": {"fallbacks": 1}}}}
    with pytest.raises(ConfigError, match="pools.default.picking.fallbacks.*discovered in DNS"):
        parse_config(discovered)
    discovered["pools"]["default"]["picking"]["fallbacks"] = 0
    parse_config(discovered)
