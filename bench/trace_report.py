"""trace_report: bench_trace's outcome: each policy's run (Run) summed up as its row of the
table (Summary), its verdict against issue 14's targets, plots over simulated time and
``trace.md`` with the setup that produced it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.trace_policies import BATCH_WATERMARK, ONLINE_WAIT_S, ORACLE_LEAD_S, PICKER_ENVOY, Policy
from bench.trace_workload import NODES, RAMP_STEPS, Background, Req, Scenario
from kvgate_testkit.load import Result, by_class, goodput, result_rows
from kvgate_testkit.nodes_stack import Node
from kvgate_testkit.reports import cell, machine, percentile
from sim.api import OUTPUT_TOKENS_HEADER

ROOT = Path(__file__).resolve().parents[1]
TTFT_TARGET_S = 2.0


@dataclass(slots=True)
class Run:
    """Run is one policy's outcome: per-request results, the timeline, each node's counters."""

    policy: Policy
    results: list[Result] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    preemptions: list[int] = field(default_factory=list)
    background: list[tuple[float, int]] = field(default_factory=list)  # (simulated s, tokens) applied
    wall_s: float = 0.0
    error: str | None = None
    skipped: str | None = None


@dataclass(frozen=True, slots=True)
class Summary:
    """Summary is one policy's row: counts, TTFT (simulated s), goodput (tokens per simulated s).

    ``kv_utilization``: the mean over samples, taken while some arrived request was not
    running on a node (queued in kvgate, the oracle or a node, or backing off after a
    429), of the KV blocks requests hold / the blocks the background load leaves them,
    over the three nodes; None when demand never went unserved. ``under_target``: share of all online requests
    (refused ones included) whose first token came within 2 s.
    """

    preemptions: tuple[int, ...]
    at_arrival: int
    by_class: dict[str, dict[str, int]]
    ttft_p50: float | None
    ttft_p99: float | None
    under_target: float | None
    kv_utilization: float | None
    goodput: float
    span_s: float
    tokens: int = 0


def kv_for_requests(row: dict[str, Any]) -> float:
    """kv_for_requests is the share of the KV blocks left by the background load that requests hold
    in a sample, over the nodes (a ratio)."""
    nodes = row["nodes"]
    room = sum(n["total_blocks"] - n["background_blocks"] for n in nodes)
    return sum(n["used_blocks"] for n in nodes) / room if room > 0 else 1.0


def preemptions_at_arrival(run: Run, bg: Background) -> int:
    """preemptions_at_arrival counts the preemptions (all nodes) the timeline saw while ``bg`` arrived."""
    count = 0
    prev: list[int] | None = None
    for row in run.timeline:
        now = [n["preemptions"] for n in row["nodes"]]
        if prev is not None and bg.arriving(row["t"]):
            count += sum(b - a for a, b in zip(prev, now))
        prev = now
    return count


def summarize(run: Run, background: Background) -> Summary:
    """summarize turns a run's results and timeline into its row of the table."""
    online = [r for r in run.results if r.req.klass == "online"]
    ttfts = [r.ttft for r in online if r.status == "ok" and r.ttft is not None]
    under = sum(1 for t in ttfts if t <= TTFT_TARGET_S) / len(online) if online else None
    tokens, span = goodput(run.results)
    starved = [row for row in run.timeline
               if row["open_online"] + row["open_batch"] > sum(n["running"] for n in row["nodes"])]
    util = (sum(kv_for_requests(row) for row in starved) / len(starved)) if starved else None
    return Summary(preemptions=tuple(run.preemptions), at_arrival=preemptions_at_arrival(run, background),
                   by_class=by_class(run.results),
                   ttft_p50=percentile(ttfts, 0.50), ttft_p99=percentile(ttfts, 0.99), under_target=under,
                   kv_utilization=util, goodput=tokens / span, span_s=span, tokens=tokens)


