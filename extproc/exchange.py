"""exchange: one HTTP request's admission state machine, free of gRPC.

An ``Exchange`` receives the decoded ext_proc messages of one request in the order Envoy
sends them (request headers, request body, response headers, response body chunks) and
returns the ``ProcessingResponse`` to send back. It holds the request's lease from the
moment it is granted until ``finish`` (or the response's end of stream) releases it.

Three Envoy configurations are served. With request headers sent
(deploy/envoy-four-message.yaml) the request is identified from them; with request headers
skipped (deploy/envoy.yaml, one blocking round trip fewer) the body message is the first and
the few request facts kvgate needs come with it as request attributes (``request_attributes``).
With the response sent to a second, observability-mode ext_proc filter
(deploy/envoy-observe.yaml: no blocking message per streamed chunk), the admission stream
carries no response at all (its protocol says response body NONE): the exchange then
*observes* the response fed from that other stream, found again by the ``link`` it put in
the request's dynamic metadata, and never rewrites the response (so it asks the upstream for
stream usage only where the access log's usage filter hides it: ``usage_log``).

A pool that picks nodes (every backend has an ``address``) is served only with request
headers sent and the body BUFFERED (deploy/envoy-endpoint-picker.yaml): Envoy then holds
the request until kvgate has answered its body, so the answer can name the node the way
the Gateway API Inference Extension's endpoint picker does (request header
``x-gateway-destination-endpoint`` and dynamic metadata ``envoy.lb``, with the route
cache cleared), and a refused request never opens an upstream request. The tokens seen
on the response stream tell the node's ledger how far the request has got.

The same pool is served as an ``InferencePool``'s endpoint picker, in the modes the
picker protocol fixes (deploy/envoy-inference-pool.yaml; ``picker_protocol``): both bodies
FULL_DUPLEX_STREAMED. The answer to the request headers is then owed until the body's
end: kvgate collects the body, decides, and answers in the protocol's order, the headers
(naming the node) and then the body as streamed chunks; response chunks are passed back
as they come, read on the way for usage and tokens. A subset hint restricts the nodes
kvgate may pick (503 when none of them may be picked), and the endpoint the proxy says
served the request takes the request's node charge when it is not the one picked.

A ``Gate`` is what every exchange shares: the configuration, each pool's tokenizer and
chat template, the API-key table, the admission core, the metrics and a small thread
pool for tokenizing large bodies off the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import duration_pb2

from extproc import openai_api as oai
from extproc import picker_protocol as epp
from extproc import usage_log
from extproc.admission import (Admission, Demand, Lease, Outcome, Rejection, StoreError,
                               UnknownPoolError)
from extproc.clock import Clock
from extproc.config import ClassConfig, Config, PoolConfig
from extproc.errors import ConfigError, RequestError
from extproc.metrics import Metrics
from extproc.tokens import TEMPLATES, load_tokenizer
from extproc.waitwatch import cut_at_base_timeout

log = logging.getLogger("kvgate.exchange")

# Bodies above this size are parsed and tokenized in the thread pool: tiktoken releases
# the GIL, and at ~10 MB/s a 32 KB body costs ~3 ms, the most the loop should stall.
OFFLOAD_BYTES = 32 * 1024
# Tenant name of requests whose identity is not configured. Configured names cannot
# start with '_', so this never collides with one.
ANONYMOUS_TENANT = "_anonymous"
# The message timeout kvgate asks Envoy for while a request waits in its class's queue,
# on top of the class's max_wait_s (seconds).
WAIT_TIMEOUT_MARGIN_S = 1.0
# Per-route metadata keys (namespace ``kvgate``); anything else counts as "unknown".
ROUTE_KEYS = ("pool", "tenant_class", "context_window", "max_body_bytes", "release")
# How an admitted request's end reaches kvgate (route key ``release``): the end of its
# ext_proc stream; an entry of Envoy's gRPC access log (deploy/envoy-access-log.yaml); or
# the end of its stream for the budget and, for a stream cut short, the access log entry
# for the cause (STREAM_AND_LOG: Envoy ends the ext_proc stream alike whether the client
# left or the upstream died, and only its access log tells them apart).
STREAM_AND_LOG = "stream_and_log"
RELEASES = ("stream", "access_log", STREAM_AND_LOG)
# A bad route setting is logged at most once per key in this many seconds.
ROUTE_LOG_INTERVAL_S = 60.0
# The tenant header never seen: said once this many requests in a row lacked it, then at
# most once per TENANT_HEADER_LOG_INTERVAL_S (seconds) while it stays unseen.
TENANT_HEADER_UNSEEN_AFTER = 100
TENANT_HEADER_LOG_INTERVAL_S = 600.0
ROUTE_CACHE_ENTRIES = 256
METADATA_NAMESPACE = "kvgate"
# Dynamic metadata key (namespace ``kvgate``) of the token that ties a request's response,
# seen on an observability-mode stream, to the exchange that admitted it.
LINK_KEY = "link"
# Request attributes (Envoy CEL expressions) that stand in for the request headers when
# Envoy skips them; the tenant header's entry is built from the configured header name.
ATTR_PATH = "request.path"
ATTR_METHOD = "request.method"
ATTR_CONTENT_TYPE = "request.headers['content-type']"
ATTR_AUTHORIZATION = "request.headers['authorization']"
# Set by the server's decoder (never by Envoy) when the attributes were not valid UTF-8
# (Envoy copies header bytes into protobuf strings) and had to be dropped to decode the rest.
UNDECODABLE_ATTRIBUTES = "kvgate.undecodable_attributes"
# How a picked node is named to Envoy (the endpoint picker protocol's names).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"


def tenant_attribute(header: str) -> str:
    """tenant_attribute is the request attribute that carries the tenant header ``header``."""
    return f"request.headers['{header}']"


def request_attributes(tenant_header: str) -> list[str]:
    """request_attributes lists what Envoy's ``request_attributes`` must name when request
    headers are skipped (in this order in deploy/envoy.yaml)."""
    return [ATTR_PATH, ATTR_METHOD, ATTR_CONTENT_TYPE, ATTR_AUTHORIZATION,
            tenant_attribute(tenant_header)]


_JSON = "application/json"


# --- constant responses ------------------------------------------------------------
# Built once: most messages are answered with one of these, and building a protobuf
# message per chunk would be pure overhead on every streamed token.

def _continue_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


CONTINUE_REQUEST_HEADERS = _continue_headers()
CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
_NOTHING_MORE = processing_mode_pb2.ProcessingMode(
    request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
    response_header_mode=processing_mode_pb2.ProcessingMode.SKIP,
    response_body_mode=processing_mode_pb2.ProcessingMode.NONE,
    request_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP,
    response_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP)
# Paths kvgate does not admit: let the rest of the request and its response bypass the
# processor (needs allow_mode_override in Envoy; without it Envoy sends them anyway and
# they are answered with CONTINUE).
PASS_THROUGH = pb.ProcessingResponse(request_headers=pb.HeadersResponse(),
                                     mode_override=_NOTHING_MORE)
# The same, for a request first seen at its body (request headers skipped) or at its
# response (no body at all).
PASS_THROUGH_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse(),
                                          mode_override=_NOTHING_MORE)
PASS_THROUGH_RESPONSE = pb.ProcessingResponse(response_headers=pb.HeadersResponse(),
                                              mode_override=_NOTHING_MORE)

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def set_headers(mutation: pb.HeaderMutation, headers: list[tuple[str, str]]) -> None:
    """set_headers adds headers to set (replacing any previous value) to ``mutation``.

    Filling the repeated field in place costs a third of building each option with
    keyword arguments, and this runs on every admitted response.
    """
    add = mutation.set_headers.add
    for key, value in headers:
        option = add()
        header = option.header
        header.key = key
        header.raw_value = value.encode()
        option.append_action = _OVERWRITE


def immediate(status: int, headers: list[tuple[str, str]], body: bytes,
              details: str) -> pb.ProcessingResponse:
    """immediate is a response Envoy sends to the client as-is, ending the request.

    ``details`` shows in Envoy's access log (``%RESPONSE_CODE_DETAILS%``).
    """
    resp = pb.ProcessingResponse()
    imm = resp.immediate_response
    imm.status.code = status  # type: ignore[assignment]
    set_headers(imm.headers, headers)
    imm.body = body
    imm.details = details
    return resp


# --- shared state ----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PoolRuntime:
    """PoolRuntime is a pool's configuration with its loaded tokenizer and chat template."""

    config: PoolConfig
    tokenizer: Any
    template: Any


