"""bench_trace: a window of Azure's 2023 conversation trace replayed over three simulated nodes, policy by policy.

Real chat traffic stops long before ``max_tokens``, is spread over several nodes, and
shares them with load the gateway never saw. This benchmark replays that: a window of
the conversation trace (arrival instants, prompt and output tokens), time-compressed to
load the pool, goes through the real Envoy to three simulated vLLM nodes (``sim``), one
of which carries background KV load kvgate did not admit for part of the run. Every
policy gets the same requests, in one run:

1. ``none``:        no admission control, Envoy round robin;
2. ``pool-rr``:     kvgate at the pool level (one KV budget for the three nodes), Envoy round robin;
3. ``pool-lr``:     the same kvgate, Envoy least-request;
4. ``oracle``:      the upper bound: the benchmark knows each request's true output length and
                    each node's true KV (background included) and sends a request, through
                    Envoy, to the node with the most room as soon as its final size fits there;
   ``oracle-classes``: the same bound under the class policy kvgate is given: a batch
                    document goes only where the node stays within the class's kv_watermark;
5. ``picker-worst``: kvgate picking the node (``picking: {growth: worst_case}``);
6. ``picker-learned``: kvgate picking the node where other load shares the nodes
   (``picking: {growth: learned, quantile: 0.9, reserve_fraction: 0.1}``), the recommended
   setting with the Redis store (which refuses pooled growth);
7. ``picker-pooled``: the same with the quantile of each node's summed growth
   (``growth: pooled``), the recommended setting for one replica;
8. ``picker-thin``: learned growth with the default reserve (0.02): what the reserve buys.

Policies 5-8 need ``deploy/envoy-endpoint-picker.yaml`` (kvgate's endpoint picking) and
are skipped, with a line saying so, while that file is missing.

Prompts are built to the trace's exact token counts (one cl100k token per word plus the
chat template's 7 tokens, as kvgate and the node count them); the output length reaches
the node in the header ``x-sim-output-tokens`` (the node stops there, ``finish_reason:
"stop"``); kvgate never reads it. Clients set ``max_tokens`` by a stated mix (1,024,
4,096 or none). Online chats are spread over several tenants and streamed; a batch
tenant sends long documents in bursts. Reported per policy: preemptions per node and in
total, KV utilization while demand was unserved, goodput and its share of the oracle's,
online TTFT p50/p99 and the share of online requests with a first token within 2 s,
refusals per class. Writes ``bench/results/trace.md``.

    python bench/bench_trace.py [--trace ../shared/traces/azure-conv-2023.csv] [--tiny]
                                [--policies none,oracle] [--speedup 3] [--seed 1] [--raw DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.trace_policies import (BATCH_WATERMARK, ONLINE_WAIT_S, ORACLE_LEAD_S, PICKER_ENVOY, POLICIES,
                                  Oracle, Policy, api_key, envoy_for, kvgate_config)
from bench.trace_report import Run, dump_raw, report, summarize
from bench.trace_workload import (DEFAULT_TRACE, FULL, NODE, NODES, TINY, TRACE_SLICE, Background, Req, Scenario,
                                  build_requests, read_trace)
from kvgate_testkit import load
from kvgate_testkit import reports
from kvgate_testkit.load import Placer, Result, replay, session
from kvgate_testkit.nodes_stack import Node
from kvgate_testkit.procs import LOOPBACK, Procs, exit_on_sigterm, failure, free_port, print_tails
from kvgate_testkit.reports import cell, chosen
from kvgate_testkit.sampling import node_state, preemptions as read_preemptions, readings, scraped, wait_fresh
from sim.api import OUTPUT_TOKENS_HEADER

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"


# --- one run ----------------------------------------------------------------------------------

class Client(load.Client):
    """Client replays the requests through Envoy; each request names its tenant by its API key
    and tells the node its true output length (``x-sim-output-tokens``)."""

    def headers(self, req: Req) -> dict[str, str]:
        return {"content-type": "application/json", "authorization": f"Bearer {api_key(req.tenant)}",
                OUTPUT_TOKENS_HEADER: str(req.output_tokens)}


_GAUGES = {"kvgate_inflight_requests", "kvgate_kv_inflight_tokens", "kvgate_kv_budget_tokens",
           "kvgate_admission_scale", "kvgate_pool_alarm"}
# The picker's per-node readings (issue 13's contract), kept per backend label; kvgate's
# decisions per class and outcome (which class a tenant's requests landed in).
_LABELLED = {**dict.fromkeys(("kvgate_backend_kv_inflight_tokens", "kvgate_backend_kv_expected_tokens",
                              "kvgate_backend_kv_foreign_tokens", "kvgate_backend_kv_headroom_tokens",
                              "kvgate_backend_picks_total"), ("backend",)),
             "kvgate_requests_total": ("class", "outcome")}


def parse_kvgate_metrics(text: str) -> dict[str, float]:
    """parse_kvgate_metrics sums kvgate's pool gauges over labels and keeps the per-backend
    series as ``name/backend`` entries, its decisions as ``name/class/outcome`` (those seen)."""
    return {k: v for k, v in readings(text, _GAUGES, _LABELLED).items()
            if v or not k.startswith("kvgate_requests_total/")}


async def sample(session: aiohttp.ClientSession, client: Client, sim_urls: Sequence[str],
                  admin_url: str | None, timeline: list[dict[str, Any]], period_s: float,
                  oracle: Placer | None) -> None:
    """sample records every node's state, the client's open requests and kvgate's gauges every ``period_s`` real s."""
    while True:
        row: dict[str, Any] = {"t": client.sim_now(), "open_online": client.open["online"],
                               "open_batch": client.open["batch"], "refused_online": client.refusals["online"],
                               "refused_batch": client.refusals["batch"], "nodes": []}
        try:
            for url in sim_urls:
                st = await node_state(session, url)
                row["nodes"].append({k: st[k] for k in ("used_blocks", "total_blocks", "background_blocks",
                                                        "running", "waiting", "preemptions")})
            if admin_url is not None:
                async with session.get(f"{admin_url}/metrics") as resp:
                    row["kvgate"] = parse_kvgate_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
            pass  # a missed sample is a gap in the timeline, nothing more
        if len(row["nodes"]) == len(sim_urls):
            timeline.append(row)
        if oracle is not None:
            oracle.tick()
        await asyncio.sleep(period_s)


