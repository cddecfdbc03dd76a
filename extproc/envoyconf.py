"""envoyconf: the Envoy side of a kvgate configuration, written from it and checked against it.

About seven values of an Envoy file must agree with kvgate's own file: the tenant header among
the ext_proc ``request_attributes`` and in the header_mutation that strips client-sent copies,
the address of the kvgate cluster, the message timeouts against every class's ``max_wait_s``,
the listener's buffer limit and the 413 route against ``limits.max_body_bytes``, and the
``kvgate`` metadata of each route. ``envoy_filter`` writes
them from a ``Config`` (``kvgate envoy-filter``); ``extproc.envoycheck.check_envoy`` reads an
Envoy file and names every disagreement by the kvgate key it breaks (``kvgate check-config
--envoy``).

A mode names one of the Envoy files in ``deploy/`` (how a request's end reaches kvgate):

===================  ============================  =============================================
mode                 file                          what Envoy sends kvgate
===================  ============================  =============================================
three-message        ``envoy.yaml``                body (with request attributes), response
                                                   headers, body
four-message         ``envoy-four-message``        request headers too
reservation          ``envoy-reservation``         no response body: the reservation is charged
                                                   in full
observe              ``envoy-observe``             the response on a second, observability-mode
                                                   filter
access-log           ``envoy-access-log``          no response: the access-log entry releases
                                                   the lease, with the usage a Lua filter read
                                                   (``usage_log``)
endpoint-picker      ``envoy-endpoint-picker``     request headers too, held until kvgate names
                                                   the node
endpoint-picker-log  ``envoy-endpoint-picker-log`` the request as endpoint-picker, no response:
                                                   the access log brings the progress (periodic
                                                   entries) and the end, as access-log
inference-pool       ``envoy-inference-pool``      as an InferencePool's picker: bodies
                                                   FULL_DUPLEX_STREAMED
===================  ============================  =============================================

``inference-pool`` is the ext_proc filter the way gateways that implement the Gateway API
Inference Extension configure it for an InferencePool's endpoint picker (processing modes,
trailers sent; docs/endpoint-picker-protocol.md), plus what plain Envoy needs to tell the
picker which endpoint served (a response rule that copies the upstream address into the
protocol's ``envoy.lb`` metadata).

Where kvgate sees the response (three-message, four-message, observe, endpoint-picker) the
file also sends kvgate the access log entries of requests with a response flag, and its
routes say ``release: stream_and_log``: the stream's end releases the lease, the entry tells
whether a stream cut short was the client's doing or the upstream's.

Where kvgate sees no response (access-log, endpoint-picker-log) every request's entry goes to
kvgate and releases its lease; in endpoint-picker-log the connection manager also writes a
periodic entry of every stream in flight (``access_log_options.access_log_flush_interval``,
``PROGRESS_INTERVAL_S``), which tells the node's ledger how far the request has got (the usage
filter's event count) and which node serves it, and never releases.

The last three modes (and only they) route by the node kvgate names: they fit a pool that picks
its nodes (every backend has an ``address``, or DNS discovery) and no other, and the first five
fit only a pool that does not. Either other pair fails every request, so ``envoy_filter``
refuses to write one and ``check_envoy`` names it (``picking_mismatch``); without ``--mode``
the mode that fits the default pool is written (``mode_for``).

Where the default pool names fallbacks (``picking.fallbacks`` > 0) a picker mode's ``nodes``
cluster lists the nodes instead of ORIGINAL_DST (which answers a list with 503), and its route
retries once per fallback (``fallbacks_of``, ``envoyclusters.listed_nodes_cluster``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import yaml

from extproc.config import Config, PoolConfig
from extproc.envoyclusters import (CLUSTER, INFERENCE_CLUSTER, NODES_CLUSTER, fallback_retry, inference_cluster,
                                   kvgate_cluster, listed_nodes_cluster, nodes_cluster, retry_policy)
from extproc.errors import ConfigError
from extproc.gate import METADATA_NAMESPACE, WAIT_TIMEOUT_MARGIN_S
from extproc.picker_protocol import LB_NAMESPACE, SERVED_KEY, SUBSET_NAMESPACE
from extproc.request.profile import PROFILES, Seen
from extproc.usage_log import LUA_SOURCE
from extproc.usage_log import NAMESPACE as USAGE_NAMESPACE

MODES = tuple(PROFILES)
# Modes in which kvgate sees the request headers (and so decides before Envoy routes).
_HEADERS_SENT = tuple(p.name for p in PROFILES.values() if p.headers_sent)
# Modes in which kvgate names the node and Envoy's ORIGINAL_DST cluster goes there.
_PICKED = tuple(p.name for p in PROFILES.values() if p.picks)
# Modes in which kvgate sees no response: every request's access log entry releases its lease,
# with the usage the Lua filter read (``usage_log``).
_LOGGED = tuple(p.name for p in PROFILES.values() if p.response is Seen.LOG)
# How often Envoy writes a periodic access log entry of each stream in flight in the
# endpoint-picker-log mode (seconds): how late a node's ledger learns a request's first token
# and its growth, against kvgate's CPU (each entry costs it, so the CPU grows with the streams
# in flight over the interval). A first token counts in a
# node's report from the next scrape mark (``adaptive.poll_interval_s``, 1 s by default); it
# misses a mark it would have made with a chance of interval / poll interval: 1 in 4 at 0.25 s,
# 1 in 2 at 0.5 s, so 0.1 s would buy little for 2.5 times the CPU.
# bench/results/overhead-picker-log-intervals.md has the CPU by interval.
PROGRESS_INTERVAL_S = 0.25
HEADER_TO_METADATA_TYPE = ("type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3."
                           "Config")
# Modes in which kvgate sees the response: its end releases the lease, and the access log entry
# of a stream cut short tells whether the upstream broke it off (STREAM_AND_LOG).
_STREAMING = tuple(p.name for p in PROFILES.values() if p.cause_from_log)
HEADER_MUTATION_TYPE = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
BUFFER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
BUFFER_PER_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute"
# Headers only kvgate may set in the endpoint-picker mode: client-sent copies are removed.
PICKER_HEADERS = ("x-gateway-destination-endpoint", "x-gateway-destination-endpoint-served",
                  "x-gateway-destination-endpoint-subset")
# Header families a client must never send: kvgate's own and the endpoint picker's (every mode
# strips both, so a file moved to another mode stays safe).
INTERNAL_HEADER_PREFIXES = ("x-kvgate-", PICKER_HEADERS[0])
# Envoy's downstream connection limit (connections): past it new connections are refused.
MAX_DOWNSTREAM_CONNECTIONS = 10_000
# Time a client has to send its request headers (seconds).
REQUEST_HEADERS_TIMEOUT_S = 10
# request_timeout is max_message_timeout (the longest wait kvgate may ask for) plus this much
# for the upload itself (seconds): 120 s for the 60 s ceiling.
UPLOAD_ALLOWANCE_S = 60
# No byte in either direction for this long ends a stream; an idle keep-alive connection too (seconds).
IDLE_TIMEOUT_S = 300
GATEWAY_UNAVAILABLE_BODY = ('{"error":{"message":"The admission gateway is unavailable; retry shortly.",'
                            '"type":"server_error","param":null,"code":"gateway_unavailable"}}')
BODY_TOO_LARGE_BODY = ('{"error":{"message":"The request body is above this endpoint\'s limit.",'
                       '"type":"invalid_request_error","param":null,"code":"request_too_large"}}')
NO_UPSTREAM_BODY = ('{"error":{"message":"No inference server could take the request; retry shortly.",'
                    '"type":"server_error","param":null,"code":"upstream_unavailable"}}')
DEFAULT_MODE = "three-message"
"""DEFAULT_MODE is the mode written for a configuration whose default pool does not pick its nodes."""
PICKING_MODE = "endpoint-picker"
"""PICKING_MODE is the mode written for a configuration whose default pool picks its nodes."""
# What an operator is told to use instead when a pool and the Envoy file in front disagree on
# who picks the node: the shipped files of each kind, and the mode that writes the first.
PICKING_FILES = ("deploy/envoy-endpoint-picker.yaml", "deploy/envoy-endpoint-picker-log.yaml",
                 "deploy/envoy-inference-pool.yaml")
POOL_LEVEL_FILES = ("deploy/envoy.yaml", "deploy/envoy-four-message.yaml", "deploy/envoy-reservation.yaml",
                    "deploy/envoy-observe.yaml", "deploy/envoy-access-log.yaml")
# The shortest max_message_timeout written (seconds): room for a class added by a reload.
MIN_MAX_MESSAGE_TIMEOUT_S = 60
# Envoy's default per_connection_buffer_limit_bytes (bytes), when a listener sets none.
ENVOY_DEFAULT_BUFFER_BYTES = 1_048_576
# The buffer written is at least this (bytes), and 4 times max_body_bytes: headers and
# a pipelined request share the connection's buffer with the body.
MIN_BUFFER_BYTES = 4_194_304
EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
EXT_PROC_PER_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
SET_METADATA_TYPE = "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config"
LUA_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
HCM_TYPE = ("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
            "HttpConnectionManager")
_RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                 "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
                 "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")
_JSON_REFUSAL = [{"header": {"key": "content-type", "value": "application/json"}},
                 {"header": {"key": "x-should-retry", "value": "false"}}]


def mode_for(config: Config) -> str:
    """mode_for is the mode that fits ``config``'s default pool: ``PICKING_MODE`` where it picks
    its nodes, ``DEFAULT_MODE`` where Envoy's own load balancer spreads its requests."""
    return PICKING_MODE if config.pool(None).picks else DEFAULT_MODE


