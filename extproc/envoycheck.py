"""envoycheck: an operator's Envoy file read against kvgate's configuration.

``check_envoy`` names every value of the Envoy file that disagrees with what
``extproc.envoyconf`` would write for the same ``Config`` (``kvgate check-config --envoy``),
by the kvgate key it breaks: the gRPC cluster's address, the message timeouts against the
classes' waits, the request attributes, the body limits and the 413 route, the header strip
before ext_proc, each route's ``kvgate`` metadata, and whether each route's cluster routes by
the node kvgate names exactly where the route's pool picks its nodes (``picking_mismatch``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from extproc.config import Config, PoolConfig
from extproc.envoyclusters import RETRY_ON
from extproc.envoyconf import (ENVOY_DEFAULT_BUFFER_BYTES, EXT_PROC_TYPE, HEADER_MUTATION_TYPE,
                               PICKER_HEADERS, buffer_limit_bytes, identity_headers,
                               kvgate_address, picking_mismatch, request_attributes, seconds_text,
                               split_address)
from extproc.gate import METADATA_NAMESPACE, ROUTE_KEYS, WAIT_TIMEOUT_MARGIN_S
from extproc.request.profile import RELEASES, STREAM_AND_LOG


@dataclass(frozen=True, slots=True)
class Disagreement:
    """Disagreement is one value of an Envoy file that does not match kvgate's configuration.

    ``key``: the kvgate key it breaks; ``where``: the place in the Envoy file; ``reason``:
    what is wrong and what to do.
    """

    key: str
    where: str
    reason: str


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s*$")


def _duration_s(value: Any) -> float | None:
    """_duration_s reads an Envoy duration (``"2s"``, ``{seconds, nanos}``) in seconds; None if absent or odd."""
    if isinstance(value, str):
        m = _DURATION.match(value)
        return float(m.group(1)) if m else None
    if isinstance(value, dict):
        try:
            return float(value.get("seconds", 0)) + float(value.get("nanos", 0)) / 1e9
        except (TypeError, ValueError):
            return None
    return None


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _connection_managers(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """_connection_managers yields (where, listener, HCM config) for every static listener."""
    for i, listener in enumerate(_items(_dict(doc.get("static_resources")).get("listeners"))):
        listener = _dict(listener)
        name = listener.get("name", i)
        for j, chain in enumerate(_items(listener.get("filter_chains"))):
            for k, f in enumerate(_items(_dict(chain).get("filters"))):
                tc = _dict(_dict(f).get("typed_config"))
                if str(tc.get("@type", "")).endswith("HttpConnectionManager"):
                    yield f"listeners[{name}].filter_chains[{j}].filters[{k}]", listener, tc


def _cluster_addresses(doc: dict[str, Any], name: str) -> list[tuple[str, int]] | None:
    for c in _items(_dict(doc.get("static_resources")).get("clusters")):
        c = _dict(c)
        if c.get("name") == name:
            return _listed_addresses(c)
    return None


def _listed_addresses(cluster: dict[str, Any]) -> list[tuple[str, int]]:
    """_listed_addresses is every (host, port) of ``cluster``'s load assignment."""
    out = []
    for eps in _items(_dict(cluster.get("load_assignment")).get("endpoints")):
        for lb in _items(_dict(eps).get("lb_endpoints")):
            sa = _dict(_dict(_dict(_dict(lb).get("endpoint")).get("address")).get("socket_address"))
            if "port_value" in sa:
                out.append((str(sa.get("address", "")), int(sa["port_value"])))
    return out


def _check_grpc(config: Config, doc: dict[str, Any], where: str, ext: dict[str, Any]) -> list[Disagreement]:
    want_host, want_port = kvgate_address(config)
    wildcard = split_address(config.server.grpc_listen)[0] in ("", "0.0.0.0", "::")
    grpc = _dict(ext.get("grpc_service"))
    if "google_grpc" in grpc:
        target = str(_dict(grpc["google_grpc"]).get("target_uri", ""))
        addrs = [split_address(target)] if re.match(r"^[^:]*:\d+$", target) else []
        place = f"{where}.grpc_service.google_grpc.target_uri"
    else:
        cluster = _dict(grpc.get("envoy_grpc")).get("cluster_name")
        found = _cluster_addresses(doc, str(cluster))
        if found is None:
            return [Disagreement("server.grpc_listen", f"{where}.grpc_service",
                                 f"the ext_proc filter names cluster {cluster!r}, which the file does "
                                 f"not define (envoy --mode validate does not notice)")]
        addrs = found
        place = f"clusters[{cluster}]"
    if not addrs or any(port != want_port or (not wildcard and host != want_host) for host, port in addrs):
        shown = ", ".join(f"{h}:{p}" for h, p in addrs) or "no address"
        return [Disagreement("server.grpc_listen", place,
                             f"kvgate listens on {config.server.grpc_listen}, Envoy sends to {shown}")]
    return []


