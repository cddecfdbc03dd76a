"""stack: the real Envoy, kvgate and the fake upstream on free loopback ports.

Used by the end-to-end tests (one stack per test module) and by ``bench/``. Envoy's
configuration is ``deploy/envoy.yaml`` itself, pointed at loopback ports, so the tests
exercise the file operators deploy. ``processor`` picks what sits behind ext_proc:
kvgate (``"kvgate"``), any other gRPC command on a port (``argv`` with ``{port}``), or no
ext_proc filter at all (None).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from extproc.localstack import render_envoy
from kvgate_testkit.kvmetrics import LoopbackStack
from kvgate_testkit.procs import LOOPBACK, ROOT, VENV_BIN, Proc, free_port, wait_until

ENVOY_TEMPLATE = ROOT / "deploy" / "envoy.yaml"
SET_METADATA = "envoy.filters.http.set_metadata"
EXT_PROC = "envoy.filters.http.ext_proc"
BODY_TOO_LARGE_ROUTE = "body-too-large"
HEADER_MUTATION = "envoy.filters.http.header_mutation"


def _hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    listener = cfg["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def metadata_route(match_header: tuple[str, str], settings: dict[str, Any]) -> dict[str, Any]:
    """metadata_route is a route to the upstream for requests carrying ``match_header``,
    with ``settings`` as its per-route kvgate metadata."""
    name, value = match_header
    return {
        "match": {"prefix": "/", "headers": [{"name": name, "string_match": {"exact": value}}]},
        "route": {"cluster": "inference", "timeout": "0s"},
        "typed_per_filter_config": {SET_METADATA: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": "kvgate", "value": settings}]}},
    }


def envoy_config(*, listen: int, upstream: int, grpc: int | None,
                 routes: Sequence[dict[str, Any]] = (),
                 template: Path = ENVOY_TEMPLATE, max_body_bytes: int | None = None,
                 admin: int | None = None, tenant_header_from_client: bool = False) -> dict[str, Any]:
    """envoy_config renders an Envoy file of deploy/ (default deploy/envoy.yaml) for
    loopback: Envoy on ``listen``, the inference cluster on ``upstream``, ext_proc on
    ``grpc`` (None: no ext_proc filter). ``routes`` go before the file's own routes.
    ``max_body_bytes`` (kvgate's limits.max_body_bytes) moves the file's early-413 route
    to that limit, as an operator keeps the two equal. Envoy's admin interface is left out
    unless ``admin`` gives its port.

    ``tenant_header_from_client`` keeps the client's tenant header (the file strips it): the
    tests of how kvgate reads that header send it as a verified source in front would set it."""
    cfg = render_envoy(yaml.safe_load(template.read_text()), listen=listen, admin=admin or 0,
                       grpc=grpc or 1, upstream=upstream)
    if admin is None:
        cfg.pop("admin", None)
    hcm = _hcm(cfg)
    if tenant_header_from_client:
        for http_filter in hcm["http_filters"]:
            if http_filter["name"] == HEADER_MUTATION:
                mutations = http_filter["typed_config"]["mutations"]
                mutations["request_mutations"] = [
                    m for m in mutations["request_mutations"] if "remove" not in m]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    vhost["routes"] = [*routes, *vhost["routes"]]
    if max_body_bytes is not None:
        for route in vhost["routes"]:
            if route.get("name") == BODY_TOO_LARGE_ROUTE:
                for header in route["match"]["headers"]:
                    if header["name"] == "content-length":
                        header["range_match"]["start"] = max_body_bytes + 1
    if grpc is None:
        without_processor(cfg)
    return cfg


def without_processor(cfg: dict[str, Any]) -> None:
    """without_processor removes kvgate from a rendered Envoy file in place: its ext_proc
    filter, the routes' settings of that filter, the access logs sent to it and the ``kvgate``
    cluster (plain Envoy)."""
    hcm = _hcm(cfg)
    hcm["http_filters"] = [f for f in hcm["http_filters"] if not _is_ext_proc(f)]
    hcm["access_log"] = [a for a in hcm.get("access_log", []) if (
        a.get("typed_config", {}).get("common_config", {}).get("grpc_service", {})
        .get("envoy_grpc", {}).get("cluster_name") != "kvgate")]
    if not hcm["access_log"]:
        del hcm["access_log"]
    cfg["static_resources"]["clusters"] = [
        c for c in cfg["static_resources"]["clusters"] if c["name"] != "kvgate"]
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:  # settings of a filter that is gone
        per_filter = route.get("typed_per_filter_config", {})
        for name in [n for n in per_filter if n.startswith(EXT_PROC)]:
            del per_filter[name]


def _is_ext_proc(http_filter: dict[str, Any]) -> bool:
    return str(http_filter.get("typed_config", {}).get("@type", "")).endswith(
        "ext_proc.v3.ExternalProcessor")


def _stops_at_once(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """_stops_at_once is ``config`` with ``server.drain_s`` 0 unless the test set it: a stack is
    stopped when its module ends, and kvgate's 5 s drain would only make every module 5 s
    longer (tests of draining set their own)."""
    if config is None:
        return None
    out = dict(config)
    server = dict(out.get("server") or {})
    server.setdefault("drain_s", 0)
    out["server"] = server
    return out


class Stack(LoopbackStack):
    """Stack is one fake upstream, one processor and one Envoy, each a child process.

    ``kvgate_config`` is the kvgate configuration as a mapping (written to a file in
    ``workdir``). ``processor``: "kvgate", None (plain Envoy), or an argv with ``{port}``.
    ``envoy_edit`` changes the rendered Envoy configuration in place before Envoy starts
    (what a test adds beside the file, e.g. a listener of its own for the access log).
    """

    def __init__(self, workdir: Path, kvgate_config: dict[str, Any] | None = None, *,
                 processor: str | Sequence[str] | None = "kvgate",
                 routes: Sequence[dict[str, Any]] = (), envoy_concurrency: int = 1,
                 envoy_template: Path = ENVOY_TEMPLATE, upstream_args: Sequence[str] = (),
                 envoy_admin: bool = False, tenant_header_from_client: bool = False,
                 envoy_edit: Callable[[dict[str, Any]], None] | None = None) -> None:
        super().__init__()
        self.envoy_edit = envoy_edit
        self.workdir = workdir
        self.envoy_admin_port = free_port() if envoy_admin else None
        self.tenant_header_from_client = tenant_header_from_client
        self.kvgate_config = kvgate_config
        self.processor = processor
        self.routes = list(routes)
        self.envoy_concurrency = envoy_concurrency
        self.envoy_template = envoy_template
        self.upstream_args = list(upstream_args)
        self.upstream_port = free_port()

    @property
    def upstream_url(self) -> str:
        return f"http://{LOOPBACK}:{self.upstream_port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / "kvgate.yaml"

    def start(self) -> Stack:
        """start launches upstream, processor and Envoy, each waited for on its port."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        py = sys.executable
        try:
            up = self._spawn("upstream", [py, "-m", "kvgate_testkit.upstream",
                                          "--port", str(self.upstream_port), *self.upstream_args])
            up.wait_port(self.upstream_port)
            grpc: int | None = None
            if self.processor == "kvgate":
                self.config_path.write_text(yaml.safe_dump(_stops_at_once(self.kvgate_config),
                                                           sort_keys=False))
                kv = self._spawn("kvgate", [py, "-m", "extproc", "serve", "--config",
                                            str(self.config_path), "--grpc-listen",
                                            f"{LOOPBACK}:{self.grpc_port}", "--admin-listen",
                                            f"{LOOPBACK}:{self.admin_port}", "--log-level", "info"])
                kv.wait_port(self.admin_port)
                kv.wait_port(self.grpc_port)
                grpc = self.grpc_port
            elif self.processor is not None:
                argv = [a.replace("{port}", str(self.grpc_port)) for a in self.processor]
                self._spawn("processor", argv).wait_port(self.grpc_port)
                grpc = self.grpc_port
            limit = (self.kvgate_config or {}).get("limits", {}).get("max_body_bytes")
            cfg = envoy_config(listen=self.envoy_port, upstream=self.upstream_port, grpc=grpc,
                               routes=self.routes, template=self.envoy_template,
                               max_body_bytes=limit if self.processor == "kvgate" else None,
                               admin=self.envoy_admin_port,
                               tenant_header_from_client=self.tenant_header_from_client)
            if self.envoy_edit is not None:
                self.envoy_edit(cfg)
            envoy_yaml = self.workdir / "envoy.yaml"
            envoy_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))
            envoy = self._spawn("envoy", [str(VENV_BIN / "envoy"), "-c", str(envoy_yaml),
                                          "--log-level", "warn", "--disable-hot-restart",
                                          "--concurrency", str(self.envoy_concurrency)])
            envoy.wait_port(self.envoy_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(argv, self.workdir / f"{name}.log")
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        """stop ends Envoy first, then the processor and the upstream."""
        for name in ("envoy", "processor", "kvgate", "upstream"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop()

    # --- looking inside -------------------------------------------------------------------


    def inflight(self) -> float:
        """inflight is kvgate's admitted, unreleased requests over all pools and classes."""
        return self.metric("kvgate_inflight_requests")

    def wait_inflight(self, value: float, timeout: float = 5.0) -> None:
        """wait_inflight waits until kvgate reports ``value`` requests in flight."""
        wait_until(lambda: self.inflight() == value, timeout=timeout,
                   what=f"kvgate_inflight_requests == {value}")

    def envoy_stat(self, name: str) -> int:
        """envoy_stat is one counter or gauge of Envoy's admin /stats (needs ``envoy_admin``)."""
        url = f"http://{LOOPBACK}:{self.envoy_admin_port}/stats?filter=^{name}$"
        with urllib.request.urlopen(url, timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                key, _, value = line.partition(": ")
                if key == name:
                    return int(value)
        return 0

    def upstream_json(self, path: str) -> Any:
        """upstream_json GETs one of the fake upstream's control endpoints."""
        with urllib.request.urlopen(f"{self.upstream_url}{path}", timeout=5) as resp:
            return json.loads(resp.read())

    def upstream_post(self, path: str) -> None:
        """upstream_post POSTs to one of the fake upstream's control endpoints."""
        req = urllib.request.Request(f"{self.upstream_url}{path}", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=5):
            pass

    def log(self, name: str) -> str:
        proc = self.procs.get(name)
        return proc.output() if proc else ""


def openai_client(stack: Stack) -> Any:
    """openai_client is the real openai client pointed at the stack's Envoy, without retries."""
    from openai import OpenAI

    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)


def released(stack: Stack, cause: str) -> float:
    """released is kvgate's count of leases released with ``cause``."""
    return stack.metric("kvgate_releases_total", cause=cause)