@dataclass(frozen=True, slots=True)
class RouteSettings:
    """RouteSettings are the per-route overrides Envoy sent (None: the file's value).

    ``context_window`` in tokens, ``max_body_bytes`` in bytes, ``release`` one of RELEASES.
    """

    pool: str | None = None
    tenant_class: str | None = None
    context_window: int | None = None
    max_body_bytes: int | None = None
    release: str | None = None


NO_ROUTE_SETTINGS = RouteSettings()


class Gate:
    """Gate holds what every exchange shares and can be reconfigured at run time.

    ``offload_bytes``: bodies larger than this are parsed and tokenized in ``executor``
    (None: the loop's default executor).
    """

    def __init__(self, config: Config, admission: Admission, metrics: Metrics, clock: Clock,
                 executor: Executor | None = None, offload_bytes: int = OFFLOAD_BYTES) -> None:
        self.admission = admission
        self.metrics = metrics
        self.clock = clock
        self.executor = executor
        self.offload_bytes = offload_bytes
        self._route_logged: dict[str, float] = {}
        self._cut_logged = False
        self._routes: dict[bytes, tuple[RouteSettings, tuple[tuple[str, str], ...]]] = {}
        self._link_prefix = secrets.token_hex(6)
        self._links = itertools.count(1)
        self.config = config
        self.pools: dict[str, PoolRuntime] = {}
        self.api_keys: dict[str, str] = {}
        # Tenants only the tenant header can name (no API key), and how many requests in a
        # row came without that header (None once one carried it).
        self._header_tenants = False
        self._header_missing: int | None = 0
        self._header_logged: float | None = None
        self._apply(config)

    def reconfigure(self, config: Config) -> None:
        """reconfigure switches new requests to ``config``; requests in flight keep theirs.

        Tokenizers load first, so a config whose tokenizer cannot load raises
        ``ConfigError`` and changes nothing.
        """
        self._apply(config)

    def _apply(self, config: Config) -> None:
        pools = {}
        for name, pc in config.pools.items():
            try:
                tokenizer = load_tokenizer(pc.tokenizer)
            except ConfigError as err:
                raise ConfigError(f"pools.{name}.tokenizer", err.reason) from None
            pools[name] = PoolRuntime(pc, tokenizer, TEMPLATES[pc.chat_template])
        api_keys = {digest: t.name for t in config.tenants.tenants.values()
                    for digest in t.api_key_sha256}
        if config.tenants.header != self.config.tenants.header or not self._header_tenants:
            self._header_missing, self._header_logged = 0, None
        self._header_tenants = any(not t.api_key_sha256 for t in config.tenants.tenants.values())
        self.config, self.pools, self.api_keys = config, pools, api_keys
        self._routes = {}  # pool and class names may have changed

    def new_link(self) -> str:
        """new_link is a token naming one admitted request within this process (see LINK_KEY).

        The random prefix keeps another kvgate process from ever matching it.
        """
        return f"{self._link_prefix}-{next(self._links)}"

    # --- identity ----------------------------------------------------------------

    def tenant_of(self, header_values: list[bytes], authorization: bytes | None,
                  fairness_values: Sequence[bytes] = ()) -> str:
        """tenant_of names the configured tenant of a request, or ANONYMOUS_TENANT.

        An API key (``authorization: Bearer KEY``) whose SHA-256 is configured wins over
        the tenant header: a key is a credential, the header only a claim. A tenant that
        has keys is reachable only with one of them: a header naming it without its key is
        refused (RequestError 401 ``invalid_api_key``), so that nobody takes its class or
        drains its bucket by writing its name. More than one tenant header is refused
        (RequestError 400): which one counts would be a guess. The fairness header
        (``tenants.fairness_header``, ``fairness_values``) names the tenant when the tenant
        header is absent, under the same rules.
        """
        tenants = self.config.tenants
        for name, values in ((tenants.header, header_values), (tenants.fairness_header, fairness_values)):
            if len(values) > 1:
                raise RequestError(f"the {name} header is given {len(values)} times; send it once",
                                   param=name)
        header_values = list(header_values or fairness_values)
        if authorization is not None and self.api_keys:
            scheme, _, key = authorization.strip().partition(b" ")
            if scheme.lower() == b"bearer" and key:
                owner = self.api_keys.get(hashlib.sha256(key.strip()).hexdigest())
                if owner is not None:
                    return owner
        if not header_values:
            self._tenant_header_missing()
        else:
            self._header_missing = None
            name = header_values[0].decode("latin-1").strip()
            known = self.config.tenants.tenants.get(name)
            if known is not None:
                if known.api_key_sha256:
                    # The name is not echoed: it is the client's input.
                    raise RequestError("This tenant requires one of its API keys "
                                       "(authorization: Bearer KEY); the key given is missing "
                                       "or not one of them.", status=401, code="invalid_api_key")
                return name
        return ANONYMOUS_TENANT

    def _tenant_header_missing(self) -> None:
        """_tenant_header_missing notes a request without the tenant header (and without a
        tenant's key). When tenants exist that only that header can name and no request has
        ever carried it, the header Envoy sends is most likely not ``tenants.header``: every
        request falls into the default class, which deserves a word."""
        if not self._header_tenants:
            return  # every tenant has keys: requests without the header are the norm
        self.metrics.tenant_header_unseen.labels("absent").inc()
        missing = self._header_missing
        if missing is None:
            return
        self._header_missing = missing = missing + 1
        now = self.clock.now()
        if missing >= TENANT_HEADER_UNSEEN_AFTER and (
                self._header_logged is None or now - self._header_logged >= TENANT_HEADER_LOG_INTERVAL_S):
            self._header_logged = now
            log.warning("none of the last %d requests carried the tenant header %r, and "
                        "tenants are configured that only it can name: every request is in "
                        "the default class. Check that Envoy sends this header (the "
                        "request_attributes entry, or the filter that sets it) under the "
                        "name tenants.header gives (kvgate_tenant_header_unseen_total)",
                        missing, self.config.tenants.header)

    def class_named(self, objective_values: list[bytes]) -> ClassConfig | None:
        """class_named is the class the objective header (``tenants.objective_header``) names,
        or None when it is absent or names no configured class (then said at most once a
        minute: the request keeps its tenant's class). Given twice: RequestError 400."""
        if not objective_values:
            return None
        name = self.config.tenants.objective_header
        if len(objective_values) > 1:
            raise RequestError(f"the {name} header is given {len(objective_values)} times; send "
                               "it once", param=name)
        value = objective_values[0].decode("latin-1").strip()
        found = self.config.tenants.classes.get(value)
        if found is None:
            if self._log_due("_objective"):
                log.warning("a request's %s header names no class of tenants.classes (%s): it "
                            "keeps its tenant's class", name, ", ".join(sorted(self.config.tenants.classes)))
        return found

    def other_header_attributes(self, names: list[str]) -> None:
        """other_header_attributes notes request-header attributes Envoy sent that kvgate
        does not read (``names``): a request_attributes list naming another tenant header
        than ``tenants.header``. Counted per request, logged at most once a minute."""
        self.metrics.tenant_header_unseen.labels("other_header").inc()
        if self._log_due("_other_header"):
            log.error("Envoy sends the request attribute(s) %s, which kvgate does not read; "
                      "kvgate's tenant header is %r (tenants.header). Make the two the same, "
                      "or every request falls into the default class",
                      ", ".join(repr(n[:80]) for n in names[:4]), self.config.tenants.header)

    # --- per-route settings --------------------------------------------------------

    def route_settings(self, metadata: Any) -> RouteSettings:
        """route_settings reads the ``kvgate`` namespace of the request's metadata context.

        ``metadata`` is an ``envoy.config.core.v3.Metadata``. Unknown keys and bad values
        are ignored, but never silently: each is counted in
        ``kvgate_route_metadata_errors_total{key}`` and logged (at most once per key a
        minute). Numbers arrive as doubles and must be whole and positive. Every request
        of a route carries the same entry: results are remembered by its encoding.
        """
        if metadata is None or METADATA_NAMESPACE not in metadata.filter_metadata:
            return NO_ROUTE_SETTINGS
        struct = metadata.filter_metadata[METADATA_NAMESPACE]
        key = struct.SerializeToString(deterministic=True)
        hit = self._routes.get(key)
        if hit is None:
            hit = self._parse_route(struct)
            if len(self._routes) >= ROUTE_CACHE_ENTRIES:  # routes are few; anything else is odd
                self._routes.clear()
            self._routes[key] = hit
        settings, errors = hit
        for error_key, message in errors:
            self._route_error(error_key, message)
        return settings

    def _parse_route(self, struct: Any) -> tuple[RouteSettings, tuple[tuple[str, str], ...]]:
        values: dict[str, Any] = {}
        errors: list[tuple[str, str]] = []
        for key, value in struct.fields.items():
            if key not in ROUTE_KEYS:
                errors.append(("unknown", f"unknown per-route key {key[:64]!r}"))
                continue
            kind = value.WhichOneof("kind")
            if key == "release":
                if kind != "string_value" or value.string_value not in RELEASES:
                    errors.append((key, f"release must be one of {', '.join(RELEASES)}"))
                else:
                    values[key] = value.string_value
            elif key in ("pool", "tenant_class"):
                names = self.config.pools if key == "pool" else self.config.tenants.classes
                if kind != "string_value":
                    errors.append((key, f"{key} must be a string"))
                elif value.string_value not in names:
                    errors.append((key, f"{key} {value.string_value[:64]!r} is not configured"))
                else:
                    values[key] = value.string_value
            else:
                minimum = 64 if key == "max_body_bytes" else 1
                number = value.number_value if kind == "number_value" else math.nan
                if not (math.isfinite(number) and number.is_integer() and number >= minimum):
                    errors.append((key, f"{key} must be a whole number >= {minimum}"))
                else:
                    values[key] = int(number)
        return (RouteSettings(**values) if values else NO_ROUTE_SETTINGS), tuple(errors)

    def misconfigured(self, message: str) -> None:
        """misconfigured counts a request kvgate cannot serve because of Envoy's
        configuration (``kvgate_internal_errors_total``) and logs why, at most once a minute."""
        self.metrics.internal_errors.inc()
        if self._log_due("_misconfigured"):
            log.error("refusing requests: %s", message)

    def served_elsewhere(self, pool: str, address: str) -> None:
        """served_elsewhere hears that the proxy named an endpoint that is no node of ``pool`` as
        the one that served a request: the charge stays on the node picked. Counted in
        ``kvgate_served_unknown_endpoint_total``, logged at most once a minute."""
        self.metrics.served_unknown_endpoint(pool)
        if self._log_due("_served_elsewhere"):
            log.warning("the proxy says a request of pool %r was served by %s, which is no node "
                        "of the pool: its KV stays charged to the node kvgate picked. Check that "
                        "the pool's backend addresses are the endpoints the gateway routes to",
                        pool, address[:80].encode("ascii", "backslashreplace").decode())

    def wait_cut(self, class_name: str, asked_s: float, waited_s: float) -> None:
        """wait_cut hears that a waiting request's stream ended after ``waited_s`` seconds,
        having asked Envoy for an ``asked_s`` message timeout. When Envoy's base timeout cut
        it (``waitwatch``), it is counted in ``kvgate_envoy_override_ignored_total`` and said
        once per process, loudly: every waiting request of the class gets a 504."""
        base = self.config.server.envoy_message_timeout_s
        if not cut_at_base_timeout(waited_s, base, asked_s):
            return
        self.metrics.override_ignored(class_name)
        if not self._cut_logged:
            self._cut_logged = True
            log.error("Envoy ignored kvgate's message-timeout override: a request of class %r that "
                      "asked for %.1f s to wait was cut after %.2f s (server.envoy_message_timeout_s "
                      "%.1f s); Envoy's max_message_timeout is below it, so every waiting request "
                      "gets a 504. Raise max_message_timeout (kvgate check-config FILE --envoy "
                      "ENVOY.yaml names it)", class_name, asked_s, waited_s, base)

    def _log_due(self, key: str) -> bool:
        """_log_due tells whether the line logged under ``key`` is due: at most one a minute
        (ROUTE_LOG_INTERVAL_S), while its metric counts every occurrence."""
        now = self.clock.now()
        last = self._route_logged.get(key)
        if last is not None and now - last < ROUTE_LOG_INTERVAL_S:
            return False
        self._route_logged[key] = now
        return True

    def _route_error(self, key: str, message: str) -> None:
        self.metrics.route_metadata_error(key)
        if self._log_due(key):
            log.warning("ignoring per-route setting: %s (kvgate_route_metadata_errors_total"
                        "{key=%r} counts every occurrence)", message, key)