def _check_timeouts(config: Config, where: str, ext: dict[str, Any]) -> list[Disagreement]:
    out = []
    base = _duration_s(ext.get("message_timeout", "0.2s"))
    if base is None or not math.isclose(base, config.server.envoy_message_timeout_s, abs_tol=1e-6):
        out.append(Disagreement("server.envoy_message_timeout_s", f"{where}.message_timeout",
                                f"Envoy's message_timeout is {ext.get('message_timeout', '0.2s (default)')}, "
                                f"kvgate expects {seconds_text(config.server.envoy_message_timeout_s)} "
                                f"(it watches for waits cut off there)"))
    ceiling = _duration_s(ext.get("max_message_timeout", "0s")) or 0.0
    for name, cls in sorted(config.tenants.classes.items()):
        need = cls.max_wait_s + WAIT_TIMEOUT_MARGIN_S
        if cls.max_wait_s > 0 and need > ceiling + 1e-9:
            out.append(Disagreement(
                f"tenants.classes.{name}.max_wait_s", f"{where}.max_message_timeout",
                f"a waiting request of class {name!r} asks Envoy for a {seconds_text(need)} message "
                f"timeout (max_wait_s + {seconds_text(WAIT_TIMEOUT_MARGIN_S)}), above max_message_timeout "
                f"{seconds_text(ceiling)}: Envoy ignores it and every wait ends in a 504 after "
                f"{ext.get('message_timeout', '0.2s')}; set max_message_timeout to at least {seconds_text(math.ceil(need))}"))
    return out


def _check_attributes(config: Config, where: str, ext: dict[str, Any]) -> list[Disagreement]:
    mode = _dict(ext.get("processing_mode"))
    if mode.get("request_header_mode", "SEND") != "SKIP":
        return []
    have = {str(a).replace('"', "'") for a in _items(ext.get("request_attributes"))}
    out = []
    tenant = f"request.headers['{config.tenants.header}']"
    if tenant not in have:
        out.append(Disagreement("tenants.header", f"{where}.request_attributes",
                                f"request headers are skipped and {tenant} is not among the request "
                                f"attributes: kvgate never sees the tenant"))
    if "request.path" not in have:
        out.append(Disagreement("pools", f"{where}.request_attributes",
                                "request headers are skipped and request.path is not among the request "
                                "attributes: kvgate cannot tell an LLM endpoint from anything else"))
    if any(t.api_key_sha256 for t in config.tenants.tenants.values()) and \
            "request.headers['authorization']" not in have:
        out.append(Disagreement("tenants.tenants", f"{where}.request_attributes",
                                "tenants are known by API key but request.headers['authorization'] is "
                                "not among the request attributes"))
    return out


def _check_body(config: Config, where: str, listener: dict[str, Any], hcm: dict[str, Any],
                ext: dict[str, Any]) -> list[Disagreement]:
    out = []
    cap = config.limits.max_body_bytes
    if _dict(ext.get("processing_mode")).get("request_body_mode", "NONE") == "BUFFERED":
        limit = int(listener.get("per_connection_buffer_limit_bytes", ENVOY_DEFAULT_BUFFER_BYTES))
        if limit <= cap:
            out.append(Disagreement("limits.max_body_bytes", f"{where} listener per_connection_buffer_limit_bytes",
                                    f"Envoy buffers at most {limit} bytes, not above max_body_bytes {cap}: "
                                    f"bodies near the cap get Envoy's bare 413; set it to {buffer_limit_bytes(config)}"))
    for vi, vh in enumerate(_items(_dict(hcm.get("route_config")).get("virtual_hosts"))):
        for ri, route in enumerate(_items(_dict(vh).get("routes"))):
            route = _dict(route)
            if _dict(route.get("direct_response")).get("status") != 413:
                continue
            for h in _items(_dict(route.get("match")).get("headers")):
                h = _dict(h)
                start = _dict(h.get("range_match")).get("start")
                if str(h.get("name", "")).lower() == "content-length" and start is not None \
                        and int(start) != cap + 1:
                    out.append(Disagreement("limits.max_body_bytes",
                                            f"{where}.route_config.virtual_hosts[{vi}].routes[{ri}]",
                                            f"Envoy answers 413 from content-length {start}, kvgate's cap "
                                            f"is {cap}: make the range start {cap + 1}"))
    return out