def plot(run: Run, path: Path) -> None:
    """plot draws one policy over simulated time: KV usage per node, requests open and running, 429s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = run.timeline
    t = [row["t"] for row in tl]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    colors = ("tab:blue", "tab:green", "tab:red")
    for i, color in enumerate(colors[:len(tl[0]["nodes"]) if tl else 0]):
        ax1.plot(t, [(row["nodes"][i]["used_blocks"] + row["nodes"][i]["background_blocks"])
                     / row["nodes"][i]["total_blocks"] for row in tl], color=color, label=f"node {i}: KV usage")
        bg = [row["nodes"][i]["background_blocks"] / row["nodes"][i]["total_blocks"] for row in tl]
        if any(bg):
            ax1.fill_between(t, 0, bg, color=color, alpha=0.15, label=f"node {i}: background load")
        marks, prev = [], 0
        for row in tl:
            if row["nodes"][i]["preemptions"] > prev:
                marks.append(row["t"])
                prev = row["nodes"][i]["preemptions"]
        if marks:
            ax1.vlines(marks, -0.06 - 0.04 * i, -0.02 - 0.04 * i, color=color, linewidth=0.8)
    ax1.set_ylim(-0.2, 1.05)
    ax1.set_ylabel("ratio of node KV")
    ax1.legend(loc="upper right", fontsize=7, ncol=2)
    ax1.set_title(f"{run.policy.title}: {sum(run.preemptions)} preemptions (ticks below 0)", fontsize=10)
    ax2.plot(t, [row["open_online"] for row in tl], color="tab:blue", label="client: online open")
    ax2.plot(t, [row["open_batch"] for row in tl], color="tab:orange", label="client: batch open")
    ax2.plot(t, [sum(n["running"] for n in row["nodes"]) for row in tl], color="black", linewidth=1,
             label="nodes: running")
    ax2.plot(t, [sum(n["waiting"] for n in row["nodes"]) for row in tl], color="tab:gray", linewidth=1,
             label="nodes: waiting")
    if any("kvgate" in row for row in tl):
        ax2.plot(t, [row.get("kvgate", {}).get("kvgate_inflight_requests", math.nan) for row in tl],
                 color="tab:purple", linestyle="--", label="kvgate: admitted in flight")
    ax2.set_ylabel("requests")
    ax2.legend(loc="upper right", fontsize=7)
    ax3.plot(t, [row["refused_online"] for row in tl], color="tab:blue", label="429s to online (cumulative)")
    ax3.plot(t, [row["refused_batch"] for row in tl], color="tab:orange", label="429s to batch (cumulative)")
    ax3.set_ylabel("429 answers")
    ax3.set_xlabel("simulated time (s)")
    ax3.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_summary(runs: list[Run], sums: dict[str, Summary], path: Path) -> None:
    """plot_summary draws the policies side by side: goodput share of the oracle, preemptions,
    share of online requests with a first token within 2 s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in runs if r.skipped is None]
    oracle = sums.get("oracle")
    keys = [r.policy.key for r in ran]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    share = [sums[k].goodput / oracle.goodput if oracle and oracle.goodput > 0 else 0.0 for k in keys]
    panels = ((share, "goodput / oracle's", "tab:green"),
              ([float(sum(sums[k].preemptions)) for k in keys], "preemptions (3 nodes)", "tab:red"),
              ([sums[k].under_target or 0.0 for k in keys], "online TTFT <= 2 s", "tab:blue"))
    for ax, (values, title, color) in zip(axes, panels):
        ax.bar(range(len(keys)), values, color=color)
        ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _pct_fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def report(runs: list[Run], sc: Scenario, node: Node, trace: Path, rows: int, reqs: list[Req],
           speedup: float, seed: int, wall_s: float, out: Path, command: str) -> list[str]:
    """report writes ``trace.md`` to ``out`` and returns its verdict lines."""
    ran = [r for r in runs if r.skipped is None]
    sums = {r.policy.key: summarize(r, sc.background) for r in ran}
    verdict = verdicts(runs, sums)
    lines = [
        "# Trace replay: Azure LLM inference trace 2023 (conversation) over three nodes",
        "",
        f"Generated by `{command}` (`make bench-trace`), scenario `{sc.name}`, seed {seed}, "
        f"speedup {speedup:g}x, {len(ran)} policies run in {wall_s:.0f} s wall time on {machine()}.",
        "",
        *table(runs, sums),
        "", *verdict, "",
        "## Setup", "",
        *setup(sc, node, trace, rows, reqs),
        ""]
    out.mkdir(parents=True, exist_ok=True)
    lines += ["## Over time", "", *pictures(runs, sums, out)]
    (out / "trace.md").write_text("\n".join(lines))
    return verdict


