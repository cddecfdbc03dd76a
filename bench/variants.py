"""variants: the Envoy files the hot-path benchmarks compare, by name: each shipped file of
deploy/ and the levers derived from them (a file as it was before an issue, another mode,
another flush interval), written to a run's folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvgate_testkit.stack import ENVOY_TEMPLATE

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
