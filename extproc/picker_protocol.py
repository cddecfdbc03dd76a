"""picker_protocol: the Gateway API Inference Extension's endpoint picker protocol, as data.

Gateways that implement an ``InferencePool`` (Istio, Envoy Gateway, kgateway, GKE) call the
pool's endpoint picker through ext_proc with both bodies ``FULL_DUPLEX_STREAMED``
(docs/endpoint-picker-protocol.md has the facts and their sources). This module holds what
that protocol names and the few pure functions kvgate needs to speak it; the request
decides, this module only reads and writes the protocol's shapes.

- The proxy may restrict the choice: filter metadata ``envoy.lb.subset_hint`` /
  ``x-gateway-destination-endpoint-subset``, a string of ``ip:port`` entries separated by
  commas or a list of such strings (``subset_hint``).
- At response time the proxy names the endpoint that served in filter metadata
  ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` (``served_endpoint``).
- In ``FULL_DUPLEX_STREAMED`` the processor sends every body byte back itself, as
  ``streamed_response`` chunks (``streamed_body``).
"""

from __future__ import annotations

from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# The most bytes of body one streamed_response chunk carries: the reference picker stays
# under 64 KiB, the per-chunk limit of some Envoy builds.
CHUNK_BYTES = 62_000
# A hint is read up to this many entries and bytes; anything past them is hostile or broken,
# and the hint then names nothing kvgate may pick (fail closed: a 503, never an unchecked node).
MAX_HINT_ENTRIES = 1024
MAX_HINT_BYTES = 64 * 1024
# The longest ``host:port`` entry considered (a DNS name of 253 bytes, brackets and a port).
MAX_ENDPOINT_BYTES = 263

_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def full_duplex(protocol: Any) -> bool:
    """full_duplex tells whether a stream's ProtocolConfiguration (Envoy sends it with the first
    message; None when it did not) says the request body is FULL_DUPLEX_STREAMED."""
    return protocol is not None and protocol.request_body_mode == _FULL_DUPLEX


def response_full_duplex(protocol: Any) -> bool:
    """response_full_duplex is ``full_duplex`` for the response body."""
    return protocol is not None and protocol.response_body_mode == _FULL_DUPLEX


def _entries(value: Any) -> list[str] | None:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        texts = [value.string_value]
    elif kind == "list_value":
        texts = []
        for item in value.list_value.values:
            if item.WhichOneof("kind") != "string_value":
                return None  # a number or a struct in a list of addresses: not a hint
            texts.append(item.string_value)
    else:
        return None
    if sum(len(t) for t in texts) > MAX_HINT_BYTES:
        return None
    out: list[str] = []
    for text in texts:
        out.extend(e.strip() for e in text.split(",") if e.strip())
    return out if len(out) <= MAX_HINT_ENTRIES else None


def subset_hint(metadata: Any) -> frozenset[str] | None:
    """subset_hint is the set of endpoints the proxy allows for a request, or None (no hint).

    ``metadata`` is the request's ``metadata_context`` (``envoy.config.core.v3.Metadata``).
    A hint that is present but empty, too large or of the wrong type allows nothing: the
    protocol's answer is then 503, and kvgate never falls back to all nodes. Entries are
    ``host:port``, or a bare host that allows every port of it (as the reference picker
    reads them); entries that are neither are dropped (they could match no node).
    """
    if metadata is None or SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    entries = _entries(fields[SUBSET_KEY])
    if entries is None:
        return frozenset()
    return frozenset(e for e in entries if len(e) <= MAX_ENDPOINT_BYTES and e.isprintable()
                     and " " not in e)


def served_endpoint(metadata: Any) -> str | None:
    """served_endpoint is the endpoint the proxy says served the request (``HOST:PORT``), or None.

    Read from a response message's ``metadata_context``; a value that is not a string, or
    not a plausible ``host:port``, is None (outside input, never trusted further).
    """
    if metadata is None or LB_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[LB_NAMESPACE].fields
    if SERVED_KEY not in fields or fields[SERVED_KEY].WhichOneof("kind") != "string_value":
        return None
    value = fields[SERVED_KEY].string_value.strip()
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or len(value) > MAX_ENDPOINT_BYTES:
        return None
    return value


def streamed_body(kind: str, body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """streamed_body is ``body`` sent back to Envoy as FULL_DUPLEX_STREAMED chunks of at most
    CHUNK_BYTES, the last carrying ``end_of_stream``; ``kind`` is ``request_body`` or
    ``response_body``. An empty body is one empty chunk (the end of stream must still travel)."""
    out = []
    at = 0
    while True:
        piece = body[at:at + CHUNK_BYTES]
        at += CHUNK_BYTES
        last = at >= len(body)
        resp = pb.ProcessingResponse()
        streamed = getattr(resp, kind).response.body_mutation.streamed_response
        streamed.body = piece
        streamed.end_of_stream = end_of_stream and last
        out.append(resp)
        if last:
            return out


def streamed_chunk(kind: str, body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """streamed_chunk is one chunk passed on as it came (a response chunk is never split or held)."""
    resp = pb.ProcessingResponse()
    streamed = getattr(resp, kind).response.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = end_of_stream
    return resp