def picks_by_mode(mode: str) -> bool:
    """picks_by_mode is True when an Envoy file of ``mode`` routes each request to the node
    kvgate names (an ORIGINAL_DST cluster reading ``x-gateway-destination-endpoint``)."""
    return mode in _PICKED


def picking_mismatch(pool: PoolConfig, envoy_picks: bool, via: str) -> str | None:
    """picking_mismatch says why ``pool`` cannot be served by an Envoy side that routes by the
    node kvgate names (``envoy_picks``) or by its own load balancer, and what to use instead;
    None when they agree. ``via`` names that Envoy side in the sentence (a mode, a route).

    Either mismatch fails every request at run time: a picking pool behind a load-balanced
    route is refused 500 ``gateway_misconfigured`` (its headers went upstream before kvgate
    could name the node); a pool-level pool behind an ORIGINAL_DST route never names a node,
    and Envoy answers its plain-text 503."""
    if pool.picks == envoy_picks:
        return None
    if pool.picks:
        why = "its nodes are discovered in DNS" if pool.discovery is not None else \
            "every backend has an address"
        return (f"pool {pool.name!r} picks its nodes ({why}), but {via} lets Envoy's own load "
                f"balancer choose the node: every request would be refused with kvgate's 500 "
                f"gateway_misconfigured. Use {PICKING_FILES[0]} (or {', '.join(PICKING_FILES[1:])}; "
                f"`kvgate envoy-filter --mode {PICKING_MODE}` writes it), or remove the backends' "
                f"addresses to guard the pool as a whole")
    have = sum(b.address is not None for b in pool.backends)
    why = (f"{have} of its {len(pool.backends)} backends have an address" if have
           else "its backends have no address" if pool.backends else "it has no backends")
    return (f"pool {pool.name!r} does not pick its nodes ({why}), but {via} routes by "
            f"x-gateway-destination-endpoint, which kvgate sets only for a pool that picks: every "
            f"request would get Envoy's plain-text 503. Use {POOL_LEVEL_FILES[0]} (or another "
            f"pool-level file: {', '.join(POOL_LEVEL_FILES[1:])}; `kvgate envoy-filter --mode "
            f"{DEFAULT_MODE}` writes it), or give every backend of {pool.name!r} an address")