def table(runs: list[Run], sums: dict[str, Summary]) -> list[str]:
    """table is the report's table: one row a policy, a skipped one with its reason."""
    oracle = sums.get("oracle")
    kept = sums.get("oracle-classes")
    lines = [
        "| policy | preemptions: node 0 / 1 / 2 = total (as the background arrived) | KV utilization while demand waits "
        "| goodput (tok/s) | share of the oracle's | share of the class-keeping oracle's "
        "| online TTFT p50 / p99 (s) | online TTFT <= 2 s "
        "| online ok / refused / error | batch ok / refused / error | 429s seen (online, batch) |",
        "|---|---|---:|---:|---:|---:|---|---:|---|---|---|",
    ]
    for run in runs:
        if run.skipped is not None:
            lines.append(f"| {run.policy.title} | {run.skipped} | | | | | | | | | |")
            continue
        s = sums[run.policy.key]
        o, b = s.by_class["online"], s.by_class["batch"]
        share = _pct_fmt(s.goodput / oracle.goodput) if oracle and oracle.goodput > 0 else "n/a"
        share_kept = _pct_fmt(s.goodput / kept.goodput) if kept and kept.goodput > 0 else "n/a"
        name = run.policy.title + (f" (**error**: {run.error})" if run.error else "")
        pre = " / ".join(str(p) for p in s.preemptions) + f" = {sum(s.preemptions)} ({s.at_arrival})"
        lines.append(f"| {name} | {pre} | {_pct_fmt(s.kv_utilization)} | {s.goodput:,.0f} | {share} | {share_kept} "
                     f"| {cell(s.ttft_p50)} / {cell(s.ttft_p99)} | {_pct_fmt(s.under_target)} "
                     f"| {o['ok']} / {o['refused']} / {o['error']} | {b['ok']} / {b['refused']} / {b['error']} "
                     f"| {o['429s']}, {b['429s']} |")
    return lines


def setup(sc: Scenario, node: Node, trace: Path, rows: int, reqs: list[Req]) -> list[str]:
    """setup is the report's Setup section: the trace window, the clients, the nodes, kvgate, the oracle."""
    online = [r for r in reqs if r.klass == "online"]
    mix = ", ".join(f"{'none' if v is None else f'{v:,}'} ({sum(r.max_tokens == v for r in online)})"
                    for v, _ in sc.max_tokens_mix)
    bg = sc.background
    return [
        f"- Trace: `{trace}` (Azure LLM inference trace 2023, conversation, as processed by the "
        "Vidur project; CC-BY-4.0 / MIT, see `bench/traces/README.md`), trace seconds "
        f"{sc.start_s:g}-{sc.start_s + sc.window_s:g}: {rows} requests, compressed {sc.compress:g}x "
        f"into {sc.duration_s:.1f} simulated s. Prompts are built to the trace's token counts "
        "(cl100k words + the OpenAI chat template's 7 tokens; shorter prompts are padded to 8); each "
        f"request carries its trace output length in `{OUTPUT_TOKENS_HEADER}`, so the node stops there "
        "(`finish_reason: stop`) unless max_tokens comes first. kvgate does not read that header.",
        f"- Online: {len(online)} streamed chats over {sc.online_tenants} tenants, retried twice on 429/5xx "
        f"(openai-python's default). Clients' max_tokens, drawn per request: {mix}; without a cap the "
        "node may run to the end of the context (as vLLM) and kvgate reserves its pool's "
        "`default_max_tokens` (1,024).",
        "- Batch (one tenant, not streamed, retried until "
        f"{sc.drain_s:g} s after the last arrival): "
        + "; ".join(f"{b.count} documents of {b.prompt[0]:,}-{b.prompt[1]:,} tokens at t={b.at:g} s, "
                    f"outputs {b.output[0]}-{b.output[1]}" for b in sc.bursts)
        + f"; max_tokens {sc.batch_max_tokens}.",
        f"- Nodes: {NODES} simulated vLLM V1 nodes, each {node.kv_capacity_tokens:,} KV tokens in blocks of "
        f"{node.block_size}, max_model_len {node.max_model_len:,}, chunked prefill "
        f"{node.max_num_batched_tokens} tokens/step, prefill {node.prefill_tokens_per_s:,.0f} tok/s, decode "
        f"{node.decode_tokens_per_s:g} tok/s per sequence (+{node.batch_slowdown:.0%} per extra sequence). "
        f"Node {bg.node} holds {bg.tokens:,} tokens of background load (not admitted by any gateway) from "
        f"t={bg.start_s:g} s to t={bg.end_s:g} s"
        + (f", rising in {RAMP_STEPS} steps over {bg.ramp_s:g} s" if bg.ramp_s > 0 else "")
        + "; preemptions in parentheses are those seen while it rose and 3 s after.",
        "- kvgate (policies 2, 3, 5-8): the three nodes as backends, KV budget 0.9 x their reported "
        "capacity, adaptive scale on the fullest node (watermarks 0.70/0.85), classes `online` "
        f"(priority 10, may wait {ONLINE_WAIT_S:g} s unless the command gives `--online-wait`) and `batch` (priority -10, sheddable, may wait 10 s, "
        f"kv_watermark {BATCH_WATERMARK:g} unless the command gives `--batch-watermark`). Policies 5-8 add "
        "each node's `address` and the pool's `picking` section, "
        f"with `{PICKER_ENVOY.relative_to(ROOT)}` unless the command gives `--picker-envoy`.",
        "- Oracle (policy 4): knows each request's true output and each node's true KV; admits a "
        "request to the node with the most room once prompt + true output fits there (keeping room "
        f"for the background load from {ORACLE_LEAD_S:g} s before it comes, since it knows when); online first; "
        "never refuses. It lets a small request pass a large one that does not fit yet: it maximizes "
        "goodput, not tail latency (hence its TTFT p99). Routed through the same Envoy, by a header "
        "matched to one cluster per node. Policy 4b is the same oracle bound by the batch class's "
        "kv_watermark, as kvgate is (a document goes only where the node, everything counted, stays "
        "within it): the upper bound under the operator's class policy; 4 ignores that policy.",
        "- KV utilization: mean, over the samples taken while some arrived request was not running on a "
        "node, of the KV blocks requests held / the blocks the background load left them (three nodes). "
        "Goodput: prompt + "
        "completion tokens of completed requests per simulated second, until the last completion. "
        "TTFT from the first attempt (retries and queueing included); the 2 s share counts every "
        "online request, refused ones as misses.",
        "- Limits of this evidence: the nodes are simulated (vLLM V1's scheduling rules, speeds as "
        "parameters); each policy runs once in real time on a shared machine, so figures move between "
        "runs; the max_tokens mix is an assumption the trace cannot confirm.",
    ]


