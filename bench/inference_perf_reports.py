"""inference_perf_reports: inference-perf's own per-stage reports, and the nodes' counters over
each stage, turned into the tables of bench/results/inference-perf.md.

inference-perf (kubernetes-sigs, PyPI ``inference-perf``) writes, per load stage N, into its
``storage.local_storage.path``:

- ``stage_N_lifecycle_metrics.json``: what its client saw. ``load_summary`` (``requested_rate``,
  ``achieved_rate`` in requests per second, ``count`` sent), ``successes`` (``count``,
  ``latency.time_to_first_token`` and the other latencies in seconds as ``mean``/``median``/
  ``p90``/``p99``..., ``throughput.output_tokens_per_sec`` and ``requests_per_sec``,
  ``prompt_tokens.mean``: the server's ``usage.prompt_tokens`` where it reports them),
  ``failures`` (``count``, ``by_label``: ``{"429 - ...": {"count": n}}``);
- ``inference-perf.partial.stage_N.yaml``: its slice of a BR0.2 report, whose ``run.time``
  (``start``, ``end``, ISO 8601) is the stage's wall-clock window.

The benchmark samples the nodes' /metrics with wall-clock times (``Sample``); a stage's share of
a counter is its value at the first sample at or after the stage's end less its value at the
last sample at or before the stage's start, summed over the nodes. Nothing here needs
inference-perf installed: it reads the files it wrote.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

STAGE_FILE = re.compile(r"stage_(\d+)_lifecycle_metrics\.json$")
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
KV_USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"


@dataclass(frozen=True, slots=True)
class Stage:
    """Stage is what inference-perf reported for one load stage: rates in requests per second,
    latencies in seconds (None when no request succeeded), throughput in tokens or requests
    per second, ``failures`` by inference-perf's label (e.g. ``429 - rate limited``), the mean
    prompt in tokens (the server's count where it reports one), and the stage's wall-clock
    window (epoch seconds; None when its partial report is missing)."""

    index: int
    rate: float
    achieved_rate: float | None
    sent: int
    completed: int
    failures: dict[str, int]
    ttft_p50: float | None
    ttft_p99: float | None
    latency_p50: float | None
    output_tokens_per_s: float
    requests_per_s: float
    prompt_tokens_mean: float | None = None
    start: float | None = None
    end: float | None = None

    @property
    def failed(self) -> int:
        return sum(self.failures.values())


def _quantile(summary: dict[str, Any] | None, key: str) -> float | None:
    if not summary or summary.get(key) is None:
        return None
    return float(summary[key])


def stage_from(index: int, report: dict[str, Any], window: tuple[float, float] | None = None) -> Stage:
    """stage_from reads one ``stage_N_lifecycle_metrics.json`` (parsed) of stage ``index``."""
    load = report.get("load_summary") or {}
    ok = report.get("successes") or {}
    latency = ok.get("latency") or {}
    throughput = ok.get("throughput") or {}
    failures = report.get("failures") or {}
    by_label = {str(k): int(v.get("count", 0)) for k, v in (failures.get("by_label") or {}).items()}
    unlabelled = int(failures.get("count", 0)) - sum(by_label.values())
    if unlabelled > 0:  # a count without labels still counts
        by_label["unlabelled"] = unlabelled
    achieved = load.get("achieved_rate")
    return Stage(
        index=index, rate=float(load.get("requested_rate") or 0.0),
        achieved_rate=None if achieved is None else float(achieved),
        sent=int(load.get("count", 0)), completed=int(ok.get("count", 0)), failures=by_label,
        ttft_p50=_quantile(latency.get("time_to_first_token"), "median"),
        ttft_p99=_quantile(latency.get("time_to_first_token"), "p99"),
        latency_p50=_quantile(latency.get("request_latency"), "median"),
        output_tokens_per_s=float(throughput.get("output_tokens_per_sec", 0.0)),
        requests_per_s=float(throughput.get("requests_per_sec", 0.0)),
        prompt_tokens_mean=_quantile(ok.get("prompt_tokens"), "mean"),
        start=window[0] if window else None, end=window[1] if window else None)


def window_of(partial: dict[str, Any]) -> tuple[float, float] | None:
    """window_of is a stage's wall-clock window (epoch seconds) from its BR0.2 partial report's
    ``run.time``; None when it has none."""
    when = (partial.get("run") or {}).get("time") or {}
    start, end = when.get("start"), when.get("end")
    if start is None or end is None:
        return None

    def epoch(v: Any) -> float:
        return (v if isinstance(v, datetime) else datetime.fromisoformat(str(v))).timestamp()

    return epoch(start), epoch(end)


def read_stages(folder: Path) -> list[Stage]:
    """read_stages reads every stage report inference-perf wrote into ``folder``, in order."""
    stages = []
    for path in folder.iterdir():
        m = STAGE_FILE.search(path.name)
        if not m:
            continue
        index = int(m.group(1))
        partial = folder / f"inference-perf.partial.stage_{index}.yaml"
        window = window_of(yaml.safe_load(partial.read_text()) or {}) if partial.exists() else None
        stages.append(stage_from(index, json.loads(path.read_text()), window))
    return sorted(stages, key=lambda s: s.index)


# --- the nodes' counters over a stage --------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Sample:
    """Sample is every node's /metrics at one wall-clock instant ``at`` (epoch seconds):
    ``nodes[i]`` maps a sample name to its value, labels summed."""

    at: float
    nodes: tuple[dict[str, float], ...]

    def total(self, name: str) -> float:
        return sum(n.get(name, 0.0) for n in self.nodes)


@dataclass(frozen=True, slots=True)
class NodeFigures:
    """NodeFigures is what the nodes did during a stage: preemptions (all nodes), prefix-cache
    queries and hits (tokens, all nodes), the highest KV usage any node showed (0..1), and the
    most requests waiting in the nodes' own queues at once (all nodes; where a setup queues,
    beside kvgate's queue). None where the samples do not cover the stage."""

    preemptions: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    kv_peak: float | None = None
    waiting_peak: float | None = None

    @property
    def hit_rate(self) -> float | None:
        if self.prefix_hits is None or not self.prefix_queries:
            return None
        return self.prefix_hits / self.prefix_queries


def _delta(samples: Sequence[Sample], name: str, start: float, end: float) -> float | None:
    before = [s for s in samples if s.at <= start]
    after = [s for s in samples if s.at >= end]
    if not before or not after:
        return None
    return after[0].total(name) - before[-1].total(name)


def node_figures(samples: Sequence[Sample], start: float | None, end: float | None) -> NodeFigures:
    """node_figures is the nodes' counters over [start, end] (epoch s) from ``samples`` in time
    order; every figure None when the window is unknown."""
    if start is None or end is None:
        return NodeFigures()
    inside = [s for s in samples if start <= s.at <= end]
    return NodeFigures(preemptions=_delta(samples, PREEMPTIONS, start, end),
                       prefix_queries=_delta(samples, PREFIX_QUERIES, start, end),
                       prefix_hits=_delta(samples, PREFIX_HITS, start, end),
                       kv_peak=max((max((n.get(KV_USAGE, 0.0) for n in s.nodes), default=0.0)
                                    for s in inside), default=None),
                       waiting_peak=max((s.total(WAITING) for s in inside), default=None))


# --- the report's tables -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Measured:
    """Measured is one setup's stage: inference-perf's report and the nodes' figures."""

    setup: str
    stage: Stage
    nodes: NodeFigures = field(default_factory=NodeFigures)


def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def _failures(stage: Stage) -> str:
    if not stage.failures:
        return "0"
    return f"{stage.failed} (" + ", ".join(f"{k}: {v}" for k, v in sorted(stage.failures.items())) + ")"


def stage_table(rows: Sequence[Measured], baseline: str | None = None) -> list[str]:
    """stage_table is one stage's markdown table, a line per setup; with ``baseline`` (a setup's
    name) a last line gives each other setup's TTFT and throughput over the baseline's."""
    lines = ["| setup | completed / sent | failures | achieved rate (req/s) | TTFT p50 (s) | TTFT p99 (s) | "
             "latency p50 (s) | output tok/s | preemptions | prefix hit rate | KV peak | waiting at the nodes, most |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in rows:
        s, n = m.stage, m.nodes
        lines.append(
            f"| {m.setup} | {s.completed} / {s.sent} | {_failures(s)} | {_num(s.achieved_rate, '.2f')} | "
            f"{_num(s.ttft_p50, '.3f')} | {_num(s.ttft_p99, '.3f')} | {_num(s.latency_p50, '.2f')} | "
            f"{s.output_tokens_per_s:.0f} | {_num(n.preemptions, 'g')} | {_num(n.hit_rate, '.2f')} | "
            f"{_num(n.kv_peak, '.2f')} | {_num(n.waiting_peak, 'g')} |")
    base = next((m for m in rows if m.setup == baseline), None)
    for m in rows:
        if base is None or m is base:
            continue
        s, b = m.stage, base.stage
        lines.append(
            f"| {m.setup} ÷ {base.setup} | | | | {_num(_ratio(s.ttft_p50, b.ttft_p50), '.2f')}x | "
            f"{_num(_ratio(s.ttft_p99, b.ttft_p99), '.2f')}x | {_num(_ratio(s.latency_p50, b.latency_p50), '.2f')}x | "
            f"{_num(_ratio(s.output_tokens_per_s, b.output_tokens_per_s), '.2f')}x | | | | |")
    return lines


def tables(measured: Sequence[Measured], baseline: str | None = None) -> list[str]:
    """tables is a markdown table per stage (by stage index), setups side by side."""
    out: list[str] = []
    for index in sorted({m.stage.index for m in measured}):
        rows = [m for m in measured if m.stage.index == index]
        rate = rows[0].stage.rate
        prompt = next((m.stage.prompt_tokens_mean for m in rows if m.stage.prompt_tokens_mean), None)
        size = "" if prompt is None else f", prompts of {prompt:.0f} tokens on average (the nodes' count)"
        out += [f"### Stage {index}: {rate:g} requests/s offered{size}", "", *stage_table(rows, baseline), ""]
    return out