def fallbacks_of(config: Config, mode: str) -> int:
    """fallbacks_of is how many fallbacks kvgate names for the default pool behind a file of
    ``mode`` (``picking.fallbacks``; 0 in a pool-level mode): above 0 the file's ``nodes``
    cluster lists the nodes (``listed_nodes_cluster``) and its route retries once per fallback."""
    return config.pool(None).picking.fallbacks if mode in _PICKED else 0


def listed_addresses(config: Config) -> list[str]:
    """listed_addresses is every node the listed ``nodes`` cluster holds: the addresses of every
    picking pool's backends, in order, once each. Raises ConfigError for a picking pool
    discovered in DNS: its nodes cannot be listed, and the listed cluster would refuse them all."""
    out: list[str] = []
    for pool in config.pools.values():
        if pool.picks and pool.discovery is not None:
            raise ConfigError(f"pools.{config.default_pool}.picking.fallbacks",
                              f"the Envoy cluster that honours fallbacks lists its nodes, but pool "
                              f"{pool.name!r} discovers its nodes in DNS: its requests would all be refused. "
                              f"Set fallbacks to 0, or list {pool.name!r}'s backends")
        out += [b.address for b in pool.backends if b.address is not None and b.address not in out]
    return out


def seconds_text(value: float) -> str:
    """seconds_text writes a duration (seconds) as Envoy's YAML string, e.g. ``2s`` or ``0.25s``."""
    return f"{int(value)}s" if float(value).is_integer() else f"{value:g}s"