def _name_node(resp: pb.ProcessingResponse, common: Any, address: str) -> None:
    """_name_node steers the request to ``address`` (``HOST:PORT``) the way the endpoint picker
    protocol does: the destination header, the same value in ``envoy.lb`` dynamic metadata,
    and the route cache cleared so Envoy routes by them."""
    set_headers(common.header_mutation, [(DESTINATION_HEADER, address)])
    common.clear_route_cache = True
    resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = address


# --- one request -------------------------------------------------------------------

def _evaluate(endpoint: oai.Endpoint, body: bytes, content_type: str | None,
              pool: PoolRuntime) -> tuple[oai.ParsedRequest, int]:
    """_evaluate parses a body and counts its prompt tokens (may run in a worker thread)."""
    parsed = oai.parse_request(endpoint, body, content_type)
    return parsed, oai.count_prompt_tokens(parsed, pool.tokenizer, pool.template)


def _attribute_values(attributes: Any) -> dict[str, str]:
    """_attribute_values flattens Envoy's request attributes (name -> string value)."""
    values: dict[str, str] = {}
    if attributes:
        for struct in attributes.values():
            for key, value in struct.fields.items():
                if value.WhichOneof("kind") == "string_value":
                    values[key] = value.string_value
    return values


_REASON_OUTCOME = {"concurrency": "rejected_concurrency", "tpm": "rejected_tpm",
                   "kv_budget": "rejected_kv_budget", "shed": "rejected_shed"}