def _check_strip(config: Config, where: str, filters: list[Any], ext_index: int) -> list[Disagreement]:
    """_check_strip names each header kvgate reads as a tenant or class claim that a client could
    send itself: no header_mutation filter before ext_proc removes it (a ``remove`` of it, or
    a prefix match)."""
    removed: list[str] = []
    prefixes: list[str] = []
    for f in filters[:ext_index]:
        tc = _dict(_dict(f).get("typed_config"))
        if tc.get("@type") != HEADER_MUTATION_TYPE:
            continue
        for m in _items(_dict(_dict(tc.get("mutations"))).get("request_mutations")):
            m = _dict(m)
            prefix = _dict(_dict(m.get("remove_on_match")).get("key_matcher")).get("prefix")
            removed.append(str(m.get("remove", "")).lower())
            if isinstance(prefix, str) and prefix:
                prefixes.append(prefix.lower())
    keys = {config.tenants.header: "tenants.header", config.tenants.fairness_header: "tenants.fairness_header",
            config.tenants.objective_header: "tenants.objective_header"}
    out = []
    for header in identity_headers(config):
        if header in removed or any(header.startswith(p) for p in prefixes):
            continue
        out.append(Disagreement(keys[header], f"{where}.http_filters",
                                f"no header_mutation filter before ext_proc removes {header!r}: any "
                                f"client can name its own tenant or class; add `remove: {header}` to "
                                f"the first filter (a verified source sets it after that filter)"))
    return out