def split_address(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def kvgate_address(config: Config) -> tuple[str, int]:
    """kvgate_address is where Envoy reaches kvgate: its gRPC address, loopback for a wildcard."""
    host, port = split_address(config.server.grpc_listen)
    return ("127.0.0.1" if host in ("", "0.0.0.0", "::") else host), port


def needed_max_message_timeout_s(config: Config) -> float:
    """needed_max_message_timeout_s is the largest override kvgate asks for (seconds), 0 if none.

    A class that waits (``max_wait_s > 0``) extends the message timeout to max_wait_s plus
    ``WAIT_TIMEOUT_MARGIN_S``; Envoy ignores an override above its ``max_message_timeout``.
    """
    waits = [c.max_wait_s for c in config.tenants.classes.values() if c.max_wait_s > 0]
    return max(waits) + WAIT_TIMEOUT_MARGIN_S if waits else 0.0


def max_message_timeout_s(config: Config) -> int:
    """max_message_timeout_s is the ext_proc ``max_message_timeout`` written (whole seconds):
    room for every class's wait, at least ``MIN_MAX_MESSAGE_TIMEOUT_S``."""
    return max(MIN_MAX_MESSAGE_TIMEOUT_S, math.ceil(needed_max_message_timeout_s(config)))


def request_timeout_s(config: Config) -> int:
    """request_timeout_s is the connection manager's ``request_timeout`` (whole seconds): the
    longest queue wait kvgate may ask for plus ``UPLOAD_ALLOWANCE_S`` for sending the request.
    Envoy stops this clock once the request has gone upstream, so it never cuts a generation."""
    return max_message_timeout_s(config) + UPLOAD_ALLOWANCE_S


def buffer_limit_bytes(config: Config) -> int:
    """buffer_limit_bytes is the listener buffer written for ``limits.max_body_bytes`` (bytes)."""
    return max(MIN_BUFFER_BYTES, 4 * config.limits.max_body_bytes)


def request_attributes(config: Config) -> list[str]:
    """request_attributes is what kvgate reads of the request headers when Envoy skips them."""
    return ["request.path", "request.method", "request.headers['content-type']",
            "request.headers['authorization']", f"request.headers['{config.tenants.header}']"]


def _inference_pool_modes() -> dict[str, str]:
    """_inference_pool_modes is the processing mode InferencePool gateways give the picker's
    filter: headers, both bodies FULL_DUPLEX_STREAMED and trailers, all sent."""
    return {"request_header_mode": "SEND", "response_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"}


def _ext_proc(config: Config, mode: str) -> dict[str, Any]:
    skip_headers = mode not in _HEADERS_SENT
    seen = PROFILES[mode].response
    response_body = "STREAMED" if seen is Seen.STREAM else "NONE"
    response_headers = "SEND" if seen in (Seen.STREAM, Seen.HEADERS) else "SKIP"
    cfg: dict[str, Any] = {
        "@type": EXT_PROC_TYPE,
        "grpc_service": {"envoy_grpc": {"cluster_name": CLUSTER}},
        "failure_mode_allow": False,
        "status_on_error": {"code": "ServiceUnavailable"},
        "message_timeout": seconds_text(config.server.envoy_message_timeout_s),
        "max_message_timeout": seconds_text(max_message_timeout_s(config)),
        "processing_mode": {
            "request_header_mode": "SKIP" if skip_headers else "SEND",
            "request_body_mode": "BUFFERED",
            "response_header_mode": response_headers,
            "response_body_mode": response_body,
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        },
    }
    if mode == "inference-pool":
        cfg["processing_mode"] = _inference_pool_modes()
    if skip_headers:
        cfg["request_attributes"] = request_attributes(config)
    if mode in ("three-message", "four-message", "reservation", "endpoint-picker"):
        cfg["allow_mode_override"] = True
    if mode in ("endpoint-picker", "endpoint-picker-log"):  # the answer names the node, clears the route
        cfg["mutation_rules"] = {"allow_all_routing": True}
    forwarded = [METADATA_NAMESPACE]
    if mode == "inference-pool":  # the subset hint (request) and the endpoint served (response)
        forwarded += [SUBSET_NAMESPACE, LB_NAMESPACE]
    elif mode == "endpoint-picker" and fallbacks_of(config, mode):
        # The endpoint that served, which the listed cluster's policy writes: a fallback's
        # charge moves to it at the response headers.
        forwarded.append(LB_NAMESPACE)
    if mode in _LOGGED:  # the usage filter's mark: kvgate may ask for stream usage
        forwarded.append(USAGE_NAMESPACE)
    options: dict[str, Any] = {"forwarding_namespaces": {"untyped": forwarded}}
    if mode in (*_LOGGED, *_STREAMING):  # the link, for the access log (and the observer)
        options["receiving_namespaces"] = {"untyped": [METADATA_NAMESPACE]}
    cfg["metadata_options"] = options
    return cfg


def identity_headers(config: Config) -> list[str]:
    """identity_headers is every request header kvgate reads as a tenant or class claim: the
    tenant header, then the fairness and objective headers when they are read."""
    t = config.tenants
    return [h for h in (t.header, t.fairness_header, t.objective_header) if h]


def header_strip(config: Config) -> list[dict[str, Any]]:
    """header_strip is the request mutations of the first filter: the client's copies of the
    headers that name a tenant or a class, then every header of kvgate's and the endpoint
    picker's families, removed."""
    return [*({"remove": h} for h in identity_headers(config)),
            *({"remove_on_match": {"key_matcher": {"prefix": p}}} for p in INTERNAL_HEADER_PREFIXES)]


def _http_filters(config: Config, mode: str) -> list[dict[str, Any]]:
    filters: list[dict[str, Any]] = [
        {"name": "envoy.filters.http.header_mutation", "typed_config": {
            "@type": HEADER_MUTATION_TYPE, "mutations": {"request_mutations": header_strip(config)}}},
        {"name": "envoy.filters.http.set_metadata", "typed_config": {"@type": SET_METADATA_TYPE}},
    ]
    if mode in _LOGGED:
        # Before ext_proc: its mark on the request reaches kvgate with the body. On the way
        # back it reads each response chunk as it passes, for the access log (usage_log).
        filters.append({"name": "envoy.filters.http.lua", "typed_config": {
            "@type": LUA_TYPE, "default_source_code": {"inline_string": LUA_SOURCE}}})
    filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": _ext_proc(config, mode)})
    if mode == "observe":
        filters.append({"name": "kvgate.observe", "typed_config": {
            "@type": EXT_PROC_TYPE,
            "grpc_service": {"envoy_grpc": {"cluster_name": CLUSTER}},
            "observability_mode": True,
            "deferred_close_timeout": "0.02s",
            "failure_mode_allow": True,
            "stat_prefix": "kvgate_observe",
            "processing_mode": {"request_header_mode": "SKIP", "request_body_mode": "NONE",
                                "response_header_mode": "SEND", "response_body_mode": "STREAMED",
                                "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
            # The link to the lease, written by the admission filter, reaches kvgate here.
            "metadata_options": {"forwarding_namespaces": {"untyped": [METADATA_NAMESPACE]}},
        }})
    if mode == "inference-pool":
        # After ext_proc, so first on the way back: the address the router connected to
        # (added to the response by the route) becomes the protocol's served endpoint in
        # envoy.lb, which ext_proc then forwards with the response headers; the header
        # itself never reaches the client.
        filters.append({"name": "envoy.filters.http.header_to_metadata", "typed_config": {
            "@type": HEADER_TO_METADATA_TYPE,
            "response_rules": [{"header": SERVED_KEY, "remove": True, "on_header_present": {
                "metadata_namespace": LB_NAMESPACE, "key": SERVED_KEY, "type": "STRING"}}]}})
    else:
        # With request headers skipped ext_proc lets them go upstream at once, so a refused
        # request would open an upstream request; where they are sent Envoy holds them anyway
        # and the buffer costs no round trip. Not with FULL_DUPLEX_STREAMED bodies: kvgate
        # holds the request there itself, and a buffer would hold every streamed chunk.
        filters.append({"name": "envoy.filters.http.buffer", "typed_config": {
            "@type": BUFFER_TYPE, "max_request_bytes": buffer_limit_bytes(config)}})
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    return filters


def _routes(config: Config, mode: str, upstream_cluster: str) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = []
    if mode not in _HEADERS_SENT:
        # kvgate first hears of a request with its whole body: refuse what it would refuse
        # anyway before the body is read.
        routes.append({
            "name": "body-too-large",
            "match": {"prefix": "/", "headers": [{"name": "content-length", "range_match": {
                "start": config.limits.max_body_bytes + 1, "end": 9223372036854775807}}]},
            "direct_response": {"status": 413, "body": {"inline_string": BODY_TOO_LARGE_BODY}},
            # Answered at once: the buffer filter would hold it until the body is read.
            "typed_per_filter_config": {"envoy.filters.http.buffer": {
                "@type": BUFFER_PER_ROUTE_TYPE, "disabled": True}},
            "response_headers_to_add": _JSON_REFUSAL,
        })
        routes.append({
            "name": "no-body",
            "match": {"safe_regex": {"regex": "/v1/(chat/completions|completions|embeddings)/*"},
                      "headers": [{"name": ":method", "string_match": {"exact": "POST"}},
                                  {"name": "content-length", "range_match": {"start": 0, "end": 1}}]},
            "direct_response": {"status": 400, "body": {"inline_string": (
                '{"error":{"message":"the request has no body; send a JSON object",'
                '"type":"invalid_request_error","param":null,"code":null}}')}},
            "response_headers_to_add": _JSON_REFUSAL,
        })
    value: dict[str, Any] = {"pool": config.default_pool}
    release = PROFILES[mode].release
    if release is not None:
        value["release"] = release.value
    target: dict[str, Any] = {"cluster": upstream_cluster, "timeout": "0s"}
    if fallbacks_of(config, mode):
        target["retry_policy"] = fallback_retry(fallbacks_of(config, mode))
    route: dict[str, Any] = {
        "match": {"prefix": "/"},
        "route": target,
        "typed_per_filter_config": {"envoy.filters.http.set_metadata": {
            "@type": SET_METADATA_TYPE,
            "metadata": [{"metadata_namespace": METADATA_NAMESPACE, "value": value}]}},
    }
    if mode == "inference-pool":  # read back by the header_to_metadata filter (_http_filters)
        route["response_headers_to_add"] = [{
            "header": {"key": SERVED_KEY, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    if mode not in _HEADERS_SENT:
        routes += _headers_sent_routes(config, mode, route)
    routes.append(route)
    return routes


# Requests that may come without a body, in the modes that skip request headers: any method
# but POST, and a POST that declares no length or 0 (chunked, or none at all).
_MAY_HAVE_NO_BODY = (
    ("not-post", {"name": ":method", "string_match": {"exact": "POST"}, "invert_match": True}),
    ("no-content-length", {"name": "content-length", "invert_match": True,
                           "treat_missing_header_as_empty": True,
                           "range_match": {"start": 1, "end": 9223372036854775807}}),
)


def _headers_sent_routes(config: Config, mode: str, default: dict[str, Any]) -> list[dict[str, Any]]:
    """_headers_sent_routes are the default route again for requests that may have no body,
    with ext_proc told to send their request headers (``ExtProcPerRoute``): with the headers
    skipped, a request without a body sends kvgate no request message at all, and would reach
    the upstream unseen (a ``DELETE /v1/models``, a ``GET /generate``). kvgate decides on them
    at their headers: a GET or HEAD of ``limits.pass_paths`` passes, counted, the rest is refused
    as in the modes that send headers. A POST with a declared length, the inference request, keeps
    the default route's one round trip fewer."""
    modes = {**_ext_proc(config, mode)["processing_mode"], "request_header_mode": "SEND"}
    per_filter = {**default["typed_per_filter_config"], "envoy.filters.http.ext_proc": {
        "@type": EXT_PROC_PER_ROUTE_TYPE, "overrides": {"processing_mode": modes}}}
    return [copy.deepcopy({**default, "name": name, "match": {"prefix": "/", "headers": [header]},
                           "typed_per_filter_config": per_filter}) for name, header in _MAY_HAVE_NO_BODY]


def _access_log(mode: str) -> list[dict[str, Any]]:
    """_access_log is the gRPC access log to kvgate: every request's entry in the modes where
    kvgate sees no response (it releases the lease), otherwise only the entries of requests
    with a response flag (cut short, reset, refused by Envoy), which tell a dead upstream
    from a client that left."""
    log: dict[str, Any] = {"name": "envoy.access_loggers.http_grpc"}
    if mode not in _LOGGED:
        log["filter"] = {"response_flag_filter": {}}  # no flags listed: any flag set
    return [{**log, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
        "common_config": {"log_name": CLUSTER, "transport_api_version": "V3",
                          "grpc_service": {"envoy_grpc": {"cluster_name": CLUSTER}},
                          "buffer_flush_interval": "0.005s", "buffer_size_bytes": 16777216}}}]


def envoy_filter(config: Config, mode: str | None = None, *,
                 upstream: str = "inference:8000") -> dict[str, Any]:
    """envoy_filter is what an Envoy file needs for ``config`` in ``mode``, as blocks keyed by
    where each goes: whole, so that the blocks placed into a listener of one's own (with its
    address and a ``stat_prefix``) make a file ``envoy --mode validate`` accepts.

    ``overload_manager`` (the bootstrap's: the connection limit); ``listener`` (the listener's
    fields: its buffer); ``http_connection_manager`` (the connection manager's fields: path
    normalisation, timeouts, underscore policy, Envoy's own answers in OpenAI's shape, the
    access log where the mode needs it, the HTTP filters in order); ``virtual_host`` (the
    virtual host's fields: the routes, the refusals Envoy answers itself before the default
    route with its ``kvgate`` metadata, headers added and removed, the retry of a pool-level
    file); ``clusters`` (the upstream cluster the routes name, then kvgate's). ``upstream``
    (HOST:PORT) is the pool-level ``inference`` cluster's DNS name and port; the picker
    modes' ``nodes`` cluster goes wherever kvgate says.

    ``mode`` None: ``mode_for(config)``. Raises ValueError for an unknown mode, and
    ``ConfigError`` for a mode that does not fit the default pool (``picking_mismatch``): a
    picking pool needs a picking mode and a pool-level pool a pool-level one, or every request
    fails; such a pair is never written.
    """
    if mode is None:
        mode = mode_for(config)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")
    pool = config.pool(None)
    mismatch = picking_mismatch(pool, picks_by_mode(mode), f"--mode {mode}")
    if mismatch:
        raise ConfigError(f"pools.{pool.name}.backends", mismatch)
    picked = mode in _PICKED
    hcm: dict[str, Any] = {}
    if mode in _LOGGED or mode in _STREAMING:
        hcm["access_log"] = _access_log(mode)
    if mode == "endpoint-picker-log":
        hcm["access_log_options"] = {"access_log_flush_interval": seconds_text(PROGRESS_INTERVAL_S)}
    hcm.update(_connection_manager(config))
    hcm["http_filters"] = _http_filters(config, mode)
    vhost: dict[str, Any] = {"routes": _routes(config, mode, NODES_CLUSTER if picked else INFERENCE_CLUSTER)}
    if mode != "reservation":
        # kvgate or the usage filter reads the completion count in the response body: a
        # compressed body hides it (charged at its reservation), so the upstream is asked for
        # none. An inference server next to its gateway gains nothing from compressing.
        vhost["request_headers_to_remove"] = ["accept-encoding"]
    if mode in ("observe", *_LOGGED):
        vhost["response_headers_to_add"] = [
            {"header": {"key": h, "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{h})%"}}
            for h in _RATE_HEADERS]
    if not picked:  # Envoy's own balancer: a request that never reached a node tries another
        vhost["retry_policy"] = retry_policy()
    uhost, uport = split_address(upstream)
    return {
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": ("type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections."
                          "v3.DownstreamConnectionsConfig"),
                "max_active_downstream_connections": MAX_DOWNSTREAM_CONNECTIONS}}]},
        "listener": {"per_connection_buffer_limit_bytes": buffer_limit_bytes(config)},
        "http_connection_manager": hcm,
        "virtual_host": vhost,
        "clusters": [_upstream_cluster(config, mode, uhost, uport), kvgate_cluster(*kvgate_address(config))],
    }