# States of an exchange.
_NEW, _BODY, _PASS, _ADMITTED, _DONE = range(5)


class Exchange:
    """Exchange is one HTTP request's admission state machine (see the module doc).

    Methods are called in Envoy's message order; each returns the response to send.
    ``finish`` must be called once the ext_proc stream ends, however it ends: it releases
    the lease (if still held) with the cause derived from what was seen.
    """

    __slots__ = ("gate", "state", "endpoint", "pool", "pool_name", "class_cfg", "tenant",
                 "route", "content_type", "body", "max_body", "streamed", "lease", "strip_usage",
                 "tracker", "status", "response_done", "upstream_error", "outcome", "observe",
                 "link", "response_unread", "duplex", "response_duplex", "hint",
                 "cut_by_upstream", "cause_pending")

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.state = _NEW
        self.endpoint: oai.Endpoint | None = None
        self.pool: PoolRuntime | None = None
        self.pool_name = ""
        self.class_cfg: ClassConfig | None = None
        self.tenant = ANONYMOUS_TENANT
        self.route = NO_ROUTE_SETTINGS
        self.content_type: str | None = None
        self.body: bytearray | None = None
        self.max_body = 0
        # The request asked for a streamed response. The parsed body itself is not kept:
        # an in-flight request holds no copy of its prompt.
        self.streamed = False
        self.lease: Lease | None = None
        self.strip_usage = False
        self.tracker: oai.ResponseTracker | None = None
        self.status = 0
        self.response_done = False
        self.upstream_error = False
        self.outcome: Outcome | None = None
        # The response arrives on another (observability-mode) stream, tied by ``link``.
        self.observe = False
        self.link: str | None = None
        # Response headers came on this stream, but Envoy sends no response body
        # (deploy/envoy-reservation.yaml): the completion is charged at the reservation.
        self.response_unread = False
        # Bodies FULL_DUPLEX_STREAMED (the endpoint picker protocol): kvgate passes every body
        # byte back itself. ``hint``: the endpoints the proxy allows (None: no hint).
        self.duplex = False
        self.response_duplex = False
        self.hint: frozenset[str] | None = None
        # Route ``release: stream_and_log``: what Envoy's access log entry told of a stream
        # cut short (None: no entry yet; True: the upstream broke it off), and whether the
        # cause of a release made without it still awaits the entry (``told_by_log``).
        self.cut_by_upstream: bool | None = None
        self.cause_pending = False

    # --- request headers -------------------------------------------------------------

    def request_headers(self, msg: pb.HttpHeaders, metadata: Any = None,
                        protocol: Any = None) -> pb.ProcessingResponse | None:
        """request_headers picks the endpoint, pool, tenant and class; refuses early what it can.

        Answers 413 for a declared content-length above the cap (before any body is
        read), 400 for duplicate tenant headers or a missing body; passes through paths
        that are not admitted. ``protocol`` is the stream's ProtocolConfiguration when
        Envoy sent one: with a FULL_DUPLEX_STREAMED request body the answer to an admitted
        path's headers comes with the body's decision, and None is returned here.
        """
        if self.state != _NEW:  # a second request on one stream: never from Envoy; ignore it
            return CONTINUE_REQUEST_HEADERS
        self.duplex = epp.full_duplex(protocol)
        self.response_duplex = epp.response_full_duplex(protocol)
        self.hint = epp.subset_hint(metadata)
        tenant_header = self.gate.config.tenants.header
        path = method = b""
        content_length: bytes | None = None
        authorization: bytes | None = None
        tenant_values: list[bytes] = []
        fairness_header = self.gate.config.tenants.fairness_header
        objective_header = self.gate.config.tenants.objective_header
        fairness_values: list[bytes] = []
        objective_values: list[bytes] = []
        for h in msg.headers.headers:
            key = h.key
            if key == ":path":
                path = h.raw_value
            elif key == ":method":
                method = h.raw_value
            elif key == "content-length":
                content_length = h.raw_value
            elif key == "content-type":
                self.content_type = h.raw_value.decode("latin-1")
            elif key == "authorization":
                authorization = h.raw_value
            elif key == tenant_header:
                tenant_values.append(h.raw_value)
            elif key == fairness_header:
                fairness_values.append(h.raw_value)
            elif key == objective_header:
                objective_values.append(h.raw_value)
        refusal = self._begin(path.decode("latin-1"), method == b"POST", authorization,
                              tenant_values, metadata, fairness_values, objective_values)
        if refusal is not None:
            return refusal
        if self.state == _PASS:
            if self.duplex:  # no mode_override in this mode: the bodies are passed back
                return self._pass_through_picked(duplex=True) or CONTINUE_REQUEST_HEADERS
            return self._pass_through_picked() or PASS_THROUGH
        if content_length is not None:
            try:
                declared = int(content_length)
            except ValueError:
                return self._refuse(RequestError("content-length is not a number",
                                                 param="content-length"), "rejected_invalid")
            if declared > self.max_body:
                return self._refuse_too_large(declared)
        if msg.end_of_stream:
            return self._refuse(RequestError("the request has no body; send a JSON object"),
                                "rejected_invalid")
        self.state = _BODY
        self.body = bytearray()
        return None if self.duplex else CONTINUE_REQUEST_HEADERS

    def _begin_from_attributes(self, attributes: Any, metadata: Any) -> pb.ProcessingResponse | None:
        """_begin_from_attributes identifies a request whose headers Envoy skipped, from the
        request attributes sent with its first body message (``request_attributes``).

        Envoy joins repeated headers with ``,`` (tenant names cannot contain one), so a
        tenant value with a comma is a repeated tenant header. Attributes that were not
        UTF-8 (a client's bad header byte; see server.decode_request) get a 400. Without
        ``request.path`` kvgate cannot tell what the request is: it refuses it (fail closed)
        and says why.
        """
        if attributes and UNDECODABLE_ATTRIBUTES in attributes:
            return self._refuse(RequestError(
                "a request header (the tenant header, authorization or content-type) is not "
                "valid UTF-8"), "rejected_invalid")
        values = _attribute_values(attributes)
        tenants = self.gate.config.tenants
        known = (ATTR_CONTENT_TYPE, ATTR_AUTHORIZATION, tenant_attribute(tenants.header),
                 *(tenant_attribute(h) for h in (tenants.fairness_header, tenants.objective_header) if h))
        others = [k for k in values if k.startswith("request.headers[") and k not in known]
        if others:
            self.gate.other_header_attributes(others)
        path = values.get(ATTR_PATH)
        if path is None:
            return self._misconfigured(
                "Envoy sent a request body without the request headers and without the "
                f"{ATTR_PATH!r} request attribute: list kvgate's request attributes in the "
                "ext_proc filter's request_attributes (see deploy/envoy.yaml)")
        self.content_type = values.get(ATTR_CONTENT_TYPE)
        authorization = values.get(ATTR_AUTHORIZATION)
        return self._begin(path, values.get(ATTR_METHOD) == "POST",
                           None if authorization is None else authorization.encode(),
                           self._tenant_values(values), metadata,
                           self._header_values(values, tenants.fairness_header),
                           self._header_values(values, tenants.objective_header))

    def _tenant_values(self, values: dict[str, str]) -> list[bytes]:
        return self._header_values(values, self.gate.config.tenants.header)

    @staticmethod
    def _header_values(values: dict[str, str], header: str | None) -> list[bytes]:
        """_header_values is the values of request header ``header`` among the request
        attributes, one per repeated header ([] for None: a header kvgate does not read)."""
        if header is None:
            return []
        tenant = values.get(tenant_attribute(header))
        # Envoy copied the header's bytes, which were UTF-8 (the message decoded): the same
        # bytes the header itself would have given.
        return [] if tenant is None else [v.encode() for v in tenant.split(",")]

    def _class_from_attributes(self, attributes: Any, metadata: Any) -> None:
        """_class_from_attributes sets the pool and class of a request refused before kvgate
        saw its body (Envoy's own 413), so that it is counted where it belongs; an identity
        that would have been refused leaves the default class."""
        gate = self.gate
        values = _attribute_values(attributes)
        route = gate.route_settings(metadata)
        self.pool_name = route.pool or gate.config.default_pool
        authorization = values.get(ATTR_AUTHORIZATION)
        try:
            tenant = gate.tenant_of(self._tenant_values(values),
                                    None if authorization is None else authorization.encode())
        except RequestError:
            return
        self.class_cfg = (gate.config.tenants.classes[route.tenant_class] if route.tenant_class
                          else gate.config.class_of(tenant))

    def _begin(self, path: str, post: bool, authorization: bytes | None,
               tenant_values: list[bytes], metadata: Any, fairness_values: list[bytes] | None = None,
               objective_values: list[bytes] | None = None) -> pb.ProcessingResponse | None:
        """_begin picks endpoint, pool, tenant and class; returns a refusal or None.

        A path kvgate does not admit leaves the state _PASS. The class: the route's, else
        the one the objective header names, else the tenant's.
        """
        gate = self.gate
        config = gate.config
        endpoint = oai.endpoint_for_path(path)
        if endpoint is None or not post:
            limits = config.limits
            if limits.unknown_paths == "pass" or oai.path_passes(oai.normalise_path(path),
                                                                   limits.pass_paths):
                self.state = _PASS
                return None
            return self._refuse_path(path, endpoint is not None)
        self.endpoint = endpoint
        self.route = route = gate.route_settings(metadata)
        self.pool_name = route.pool or config.default_pool
        self.pool = gate.pools[self.pool_name]
        self.max_body = route.max_body_bytes or config.limits.max_body_bytes
        try:
            self.tenant = gate.tenant_of(tenant_values, authorization, fairness_values or ())
            objective = None if route.tenant_class else gate.class_named(objective_values or [])
        except RequestError as err:
            self.class_cfg = config.tenants.classes[config.tenants.default_class]
            return self._refuse(err, "rejected_unauthenticated" if err.status == 401
                                else "rejected_invalid")
        self.class_cfg = (config.tenants.classes[route.tenant_class] if route.tenant_class
                          else objective or config.class_of(self.tenant))
        return None

    # --- request body ------------------------------------------------------------------

    async def request_body(self, msg: pb.HttpBody,
                           send: Callable[[pb.ProcessingResponse], Awaitable[None]] | None = None,
                           attributes: Any = None, metadata: Any = None,
                           protocol: Any = None) -> pb.ProcessingResponse | list[pb.ProcessingResponse] | None:
        """request_body decides: parse, count, check the context window, then acquire.

        With a FULL_DUPLEX_STREAMED request body, chunks before the last are not answered
        (None), and an admitted request is answered with a list: the owed request-headers
        answer, then the body as streamed chunks. A passed-through request's chunks go
        back as they came.

        ``send`` lets the exchange extend Envoy's message timeout before it waits in its
        class's queue (``override_message_timeout``); None when the caller cannot.
        ``attributes`` and ``metadata`` identify the request when it is the stream's first
        message (Envoy skips request headers); otherwise they are not read. ``protocol`` is
        the stream's ProtocolConfiguration when Envoy sent one: a response body mode NONE
        means the response is observed elsewhere (the module doc).
        """
        if protocol is not None and self.state in (_NEW, _BODY):
            self.observe = protocol.response_body_mode == processing_mode_pb2.ProcessingMode.NONE
        if self.state == _NEW:
            first = self._begin_from_attributes(attributes, metadata)
            if first is not None:
                return first
            if self.state == _PASS:
                return PASS_THROUGH_BODY
            if self.pool is not None and self.pool.config.picks:
                return self._misconfigured(
                    f"pool {self.pool_name!r} picks its nodes (its backends have addresses), but "
                    "Envoy skips the request headers, so they went upstream before kvgate could "
                    "name the node: use deploy/envoy-endpoint-picker.yaml (request headers SEND, "
                    "request body BUFFERED)")
            self.state = _BODY
            self.body = bytearray()
        if self.state != _BODY:
            if self.duplex:
                return epp.streamed_chunk("request_body", msg.body, msg.end_of_stream)
            return CONTINUE_REQUEST_BODY
        body = self.body
        assert body is not None
        if body or not msg.end_of_stream:
            # Only a non-BUFFERED Envoy config sends a body in parts: keep collecting.
            body += msg.body
            if len(body) > self.max_body:
                return self._refuse_too_large(len(body))
            if not msg.end_of_stream:
                return None if self.duplex else CONTINUE_REQUEST_BODY
            raw = bytes(body)
        else:  # BUFFERED: the whole body in one message
            raw = msg.body
            if len(raw) > self.max_body:
                return self._refuse_too_large(len(raw))
        self.body = None
        gate = self.gate
        started = gate.clock.now()
        pool = self.pool
        assert pool is not None and self.endpoint is not None and self.class_cfg is not None
        try:
            if len(raw) > gate.offload_bytes:
                loop = asyncio.get_running_loop()
                parsed, prompt_tokens = await loop.run_in_executor(
                    gate.executor, _evaluate, self.endpoint, raw, self.content_type, pool)
            else:
                parsed, prompt_tokens = _evaluate(self.endpoint, raw, self.content_type, pool)
            window = self.route.context_window or pool.config.context_window
            reserved = oai.request_reservation(parsed, prompt_tokens, window,
                                               pool.config.default_max_tokens)
            oai.check_context(parsed, prompt_tokens, reserved, window)
        except RequestError as err:
            outcome = ("rejected_context_length" if err.code == "context_length_exceeded"
                       else "rejected_body_too_large" if err.status == 413 else "rejected_invalid")
            return self._refuse(err, outcome)
        self.streamed = parsed.stream
        among = self.hint if pool.config.picks else None
        if among is not None and not gate.admission.eligible_nodes(self.pool_name, among):
            return self._no_eligible_endpoint()
        demand = Demand(pool=self.pool_name, tenant=self.tenant, class_name=self.class_cfg.name,
                        prompt_tokens=prompt_tokens, completion_tokens=reserved, among=among)
        if self.class_cfg.max_wait_s > 0 and send is not None:
            await send(self._wait_timeout(self.class_cfg.max_wait_s))
        try:
            result = await gate.admission.acquire(demand)
        except asyncio.CancelledError:  # the stream ended while the request waited
            if self.class_cfg.max_wait_s > 0 and send is not None:
                gate.wait_cut(self.class_cfg.name, self.class_cfg.max_wait_s + WAIT_TIMEOUT_MARGIN_S,
                              gate.clock.now() - started)
            raise
        except UnknownPoolError:
            # A reload removed the pool between the choice (headers, or before counting off
            # the loop) and now: nothing was taken; the client's retry meets the new config.
            self.state = _DONE
            log.warning("refusing a request: its pool %r was removed by a reload", self.pool_name)
            return immediate(503, [("content-type", _JSON), ("retry-after", "1"),
                                   ("retry-after-ms", "1000"),
                                   ("x-kvgate-reason", "pool_reconfigured")],
                             oai.error_body("The gateway was reconfigured while this request was "
                                            "being admitted. Retry.", error_type="server_error",
                                            code="pool_reconfigured"),
                             "kvgate_pool_reconfigured")
        except StoreError as err:
            # The shared store cannot answer and is set to fail closed: retry shortly.
            gate.metrics.decision_time(self.pool_name, gate.clock.now() - started)
            self.state = _DONE
            gate.metrics.request(self.pool_name, self.class_cfg.name, "rejected_store_unavailable")
            log.warning("refusing a request: %s", err)
            return immediate(503, [("content-type", _JSON), ("retry-after", "1"),
                                   ("retry-after-ms", "1000"),
                                   ("x-kvgate-reason", "store_unavailable")],
                             oai.error_body(f"Admission is unavailable: {err}. Retry shortly.",
                                            error_type="server_error", code="store_unavailable"),
                             "kvgate_store_unavailable")
        gate.metrics.decision_time(self.pool_name, gate.clock.now() - started)
        if isinstance(result, Rejection):
            self.state = _DONE
            gate.metrics.request(self.pool_name, self.class_cfg.name,
                                 _REASON_OUTCOME.get(result.reason.value, "rejected_invalid"))
            status, headers, payload = oai.rejection_response(result)
            return immediate(status, headers, payload, f"kvgate_{result.reason.value}")
        self.lease = result
        self.state = _ADMITTED
        gate.metrics.request(self.pool_name, self.class_cfg.name, "admitted")
        cap = reserved // parsed.sequences if pool.config.enforce_max_tokens and parsed.sequences else None
        if self.observe:
            # Stream usage only where the access log's usage filter reads it and can hide it.
            usage = self.released_by_access_log and usage_log.announced(metadata)
            capped, strip = oai.upstream_body(parsed, cap_max_tokens=cap, stream_usage=usage)
            resp = self._linked_continue(result, capped)
            if strip:
                usage_log.ask_to_strip(resp)
            return resp
        new_body, self.strip_usage = oai.upstream_body(parsed, cap_max_tokens=cap)
        node = result.node
        if self.duplex:
            return self._duplex_answer(raw if new_body is None else new_body,
                                       new_body is not None, node)
        if self.route.release == STREAM_AND_LOG:
            resp = self._linked_continue(result, new_body, rates=False)
            if node is not None:
                _name_node(resp, resp.request_body.response, node)
            return resp
        if new_body is None and node is None:
            return CONTINUE_REQUEST_BODY
        # Ask the upstream for stream usage (the client did not; its usage chunk is then
        # hidden from the client) and/or cap max_tokens at the reservation. Envoy does not
        # fix content-length for a replaced body: set it in the same answer or Envoy fails
        # the request with 500.
        resp = pb.ProcessingResponse()
        common = resp.request_body.response
        if new_body is not None:
            set_headers(common.header_mutation, [("content-length", str(len(new_body)))])
            common.body_mutation.body = new_body
        if node is not None:
            _name_node(resp, common, node)
        return resp

    def _duplex_answer(self, body: bytes, replaced: bool,
                       node: str | None) -> list[pb.ProcessingResponse]:
        """_duplex_answer is an admitted request's answer in FULL_DUPLEX_STREAMED: the owed
        request-headers answer (the node, and content-length when the body was replaced),
        then every body byte, in the protocol's order."""
        head = pb.ProcessingResponse()
        common = head.request_headers.response
        if replaced:
            set_headers(common.header_mutation, [("content-length", str(len(body)))])
        if node is not None:
            _name_node(head, common, node)
        else:
            head.request_headers.SetInParent()
        return [head, *epp.streamed_body("request_body", body, True)]

    def _no_eligible_endpoint(self) -> pb.ProcessingResponse:
        """_no_eligible_endpoint is the protocol's 503 when the proxy's subset hint allows no
        node kvgate may pick (empty, unknown addresses, or every allowed node not up)."""
        self.state = _DONE
        cls = self.class_cfg
        self.gate.metrics.request(self.pool_name or self.gate.config.default_pool,
                                  cls.name if cls is not None else self.gate.config.tenants.default_class,
                                  "rejected_no_endpoint")
        return immediate(503, [("content-type", _JSON), ("retry-after", "1"),
                               ("x-kvgate-reason", "no_endpoint")],
                         oai.error_body("None of the endpoints this request may go to can take it "
                                        "now. Retry shortly.", error_type="server_error",
                                        code="no_eligible_endpoint"),
                         "kvgate_no_eligible_endpoint")

    def _pass_through_picked(self, duplex: bool = False) -> pb.ProcessingResponse | None:
        """_pass_through_picked lets a request kvgate does not admit go to an up node of a picking
        pool (uncharged): Envoy routes by the node kvgate names, so even these need one. None
        when the pool does not pick; a 503 when no node is up (among those the subset hint
        allows). ``duplex``: no mode_override (the bodies are passed back one by one)."""
        pool = self.gate.pools.get(self.pool_name or self.gate.config.default_pool)
        if pool is None or not pool.config.picks:
            return None
        address = self.gate.admission.any_node(pool.config.name, self.hint)
        if address is None:
            self.state = _DONE
            return immediate(503, [("content-type", _JSON), ("retry-after", "1"),
                                   ("x-kvgate-reason", "no_node")],
                             oai.error_body("No node of this pool answers its metrics now. Retry "
                                            "shortly.", error_type="server_error", code="no_node"),
                             "kvgate_no_node")
        resp = pb.ProcessingResponse() if duplex else pb.ProcessingResponse(mode_override=_NOTHING_MORE)
        _name_node(resp, resp.request_headers.response, address)
        return resp

    def _linked_continue(self, lease: Lease, new_body: bytes | None = None, *,
                         rates: bool = True) -> pb.ProcessingResponse:
        """_linked_continue admits a request whose response is observed on another stream, or
        whose access log entry kvgate reads: the link and (``rates``) the x-ratelimit-* values
        go into the request's dynamic metadata, where the observing filter, the access log
        (and Envoy's response_headers_to_add) find them. ``new_body`` (with its
        content-length) replaces the request body when given."""
        self.link = self.gate.new_link()
        resp = pb.ProcessingResponse()
        resp.request_body.SetInParent()
        if new_body is not None:
            common = resp.request_body.response
            set_headers(common.header_mutation, [("content-length", str(len(new_body)))])
            common.body_mutation.body = new_body
        fields = resp.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
        fields[LINK_KEY].string_value = self.link
        if rates:
            for key, value in oai.rate_limit_headers(lease.rate):
                fields[key].string_value = value
        return resp

    @staticmethod
    def _wait_timeout(max_wait_s: float) -> pb.ProcessingResponse:
        seconds = max_wait_s + WAIT_TIMEOUT_MARGIN_S
        whole = int(seconds)
        return pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(
            seconds=whole, nanos=int((seconds - whole) * 1e9)))

    # --- response ------------------------------------------------------------------------

    def response_headers(self, msg: pb.HttpHeaders, *, observed: bool = False,
                         attributes: Any = None, metadata: Any = None) -> pb.ProcessingResponse:
        """response_headers notes the upstream status and adds the x-ratelimit-* headers.

        ``observed``: the headers come from the observability-mode stream (their answer is
        not sent); otherwise from this exchange's own stream. ``attributes`` and
        ``metadata`` come with a stream's first message: they name the tenant of a request
        Envoy refused before kvgate saw it.

        A response before any admission had no request body (nothing to admit) or was
        answered by Envoy itself: it passes through, except Envoy's own 413 for a body above
        its buffer limit, which gets kvgate's OpenAI-shaped 413 like any body above the cap.
        """
        lease = self.lease
        if self.state in (_NEW, _BODY):
            # Nothing admitted: Envoy answered before the body reached kvgate (or there was
            # no body). Its own 413 for a body above its buffer limit gets kvgate's shape.
            first = self.state == _NEW
            self.state = _PASS
            for h in msg.headers.headers:
                if h.key == ":status" and h.raw_value == b"413":
                    if first and attributes and UNDECODABLE_ATTRIBUTES not in attributes:
                        self._class_from_attributes(attributes, metadata)
                    return self._refuse(RequestError(
                        "The request body is above this endpoint's limit.", status=413,
                        code="request_too_large"), "rejected_body_too_large")
            return PASS_THROUGH_RESPONSE if first else CONTINUE_RESPONSE_HEADERS
        if self.state != _ADMITTED or lease is None:
            return CONTINUE_RESPONSE_HEADERS
        if lease.node is not None:
            self._served_by(lease, epp.served_endpoint(metadata))
        content_type = ""
        for h in msg.headers.headers:
            if h.key == ":status":
                try:
                    self.status = int(h.raw_value)
                except ValueError:
                    self.status = 0
            elif h.key == "content-type":
                content_type = h.raw_value.decode("latin-1")
        self.upstream_error = self.status >= 400
        if self.observe and not observed:
            # deploy/envoy-reservation.yaml: response headers on the admission stream, whose
            # response body mode is NONE. No body will follow and no observing stream will
            # show it: the lease is released when the stream ends (with the HTTP stream) and
            # the completion is charged at the reservation. Not a mode_override to NONE:
            # Envoy would close the stream at once.
            self.response_unread = True
            resp = pb.ProcessingResponse()
            set_headers(resp.response_headers.response.header_mutation, oai.rate_limit_headers(lease.rate))
            return resp
        streamed = content_type.startswith("text/event-stream")
        strip = self.strip_usage and streamed and not self.upstream_error
        self.tracker = oai.ResponseTracker(streamed=streamed, strip_usage_chunk=strip)
        resp = pb.ProcessingResponse()
        mutation = resp.response_headers.response.header_mutation
        set_headers(mutation, oai.rate_limit_headers(lease.rate))
        if strip:
            mutation.remove_headers.append("content-length")  # chunks may shrink: no fixed length
        if msg.end_of_stream:
            self._response_end()
        return resp

    def _served_by(self, lease: Lease, served: str | None) -> None:
        """_served_by moves the node charge to the endpoint the proxy says served the request
        (the protocol's ``x-gateway-destination-endpoint-served``) when it is another node of
        the pool; an address that is no node of the pool leaves the charge where it was
        picked, loudly."""
        if served is None or served == lease.node:
            return
        if not lease.served(served):
            self.gate.served_elsewhere(self.pool_name, served)

    def response_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        """response_body follows the response (usage, delivered chunks), hides the injected
        usage chunk, and releases the lease at the response's end of stream. With a
        FULL_DUPLEX_STREAMED response body every chunk goes back at once, as it came (or
        without the injected usage chunk): none is held."""
        if self.response_duplex:
            return self._duplex_response_body(msg)
        tracker = self.tracker
        if tracker is None:
            return CONTINUE_RESPONSE_BODY
        replacement = self._follow(tracker, msg)
        if replacement is None:
            return CONTINUE_RESPONSE_BODY
        resp = pb.ProcessingResponse()
        resp.response_body.response.body_mutation.body = replacement
        return resp

    def _follow(self, tracker: oai.ResponseTracker, msg: pb.HttpBody) -> bytes | None:
        """_follow reads one response chunk: usage, the tokens generated so far (for a picked
        node's ledger), and the end of the response (released at once). Returns the chunk's
        replacement (the injected usage chunk hidden), or None to pass it as it came."""
        replacement = tracker.feed(msg.body, msg.end_of_stream)
        lease = self.lease
        if lease is not None and lease.node is not None and tracker.delivered_chunks:
            lease.progress(tracker.delivered_chunks)
        if msg.end_of_stream:
            self._response_end()
        return replacement

    def _duplex_response_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        tracker = self.tracker
        if tracker is None:
            return epp.streamed_chunk("response_body", msg.body, msg.end_of_stream)
        replacement = self._follow(tracker, msg)
        return epp.streamed_chunk("response_body", msg.body if replacement is None else replacement,
                                  msg.end_of_stream)

    def request_trailers(self) -> pb.ProcessingResponse:
        """request_trailers answers the request's trailers. With a FULL_DUPLEX_STREAMED body
        still being collected they end the body without an end of stream on it: kvgate does
        not decide on such a body and refuses the request (400), taking nothing."""
        if self.duplex and self.state == _BODY:
            self.body = None
            return self._refuse(RequestError("request trailers are not accepted on this "
                                             "endpoint; send the JSON body without trailers"),
                                "rejected_invalid")
        return CONTINUE_REQUEST_TRAILERS

    @property
    def released_by_access_log(self) -> bool:
        """released_by_access_log: admitted on a route whose end comes by Envoy's access log
        (route key ``release: access_log``, response neither sent nor observed): the ext_proc
        stream may end with the request body, and ``ended_by_log`` releases the lease."""
        return (self.observe and self.lease is not None and self.state == _ADMITTED
                and self.route.release == "access_log")

    def ended_by_log(self, status: int, cut_short: bool, upstream_failed: bool = False,
                     usage: usage_log.LoggedUsage | None = None) -> Outcome | None:
        """ended_by_log releases the lease as Envoy's access log entry of the request tells:
        the response status (0: none was sent), whether the stream was cut short (the
        client went away, an idle timeout) and whether the upstream failed (reset or closed
        its connection): a stream cut short by the upstream is an upstream_error. The
        completion is charged as the usage filter saw it (``usage``, as a response read
        here would be), at its reservation without the filter."""
        if usage is not None:
            self.gate.metrics.logged_usage(usage.result)
            self.tracker = usage.tracker(self.streamed)
            self.cut_by_upstream = cut_short and upstream_failed
        self.status = status
        self.upstream_error = status >= 400 or (cut_short and upstream_failed)
        self.response_done = status != 0 and not cut_short
        return self.finish()

    def told_by_log(self, cut_by_upstream: bool) -> Outcome | None:
        """told_by_log takes what Envoy's access log entry tells of a request released by its
        stream (route ``release: stream_and_log``): whether the upstream broke the response
        off. Before the stream's end it is kept for ``finish``; after a release whose cause
        waited for it, the release is counted now, and its cause returned (None otherwise).
        ``told_by_log(False)`` is also the fallback when the entry never comes."""
        lease = self.lease
        if lease is None:
            return None
        if self.outcome is None:
            self.cut_by_upstream = cut_by_upstream
            return None
        if not self.cause_pending:
            return None
        self.cause_pending = False
        outcome = Outcome.UPSTREAM_ERROR if cut_by_upstream else Outcome.CLIENT_DISCONNECT
        self.outcome = lease.outcome = outcome
        self.gate.metrics.release(self.pool_name, outcome.value)
        return outcome

    def _response_end(self) -> None:
        # The response is complete: free the slot now rather than when Envoy gets round
        # to closing the ext_proc stream.
        self.response_done = True
        self.finish()

    # --- the end -------------------------------------------------------------------------

    def finish(self, *, gave_up: bool = False) -> Outcome | None:
        """finish releases the lease if still held and returns the cause (None if nothing to do).

        The cause: upstream_error for an upstream 4xx/5xx; completed once the response's
        end of stream, or a stream's ``[DONE]`` event, was seen; timeout when kvgate itself gave up (``gave_up``); ended for
        a response whose body was not read (deploy/envoy-reservation.yaml: complete or cut
        short, Envoy ends the stream alike, by a half-close or a reset at random);
        upstream_error for a stream the access log says the upstream broke off;
        client_disconnect otherwise. Completion tokens charged: the reported usage; for a
        stream cut short, the chunks delivered; otherwise (unknown) the whole reservation.
        Idempotent: later calls change nothing.

        On a ``release: stream_and_log`` route a stream cut short before its access log entry
        came is released now all the same, and only the counting of its cause waits for the
        entry (``cause_pending``, settled by ``told_by_log``).
        """
        lease = self.lease
        self.state = _DONE
        if lease is None or self.outcome is not None:
            return None
        tracker = self.tracker
        if self.upstream_error:
            outcome = Outcome.UPSTREAM_ERROR
        elif self.response_done or (tracker is not None and tracker.done_seen):
            # [DONE] passed through kvgate to the client: the generation ended. openai-python
            # closes on it, often before the upstream's end of body reaches Envoy.
            outcome = Outcome.COMPLETED
        elif gave_up:
            outcome = Outcome.TIMEOUT
        elif self.response_unread:
            outcome = Outcome.ENDED
        elif self.cut_by_upstream:
            outcome = Outcome.UPSTREAM_ERROR
        else:
            outcome = Outcome.CLIENT_DISCONNECT
        self.outcome = outcome
        if lease.release(outcome, self._completion_tokens(outcome)):
            if (outcome is Outcome.CLIENT_DISCONNECT and self.cut_by_upstream is None
                    and self.link is not None and self.route.release == STREAM_AND_LOG):
                self.cause_pending = True
            else:
                self.gate.metrics.release(self.pool_name, outcome.value)
        return outcome

    def _completion_tokens(self, outcome: Outcome) -> int | None:
        tracker = self.tracker
        if tracker is not None and tracker.completion_tokens is not None:
            return tracker.completion_tokens
        if tracker is None and (self.observe or self.response_unread):
            return None  # the response was never observed: unknown, charge the reservation
        if (outcome in (Outcome.CLIENT_DISCONNECT, Outcome.TIMEOUT) or self.cut_by_upstream) \
                and self.streamed:
            # What reached the client is what was generated (the upstream is reset within
            # a millisecond of the disconnect).
            return tracker.delivered_chunks if tracker is not None else 0
        return None

    # --- refusals ------------------------------------------------------------------------

    def _refuse(self, err: RequestError, outcome: str) -> pb.ProcessingResponse:
        self.state = _DONE
        cls = self.class_cfg
        self.gate.metrics.request(self.pool_name or self.gate.config.default_pool,
                                  cls.name if cls is not None else self.gate.config.tenants.default_class,
                                  outcome)
        status, headers, payload = oai.request_error_response(err)
        if not any(k == "x-kvgate-reason" for k, _ in headers):
            headers = [*headers, ("x-kvgate-reason", outcome.removeprefix("rejected_"))]
        return immediate(status, headers, payload, f"kvgate_{outcome}")

    def _refuse_path(self, path: str, admitted_path: bool) -> pb.ProcessingResponse:
        """_refuse_path answers a path kvgate neither admits nor lets through (404), or an
        admitted path with another method than POST (405): on an inference route nothing
        reaches the GPUs unadmitted (``limits.unknown_paths``)."""
        self.pool_name = self.gate.config.default_pool
        shown = path[:100].encode("ascii", "backslashreplace").decode()
        if admitted_path:
            err = RequestError(f"{shown} accepts POST only.", status=405, code="method_not_allowed")
        else:
            err = RequestError(f"Unknown request URL: {shown}. This gateway serves "
                               "/v1/chat/completions, /v1/completions, /v1/embeddings and "
                               "/v1/responses.", status=404, code="unknown_url")
        return self._refuse(err, "rejected_path")

    def _misconfigured(self, message: str) -> pb.ProcessingResponse:
        self.state = _DONE
        self.gate.misconfigured(message)
        return immediate(500, [("content-type", _JSON), ("x-kvgate-reason", "misconfigured")],
                         oai.error_body("The admission gateway is misconfigured; the operator "
                                        "has been told.", error_type="server_error",
                                        code="gateway_misconfigured"),
                         "kvgate_misconfigured")

    def _refuse_too_large(self, size: int) -> pb.ProcessingResponse:
        self.body = None
        return self._refuse(RequestError(
            f"The request body is {size} bytes, above this endpoint's limit of "
            f"{self.max_body} bytes.", status=413, code="request_too_large"),
            "rejected_body_too_large")
