"""encoded: the ext_proc answers kvgate sends on every admitted request, as protobuf wire bytes.

grpc writes each answer through the ext_proc method's response serializer
(``service.encode_response``), which writes bytes as they are and serializes a
``ProcessingResponse``. The answers an admitted request meets every time are built here as
the bytes protobuf would write for them, never as messages:

- the constant ones (CONTINUE of each phase: most messages are answered with one of them),
  serialized once when this module loads;
- the response headers' answer (``response_headers``: the x-ratelimit-* headers set, maybe
  content-length removed) and the body answer that carries the request's link in its dynamic
  metadata (``linked_body``): protobuf's wire form of a message is the concatenation of its
  fields, so each is spliced from pre-encoded pieces and the few values that vary, its
  wrapping (tags and lengths, which depend only on the payload's length) built once per
  length.

As messages, each would be parsed from such bytes or built field by field, then serialized
again, on every admitted request, each step costing more instructions than the
concatenations. Tests compare every answer here with what protobuf writes for the same
message (tests/unit/test_answers_wire.py).
"""

from __future__ import annotations

from typing import Any, TypeAlias

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.gate import METADATA_NAMESPACE

# What kvgate writes for one of Envoy's messages: a message, or its wire bytes.
Answer: TypeAlias = "pb.ProcessingResponse | bytes"

CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse()).SerializeToString()
CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString()
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse()).SerializeToString()
CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString()
CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString()
CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString()

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# Wire tags (field number << 3 | wire type) of HeaderMutation.set_headers (1),
# HeaderValueOption.header (1) and append_action (3, a varint), HeaderValue.key (1) and
# raw_value (3); _LEN_2: a length-delimited field 2.
_LEN_1, _LEN_2, _RAW_VALUE, _APPEND_ACTION = b"\x0a", b"\x12", b"\x1a", b"\x18"
# Each header's option as wire bytes, by (key, value): most of what kvgate sets repeats (the
# limits, the reasons, a reset of 0s). Emptied when full: a value that never repeats (the
# tokens left) costs its encoding each time, and the memory stays bounded.
_OPTIONS: dict[tuple[str, str], bytes] = {}
_CACHE_MAX = 4096


def _varint(n: int) -> bytes:
    """_varint is ``n`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# Varints of the lengths an answer's parts have (a response's headers are a few hundred
# bytes): a list index, where _varint is a Python call.
_VARINTS = [_varint(n) for n in range(4096)]


def _field(tag: bytes, value: bytes) -> bytes:
    """_field is a length-delimited field: its ``tag``, the length of ``value``, ``value``."""
    n = len(value)
    return b"".join((tag, _VARINTS[n] if n < 4096 else _varint(n), value))


def _prefix(prefixes: dict[int, bytes], n: int, wrap: Any) -> bytes:
    """_prefix is what ``wrap`` (a function of the payload) puts before a payload of ``n``
    bytes: it depends only on the length, so each is built once, in ``prefixes``."""
    got = prefixes.get(n)
    if got is None:
        if len(prefixes) >= _CACHE_MAX:
            prefixes.clear()
        got = prefixes[n] = wrap(bytes(n))[:-n or None]
    return got


def _option(key: str, value: str) -> bytes:
    """_option is one entry of HeaderMutation.set_headers as wire bytes: the header ``key``
    with ``value`` as its raw value, set whether or not the request has it."""
    k, v = key.encode(), value.encode()
    header = b"".join((_LEN_1, _varint(len(k)), k, _RAW_VALUE, _varint(len(v)), v))
    option = b"".join((_LEN_1, _varint(len(header)), header, _APPEND_ACTION, _varint(_OVERWRITE)))
    return b"".join((_LEN_1, _varint(len(option)), option))


def header_options(headers: list[tuple[str, str]]) -> bytes:
    """header_options is ``headers`` as HeaderMutation.set_headers entries (each replacing any
    previous value), wire bytes, each encoded once while it repeats (``_OPTIONS``)."""
    wire = []
    options = _OPTIONS
    for pair in headers:
        got = options.get(pair)
        if got is None:
            got = _option(*pair)
            if len(options) >= _CACHE_MAX:
                options.clear()
            options[pair] = got
        wire.append(got)
    return b"".join(wire)


# HeaderMutation.remove_headers (2) naming content-length, as wire bytes.
_REMOVE_CONTENT_LENGTH = b"\x12\x0econtent-length"


def _headers_answer_wire(mutation: bytes) -> bytes:
    # ProcessingResponse.response_headers (2), HeadersResponse.response (1),
    # CommonResponse.header_mutation (2).
    return _field(_LEN_2, _field(_LEN_1, _field(_LEN_2, mutation)))


_HEADERS_PREFIXES: dict[int, bytes] = {}


def response_headers(headers: list[tuple[str, str]], drop_length: bool) -> bytes:
    """response_headers is the answer that lets the response's headers go to the client with
    ``headers`` set (replacing any previous value), and without content-length if
    ``drop_length``."""
    mutation = header_options(headers)
    if drop_length:
        mutation += _REMOVE_CONTENT_LENGTH
    prefix = _HEADERS_PREFIXES.get(len(mutation))
    if prefix is None:
        prefix = _prefix(_HEADERS_PREFIXES, len(mutation), _headers_answer_wire)
    return prefix + mutation


# ProcessingResponse.request_body (3), present and empty; its dynamic_metadata's (8) entry
# (Struct.fields, 1) with the key (1) ``kvgate``, whose value (2) is a Struct (Value field 5).
_EMPTY_REQUEST_BODY, _DYNAMIC_METADATA, _STRUCT_VALUE = b"\x1a\x00", b"\x42", b"\x2a"
_NAMESPACE_KEY = _LEN_1 + _varint(len(METADATA_NAMESPACE.encode())) + METADATA_NAMESPACE.encode()


def _metadata_answer_wire(entries: bytes) -> bytes:
    # The empty request_body, then dynamic_metadata's ``kvgate`` entry: its key, its value
    # a Value holding a Struct of ``entries``.
    namespace = _NAMESPACE_KEY + _field(_LEN_2, _field(_STRUCT_VALUE, entries))
    return _EMPTY_REQUEST_BODY + _field(_DYNAMIC_METADATA, _field(_LEN_1, namespace))


_METADATA_PREFIXES: dict[int, bytes] = {}


def linked_body(key: str, value: str) -> bytes:
    """linked_body is the body answer that lets the body go as it came, with ``key``:
    ``value`` (a string) in the request's ``kvgate`` dynamic metadata (the link of the
    STREAM_AND_LOG mode). Only for one entry: encoding each further pair here costs more
    than its setter on a message (the rates beside the link go through ``answers.body_answer``).
    The entry is written out without calls (a long one goes through ``_field``)."""
    k, v = key.encode(), value.encode()
    # Struct.fields entry: key (1), Value (2) with string_value (3).
    if len(k) + len(v) < 1024:
        varints = _VARINTS
        value_wire = _RAW_VALUE + varints[len(v)] + v
        entry = b"".join((_LEN_1, varints[len(k)], k, _LEN_2, varints[len(value_wire)], value_wire))
        wire = _LEN_1 + varints[len(entry)] + entry
    else:
        wire = _field(_LEN_1, _field(_LEN_1, k) + _field(_LEN_2, _field(_RAW_VALUE, v)))
    prefix = _METADATA_PREFIXES.get(len(wire))
    if prefix is None:
        prefix = _prefix(_METADATA_PREFIXES, len(wire), _metadata_answer_wire)
    return prefix + wire