def _upstream_cluster(config: Config, mode: str, host: str, port: int) -> dict[str, Any]:
    """_upstream_cluster is the cluster the routes name: ``inference`` at ``host``:``port`` (DNS)
    in a pool-level mode; in a picker mode ``nodes``, ORIGINAL_DST, or the nodes listed where
    kvgate names fallbacks (an ORIGINAL_DST cluster answers every list with 503)."""
    if mode not in _PICKED:
        return inference_cluster(host, port)
    if fallbacks_of(config, mode):
        return listed_nodes_cluster([split_address(a) for a in listed_addresses(config)], LB_NAMESPACE, SERVED_KEY)
    return nodes_cluster()


def _connection_manager(config: Config) -> dict[str, Any]:
    """_connection_manager is the connection manager's hardening: paths normalised (no spelling
    of an admitted path passes unadmitted), uploads and idle streams bounded, headers with
    underscores dropped (they would dodge the stripping), Envoy's own answers in OpenAI's shape."""
    return {
        "normalize_path": True, "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
        "request_headers_timeout": seconds_text(REQUEST_HEADERS_TIMEOUT_S),
        "request_timeout": seconds_text(request_timeout_s(config)),
        "stream_idle_timeout": seconds_text(IDLE_TIMEOUT_S),
        "common_http_protocol_options": {"idle_timeout": seconds_text(IDLE_TIMEOUT_S),
                                         "headers_with_underscores_action": "DROP_HEADER"},
        "local_reply_config": local_reply(),
    }