async def apply_background(session: aiohttp.ClientSession, client: Client, sim_urls: Sequence[str],
                      bg: Background, applied: list[tuple[float, int]]) -> None:
    """apply_background puts the unadmitted load on its node for its window, then takes it away;
    ``applied`` gets (simulated s, tokens) as the node confirms each setting."""
    url = f"{sim_urls[bg.node]}/sim/config"
    for at, tokens in bg.steps():
        await asyncio.sleep(max(0.0, (at - client.sim_now()) / client.speedup))
        async with session.post(url, data=orjson.dumps({"background_kv_tokens": tokens})) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the node refused its background load: {await resp.text()}")
            applied.append((client.sim_now(), (await resp.json(loads=orjson.loads))["background_kv_tokens"]))


async def drive(run: Run, reqs: list[Req], sc: Scenario, speedup: float, envoy_port: int,
                sim_urls: Sequence[str], admin_url: str | None, label: str, node: Node,
                batch_watermark: float = BATCH_WATERMARK, placer: Placer | None = None) -> None:
    """drive sends the requests, places the background load and samples until every request has
    ended; ``batch_watermark`` is what an oracle that keeps the classes gives the batch class.
    ``placer``: another benchmark's oracle, used instead of this one's."""
    t0 = time.monotonic() + 0.2
    client = Client(f"http://{LOOPBACK}:{envoy_port}/v1/chat/completions", speedup, t0,
                    t0 + (sc.duration_s + sc.drain_s) / speedup, placer)
    if placer is None and run.policy.balance == "oracle":
        client.oracle = Oracle(node, len(sim_urls), sc.background, lead_s=ORACLE_LEAD_S, now=client.sim_now,
                               watermarks={"batch": batch_watermark} if run.policy.keeps_classes else None)
    run.results = [Result(r) for r in reqs]
    async with session() as s:
        run.error = await replay([client.send(s, r) for r in run.results],
                                 (sc.duration_s + sc.drain_s) / speedup + 60.0,
                                 [sample(s, client, sim_urls, admin_url, run.timeline, 0.5 / speedup, client.oracle),
                                  apply_background(s, client, sim_urls, sc.background, run.background)])
        run.preemptions = await read_preemptions(s, sim_urls)
    close_results(run, label)