def pictures(runs: list[Run], sums: dict[str, Summary], out: Path) -> list[str]:
    """pictures draws the summary and each policy's timeline into ``out`` and returns their
    Markdown lines; a plot that fails is a line saying so, the table stays."""
    ran = [r for r in runs if r.skipped is None]
    lines: list[str] = []
    drawings: list[tuple[str, Callable[[Path], None]]] = [
        ("trace_summary.png", lambda p: plot_summary(runs, sums, p)),
        *((f"trace_{r.policy.key}.png", (lambda p, r=r: plot(r, p))) for r in ran)]
    for name, draw in drawings:
        try:
            draw(out / name)
            lines += [f"![{name}]({name})", ""]
        except Exception as exc:  # a plot failing must not lose the table
            lines += [f"(plot {name} failed: {exc})", ""]
    return lines


def verdicts(runs: list[Run], sums: dict[str, Summary]) -> list[str]:
    """verdicts compares each policy with issue 14's targets."""
    oracle = sums.get("oracle")
    out = []
    for run in runs:
        if run.skipped is not None:
            out.append(f"- {run.policy.title}: {run.skipped}.")
            continue
        s = sums[run.policy.key]
        total = sum(s.preemptions)
        share = s.goodput / oracle.goodput if oracle and oracle.goodput > 0 else None
        text = f"- {run.policy.title}: {total} preemptions ({s.at_arrival} as the background load arrived)"
        if share is not None and oracle is not None and run.policy.key != "oracle":
            text += (f", goodput {share:.0%} of the oracle's ({s.tokens / max(1, oracle.tokens):.0%} of its "
                     f"tokens, the last done at {s.span_s:.0f} s against its {oracle.span_s:.0f} s)")
        kept = sums.get("oracle-classes")
        if kept is not None and kept.goodput > 0 and not run.policy.key.startswith("oracle"):
            text += f", {s.goodput / kept.goodput:.0%} of the class-keeping oracle's"
        if run.policy.key in ("picker-learned", "picker-pooled"):
            met = total == 0 and share is not None and share >= 0.9
            text += f"; target (0 preemptions, >= 90% of the oracle) **{'met' if met else 'NOT met'}**"
        elif run.policy.key == "picker-worst":
            text += f"; target (0 preemptions) **{'met' if total == 0 else 'NOT met'}**"
        out.append(text + ".")
    return out


def dump_raw(run: Run, path: Path) -> None:
    """dump_raw writes a run's per-request results and timeline as JSON (for analysis and tests)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    requests = result_rows(run.results, "prompt_tokens", "output_tokens", "max_tokens", "true_output")
    path.write_bytes(orjson.dumps({"policy": run.policy.key, "preemptions": run.preemptions,
                                   "error": run.error, "skipped": run.skipped, "background": run.background,
                                   "requests": requests, "timeline": run.timeline}))
