"""answers: the ext_proc responses kvgate sends Envoy, built in one place.

Constant answers (CONTINUE of each phase, the pass-through that turns the rest of a request
off) are built once: most messages are answered with one of them, and building a protobuf
message per chunk would be pure overhead on every streamed token. ``immediate`` is a
response Envoy sends to the client as it is; the refusals kvgate makes for its own reasons
(a reload, the shared store, no node) are here with their OpenAI-shaped bodies, and
``name_node`` steers a request to a node the way the endpoint picker protocol does.
"""

from __future__ import annotations

from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import duration_pb2

from extproc import openai_api as oai
from extproc.gate import METADATA_NAMESPACE
from extproc.picker_protocol import DESTINATION_KEY, LB_NAMESPACE, streamed_body

JSON = "application/json"


def _continue_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


CONTINUE_REQUEST_HEADERS = _continue_headers()
CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
NOTHING_MORE = processing_mode_pb2.ProcessingMode(
    request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
    response_header_mode=processing_mode_pb2.ProcessingMode.SKIP,
    response_body_mode=processing_mode_pb2.ProcessingMode.NONE,
    request_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP,
    response_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP)
# Paths kvgate does not admit: let the rest of the request and its response bypass the
# processor (needs allow_mode_override in Envoy; without it Envoy sends them anyway and
# they are answered with CONTINUE).
PASS_THROUGH = pb.ProcessingResponse(request_headers=pb.HeadersResponse(),
                                     mode_override=NOTHING_MORE)
# The same, for a request first seen at its body (request headers skipped) or at its
# response (no body at all).
PASS_THROUGH_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse(),
                                          mode_override=NOTHING_MORE)
PASS_THROUGH_RESPONSE = pb.ProcessingResponse(response_headers=pb.HeadersResponse(),
                                              mode_override=NOTHING_MORE)

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# Wire tags (field number << 3 | wire type) of HeaderMutation.set_headers (1),
# HeaderValueOption.header (1) and append_action (3, a varint), HeaderValue.key (1) and
# raw_value (3); _LEN_2: a length-delimited field 2.
_LEN_1, _LEN_2, _RAW_VALUE, _APPEND_ACTION = b"\x0a", b"\x12", b"\x1a", b"\x18"
# Each header's option as wire bytes, by (key, value): most of what kvgate sets repeats (the
# limits, the reasons, a reset of 0s). Emptied when full: a value that never repeats (the
# tokens left) costs its encoding each time, and the memory stays bounded.
_OPTIONS: dict[tuple[str, str], bytes] = {}
_OPTIONS_MAX = 4096