def close_results(run: Run, label: str) -> None:
    """close_results counts a run's unfinished requests as errors and prints how many completed."""
    load.close_results(run.results, label)


def skip_reason(policy: Policy) -> str | None:
    """skip_reason says why a policy cannot run on this checkout, or None."""
    if policy.balance == "picker" and not PICKER_ENVOY.exists():
        return (f"skipped: {PICKER_ENVOY.relative_to(ROOT)} is missing (kvgate's endpoint picking, "
                "issue 13, has not landed on this branch)")
    return None


def wait_signals(admin_url: str, timeout: float = 10.0) -> None:
    """wait_signals waits until kvgate has scraped the nodes, so a run does not start while
    kvgate still counts them as stale."""
    wait_fresh(admin_url, scraped, timeout)


def run_policy(policy: Policy, reqs: list[Req], sc: Scenario, node: Node, speedup: float, seed: int,
               workdir: Path, label: str, picker_envoy: Path = PICKER_ENVOY,
               batch_watermark: float = BATCH_WATERMARK, online_wait_s: float = ONLINE_WAIT_S) -> Run:
    """run_policy starts three fresh nodes (+ kvgate) + Envoy, replays the requests, stops them;
    the picking policies run behind ``picker_envoy``."""
    run = Run(policy)
    run.skipped = skip_reason(policy)
    if run.skipped is not None:
        return run
    started = time.monotonic()
    with Procs(workdir) as procs:
        try:
            sim_ports = [free_port() for _ in range(NODES)]
            # No cap from the node itself: a request without max_tokens may run to the end of
            # the context, as on vLLM.
            sims = [procs.start(f"sim-{i}", [*node.argv(port, speedup, seed + i, "preempt"),
                                             "--default-max-tokens", str(node.max_model_len)])
                    for i, port in enumerate(sim_ports)]
            for sim, port in zip(sims, sim_ports):
                sim.wait_port(port)
            kv = None
            if policy.kvgate is not None:
                kv = procs.kvgate(kvgate_config(policy, sc, speedup, sim_ports, node, batch_watermark,
                                                online_wait_s))
                wait_signals(kv.admin_url)
            envoy_port = free_port()
            procs.envoy(envoy_for(policy, listen=envoy_port, grpc=None if kv is None else kv.grpc_port,
                                  sim_ports=sim_ports, picker_template=picker_envoy), envoy_port)
            asyncio.run(drive(run, reqs, sc, speedup, envoy_port, [f"http://{LOOPBACK}:{p}" for p in sim_ports],
                              None if kv is None else kv.admin_url, label, node, batch_watermark))
            run.error = ((run.error or "") + procs.died()) or None
        except Exception as exc:  # one policy failing must not lose the others' results
            run.error = failure(exc)
    run.wall_s = time.monotonic() - started
    return run


def main(argv: list[str] | None = None) -> int:
    """main runs the chosen policies in turn and writes the report; returns 1 if a run failed."""
    ap = parser()
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    policies = chosen_policies(ap, args)
    sc = TINY if args.tiny else FULL
    if args.compress is not None:
        if not 0 < args.compress <= 100:
            ap.error("--compress must be in (0, 100]")
        sc = Scenario(**{**{f: getattr(sc, f) for f in Scenario.__slots__}, "compress": args.compress})
    trace = args.trace if args.trace.is_absolute() else (ROOT / args.trace)
    if not trace.exists():
        ap.error(f"no trace at {args.trace} (relative to the repository); pass --trace "
                 f"{TRACE_SLICE.relative_to(ROOT)} for the committed slice")
    try:
        rows = read_trace(trace, sc.start_s, sc.window_s)
    except (OSError, ValueError) as exc:
        ap.error(str(exc))
    if not rows:
        ap.error(f"the trace has no request in trace seconds {sc.start_s:g}-{sc.start_s + sc.window_s:g}")
    reqs = build_requests(rows, sc, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"trace benchmark: scenario {sc.name} ({len(reqs)} requests, {sc.duration_s:.1f} s simulated), "
          f"speedup {args.speedup:g}x, policies {', '.join(p.key for p in policies)}", flush=True)
    started = time.monotonic()
    runs = run_policies(policies, reqs, sc, args)
    command = reports.command("bench/bench_trace.py", ap, args)
    for line in report(runs, sc, NODE, args.trace, len(rows), reqs, args.speedup, args.seed,
                       time.monotonic() - started, args.out, command):
        print(line)
    print(f"report: {args.out / 'trace.md'}")
    return 1 if any(r.error for r in runs) else 0


