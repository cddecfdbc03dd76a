"""gate: what every request shares, and how a request is told apart from another.

A ``Gate`` holds the configuration, each pool's tokenizer and chat template, the API-key
table, the admission core, the metrics and the executor that tokenizes large bodies off the
event loop. It names a request's tenant (API key, tenant header, fairness header) and class
(objective header), reads the per-route settings Envoy sends in the ``kvgate`` metadata
namespace, and says, at most once a minute each, what it finds wrong with Envoy's
configuration. ``reconfigure`` switches new requests to a new configuration.
What Envoy tells of a request before its body is read in ``request_facts``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import secrets
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from extproc import request_facts as facts_of
from extproc.admission import Admission
from extproc.clock import Clock
from extproc.config import ClassConfig, Config, PoolConfig
from extproc.errors import ConfigError, RequestError
from extproc.metrics import Metrics
from extproc.openai_shapes import TEMPLATES
from extproc.request.profile import RELEASES, RouteRelease
from extproc.tokens import load_tokenizer
from extproc.waitwatch import cut_at_base_timeout

log = logging.getLogger("kvgate.exchange")

# Bodies above this size are parsed and tokenized in the thread pool: tiktoken releases
# the GIL, and a body of this size takes about the longest the loop should stall
# (bench/results/tokens.md).
OFFLOAD_BYTES = 32 * 1024
# Tenant name of requests whose identity is not configured. Configured names cannot
# start with '_', so this never collides with one.
ANONYMOUS_TENANT = "_anonymous"
# The message timeout kvgate asks Envoy for while a request waits in its class's queue,
# on top of the class's max_wait_s (seconds); the Envoy files are checked against it.
WAIT_TIMEOUT_MARGIN_S = 1.0
# The most characters of a fairness header's value kept as an anonymous request's flow.
FAIRNESS_ID_MAX = 128
# Per-route metadata keys (namespace ``kvgate``); anything else counts as "unknown".
ROUTE_KEYS = ("pool", "tenant_class", "context_window", "max_body_bytes", "release")
# A bad route setting is logged at most once per key in this many seconds.
ROUTE_LOG_INTERVAL_S = 60.0
# The tenant header never seen: said once this many requests in a row lacked it, then at
# most once per TENANT_HEADER_LOG_INTERVAL_S (seconds) while it stays unseen.
TENANT_HEADER_UNSEEN_AFTER = 100
TENANT_HEADER_LOG_INTERVAL_S = 600.0
ROUTE_CACHE_ENTRIES = 256
METADATA_NAMESPACE = "kvgate"


@dataclass(frozen=True, slots=True)
class PoolRuntime:
    """PoolRuntime is a pool's configuration with its loaded tokenizer and chat template.
    ``picks``: the configuration's, read once (the property walks the backends, and the
    request path asks it up to four times a request)."""

    config: PoolConfig
    tokenizer: Any
    template: Any
    picks: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "picks", self.config.picks)


@dataclass(frozen=True, slots=True)
class RouteSettings:
    """RouteSettings are the per-route overrides Envoy sent (None: the file's value).

    ``context_window`` in tokens, ``max_body_bytes`` in bytes.
    """

    pool: str | None = None
    tenant_class: str | None = None
    context_window: int | None = None
    max_body_bytes: int | None = None
    release: RouteRelease | None = None


NO_ROUTE_SETTINGS = RouteSettings()


class Gate:
    """Gate holds what every request shares and can be reconfigured at run time.

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
        if tenants.unauthenticated is None:
            raise RequestError("This gateway requires an API key (authorization: Bearer KEY); the "
                               "key given is missing or not one of its tenants'.",
                               status=401, code="invalid_api_key")
        return ANONYMOUS_TENANT

    def class_of_attributes(self, attributes: Any, metadata: Any) -> tuple[str, ClassConfig | None]:
        """class_of_attributes is the pool and class of a request refused before kvgate saw its
        body (Envoy's own 413), named by its request ``attributes`` and route ``metadata``, so
        that it is counted where it belongs; an identity that would have been refused has no
        class (None: the default's)."""
        facts = facts_of.from_attributes(facts_of.attribute_values(attributes), self.config.tenants)
        route = self.route_settings(metadata)
        pool = route.pool or self.config.default_pool
        try:
            tenant = self.tenant_of(facts.tenant, facts.authorization)
        except RequestError:
            return pool, None
        return pool, (self.config.tenants.classes[route.tenant_class] if route.tenant_class
                      else self.config.class_of(tenant))

    @staticmethod
    def fairness_id_of(tenant: str, fairness_values: Sequence[bytes]) -> str | None:
        """fairness_id_of is whom the wait queue serves in turn for a request of ``tenant``, where
        that is not the tenant itself (``Demand.fairness_id``), or None.

        A configured tenant is one flow, however its requests name it. Anonymous requests
        (ANONYMOUS_TENANT) are one flow together, which is what keeps an anonymous flood to
        one share of its class, unless the fairness header (``tenant_of`` has checked it is
        given once) names a flow: then each value is a flow of its own, prefixed so that it
        never meets a tenant's name, and cut to FAIRNESS_ID_MAX characters. The header is
        trusted as Envoy sets it (every Envoy file kvgate writes strips the client's copy):
        a client that could set it would get one share per value it invents.
        """
        if tenant != ANONYMOUS_TENANT or not fairness_values:
            return None
        value = fairness_values[0].decode("latin-1").strip()[:FAIRNESS_ID_MAX]
        return f"{ANONYMOUS_TENANT}:{value}" if value else None

    def _tenant_header_missing(self) -> None:
        """_tenant_header_missing notes a request without the tenant header (and without a
        tenant's key). When tenants exist that only that header can name and no request has
        ever carried it, the header Envoy sends is most likely not ``tenants.header``: every
        request falls into the default class, which deserves a word."""
        if not self._header_tenants:
            return  # every tenant has keys: requests without the header are the norm
        self.metrics.header_unseen("absent")
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
        self.metrics.header_unseen("other_header")
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
        # One map read (get), not a membership test and then the read: this runs on every request.
        struct = None if metadata is None else metadata.filter_metadata.get(METADATA_NAMESPACE)
        if struct is None:
            return NO_ROUTE_SETTINGS
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
                    values[key] = RouteRelease(value.string_value)
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
