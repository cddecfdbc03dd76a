"""arrival: one HTTP request's arrival at kvgate, free of gRPC: identified, its body
collected, handed to admission.

An ``Arrival`` receives the request side of one ext_proc stream in the order Envoy sends it
(request headers, or request attributes with the first body message; the body's parts; the
trailers) and returns the answer to each. Once the whole body is here it hands it to
admission (``extproc.request.admit``): a refusal is answered here, and an admission is
returned as ``Admitted``, whose ending (``extproc.request.ending``) holds the lease and takes
the response from then on: the stream's stage changes from the arrival to the ending, and the
service (``extproc.service``) feeds the response to whichever holds the stream. A response
that comes before any admission (Envoy answered, or nothing was admitted) is still the
arrival's.

What reaches kvgate, by file of deploy/ (``kvgate envoy-filter --mode``; the table is
``extproc.request.profile``):

- request headers skipped (envoy.yaml, the recommended three-message file; envoy-jwt,
  -reservation, -observe, -access-log): the body message is the first, and the few request
  facts kvgate needs come with it as request attributes (``request_facts``), one
  blocking round trip fewer (a request that may have no body, any method but POST or a
  POST that declares no length, has its headers sent by routes of its own: without a
  body it would send kvgate nothing before going upstream);
- request headers sent (envoy-four-message, -endpoint-picker, -endpoint-picker-log,
  -inference-pool): the request is identified from them;
- the response on this stream (STREAMED in envoy.yaml, -jwt, -four-message,
  -endpoint-picker; FULL_DUPLEX_STREAMED in -inference-pool), read for usage and delivered
  chunks; its headers only (-reservation: no body, the completion charged at the
  reservation); on a second, observability-mode ext_proc filter (-observe: no blocking
  message per streamed chunk), where the admission stream's protocol says response body
  NONE and the request's ending *observes* the response fed from that other stream, found
  again by the ``link`` put in the request's dynamic metadata, and never rewrites it (so it never
  asks the upstream for stream usage it could not hide); none at all (-access-log: the
  access log entry ends the request, and the file's Lua usage filter, ``usage_log``, reads
  the usage from the response as it passes and hides it from a client that did not ask).

A pool that picks nodes (every backend has an ``address``) is served only with request
headers sent and the body BUFFERED (deploy/envoy-endpoint-picker.yaml): Envoy then holds
the request until kvgate has answered its body, so the answer can name the node the way
the Gateway API Inference Extension's endpoint picker does (request header
``x-gateway-destination-endpoint`` and dynamic metadata ``envoy.lb``, with the route
cache cleared), and a refused request never opens an upstream request. The tokens seen
on the response stream tell the node's ledger how far the request has got. In
deploy/envoy-endpoint-picker-log.yaml the response is not sent (the request's end comes by
the access log, as in -access-log), and Envoy's periodic access log entries of the stream in
flight bring the tokens so far and the node that serves (``Parked.progressed``).

The same pool is served as an ``InferencePool``'s endpoint picker, in the modes the
picker protocol fixes (deploy/envoy-inference-pool.yaml; ``picker_protocol``): both bodies
FULL_DUPLEX_STREAMED. The answer to the request headers is then owed until the body's
end: kvgate collects the body, decides, and answers in the protocol's order, the headers
(naming the node) and then the body as streamed chunks; response chunks are passed back
as they come, read on the way for usage and tokens. A subset hint restricts the nodes
kvgate may pick (503 when none of them may be picked), and the endpoint the proxy says
served the request takes the request's node charge when it is not the one picked.

What every request shares (configuration, tokenizers, identity, route settings) is the
``Gate`` (``extproc.gate``); the answers it sends are built in ``extproc.answers``, its
refusals in ``extproc.request.refusals``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import openai_api as oai
from extproc import picker_protocol as epp
from extproc import request_facts as facts_of
from extproc import usage_log
from extproc.answers import PASS_THROUGH, PASS_THROUGH_BODY, PASS_THROUGH_RESPONSE, misconfigured
from extproc.encoded import (CONTINUE_REQUEST_BODY, CONTINUE_REQUEST_HEADERS, CONTINUE_REQUEST_TRAILERS,
                             CONTINUE_RESPONSE_BODY, CONTINUE_RESPONSE_HEADERS, Answer)
from extproc.config import ClassConfig
from extproc.errors import RequestError
from extproc.gate import ANONYMOUS_TENANT, NO_ROUTE_SETTINGS, Gate, PoolRuntime
from extproc.outcomes import RequestOutcome
from extproc.request.admit import Admitted, Refused, decide, pass_to_node
from extproc.request.refusals import pass_error, path_error, refusal
from extproc.request_facts import ATTR_PATH, UNDECODABLE_ATTRIBUTES, RequestFacts


__all__ = ["Arrival"]


# A body mode of NONE (a protobuf enum's attribute, read once: not on every request).
_BODY_NONE = processing_mode_pb2.ProcessingMode.NONE

# States of an arrival (_ADMITTED: the request is the ending's from then on).
_NEW, _BODY, _PASS, _ADMITTED, _DONE = range(5)


class Arrival:
    """Arrival is one HTTP request's arrival at kvgate (see the module doc).

    Methods are called in Envoy's message order; each returns the answer to send, and
    ``request_body`` returns ``Admitted`` when it admits the request: its ending holds the
    lease from then on, and nothing here does. What it has identified of the request is what
    admission reads (``admit.Identified``).
    """

    __slots__ = ("gate", "state", "endpoint", "pool", "pool_name", "class_cfg", "tenant",
                 "fairness_id", "route", "content_type", "body", "max_body",
                 "response_sent", "duplex", "response_duplex", "hint", "usage_filter")

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.state = _NEW
        self.endpoint: oai.Endpoint | None = None
        self.pool: PoolRuntime | None = None
        self.pool_name = ""
        self.class_cfg: ClassConfig | None = None
        self.tenant = ANONYMOUS_TENANT
        self.fairness_id: str | None = None  # Demand.fairness_id (Gate.fairness_id_of)
        self.route = NO_ROUTE_SETTINGS
        self.content_type: str | None = None
        # The body's parts until its end (None: not collecting). The parsed body itself is
        # not kept: an in-flight request holds no copy of its prompt.
        self.body: bytearray | None = None
        self.max_body = 0
        # The access log's usage filter announced itself on the request (``usage_log``).
        self.usage_filter = False
        # The stream's protocol sends the response body here (False: response body NONE,
        # the response is observed on another stream or not at all).
        self.response_sent = True
        # Bodies FULL_DUPLEX_STREAMED (the endpoint picker protocol): kvgate passes every body
        # byte back itself. ``hint``: the endpoints the proxy allows (None: no hint).
        self.duplex = False
        self.response_duplex = False
        self.hint: frozenset[str] | None = None

    # --- request headers -------------------------------------------------------------

    def request_headers(self, msg: pb.HttpHeaders, metadata: Any = None,
                        protocol: Any = None) -> Answer | None:
        """request_headers picks the endpoint, pool, tenant and class; refuses early what it can.

        Answers 413 for a declared content-length above the cap (before any body is
        read), 400 for duplicate tenant headers or a missing body; decides on paths that
        are not admitted (``_not_admitted``). ``protocol`` is the stream's
        ProtocolConfiguration when Envoy sent one: with a FULL_DUPLEX_STREAMED request body
        the answer to an admitted path's headers comes with the body's decision, and None
        is returned here.
        """
        if self.state != _NEW:  # a second request on one stream: never from Envoy; ignore it
            return CONTINUE_REQUEST_HEADERS
        self.duplex = epp.full_duplex(protocol)
        self.response_duplex = epp.response_full_duplex(protocol)
        if protocol is not None:  # Envoy sends it with the stream's first message only
            self.response_sent = protocol.response_body_mode != _BODY_NONE
        self.hint = epp.subset_hint(metadata)
        facts = facts_of.from_headers(msg.headers.headers, self.gate.config.tenants)
        # A body follows unless the headers end the stream (a declared length of 0: an empty
        # one, which some HTTP/2 clients still send as an empty frame).
        refusal = self._begin(facts, metadata,
                              body=not msg.end_of_stream and facts.content_length != b"0")
        if refusal is not None:
            return refusal
        if self.state == _PASS:
            passed = pass_to_node(self.gate, self.pool_name or self.gate.config.default_pool,
                                  self.hint, self.duplex)
            if type(passed) is Refused:  # a picking pool without a node up
                self.state = _DONE
                return passed.answer
            self._count_pass()
            # In duplex mode no mode_override: the bodies are passed back.
            return passed or (CONTINUE_REQUEST_HEADERS if self.duplex else PASS_THROUGH)
        if facts.content_length is not None:
            try:
                declared = int(facts.content_length)
            except ValueError:
                return self._refuse(RequestError("content-length is not a number",
                                                 param="content-length"), RequestOutcome.REJECTED_INVALID)
            if declared > self.max_body:
                return self._refuse_too_large(declared)
        if msg.end_of_stream:
            return self._refuse(RequestError("the request has no body; send a JSON object"),
                                RequestOutcome.REJECTED_INVALID)
        self.state = _BODY
        self.body = bytearray()
        return None if self.duplex else CONTINUE_REQUEST_HEADERS

    def _begin_from_attributes(self, attributes: Any, metadata: Any,
                               body: bool) -> Answer | None:
        """_begin_from_attributes identifies a request whose headers Envoy skipped, from the
        request attributes sent with its first body message (``request_facts``);
        ``body``: that message carries body bytes (or more are to come).

        Attributes that were not UTF-8 (a client's bad header byte; see
        service.decode_request) get a 400. Without ``request.path`` kvgate cannot tell what
        the request is: it refuses it (fail closed) and says why.
        """
        if attributes and UNDECODABLE_ATTRIBUTES in attributes:
            return self._refuse(RequestError(
                "a request header (the tenant header, authorization or content-type) is not "
                "valid UTF-8"), RequestOutcome.REJECTED_INVALID)
        values = facts_of.attribute_values(attributes)
        tenants = self.gate.config.tenants
        others = facts_of.unread_header_attributes(values, tenants)
        if others:
            self.gate.other_header_attributes(others)
        facts = facts_of.from_attributes(values, tenants)
        if facts.path is None:
            return self._misconfigured(
                "Envoy sent a request body without the request headers and without the "
                f"{ATTR_PATH!r} request attribute: list kvgate's request attributes in the "
                "ext_proc filter's request_attributes (see deploy/envoy.yaml)")
        return self._begin(facts, metadata, body)

    def _begin(self, facts: RequestFacts, metadata: Any, body: bool) -> Answer | None:
        """_begin picks endpoint, pool, tenant and class; returns a refusal or None.

        A path kvgate does not admit leaves the state _PASS (``_not_admitted``; ``body``:
        the request has one). The class: the route's, else the one the objective header
        names, else the tenant's.
        """
        gate = self.gate
        config = gate.config
        path = facts.path or ""
        self.content_type = facts.content_type
        endpoint = oai.endpoint_for_path(path)
        if endpoint is None or facts.method != "POST":
            return self._not_admitted(facts.method, path, endpoint is not None, body)
        self.endpoint = endpoint
        self.route = route = gate.route_settings(metadata)
        self.usage_filter = usage_log.announced(metadata)
        self.pool_name = route.pool or config.default_pool
        self.pool = gate.pools[self.pool_name]
        self.max_body = route.max_body_bytes or config.limits.max_body_bytes
        try:
            self.tenant = gate.tenant_of(facts.tenant, facts.authorization, facts.fairness)
            self.fairness_id = gate.fairness_id_of(self.tenant, facts.fairness)
            objective = None if route.tenant_class else gate.class_named(facts.objective)
        except RequestError as err:
            self.class_cfg = config.tenants.classes[config.tenants.default_class]
            return self._refuse(err, RequestOutcome.REJECTED_UNAUTHENTICATED if err.status == 401
                                else RequestOutcome.REJECTED_INVALID)
        self.class_cfg = (config.tenants.classes[route.tenant_class] if route.tenant_class
                          else objective or config.class_of(self.tenant))
        return None

    # --- request body ------------------------------------------------------------------

    async def request_body(self, msg: pb.HttpBody,
                           send: Callable[[pb.ProcessingResponse], Awaitable[None]] | None = None,
                           attributes: Any = None, metadata: Any = None,
                           protocol: Any = None) -> Answer | Admitted | None:
        """request_body decides: parse, count, check the context window, then acquire.

        An admitted request is returned as ``Admitted`` (its ``answer`` is what to send: with a
        FULL_DUPLEX_STREAMED request body a list, the owed request-headers answer, then the
        body as streamed chunks). With such a body, chunks before the last are not answered
        (None); a passed-through request's chunks go back as they came.

        ``send`` lets admission extend Envoy's message timeout before it waits in its
        class's queue (``override_message_timeout``); None when the caller cannot.
        ``attributes`` and ``metadata`` identify the request when it is the stream's first
        message (Envoy skips request headers); otherwise they are not read. ``protocol`` is
        the stream's ProtocolConfiguration when Envoy sent one: a response body mode NONE
        means the response is observed elsewhere or not at all (the module doc).
        """
        if protocol is not None and self.state in (_NEW, _BODY):
            self.response_sent = protocol.response_body_mode != _BODY_NONE
        if self.state == _NEW:
            first = self._begin_at_body(attributes, metadata,
                                        body=bool(msg.body) or not msg.end_of_stream)
            if first is not None:
                return first
        if self.state != _BODY:
            if self.duplex:
                return epp.streamed_chunk("request_body", msg.body, msg.end_of_stream)
            return CONTINUE_REQUEST_BODY
        raw, answer = self._collect(msg)
        if raw is None:
            return answer
        # The whole body: admission decides (``admit.decide``).
        decided = await decide(self.gate, self, raw, send)
        if type(decided) is Refused:
            self.state = _DONE
            return decided.answer
        self.state = _ADMITTED
        # Request facts only the decision reads: an admitted request may stay in flight for
        # minutes, thousands at once.
        self.content_type = None
        self.hint = None
        return decided

    def _begin_at_body(self, attributes: Any, metadata: Any,
                       body: bool) -> Answer | None:
        """_begin_at_body identifies a request first seen at its body (Envoy skipped the
        request headers): a refusal or a pass-through answer, or None to read the body.
        ``body``: the message carries body bytes, or more are to come."""
        first = self._begin_from_attributes(attributes, metadata, body)
        if first is not None:
            return first
        if self.state == _PASS:
            self._count_pass()
            return PASS_THROUGH_BODY
        if self.pool is not None and self.pool.picks:
            return self._misconfigured(
                f"pool {self.pool_name!r} picks its nodes (its backends have addresses), but "
                "Envoy skips the request headers, so they went upstream before kvgate could "
                "name the node: use deploy/envoy-endpoint-picker.yaml (request headers SEND, "
                "request body BUFFERED)")
        self.state = _BODY
        self.body = bytearray()
        return None

    def _collect(self, msg: pb.HttpBody) -> tuple[bytes | None, Answer | None]:
        """_collect is the whole request body once its last part has come, as (body, None);
        before that (None, the answer to this part: None in FULL_DUPLEX_STREAMED), or (None,
        the 413) for a body above the cap. Two values, as an answer may be bytes too."""
        body = self.body
        assert body is not None
        if body or not msg.end_of_stream:
            # Only a non-BUFFERED Envoy config sends a body in parts: keep collecting.
            body += msg.body
            if len(body) > self.max_body:
                return None, self._refuse_too_large(len(body))
            if not msg.end_of_stream:
                return None, None if self.duplex else CONTINUE_REQUEST_BODY
            raw = bytes(body)
        else:  # BUFFERED: the whole body in one message
            raw = msg.body
            if len(raw) > self.max_body:
                return None, self._refuse_too_large(len(raw))
        self.body = None
        return raw, None

    # --- response ------------------------------------------------------------------------

    def response_headers(self, msg: pb.HttpHeaders, attributes: Any = None,
                         metadata: Any = None) -> Answer:
        """response_headers answers response headers that come before any admission (once a
        request is admitted they are its ending's): Envoy answered before the body reached
        kvgate, or there was nothing to admit. They pass through, except Envoy's own 413 for a
        body above its buffer limit, which gets kvgate's OpenAI-shaped 413 like any body
        above the cap. ``attributes`` and ``metadata`` come with a stream's first message:
        they name the tenant of a request Envoy refused before kvgate saw it.
        """
        if self.state not in (_NEW, _BODY):
            return CONTINUE_RESPONSE_HEADERS
        first = self.state == _NEW
        self.state = _PASS
        for h in msg.headers.headers:
            if h.key == ":status" and h.raw_value == b"413":
                if first and attributes and UNDECODABLE_ATTRIBUTES not in attributes:
                    self.pool_name, self.class_cfg = self.gate.class_of_attributes(attributes, metadata)
                return self._refuse(RequestError(
                    "The request body is above this endpoint's limit.", status=413,
                    code="request_too_large"), RequestOutcome.REJECTED_BODY_TOO_LARGE)
        return PASS_THROUGH_RESPONSE if first else CONTINUE_RESPONSE_HEADERS

    def response_body(self, msg: pb.HttpBody) -> Answer:
        """response_body answers a response chunk that comes before any admission: as it came
        (with a FULL_DUPLEX_STREAMED response body, sent back at once)."""
        if self.response_duplex:
            return epp.streamed_chunk("response_body", msg.body, msg.end_of_stream)
        return CONTINUE_RESPONSE_BODY

    def request_trailers(self) -> Answer:
        """request_trailers answers the request's trailers. With a FULL_DUPLEX_STREAMED body
        still being collected they end the body without an end of stream on it: kvgate does
        not decide on such a body and refuses the request (400), taking nothing."""
        if self.duplex and self.state == _BODY:
            self.body = None
            return self._refuse(RequestError("request trailers are not accepted on this "
                                             "endpoint; send the JSON body without trailers"),
                                RequestOutcome.REJECTED_INVALID)
        return CONTINUE_REQUEST_TRAILERS

    # --- refusals ------------------------------------------------------------------------

    def _refuse(self, err: RequestError, outcome: RequestOutcome) -> Answer:
        self.state = _DONE
        cls = self.class_cfg
        self.gate.metrics.request(self.pool_name or self.gate.config.default_pool,
                                  cls.name if cls is not None else self.gate.config.tenants.default_class,
                                  outcome)
        return refusal(err, outcome)

    def _not_admitted(self, method: str, path: str, admitted_path: bool,
                      body: bool) -> Answer | None:
        """_not_admitted decides on a request kvgate does not admit (another path, or an
        admitted path with another method than POST): the state _PASS, or a refusal.

        With ``limits.unknown_paths: pass`` everything passes as it came. Otherwise a path of
        ``limits.pass_paths`` (the engines' endpoints that generate nothing) passes as a GET
        or HEAD without a body (``body`` False), all it needs (``refusals.pass_error``); any
        other path is refused (``refusals.path_error``).
        What passes is counted (``_count_pass``) once it has been let through.
        """
        limits = self.gate.config.limits
        if limits.unknown_paths == "pass":
            self.state = _PASS
            return None
        passes = oai.path_passes(oai.normalise_path(path), limits.pass_paths)
        refused = pass_error(path, method, body) if passes else (path_error(path, admitted_path),
                                                                 RequestOutcome.REJECTED_PATH)
        if refused is not None:
            self.pool_name = self.gate.config.default_pool
            return self._refuse(*refused)
        self.state = _PASS
        return None

    def _count_pass(self) -> None:
        """_count_pass counts a request let through without admission (``passed``), in the
        default pool and class: kvgate names no tenant for what it does not admit."""
        config = self.gate.config
        self.gate.metrics.request(config.default_pool, config.tenants.default_class,
                                  RequestOutcome.PASSED)

    def _misconfigured(self, message: str) -> Answer:
        self.state = _DONE
        self.gate.misconfigured(message)
        return misconfigured()

    def _refuse_too_large(self, size: int) -> Answer:
        self.body = None
        return self._refuse(RequestError(
            f"The request body is {size} bytes, above this endpoint's limit of "
            f"{self.max_body} bytes.", status=413, code="request_too_large"),
            RequestOutcome.REJECTED_BODY_TOO_LARGE)

