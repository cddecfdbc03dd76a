"""variants: the Envoy files the hot-path benchmarks compare, by name: each shipped file of
deploy/ and the levers derived from them (a file as it was before an issue, another mode,
another flush interval), written to a run's folder; ``hot_stack``, Envoy on one of them in front of
the fast fake upstream with kvgate (this tree's or another revision's), the bare processor or
nothing behind ext_proc; ``BENCH_CONFIG``, kvgate's configuration there."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import yaml

from kvgate_testkit.procs import LOOPBACK, Proc, wait_until
from kvgate_testkit.stack import ENVOY_TEMPLATE, Stack

VARIANTS = ("recommended", "four-message", "observe", "reservation", "access-log",
            "endpoint-picker", "endpoint-picker-log", "full-duplex", "no-response-headers",
            "request-only", "no-buffer", "access-log-no-lua", "endpoint-picker-log-100ms",
            "endpoint-picker-log-500ms", "endpoint-picker-log-60000ms", "endpoint-picker-log-split")
# Variants whose node the processor names (the picker files and their levers).
PICKED = ("endpoint-picker", "endpoint-picker-log", "endpoint-picker-log-100ms",
          "endpoint-picker-log-500ms", "endpoint-picker-log-60000ms", "endpoint-picker-log-split")
# The split lever's flush interval of the periodic entries' own log (seconds).
SPLIT_FLUSH_S = 0.1
# Variants kvgate does not serve (the bare processor shows what they would be worth).
BARE_ONLY = ("full-duplex", "no-response-headers", "request-only")
EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"


def variant_file(variant: str, workdir: Path) -> Path:
    """variant_file is the Envoy file of a variant: a file of deploy/ or one derived from
    deploy/envoy.yaml (written to ``workdir``).

    - ``recommended``: deploy/envoy.yaml (request headers skipped);
    - ``four-message``: deploy/envoy-four-message.yaml;
    - ``observe``: deploy/envoy-observe.yaml (the response goes to a second ext_proc filter
      in observability mode: never waited for);
    - ``reservation``: deploy/envoy-reservation.yaml (the response body is not sent: the
      completion is charged at its reservation);
    - ``access-log``: deploy/envoy-access-log.yaml (the request body alone; the release
      comes by Envoy's gRPC access log);
    - ``endpoint-picker``: deploy/envoy-endpoint-picker.yaml (request headers sent, the
      request held until kvgate names the node: the fake upstream, a pool of one node
      whose metrics it serves; the bare processor names it too, with a constant answer);
    - ``full-duplex``: the response body FULL_DUPLEX_STREAMED (Envoy does not wait for each
      chunk's answer before sending the next; the processor sends the chunks back);
    - ``no-response-headers``: response headers skipped too (status and x-ratelimit-*
      headers would have to travel by attributes and dynamic metadata);
    - ``request-only``: the response neither sent nor observed (headers SKIP, body NONE):
      one blocking message per request, the least any admission can cost;
    - ``no-buffer``: deploy/envoy.yaml without its buffer filter, as it was before issue
      15 (the upstream request opened before kvgate decides): what holding the request
      until the decision costs;
    - ``access-log-no-lua``: deploy/envoy-access-log.yaml without its Lua usage filter, as
      it was before issue 17 (the completion charged at its reservation): what reading the
      usage in Envoy costs;
    - ``endpoint-picker-log``: deploy/envoy-endpoint-picker-log.yaml (the node named as in
      the picker file, the request's ext_proc stream ends with the request body, the progress
      and the end come by the access log), and its levers ``endpoint-picker-log-100ms`` and
      ``-500ms`` with another ``access_log_flush_interval`` (the shipped one is 0.25 s), and
      ``-60000ms``: nearly no periodic entry, to tell their traffic from what a request holds;
      ``endpoint-picker-log-split``: the periodic entries on a second log of their own, flushed
      every SPLIT_FLUSH_S (the final ones keep the 5 ms log): fewer, larger batches.
    """
    if variant == "recommended":
        return ENVOY_TEMPLATE
    if variant in ("four-message", "observe", "reservation", "access-log", "endpoint-picker",
                   "endpoint-picker-log"):
        return ENVOY_TEMPLATE.parent / f"envoy-{variant}.yaml"
    source = ("envoy-access-log.yaml" if variant == "access-log-no-lua"
              else "envoy-endpoint-picker-log.yaml" if variant.startswith("endpoint-picker-log-")
              else None)
    cfg = yaml.safe_load((ENVOY_TEMPLATE.parent / source if source else ENVOY_TEMPLATE).read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    at = next(i for i, f in enumerate(filters) if f["typed_config"]["@type"] == EXT_PROC_TYPE)
    ext = filters[at]["typed_config"]
    mode = ext["processing_mode"]
    if variant == "full-duplex":
        mode["response_body_mode"] = "FULL_DUPLEX_STREAMED"
        mode["response_trailer_mode"] = "SEND"  # required by FULL_DUPLEX_STREAMED
    elif variant == "no-response-headers":
        mode["response_header_mode"] = "SKIP"
    elif variant == "request-only":
        mode["response_header_mode"] = "SKIP"
        mode["response_body_mode"] = "NONE"
    elif variant == "endpoint-picker-log-split":
        _split_periodic(hcm)
    elif variant.startswith("endpoint-picker-log-"):
        interval_ms = int(variant.rsplit("-", 1)[1].removesuffix("ms"))
        hcm["access_log_options"]["access_log_flush_interval"] = f"{interval_ms / 1000:g}s"
    elif variant == "access-log-no-lua":
        hcm["http_filters"] = [f for f in filters if f["name"] != "envoy.filters.http.lua"]
    elif variant == "no-buffer":
        hcm["http_filters"] = [f for f in filters if f["name"] != "envoy.filters.http.buffer"]
        for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
            route.get("typed_per_filter_config", {}).pop("envoy.filters.http.buffer", None)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    path = workdir / f"envoy-{variant}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _split_periodic(hcm: dict[str, Any]) -> None:
    """_split_periodic leaves the end of a request on the file's 5 ms log and puts the periodic
    entries on a second log of their own, flushed every SPLIT_FLUSH_S: fewer, larger batches."""
    end_log = hcm["access_log"][0]
    end_log["filter"] = {"log_type_filter": {"types": ["DownstreamPeriodic"], "exclude": True}}
    progress_log = yaml.safe_load(yaml.safe_dump(end_log))
    progress_log["filter"] = {"log_type_filter": {"types": ["DownstreamPeriodic"]}}
    common = progress_log["typed_config"]["common_config"]
    common["log_name"] = common["log_name"] + "-progress"
    common["buffer_flush_interval"] = f"{SPLIT_FLUSH_S:g}s"
    hcm["access_log"].append(progress_log)


# kvgate's configuration in the hot-path benchmarks: limits far above the load, so that they
# measure the path, not refusals.
# kvgate's configuration in the hot-path benchmarks: limits far above the load, so that they
# measure the path, not refusals.
BENCH_CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 1000000, "tpm": 10**13, "context_window": 32768,
                          "default_max_tokens": 1024, "tokenizer": "cl100k_base"}},
    "limits": {"max_body_bytes": 1048576},
    "server": {"drain_s": 0, "grace_s": 1},
}


class SourceStack(Stack):
    """SourceStack is a kvgate stack whose kvgate runs from another copy of the sources
    (``source``: a directory holding an ``extproc`` package), for before/after runs."""

    def __init__(self, workdir: Path, config: dict[str, Any], source: Path, **kwargs: Any) -> None:
        super().__init__(workdir, config, **kwargs)
        self.source = source

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        if name != "kvgate":
            return super()._spawn(name, argv)
        # ``python -m`` puts the working directory first on sys.path: that picks the copy.
        proc = Proc(argv, self.workdir / f"{name}.log", cwd=self.source)
        self.procs[name] = proc
        return proc


def hot_stack(workdir: Path, variant: str, work: Path, processor: str | list[str] | None = "kvgate",
              source: Path | None = None) -> Stack:
    """hot_stack is a stack of Envoy on ``variant``'s file (written to ``work`` where derived)
    in front of the fast fake upstream, with ``processor`` behind ext_proc: ``"kvgate"`` on
    BENCH_CONFIG (run from ``source`` when given), the command of a bare processor, or None
    (plain Envoy, on the recommended file's routes: a picker file needs a processor to name
    the node). In a picker file the processor names the fake upstream as its node."""
    common: dict[str, Any] = {"envoy_template": variant_file("recommended" if processor is None else variant, work),
                              "upstream_args": ["--fast"]}
    if processor == "kvgate" and source is not None:
        stack: Stack = SourceStack(workdir, BENCH_CONFIG, source, **common)
    else:
        stack = Stack(workdir, BENCH_CONFIG if processor == "kvgate" else None, processor=processor, **common)
    if variant in PICKED:
        _picks_the_upstream(stack)
    return stack


def _picks_the_upstream(stack: Stack) -> None:
    """_picks_the_upstream makes a stack of the endpoint-picker file name its fake upstream:
    kvgate's pool gets it as its one node (address and vLLM metrics), the bare processor
    names it in a constant answer."""
    node = f"{LOOPBACK}:{stack.upstream_port}"
    if stack.processor == "kvgate":
        cfg = orjson.loads(orjson.dumps(BENCH_CONFIG))
        cfg["pools"]["default"]["backends"] = [{"name": "node-0", "engine": "vllm", "address": node,
                                                "metrics_url": f"http://{node}/metrics"}]
        stack.kvgate_config = cfg
    elif isinstance(stack.processor, list):
        stack.processor = [*stack.processor, "--destination", node]


def wait_picker_nodes_up(stacks: Iterable[Stack]) -> None:
    """wait_picker_nodes_up waits until every kvgate of ``stacks`` whose pool picks its nodes
    has scraped its node once (before that, every request is refused: no node is up)."""
    for stack in stacks:
        cfg = stack.kvgate_config
        if stack.processor == "kvgate" and cfg is not None and "backends" in cfg["pools"]["default"]:
            wait_until(partial(_picks, stack), timeout=20, what="the picker's node up")


def _picks(stack: Stack) -> bool:
    return stack.metric("kvgate_backend_pickable") == 1