def parser() -> argparse.ArgumentParser:
    """parser is the command line of bench_trace."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help="the trace CSV (arrived_at,num_prefill_tokens,num_decode_tokens); default "
                         f"{DEFAULT_TRACE}, relative to the repository; {TRACE_SLICE.relative_to(ROOT)} "
                         "holds the default window")
    ap.add_argument("--tiny", action="store_true", help="10 trace seconds, a few real seconds per policy (smoke test)")
    ap.add_argument("--policies", default=",".join(p.key for p in POLICIES),
                    help="comma-separated subset of: " + ", ".join(p.key for p in POLICIES))
    ap.add_argument("--speedup", type=float, default=3.0, help="simulated seconds per real second")
    ap.add_argument("--compress", type=float, default=None,
                    help="trace seconds per simulated second (default: the scenario's)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reserve", type=float, default=None,
                    help="override every picking policy's reserve_fraction (to weigh the reserve's cost)")
    ap.add_argument("--picker-envoy", type=Path, default=PICKER_ENVOY,
                    help="the Envoy file of the picking policies (e.g. deploy/envoy-endpoint-picker-log.yaml)")
    ap.add_argument("--batch-watermark", type=float, default=BATCH_WATERMARK,
                    help="the batch class's kv_watermark (what it costs the documents' goodput)")
    ap.add_argument("--online-wait", type=float, default=ONLINE_WAIT_S,
                    help="simulated seconds kvgate lets an online chat wait for room before its 429 "
                         "(the oracle never refuses)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where trace.md goes")
    ap.add_argument("--raw", type=Path, default=None,
                    help="also write each policy's requests and timeline as JSON to this folder")
    return ap


def chosen_policies(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[Policy]:
    """chosen_policies is ``--policies`` in its order, each picking policy with ``--reserve``'s
    reserve when given; a bad option ends the command with its message."""
    policies = chosen(ap, args.policies, {p.key: p for p in POLICIES}, "policies")
    if not 0 < args.speedup <= 100:
        ap.error("--speedup must be in (0, 100]")
    if not 0 < args.online_wait <= 60:
        ap.error("--online-wait must be in (0, 60]")
    if args.reserve is not None:
        if not 0 <= args.reserve <= 0.5:
            ap.error("--reserve must be in [0, 0.5]")
        policies = [p if p.picking is None else Policy(p.key, f"{p.title} (reserve {args.reserve:g} by --reserve)",
                                                       p.balance, p.kvgate,
                                                       {**p.picking, "reserve_fraction": args.reserve})
                    for p in policies]
    return policies


def run_policies(policies: list[Policy], reqs: list[Req], sc: Scenario, args: argparse.Namespace) -> list[Run]:
    """run_policies runs each policy in turn on fresh processes, printing a line for each (and,
    when one failed, its processes' log tails), and writes each run's raw JSON under ``--raw``."""
    runs = []
    picker_envoy = args.picker_envoy if args.picker_envoy.is_absolute() else ROOT / args.picker_envoy
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-trace-") as tmp:
        for i, policy in enumerate(policies):
            key = policy.key
            label = f"{i + 1}/{len(policies)} {key}"
            print(f"- {policy.title}", flush=True)
            run = run_policy(policy, reqs, sc, NODE, args.speedup, args.seed, Path(tmp) / key, label,
                             picker_envoy, args.batch_watermark, args.online_wait)
            if run.skipped is not None:
                print(f"  [{label}] {run.skipped}", flush=True)
            else:
                s = summarize(run, sc.background)
                print(f"  [{label}] {run.wall_s:.0f} s: preemptions {list(s.preemptions)}, online ok "
                      f"{s.by_class['online']['ok']}/{s.by_class['online']['n']}, batch ok "
                      f"{s.by_class['batch']['ok']}/{s.by_class['batch']['n']}, TTFT p99 {cell(s.ttft_p99)} s, "
                      f"goodput {s.goodput:,.0f} tok/s" + (f"  ERROR: {run.error}" if run.error else ""),
                      flush=True)
                if run.error:
                    print_tails(Path(tmp) / key)
            runs.append(run)
            if args.raw is not None:
                dump_raw(run, args.raw / f"trace_{key}.json")
    return runs


if __name__ == "__main__":
    sys.exit(main())