# Envoy's own answers that get OpenAI's error body (CEL on the answer, body). kvgate's refusals
# (details ``kvgate_...``) and the routes' direct responses (already JSON) match none.
_OWN_ANSWERS = (
    # kvgate failed or is gone: SDKs retry a 503.
    ("response.code_details.startsWith('ext_proc_error')", GATEWAY_UNAVAILABLE_BODY),
    # A body past the listener's buffer (a chunked upload declares no length, so no route
    # refuses it before it is read).
    ("response.code == 413 && response.code_details == 'request_payload_too_large'", BODY_TOO_LARGE_BODY),
    # No node to send the request to: none up, every try refused or reset, none named.
    ("response.code == 503 && (response.code_details == 'no_healthy_upstream' || "
     "response.code_details.startsWith('upstream_reset_before_response_started'))", NO_UPSTREAM_BODY),
)


def local_reply() -> dict[str, Any]:
    """local_reply gives Envoy's own answers (``_OWN_ANSWERS``) OpenAI's error body, so that
    clients read them as they read kvgate's; the status stays Envoy's."""
    return {"mappers": [{
        "filter": {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": expression}}},
        "body_format_override": {"text_format_source": {"inline_string": body},
                                 "content_type": "application/json"}} for expression, body in _OWN_ANSWERS]}


def envoy_bootstrap(config: Config, mode: str | None = None, *, listen: str = "0.0.0.0:8080",
                    upstream: str = "inference:8000", admin: str = "127.0.0.1:9901") -> dict[str, Any]:
    """envoy_bootstrap is a whole Envoy file made of ``envoy_filter``'s blocks, each placed
    where its key says: one listener on ``listen`` in front of the inference server
    ``upstream`` (HOST:PORT), admin on ``admin``. ``mode`` and its errors as ``envoy_filter``."""
    if mode is None:
        mode = mode_for(config)
    piece = envoy_filter(config, mode, upstream=upstream)
    lhost, lport = split_address(listen)
    ahost, aport = split_address(admin)
    hcm = {"@type": HCM_TYPE, "stat_prefix": "inference", **piece["http_connection_manager"]}
    filters = hcm.pop("http_filters")
    hcm["route_config"] = {"name": "inference", "virtual_hosts": [
        {"name": "inference", "domains": ["*"], **piece["virtual_host"]}]}
    hcm["http_filters"] = filters
    return {
        "admin": {"address": {"socket_address": {"address": ahost, "port_value": aport}}},
        "overload_manager": piece["overload_manager"],
        "static_resources": {
            "listeners": [{
                "name": "inference",
                "address": {"socket_address": {"address": lhost, "port_value": lport}},
                **piece["listener"],
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}],
            }],
            "clusters": piece["clusters"],
        },
    }


def render(doc: dict[str, Any], source: str, mode: str) -> str:
    """render writes ``doc`` as YAML under a comment naming the kvgate file and mode it came from."""
    head = (f"# Written by `kvgate envoy-filter --config {source} --mode {mode}`: the values that must\n"
            f"# agree with {source} come from it; check a hand-edited file with\n"
            f"# `kvgate check-config {source} --envoy FILE`.\n")
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=100)


# --- check ---------------------------------------------------------------------------
