"""answers: the ext_proc responses kvgate sends Envoy, built in one place.

The answers every admitted request meets (CONTINUE of each phase, the response headers'
x-ratelimit-* headers, the link) are wire bytes built in ``extproc.encoded``; the rest are
built here as messages. Constant ones (the pass-through that turns the rest of a request
off) are built once. ``immediate`` is a
response Envoy sends to the client as it is; the refusals kvgate makes for its own reasons
(a reload, the shared store, no node) are here with their OpenAI-shaped bodies, and
``name_node`` steers a request to a node the way the endpoint picker protocol does.
"""

from __future__ import annotations

from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import duration_pb2

from extproc import openai_api as oai
from extproc.encoded import CONTINUE_REQUEST_BODY, Answer, header_options, linked_body
from extproc.gate import METADATA_NAMESPACE
from extproc.picker_protocol import DESTINATION_KEY, LB_NAMESPACE, streamed_body

JSON = "application/json"

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


def set_headers(mutation: pb.HeaderMutation, headers: list[tuple[str, str]]) -> None:
    """set_headers adds headers to set (replacing any previous value) to ``mutation``.

    The options are merged as wire bytes in one call (``encoded.header_options``): filling
    each option's three fields through the message's attributes cost about twice as many
    instructions, and this runs on every refusal.
    """
    mutation.MergeFromString(header_options(headers))


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
                metadata: list[tuple[str, str]] | None = None) -> Answer:
    """body_answer lets an admitted request's body go upstream: replaced by ``new_body``
    (None: as it came), steered to ``node`` (None: Envoy routes it), with ``metadata``'s
    (key, value) pairs in the request's ``kvgate`` dynamic metadata. The body as it came
    with no more than one entry is wire bytes (``extproc.encoded``), the rest a message.

    Envoy does not fix content-length for a replaced body: it is set in the same answer,
    or Envoy would fail the request with 500.
    """
    if new_body is None and node is None:
        if not metadata:
            return CONTINUE_REQUEST_BODY
        if len(metadata) == 1:  # the link alone (STREAM_AND_LOG)
            return linked_body(*metadata[0])
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
