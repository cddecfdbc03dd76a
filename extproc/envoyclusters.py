"""envoyclusters: the clusters an Envoy file of kvgate's routes to, and how Envoy leaves a dead node.

Three clusters: ``kvgate`` (the ext_proc gRPC service), and one upstream cluster per file:
``inference`` where Envoy's own load balancer spreads a pool's requests (the pool-level modes),
``nodes`` where kvgate names the node (the picker modes: an ORIGINAL_DST cluster that goes to
the address in ``x-gateway-destination-endpoint``; or, where kvgate names fallbacks, a STATIC
cluster listing every node with the ``override_host`` policy, ``listed_nodes_cluster``).

A node of ``inference`` that dies keeps its share of the round robin until Envoy learns it is
gone: without more, about one request in N failed for as long as the node stayed down. So the
cluster ejects a node after ``EJECT_AFTER_FAILURES`` consecutive gateway failures (connection
refused or reset, 502/503/504: outlier detection, immediate, not at the sweep; never for a
500, which may be one request's fault), for
``EJECTION_S`` and longer each time it is ejected again, and the virtual host retries a request
that never reached a node (connection refused, refused stream, reset before the request was
sent) on another node. A killed node therefore gets at most ``EJECT_AFTER_FAILURES`` requests,
each retried elsewhere: no client sees it fail. Passive only: an active health check would send
its own requests to every node, and the picker modes need none (kvgate stops picking a node
whose metrics fail, ``adaptive.stale_after_s``).
"""

from __future__ import annotations

from typing import Any

CLUSTER = "kvgate"
"""CLUSTER is the name of the ext_proc cluster (kvgate's gRPC address)."""
INFERENCE_CLUSTER = "inference"
"""INFERENCE_CLUSTER is the pool-level modes' upstream cluster: Envoy balances over its hosts."""
NODES_CLUSTER = "nodes"
"""NODES_CLUSTER is the picker modes' upstream cluster: it goes where kvgate says."""
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# Consecutive gateway failures (connect failures count) that eject a node of `inference`.
EJECT_AFTER_FAILURES = 2
# How long a first ejection lasts (seconds); Envoy multiplies it by the times ejected in a row.
EJECTION_S = 10
# At most this share of a pool's nodes is ejected at once (percent): past it Envoy would send
# everything to the rest; Envoy ejects one node anyway in a pool of one or two.
MAX_EJECTION_PERCENT = 50
# Retries of a request that never reached a node, each on a node not tried before.
RETRIES = 2
RETRY_ON = "connect-failure,refused-stream,reset-before-request"
# kvgate is the admission control: Envoy's own breakers must not refuse first.
_BREAKERS = {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                             "max_requests": 100000}]}


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def kvgate_cluster(host: str, port: int) -> dict[str, Any]:
    """kvgate_cluster is the ext_proc cluster: HTTP/2 to kvgate at ``host``:``port``, with
    breakers raised (one gRPC stream per in-flight HTTP request) and keepalive pings."""
    return {
        "name": CLUSTER,
        "type": "STATIC",
        "connect_timeout": "0.25s",
        "circuit_breakers": _BREAKERS,
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {
                "connection_keepalive": {"interval": "30s", "timeout": "5s"}}}}},
        "load_assignment": {"cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(host, port)}}]}]},
    }


def inference_cluster(host: str, port: int) -> dict[str, Any]:
    """inference_cluster is the pool-level upstream: the inference servers behind the DNS name
    ``host`` (every address it resolves to is a node), port ``port``, with outlier detection."""
    return {
        "name": INFERENCE_CLUSTER, "type": "STRICT_DNS", "connect_timeout": "1s",
        "circuit_breakers": _BREAKERS,
        "outlier_detection": {
            "consecutive_gateway_failure": EJECT_AFTER_FAILURES,
            "enforcing_consecutive_gateway_failure": 100,
            # Only a node that is gone: a 500 may be one request's fault, and Envoy's
            # success-rate ejection would take out a slow but working node.
            "enforcing_consecutive_5xx": 0,
            "enforcing_success_rate": 0,
            "base_ejection_time": f"{EJECTION_S}s",
            "max_ejection_percent": MAX_EJECTION_PERCENT,
        },
        "load_assignment": {"cluster_name": INFERENCE_CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(host, port)}}]}]},
    }


def nodes_cluster() -> dict[str, Any]:
    """nodes_cluster is the picker modes' upstream: any node kvgate names, by the header only
    kvgate sets (client-sent copies are stripped first)."""
    return {
        "name": NODES_CLUSTER, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        "circuit_breakers": _BREAKERS,
    }


OVERRIDE_HOST_TYPE = ("type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3."
                      "OverrideHost")
SUBSET_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.subset.v3.Subset"
ROUND_ROBIN_TYPE = ("type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3."
                    "RoundRobin")
# The metadata key no host of the listed cluster has: its fallback policy selects nothing.
NO_HOST_KEY = "kvgate-no-host-has-this"


def listed_nodes_cluster(addresses: list[tuple[str, int]], lb_namespace: str, served_key: str) -> dict[str, Any]:
    """listed_nodes_cluster is the picker modes' upstream where kvgate names fallbacks: every
    node (``addresses``, (IP, port)) listed, and the ``override_host`` policy, which sends a
    request to the first entry of kvgate's list and each retry to the next, and writes the
    endpoint that served into ``lb_namespace`` / ``served_key`` (where kvgate reads it at the
    response). An ORIGINAL_DST cluster answers any list with 503 (docs/endpoint-picker-protocol.md).

    The policy's required fallback, for a request whose list is exhausted or names no host of
    the cluster, is made to select nothing (a subset no host is in, NO_FALLBACK): a 503, never a
    node kvgate did not name and charge."""
    nowhere = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.subset",
        "typed_config": {"@type": SUBSET_TYPE, "fallback_policy": "NO_FALLBACK",
                         "subset_selectors": [{"keys": [NO_HOST_KEY]}],
                         "subset_lb_policy": {"policies": [{"typed_extension_config": {
                             "name": "envoy.load_balancing_policies.round_robin",
                             "typed_config": {"@type": ROUND_ROBIN_TYPE}}}]}}}}]}
    return {
        "name": NODES_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
        "circuit_breakers": _BREAKERS,
        "load_assignment": {"cluster_name": NODES_CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(host, port)}} for host, port in addresses]}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": OVERRIDE_HOST_TYPE,
                # The header kvgate sets (client-sent copies are stripped first), then the
                # same list in the protocol's metadata.
                "override_host_sources": [{"header": DESTINATION_HEADER},
                                          {"metadata": {"key": lb_namespace, "path": [{"key": DESTINATION_HEADER}]}}],
                "selected_host_key": {"key": lb_namespace, "path": [{"key": served_key}]},
                "fallback_policy": nowhere}}}]},
    }


def fallback_retry(fallbacks: int) -> dict[str, Any]:
    """fallback_retry is the picker route's retry where kvgate names ``fallbacks`` more nodes:
    a request that never reached a node goes to the next entry of kvgate's list (the
    override_host policy walks it), once per fallback. No host predicate: the list, not Envoy,
    says which node is next."""
    return {"retry_on": RETRY_ON, "num_retries": fallbacks}


def retry_policy() -> dict[str, Any]:
    """retry_policy is the pool-level virtual host's retry: a request that never reached a node
    goes to another one (``previous_hosts``), at most ``RETRIES`` times. Never a request a node
    has begun to answer: its generation may have started."""
    return {"retry_on": RETRY_ON, "num_retries": RETRIES,
            "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
            "host_selection_retry_max_attempts": 3}
