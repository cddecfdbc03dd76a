"""Unit tests of request_facts: a request reads the same whether Envoy sends its headers or,
skipping them, its request attributes."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2

from extproc.config import TenantsConfig
from extproc.request_facts import (ATTR_CONTENT_TYPE, RequestFacts, attribute_values, from_attributes,
                                   from_headers, tenant_attribute, unread_header_attributes)
from tests.unit.test_exchange_attributes import attrs

TENANTS = TenantsConfig(header="x-tenant-id")


def _headers(*pairs: tuple[str, str]) -> list[base_pb2.HeaderValue]:
    return [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]


def test_headers_and_attributes_give_the_same_facts() -> None:
    by_headers = from_headers(_headers(
        (":path", "/v1/chat/completions"), (":method", "POST"), ("content-type", "application/json"),
        ("authorization", "Bearer k"), ("x-tenant-id", "acme"), ("x-tenant-id", "other"),
        (TENANTS.objective_header or "", "gold")), TENANTS)
    extra = {tenant_attribute(TENANTS.objective_header or ""): "gold"}
    by_attributes = from_attributes(attribute_values(attrs(
        tenant="acme,other", authorization="Bearer k", **extra)), TENANTS)
    assert by_headers == by_attributes == RequestFacts(
        path="/v1/chat/completions", method="POST", content_type="application/json",
        authorization=b"Bearer k", tenant=[b"acme", b"other"], objective=[b"gold"])


def test_a_missing_path_attribute_is_told_apart_from_an_empty_path() -> None:
    assert from_attributes({ATTR_CONTENT_TYPE: "application/json"}, TENANTS).path is None
    assert from_headers(_headers(("content-type", "application/json")), TENANTS).path == ""


def test_a_header_attribute_kvgate_does_not_read_is_named() -> None:
    values = attribute_values(attrs(**{tenant_attribute("x-team"): "a"}))
    assert unread_header_attributes(values, TENANTS) == [tenant_attribute("x-team")]


def test_each_tenants_configuration_reads_its_own_header_names() -> None:
    # The attribute names are computed once per set of header names (a cache): a reload to
    # other names must read the new ones, and going back must read the old ones again.
    values = attribute_values(attrs(**{tenant_attribute("x-team"): "blue",
                                       tenant_attribute("x-tenant-id"): "acme",
                                       tenant_attribute("x-prio"): "gold"}))
    renamed = TenantsConfig(header="x-team", fairness_header=None, objective_header="x-prio")
    for _ in range(2):
        before = from_attributes(values, TENANTS)
        assert before.tenant == [b"acme"] and before.objective == [] and before.fairness == []
        # A protobuf map iterates in no set order: compare the names, not their order.
        assert sorted(unread_header_attributes(values, TENANTS)) == sorted([tenant_attribute("x-team"),
                                                                            tenant_attribute("x-prio")])
        after = from_attributes(values, renamed)
        assert after.tenant == [b"blue"] and after.objective == [b"gold"] and after.fairness == []
        assert unread_header_attributes(values, renamed) == [tenant_attribute("x-tenant-id")]


def test_only_string_attributes_are_read_and_an_empty_one_is_kept() -> None:
    # A CEL expression Envoy could not evaluate, or one of another type, is no header value:
    # left out (a path left out is told apart from an empty one, above).
    msg = attrs()
    fields = next(iter(msg.values())).fields
    fields["request.size"].number_value = 12
    fields["request.headers['x-empty']"].string_value = ""
    fields["request.headers['x-null']"].null_value = 0
    values = attribute_values(msg)
    assert values["request.headers['x-empty']"] == ""
    assert "request.size" not in values and "request.headers['x-null']" not in values