def _varint(n: int) -> bytes:
    """_varint is ``n`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _option(key: str, value: str) -> bytes:
    """_option is one entry of HeaderMutation.set_headers as wire bytes: the header ``key``
    with ``value`` as its raw value, set whether or not the request has it."""
    k, v = key.encode(), value.encode()
    header = b"".join((_LEN_1, _varint(len(k)), k, _RAW_VALUE, _varint(len(v)), v))
    option = b"".join((_LEN_1, _varint(len(header)), header, _APPEND_ACTION, _varint(_OVERWRITE)))
    return b"".join((_LEN_1, _varint(len(option)), option))


def set_headers(mutation: pb.HeaderMutation, headers: list[tuple[str, str]]) -> None:
    """set_headers adds headers to set (replacing any previous value) to ``mutation``.

    The options are merged as wire bytes in one call, each encoded once while it repeats
    (``_OPTIONS``): filling each option's three fields through the message's attributes
    cost about twice as many instructions, and this runs on every refusal.
    """
    mutation.MergeFromString(_options_wire(headers))


def _options_wire(headers: list[tuple[str, str]]) -> bytes:
    """_options_wire is ``headers`` as HeaderMutation.set_headers entries, wire bytes."""
    wire = []
    options = _OPTIONS
    for pair in headers:
        got = options.get(pair)
        if got is None:
            got = _option(*pair)
            if len(options) >= _OPTIONS_MAX:
                options.clear()
            options[pair] = got
        wire.append(got)
    return b"".join(wire)


# HeaderMutation.remove_headers (2) naming content-length, as wire bytes.
_REMOVE_CONTENT_LENGTH = b"\x12\x0econtent-length"
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
        if len(prefixes) >= _OPTIONS_MAX:
            prefixes.clear()
        got = prefixes[n] = wrap(bytes(n))[:-n or None]
    return got


def _headers_answer_wire(mutation: bytes) -> bytes:
    # ProcessingResponse.response_headers (2), HeadersResponse.response (1),
    # CommonResponse.header_mutation (2).
    return _field(_LEN_2, _field(_LEN_1, _field(_LEN_2, mutation)))


_HEADERS_PREFIXES: dict[int, bytes] = {}


def response_headers_answer(headers: list[tuple[str, str]], drop_length: bool) -> pb.ProcessingResponse:
    """response_headers_answer lets the response's headers go to the client with ``headers``
    set (replacing any previous value), and without content-length if ``drop_length``.

    Built as wire bytes, its wrapping once per length, and parsed in one call: reaching
    the header mutation through three message attributes and merging into it cost more,
    and every admitted response is answered here.
    """
    mutation = _options_wire(headers)
    if drop_length:
        mutation += _REMOVE_CONTENT_LENGTH
    prefix = _HEADERS_PREFIXES.get(len(mutation))
    if prefix is None:
        prefix = _prefix(_HEADERS_PREFIXES, len(mutation), _headers_answer_wire)
    return _FROM_WIRE(prefix + mutation)


_FROM_WIRE = pb.ProcessingResponse.FromString


def immediate(status: int, headers: list[tuple[str, str]], body: bytes,
              details: str) -> pb.ProcessingResponse:
    """immediate is a response Envoy sends to the client as-is, ending the request.

    ``details`` shows in Envoy's access log (``%RESPONSE_CODE_DETAILS%``).
    """
    resp = pb.ProcessingResponse()
    imm = resp.immediate_response
    imm.status.code = status
    set_headers(imm.headers, headers)
    imm.body = body
    imm.details = details
    return resp


def name_node(resp: pb.ProcessingResponse, common: Any, address: str) -> None:
    """name_node steers the request to ``address`` (``HOST:PORT``, or the primary then its
    fallbacks, ``HOST:PORT,HOST:PORT``) the way the endpoint picker
    protocol does: the destination header, the same value in ``envoy.lb`` dynamic metadata,
    and the route cache cleared so Envoy routes by them. ``common`` is the answer's
    CommonResponse."""
    set_headers(common.header_mutation, [(DESTINATION_KEY, address)])
    common.clear_route_cache = True
    resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_KEY].string_value = address


def body_answer(new_body: bytes | None, node: str | None,
                metadata: list[tuple[str, str]] | None = None) -> pb.ProcessingResponse:
    """body_answer lets an admitted request's body go upstream: replaced by ``new_body``
    (None: as it came), steered to ``node`` (None: Envoy routes it), with ``metadata``'s
    (key, value) pairs in the request's ``kvgate`` dynamic metadata.

    Envoy does not fix content-length for a replaced body: it is set in the same answer,
    or Envoy would fail the request with 500.
    """
    if new_body is None and node is None:
        if not metadata:
            return CONTINUE_REQUEST_BODY
        if len(metadata) == 1:  # the link alone (STREAM_AND_LOG)
            return _FROM_WIRE(_one_entry_wire(*metadata[0]))
    resp = pb.ProcessingResponse()
    resp.request_body.SetInParent()
    common = resp.request_body.response
    if new_body is not None:
        set_headers(common.header_mutation, [("content-length", str(len(new_body)))])
        common.body_mutation.body = new_body
    if node is not None:
        name_node(resp, common, node)
    if metadata:
        fields = resp.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
        for key, value in metadata:
            fields[key].string_value = value
    return resp


# ProcessingResponse.request_body (3), present and empty; its dynamic_metadata's (8) entry
# (Struct.fields, 1) with the key (1) ``kvgate``, whose value (2) is a Struct (Value field 5).
_EMPTY_REQUEST_BODY, _DYNAMIC_METADATA, _STRUCT_VALUE = b"\x1a\x00", b"\x42", b"\x2a"
_NAMESPACE_KEY = _LEN_1 + _varint(len(METADATA_NAMESPACE.encode())) + METADATA_NAMESPACE.encode()


def _one_entry_wire(key: str, value: str) -> bytes:
    """_one_entry_wire is the body answer that lets the body go as it came, with ``key``:
    ``value`` (a string) in the ``kvgate`` dynamic metadata, as wire bytes.

    Parsed in one call where three map navigations into the Struct and the value's setter
    cost more, on every request of the STREAM_AND_LOG mode (its link). Only for one entry:
    encoding each further pair here costs more than its setter (the rates beside the link
    go through the Struct). The entry is written out without calls (a long one goes
    through ``_field``), its wrapping built once per length.
    """
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


def _metadata_answer_wire(entries: bytes) -> bytes:
    # The empty request_body, then dynamic_metadata's ``kvgate`` entry: its key, its value
    # a Value holding a Struct of ``entries``.
    namespace = _NAMESPACE_KEY + _field(_LEN_2, _field(_STRUCT_VALUE, entries))
    return _EMPTY_REQUEST_BODY + _field(_DYNAMIC_METADATA, _field(_LEN_1, namespace))


_METADATA_PREFIXES: dict[int, bytes] = {}


def duplex_answer(body: bytes, replaced: bool, node: str | None) -> list[pb.ProcessingResponse]:
    """duplex_answer is an admitted request's answer in FULL_DUPLEX_STREAMED: the owed
    request-headers answer (the node, and content-length when the body was replaced), then
    every body byte, in the protocol's order."""
    head = pb.ProcessingResponse()
    common = head.request_headers.response
    if replaced:
        set_headers(common.header_mutation, [("content-length", str(len(body)))])
    if node is not None:
        name_node(head, common, node)
    else:
        head.request_headers.SetInParent()
    return [head, *streamed_body("request_body", body, True)]