def _route_metadata(hcm: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """_route_metadata yields (where, value) for each ``kvgate`` entry a route or virtual host sets."""
    for vi, vh in enumerate(_items(_dict(hcm.get("route_config")).get("virtual_hosts"))):
        vh = _dict(vh)
        places = [(f"virtual_hosts[{vi}]", vh)]
        places += [(f"virtual_hosts[{vi}].routes[{ri}]", _dict(r)) for ri, r in enumerate(_items(vh.get("routes")))]
        for place, holder in places:
            per = _dict(_dict(holder.get("typed_per_filter_config")).get("envoy.filters.http.set_metadata"))
            for mi, entry in enumerate(_items(per.get("metadata"))):
                entry = _dict(entry)
                if entry.get("metadata_namespace") == METADATA_NAMESPACE:
                    yield f"{place}.typed_per_filter_config.set_metadata[{mi}]", _dict(entry.get("value"))


def _check_routes(config: Config, where: str, hcm: dict[str, Any], filters: list[Any],
                  ext_index: int, ext: dict[str, Any], doc: dict[str, Any]) -> list[Disagreement]:
    out = []
    entries = list(_route_metadata(hcm))
    for place, value in entries:
        at = f"{where}.route_config.{place}"
        for key, v in value.items():
            if key not in ROUTE_KEYS:
                out.append(Disagreement("pools", at, f"unknown per-route key {key!r} (kvgate reads "
                                                     f"{', '.join(ROUTE_KEYS)}): it is ignored"))
            elif key == "pool" and v not in config.pools:
                out.append(Disagreement("pools", at, f"route pool {v!r} is not a configured pool "
                                                     f"({', '.join(sorted(config.pools))})"))
            elif key == "tenant_class" and v not in config.tenants.classes:
                out.append(Disagreement("tenants.classes", at, f"route tenant_class {v!r} is not a configured "
                                                               f"class ({', '.join(sorted(config.tenants.classes))})"))
            elif key == "release" and v not in RELEASES:
                out.append(Disagreement("server.access_log_ttl_s", at,
                                        f"release {v!r}: expected one of {', '.join(RELEASES)}"))
            elif key in ("context_window", "max_body_bytes") and not (
                    isinstance(v, int | float) and not isinstance(v, bool) and v > 0 and float(v).is_integer()):
                out.append(Disagreement(f"limits.{key}" if key == "max_body_bytes" else "pools", at,
                                        f"{key} must be a whole number above 0, got {v!r}"))
            elif key == "release" and v == "access_log" and not _logs_to_kvgate(config, doc, hcm, ext):
                out.append(Disagreement("server.access_log_ttl_s", at,
                                        "release: access_log, but no gRPC access log of this connection "
                                        "manager goes to the kvgate cluster: every such lease waits for "
                                        "access_log_ttl_s"))
            elif key == "release" and v == STREAM_AND_LOG and not _logs_to_kvgate(config, doc, hcm, ext):
                out.append(Disagreement("pools", at,
                                        f"release: {STREAM_AND_LOG}, but no gRPC access log of this "
                                        "connection manager goes to the kvgate cluster: an upstream that "
                                        "dies mid-stream is counted client_disconnect, a few seconds late"))
    if entries:
        names = [str(_dict(f).get("name", "")) for f in filters]
        first_set = next((i for i, n in enumerate(names) if n == "envoy.filters.http.set_metadata"), None)
        if first_set is None or first_set > ext_index:
            out.append(Disagreement("pools", f"{where}.http_filters",
                                    "routes set kvgate metadata but no set_metadata filter runs before "
                                    "ext_proc: kvgate never sees it"))
        forwarded = _items(_dict(_dict(ext.get("metadata_options")).get("forwarding_namespaces")).get("untyped"))
        if METADATA_NAMESPACE not in forwarded:
            out.append(Disagreement("pools", f"{where}.http_filters[{ext_index}].metadata_options",
                                    f"routes set kvgate metadata but forwarding_namespaces.untyped lacks "
                                    f"{METADATA_NAMESPACE!r}: kvgate never sees it"))
    return out


def _cluster_picks(doc: dict[str, Any], name: str) -> bool | None:
    """_cluster_picks: the cluster ``name`` sends each request to the address in kvgate's
    ``x-gateway-destination-endpoint`` header (ORIGINAL_DST reading it, or the override_host
    load balancing policy); None when the file defines no such cluster."""
    for c in _items(_dict(doc.get("static_resources")).get("clusters")):
        c = _dict(c)
        if c.get("name") != name:
            continue
        dst = _dict(c.get("original_dst_lb_config"))
        if c.get("type") == "ORIGINAL_DST" and dst.get("use_http_header") and \
                str(dst.get("http_header_name", "")).lower() == PICKER_HEADERS[0]:
            return True
        policies = _items(_dict(c.get("load_balancing_policy")).get("policies"))
        return any("override_host" in str(_dict(_dict(_dict(p).get("typed_extension_config")).get(
            "typed_config")).get("@type", "")).lower() for p in policies)
    return None


def _check_picking(config: Config, doc: dict[str, Any], where: str, hcm: dict[str, Any],
                   ext: dict[str, Any]) -> list[Disagreement]:
    """_check_picking names each (pool, cluster) pair of this connection manager's routes where
    the pool picks its nodes and the cluster balances by itself, or the other way round; and a
    picking pool behind a filter that skips the request headers (they go upstream first)."""
    out = []
    seen: set[tuple[str, str]] = set()
    skips_headers = _dict(ext.get("processing_mode")).get("request_header_mode", "SEND") == "SKIP"
    for vi, vh in enumerate(_items(_dict(hcm.get("route_config")).get("virtual_hosts"))):
        vh = _dict(vh)
        host_pool = _kvgate_value(vh).get("pool")
        for ri, route in enumerate(_items(vh.get("routes"))):
            route = _dict(route)
            cluster = _dict(route.get("route")).get("cluster")
            if not isinstance(cluster, str):
                continue  # a direct response, a redirect, weighted clusters: nothing picked here
            pool_name = _kvgate_value(route).get("pool", host_pool) or config.default_pool
            pool = config.pools.get(str(pool_name))
            envoy_picks = _cluster_picks(doc, cluster)
            if pool is None or envoy_picks is None or (pool.name, cluster) in seen:
                continue  # an unknown pool or cluster is named elsewhere
            at = f"{where}.route_config.virtual_hosts[{vi}].routes[{ri}]"
            name = route.get("name")
            via = f"route {name!r} (to cluster {cluster!r})" if name else f"its route to cluster {cluster!r}"
            mismatch = picking_mismatch(pool, envoy_picks, via)
            if mismatch is None and pool.picks and skips_headers:
                mismatch = picking_mismatch(pool, False, "the ext_proc filter skips the request "
                                                         "headers (they go upstream first) and")
            if mismatch:
                seen.add((pool.name, cluster))
                out.append(Disagreement(f"pools.{pool.name}.backends", at, mismatch))
            elif pool.picks and pool.picking.fallbacks:
                seen.add((pool.name, cluster))
                retries = _dict(_dict(route.get("route")).get("retry_policy") or vh.get("retry_policy"))
                out += _check_fallbacks(pool, _cluster(doc, cluster), at, retries)
    return out


def _cluster(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """_cluster is the static cluster ``name`` of ``doc`` (empty if none)."""
    for c in _items(_dict(doc.get("static_resources")).get("clusters")):
        if _dict(c).get("name") == name:
            return _dict(c)
    return {}


def _check_fallbacks(pool: PoolConfig, cluster: dict[str, Any], at: str,
                     retries: dict[str, Any]) -> list[Disagreement]:
    """_check_fallbacks names why the picking ``pool``'s fallbacks (``picking.fallbacks`` > 0)
    cannot work behind ``cluster`` (the route at ``at``, its ``retries``): an ORIGINAL_DST
    cluster answers every list with 503; a listed cluster sends a node it does not list
    nowhere; fewer retries than fallbacks leave the last ones untried."""
    key, name, n = f"pools.{pool.name}.picking.fallbacks", cluster.get("name"), pool.picking.fallbacks
    if cluster.get("type") == "ORIGINAL_DST":
        return [Disagreement(key, at, (
            f"kvgate names {n} fallback(s) (x-gateway-destination-endpoint: ip:port,ip:port), but cluster "
            f"{name!r} is ORIGINAL_DST, which answers every such list with 503: every request would "
            f"fail. `kvgate envoy-filter` writes the listed cluster that honours them, or set fallbacks to 0"))]
    out = []
    listed = {f"{h}:{p}" for h, p in _listed_addresses(cluster)}
    missing = [b.address for b in pool.backends if b.address is not None
               and b.address.replace("[", "").replace("]", "") not in listed]
    if missing:
        out.append(Disagreement(f"pools.{pool.name}.backends", f"clusters[{name}]", (
            f"cluster {name!r} does not list {', '.join(missing)}: a request kvgate sends there "
            f"(first or as a fallback) gets a 503. List every backend of the pool")))
    tries = retries.get("num_retries", 1 if retries else 0)
    if not isinstance(tries, int) or tries < n:
        out.append(Disagreement(key, f"{at}.route.retry_policy", (
            f"kvgate names {n} fallback(s) but the route retries {tries!r} time(s): the rest are never "
            f"tried. Retry on {RETRY_ON} with num_retries {n}")))
    return out


def _kvgate_value(holder: dict[str, Any]) -> dict[str, Any]:
    """_kvgate_value is the ``kvgate`` metadata a route or virtual host sets (empty if none)."""
    per = _dict(_dict(holder.get("typed_per_filter_config")).get("envoy.filters.http.set_metadata"))
    for entry in _items(per.get("metadata")):
        entry = _dict(entry)
        if entry.get("metadata_namespace") == METADATA_NAMESPACE:
            return _dict(entry.get("value"))
    return {}


def _logs_to_kvgate(config: Config, doc: dict[str, Any], hcm: dict[str, Any], ext: dict[str, Any]) -> bool:
    """_logs_to_kvgate: a gRPC access log of ``hcm`` goes to the ext_proc filter's cluster, or
    to a cluster at kvgate's address (the filter's own cluster may be what is wrong)."""
    cluster = _dict(_dict(ext.get("grpc_service")).get("envoy_grpc")).get("cluster_name")
    want = kvgate_address(config)
    for log in _items(hcm.get("access_log")):
        common = _dict(_dict(_dict(log).get("typed_config")).get("common_config"))
        target = _dict(_dict(common.get("grpc_service")).get("envoy_grpc")).get("cluster_name")
        if target == cluster or want in (_cluster_addresses(doc, str(target)) or []):
            return True
    return False


def check_envoy(config: Config, doc: Any) -> list[Disagreement]:
    """check_envoy lists every value of the Envoy file ``doc`` (decoded YAML) that disagrees with ``config``.

    An Envoy file with no ext_proc filter at all is one disagreement. Each admission filter
    (an ext_proc filter not in observability mode) of every static listener is checked.
    """
    if not isinstance(doc, dict):
        return [Disagreement("-", "(top)", "the Envoy file is not a YAML mapping")]
    out: list[Disagreement] = []
    seen = False
    for where, listener, hcm in _connection_managers(doc):
        filters = _items(hcm.get("http_filters"))
        for i, f in enumerate(filters):
            ext = _dict(_dict(f).get("typed_config"))
            if ext.get("@type") != EXT_PROC_TYPE or ext.get("observability_mode"):
                continue
            seen = True
            at = f"{where}.http_filters[{i}]"
            out += _check_grpc(config, doc, at, ext)
            out += _check_timeouts(config, at, ext)
            out += _check_attributes(config, at, ext)
            out += _check_body(config, where, listener, hcm, ext)
            out += _check_routes(config, where, hcm, filters, i, ext, doc)
            out += _check_strip(config, where, filters, i)
            out += _check_picking(config, doc, where, hcm, ext)
    if not seen:
        out.append(Disagreement("-", "static_resources.listeners",
                                "no ext_proc filter (outside observability mode) in any listener"))
    return out
