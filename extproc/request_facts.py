"""request_facts: what kvgate reads of a request before its body, in either of Envoy's shapes.

With request headers sent, the facts come from the headers message; with request headers
skipped (deploy/envoy.yaml), from the request attributes that come with the first body
message, Envoy CEL expressions that ``request_attributes`` lists (in deploy/envoy.yaml's
order). Both give the same ``RequestFacts``: the path and method, the declared
content-length and content-type, ``authorization``, and the values of the tenant, fairness
and objective headers, one per header sent. Who the request is (tenant, class) is decided
from them by the ``Gate``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from extproc.config import TenantsConfig

# Request attributes that stand in for the request headers when Envoy skips them; the
# tenant header's entry is built from the configured header name.
ATTR_PATH = "request.path"
ATTR_METHOD = "request.method"
ATTR_CONTENT_TYPE = "request.headers['content-type']"
ATTR_AUTHORIZATION = "request.headers['authorization']"
# Set by the service's decoder (never by Envoy) when the attributes were not valid UTF-8
# (Envoy copies header bytes into protobuf strings) and had to be dropped to decode the rest.
UNDECODABLE_ATTRIBUTES = "kvgate.undecodable_attributes"


def tenant_attribute(header: str) -> str:
    """tenant_attribute is the request attribute that carries the tenant header ``header``."""
    return f"request.headers['{header}']"


def request_attributes(tenant_header: str) -> list[str]:
    """request_attributes lists what Envoy's ``request_attributes`` must name when request
    headers are skipped (in this order in deploy/envoy.yaml)."""
    return [ATTR_PATH, ATTR_METHOD, ATTR_CONTENT_TYPE, ATTR_AUTHORIZATION,
            tenant_attribute(tenant_header)]


@dataclass(slots=True)
class RequestFacts:
    """RequestFacts is what kvgate reads of a request before its body.

    ``path`` None: Envoy sent no path attribute (its configuration lacks it).
    ``method`` is as sent ("" when none came).
    ``content_length`` is the declared value as sent (None: not declared).
    """

    path: str | None = ""
    method: str = ""
    content_length: bytes | None = None
    content_type: str | None = None
    authorization: bytes | None = None
    tenant: list[bytes] = field(default_factory=list)
    fairness: list[bytes] = field(default_factory=list)
    objective: list[bytes] = field(default_factory=list)


def from_headers(headers: Iterable[Any], tenants: TenantsConfig) -> RequestFacts:
    """from_headers reads the facts from a request headers message's ``headers.headers``."""
    facts = RequestFacts()
    tenant_header, fairness_header = tenants.header, tenants.fairness_header
    objective_header = tenants.objective_header
    for h in headers:
        key = h.key
        if key == ":path":
            facts.path = h.raw_value.decode("latin-1")
        elif key == ":method":
            facts.method = h.raw_value.decode("latin-1")
        elif key == "content-length":
            facts.content_length = h.raw_value
        elif key == "content-type":
            facts.content_type = h.raw_value.decode("latin-1")
        elif key == "authorization":
            facts.authorization = h.raw_value
        elif key == tenant_header:
            facts.tenant.append(h.raw_value)
        elif key == fairness_header:
            facts.fairness.append(h.raw_value)
        elif key == objective_header:
            facts.objective.append(h.raw_value)
    return facts


def attribute_values(attributes: Any) -> dict[str, str]:
    """attribute_values flattens Envoy's request attributes (name -> string value)."""
    values: dict[str, str] = {}
    if attributes:
        # Keys, then lookups: the protobuf maps' items() and values() are the generic
        # Mapping views, several times slower per entry on every request.
        for namespace in attributes:
            fields = attributes[namespace].fields
            for key in fields:
                value = fields[key]
                # A text read first: only an empty one needs asking whether the value is a
                # string at all (one protobuf call fewer per attribute).
                text = value.string_value
                if text or value.WhichOneof("kind") == "string_value":
                    values[key] = text
    return values


@dataclass(frozen=True, slots=True)
class _AttributeNames:
    """_AttributeNames are the request attributes that carry the headers kvgate reads, for
    one set of configured header names (None: a header kvgate does not read)."""

    tenant: str
    fairness: str | None
    objective: str | None
    known: frozenset[str]
    # Every attribute name kvgate reads (the path and method too): attributes within it
    # name no unread header, told by one subset test.
    read: frozenset[str]


@functools.lru_cache(maxsize=16)
def _attribute_names(header: str, fairness_header: str | None,
                     objective_header: str | None) -> _AttributeNames:
    """_attribute_names builds the attribute names of a tenants configuration once: they are
    read on every request, and their header names change only with a reload (a reload with
    other names gets its own entry)."""
    named = [tenant_attribute(h) if h else None for h in (header, fairness_header, objective_header)]
    known = frozenset([ATTR_CONTENT_TYPE, ATTR_AUTHORIZATION, *(n for n in named if n)])
    return _AttributeNames(named[0] or "", named[1], named[2], known, known | {ATTR_PATH, ATTR_METHOD})


# The tenants configuration last asked about, and its names: the configuration changes only
# with a reload, and a lookup by identity costs a fraction of the cached call's hashing.
_last_names: tuple[TenantsConfig | None, _AttributeNames | None] = (None, None)


def _names_of(tenants: TenantsConfig) -> _AttributeNames:
    global _last_names
    last, names = _last_names
    if last is tenants and names is not None:
        return names
    names = _attribute_names(tenants.header, tenants.fairness_header, tenants.objective_header)
    _last_names = (tenants, names)
    return names


def from_attributes(values: dict[str, str], tenants: TenantsConfig) -> RequestFacts:
    """from_attributes reads the facts from the request attributes ``values``
    (``attribute_values``).

    Envoy joins repeated headers with ``,`` (tenant names cannot contain one), so a value
    with a comma is a repeated header. Envoy copied the header's bytes, which were UTF-8
    (the message decoded): their encoding gives the bytes the header itself would have.
    """
    names = _names_of(tenants)
    get = values.get
    authorization = get(ATTR_AUTHORIZATION)
    # Most requests send none of the three headers: a lookup each, no call.
    tenant = get(names.tenant)
    fairness = None if names.fairness is None else get(names.fairness)
    objective = None if names.objective is None else get(names.objective)
    return RequestFacts(
        path=get(ATTR_PATH), method=get(ATTR_METHOD, ""), content_type=get(ATTR_CONTENT_TYPE),
        authorization=None if authorization is None else authorization.encode(),
        tenant=[] if tenant is None else _split(tenant),
        fairness=[] if fairness is None else _split(fairness),
        objective=[] if objective is None else _split(objective))


def unread_header_attributes(values: dict[str, str], tenants: TenantsConfig) -> list[str]:
    """unread_header_attributes names the request-header attributes among ``values`` that
    kvgate does not read (a request_attributes list naming another tenant header)."""
    names = _names_of(tenants)
    if values.keys() <= names.read:  # the usual request
        return []
    known = names.known
    return [k for k in values if k.startswith("request.headers[") and k not in known]


def _split(value: str) -> list[bytes]:
    """_split is the values of a request header attribute, one per repeated header."""
    return [v.encode() for v in value.split(",")]