def message_timeout(seconds: float) -> pb.ProcessingResponse:
    """message_timeout asks Envoy to wait ``seconds`` for the next answer on this stream
    (``override_message_timeout``; Envoy's ``max_message_timeout`` bounds it)."""
    whole = int(seconds)
    return pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(
        seconds=whole, nanos=int((seconds - whole) * 1e9)))


def unavailable(reason: str, message: str, *, code: str | None = None,
                retry_after_ms: bool = True, should_retry: bool = True) -> pb.ProcessingResponse:
    """unavailable is kvgate's 503 for a request it cannot place now, to be retried in a
    second (``x-should-retry: true``, ``retry-after``): ``reason`` goes to
    ``x-kvgate-reason`` and (prefixed ``kvgate_``) Envoy's response code details, ``code``
    (default ``reason``) into the OpenAI error body. ``should_retry`` False: a 503 that the
    same request would get again (``x-should-retry: false``, no retry delay)."""
    if should_retry:
        headers = [("content-type", JSON), ("x-should-retry", "true"), ("retry-after", "1")]
        if retry_after_ms:
            headers.append(("retry-after-ms", "1000"))
    else:
        headers = [("content-type", JSON), ("x-should-retry", "false")]
    headers.append(("x-kvgate-reason", reason))
    return immediate(503, headers, oai.error_body(message, error_type="server_error",
                                                  code=code or reason), f"kvgate_{code or reason}")


def misconfigured() -> pb.ProcessingResponse:
    """misconfigured is the 500 for a request Envoy's configuration keeps kvgate from serving
    (the operator is told in the log)."""
    return immediate(500, [("content-type", JSON), ("x-should-retry", "false"),
                           ("x-kvgate-reason", "misconfigured")],
                     oai.error_body("The admission gateway is misconfigured; the operator "
                                    "has been told.", error_type="server_error",
                                    code="gateway_misconfigured"),
                     "kvgate_misconfigured")
