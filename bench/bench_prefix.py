"""bench_prefix: a burst that shares one long system prompt, straight to a simulated node and
through Envoy + kvgate (prefix-blind, and counting a shared prefix once), side by side (issue 29).

Every row starts a fresh ``kvgate sim --enable-prefix-caching`` node of ``--kv-tokens`` KV
tokens and sends ``--requests`` streamed chats at once, each a system prompt of
``--prefix-tokens`` one-token words plus its own question of ``--question-tokens``, generating
exactly ``--max-tokens`` (the simulator's ``--output-lengths max``). In the *shared* burst every
request has the same system prompt; in the *unique* burst each has its own. Rows:

- ``direct``: straight to the node;
- ``kvgate-blind``: through the real Envoy (deploy/envoy-endpoint-picker.yaml) and kvgate
  picking over that one node, ``picking.shared_prefix: false``, a class that may wait;
- ``kvgate-prefix``: the same with ``picking.shared_prefix: true``.

Reported per row: completed/total, the burst's time (and its ratio to ``direct`` of the same
burst), the node's preemptions, its KV usage at most (sampled), its prefix-cache hit rate
(hits / queries, tokens), TTFT p50/p99; for kvgate rows what kvgate saw (sampled): its
requests in flight at most, shared-prefix tokens and expected tokens at most, headroom at least.
Times are simulated seconds (the node runs ``--speedup`` times faster than real time).

Trace mode (``--mode trace``; ``both``, the default, runs the burst and then it): a window of
the Mooncake conversation trace over three prefix-caching nodes, rows round robin, kvgate
prefix-blind, kvgate prefix-aware and an oracle that knows every node's cache
(``bench/prefix_trace.py``), written to ``--trace-out``; ``--sweep`` adds prefix-aware rows
over ``prefix_affinity`` and ``prefix_record_keys``.

    make bench-prefix                            # writes bench/results/local/prefix.md and prefix-trace.md
    python bench/bench_prefix.py --mode burst --out -          # the burst, printed only
    python bench/bench_prefix.py --mode trace --rows oracle --sweep --trace-out bench/results/prefix-sweep.md
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import orjson

from bench import prefix_trace
from extproc.config import PickingConfig
from kvgate_testkit import reports
from kvgate_testkit.nodes_stack import MODEL, NodesStack
from kvgate_testkit.procs import LOOPBACK, Proc, exit_on_sigterm, free_port
from kvgate_testkit.reports import machine, percentile, publish
from kvgate_testkit.revision import describe
from kvgate_testkit.sampling import readings
from sim.api import WORDS

ROOT = Path(__file__).resolve().parents[1]

# The issue's targets for the real engine (issue 29, Evidence): the shared burst through
# kvgate at most this many times the direct time, with no preemption.
TARGET_RATIO = 1.25
SAMPLE_S = 0.1  # real seconds between two samples of the node's and kvgate's /metrics
# The trace mode's window and scale (see bench/prefix_trace.py): what two shared cores drive.
TRACE = Path("..") / "shared" / "traces" / "mooncake-conversation-first30min.jsonl"
TRACE_SLICE = ROOT / "bench" / "traces" / "mooncake-conversation-slice.jsonl"
TRACE_START_S = 300.0
TRACE_WINDOW_S = 900.0
TRACE_SAMPLE = 6
TRACE_COMPRESS = 10.0
TRACE_SPEEDUP = 2.0
TRACE_KV_TOKENS = 196_608


@dataclass(frozen=True, slots=True)
class Row:
    """Row is one setup: the burst it sends (``shared`` system prompt or unique ones), and how:
    ``shared_prefix`` None straight to the node, else through Envoy + kvgate with that setting."""

    name: str
    shared: bool
    shared_prefix: bool | None

    @property
    def burst(self) -> str:
        return "shared" if self.shared else "unique"


ROWS = (Row("direct", True, None), Row("kvgate-blind", True, False), Row("kvgate-prefix", True, True),
        Row("direct", False, None), Row("kvgate-prefix", False, True))


def seeded_words(seed: int, count: int) -> str:
    """seeded_words is ``count`` words of the simulator's vocabulary (one cl100k token each,
    a leading space included) drawn from ``seed``: the same text for the same seed."""
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) for _ in range(count))


def burst_messages(shared: bool, n: int, prefix_tokens: int, question_tokens: int
                   ) -> list[list[dict[str, str]]]:
    """burst_messages is the chat messages of ``n`` requests: a system prompt of
    ``prefix_tokens`` words (one for all when ``shared``, else one per request) and a question
    of ``question_tokens`` words of each request's own."""
    return [[{"role": "system", "content": seeded_words(0 if shared else 1000 + i, prefix_tokens)},
             {"role": "user", "content": seeded_words(2000 + i, question_tokens)}] for i in range(n)]


def ratio(num: float | None, den: float | None) -> float | None:
    """ratio is num / den, None when either is unknown or den is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


@dataclass(slots=True)
class Result:
    """Result is what one row measured; times in simulated seconds, usage a ratio, tokens."""

    row: Row
    total: int
    completed: int = 0
    refused: int = 0
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    preemptions: float = 0.0
    kv_peak: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    prompt_tokens: int | None = None
    kvgate: dict[str, float] = field(default_factory=dict)  # kvgate's figures, sampled

    @property
    def hit_rate(self) -> float | None:
        return ratio(self.prefix_hits, self.prefix_queries)


def verdicts(results: Sequence[Result]) -> list[tuple[str, bool]]:
    """verdicts says, for each of the issue's targets, whether the run met it: the shared burst
    through kvgate-prefix at most ``TARGET_RATIO`` x direct with 0 preemptions (and every
    request completed); the unique burst through kvgate-prefix with 0 preemptions."""
    by = {(r.row.name, r.row.burst): r for r in results}
    out: list[tuple[str, bool]] = []
    shared, direct = by.get(("kvgate-prefix", "shared")), by.get(("direct", "shared"))
    if shared is not None and direct is not None:
        x = ratio(shared.seconds, direct.seconds)
        out.append((f"shared burst through kvgate-prefix <= {TARGET_RATIO}x direct "
                    f"({'n/a' if x is None else f'{x:.2f}x'})",
                    x is not None and x <= TARGET_RATIO and shared.completed == shared.total))
        out.append((f"shared burst through kvgate-prefix: 0 preemptions ({shared.preemptions:g})",
                    shared.preemptions == 0))
    unique = by.get(("kvgate-prefix", "unique"))
    if unique is not None:
        out.append((f"unique burst through kvgate-prefix: 0 preemptions ({unique.preemptions:g})",
                     unique.preemptions == 0 and unique.completed == unique.total))
    return out


def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def table(results: Sequence[Result]) -> list[str]:
    """table is the report's markdown table, one line per result; the ratio is to ``direct``
    of the same burst."""
    direct = {r.row.burst: r.seconds for r in results if r.row.shared_prefix is None}
    lines = ["| burst | row | completed | time (s) | x direct | preemptions | KV peak | "
             "prefix hit rate | TTFT p50 (s) | TTFT p99 (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r.row.burst} | {r.row.name} | {r.completed}/{r.total} | {r.seconds:.1f} | "
            f"{_num(ratio(r.seconds, direct.get(r.row.burst)), '.2f')} | {r.preemptions:g} | "
            f"{r.kv_peak:.2f} | {_num(r.hit_rate, '.2f')} | {_num(percentile(r.ttfts, 0.5), '.2f')} | "
            f"{_num(percentile(r.ttfts, 0.99), '.2f')} |")
    return lines


def kvgate_table(results: Sequence[Result]) -> list[str]:
    """kvgate_table is what kvgate's /metrics showed during its rows (sampled)."""
    lines = ["| burst | row | kvgate in flight, at most | shared-prefix tokens, at most | "
             "expected tokens, at most | headroom tokens, at least |", "|---|---|---:|---:|---:|---:|"]
    for r in results:
        if r.kvgate:
            k = r.kvgate
            lines.append(f"| {r.row.burst} | {r.row.name} | {k['inflight']:g} | {k['shared']:g} | "
                         f"{k['expected']:g} | {k['headroom']:g} |")
    return lines


# --- running a row ----------------------------------------------------------------------

def node_args(args: argparse.Namespace) -> list[str]:
    """node_args is the simulator's options common to every row (NodesStack adds the rest)."""
    return ["--enable-prefix-caching", "--block-size", str(args.block_size),
            "--speedup", str(args.speedup), "--stream-interval", "8", "--log-level", "WARNING"]


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url) as resp:
        return readings(await resp.text())


async def one(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
              max_tokens: int, speedup: float, r: Result) -> None:
    """one sends a streamed chat as openai-python would (two retries of a 429/503, honouring
    retry-after); records its TTFT (simulated s, from the first attempt) when it completes."""
    body = orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                         "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.monotonic()
    for attempt in range(3):
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            if resp.status in (429, 503) and attempt < 2:
                await asyncio.sleep(float(resp.headers.get("retry-after", "0.5")))
                continue
            if resp.status != 200:
                r.refused += 1
                return
            first: float | None = None
            usage: dict[str, int] | None = None
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                    first = time.monotonic() - t0
                usage = chunk.get("usage") or usage
            if first is not None and usage is not None and usage.get("completion_tokens") == max_tokens:
                r.completed += 1
                r.ttfts.append(first * speedup)
                r.prompt_tokens = usage.get("prompt_tokens")
            else:
                r.refused += 1
            return


async def drive(row: Row, args: argparse.Namespace, node_url: str, send_url: str,
                admin_url: str | None) -> Result:
    """drive sends the row's burst to ``send_url`` while sampling the node (and kvgate at
    ``admin_url``); returns what it measured."""
    r = Result(row, args.requests)
    burst = burst_messages(row.shared, args.requests, args.prefix_tokens, args.question_tokens)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        before = await scrape(session, f"{node_url}/metrics")
        seen = {"inflight": 0.0, "shared": 0.0, "expected": 0.0, "headroom": math.inf}
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                node = await scrape(session, f"{node_url}/metrics")
                r.kv_peak = max(r.kv_peak, node.get("vllm:kv_cache_usage_perc", 0.0))
                if admin_url is not None:
                    k = await scrape(session, f"{admin_url}/metrics")
                    seen["inflight"] = max(seen["inflight"], k.get("kvgate_inflight_requests", 0.0))
                    seen["shared"] = max(seen["shared"], k.get("kvgate_backend_kv_shared_prefix_tokens", 0.0))
                    seen["expected"] = max(seen["expected"], k.get("kvgate_backend_kv_expected_tokens", 0.0))
                    seen["headroom"] = min(seen["headroom"], k.get("kvgate_backend_kv_headroom_tokens", math.inf))
                await asyncio.sleep(SAMPLE_S)

        sampler = asyncio.create_task(sample())
        t0 = time.monotonic()
        await asyncio.gather(*(one(session, f"{send_url}/v1/chat/completions", m, args.max_tokens,
                                   args.speedup, r) for m in burst))
        r.seconds = (time.monotonic() - t0) * args.speedup
        done.set()
        await sampler
        after = await scrape(session, f"{node_url}/metrics")
    r.preemptions = after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"]
    r.prefix_queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    r.prefix_hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    if admin_url is not None:
        r.kvgate = seen
    return r


def run_row(row: Row, args: argparse.Namespace) -> Result:
    """run_row starts the row's fresh node (and Envoy + kvgate), sends its burst, stops them."""
    with tempfile.TemporaryDirectory() as tmp:
        if row.shared_prefix is None:
            port = free_port()
            node = Proc([sys.executable, "-m", "sim", "--listen", f"{LOOPBACK}:{port}", "--model", MODEL,
                         "--max-model-len", "32768", "--kv-capacity-tokens", str(args.kv_tokens),
                         *node_args(args)], Path(tmp) / "node.log")
            try:
                node.wait_port(port)
                url = f"http://{LOOPBACK}:{port}"
                return asyncio.run(drive(row, args, url, url, None))
            finally:
                node.stop()
        stack = NodesStack(Path(tmp), nodes=1, kv_capacity_tokens=args.kv_tokens, sim_args=node_args(args),
                           pool={"picking": {"shared_prefix": row.shared_prefix}},
                           config={"tenants": {"classes": {"standard": {"max_wait_s": args.max_wait}}}})
        stack.start()
        try:
            deadline = time.monotonic() + 10
            while stack.metric("kvgate_backend_pickable") < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("kvgate never saw the node")
                time.sleep(0.1)
            return asyncio.run(drive(row, args, stack.node_url(0), stack.base_url, stack.admin_url))
        finally:
            stack.stop()


def report(results: Sequence[Result], args: argparse.Namespace, command: str, wall_s: float) -> str:
    """report is the markdown report of a run."""
    prompt = next((r.prompt_tokens for r in results if r.prompt_tokens), None)
    lines = [
        "# A burst sharing one long system prompt, direct and through kvgate (bench/bench_prefix.py)", "",
        f"Command: `{command}` (`make bench-prefix`). Revision {describe()}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}, shared with other work; "
        f"the run took {wall_s:.0f} s.", "",
        f"Each row: a fresh `kvgate sim --enable-prefix-caching` node of {args.kv_tokens} KV tokens "
        f"(blocks of {args.block_size}, speedup {args.speedup:g}: times are simulated seconds), "
        f"{args.requests} streamed chats at once, each a {args.prefix_tokens}-word system prompt "
        f"(the same for all in the *shared* burst, its own in the *unique* one) and its own "
        f"{args.question_tokens}-word question ({prompt if prompt else 'n/a'} prompt tokens after the "
        f"chat template), generating exactly {args.max_tokens} tokens. kvgate rows: the real Envoy "
        "(deploy/envoy-endpoint-picker.yaml) and kvgate picking over that one node (its defaults: "
        f"worst-case growth until 20 requests settled, reserve 0.02), class `standard` waiting up to "
        f"{args.max_wait:g} real s; the client retries a 429/503 twice, as openai-python does. "
        "Completed: every token generated. KV peak: the node's `vllm:kv_cache_usage_perc` at most, "
        f"sampled every {SAMPLE_S:g} real s; hit rate: `vllm:prefix_cache_hits_total` / "
        "`vllm:prefix_cache_queries_total` over the burst.", "",
        *table(results), "",
        "What kvgate's /metrics showed during its rows (sampled, the node's series):", "",
        *kvgate_table(results), "",
        "Targets (issue 29, for the real engine, checked here on the simulator):", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in verdicts(results)]
    return "\n".join(lines)


def run_trace(args: argparse.Namespace, command: str) -> str:
    """run_trace replays the Mooncake window row by row (``prefix_trace``) and returns its report."""
    trace = Path(args.trace) if Path(args.trace).is_absolute() else ROOT / args.trace
    if not trace.exists():
        raise SystemExit(f"no trace at {args.trace} (relative to the repository); pass --trace "
                         f"{TRACE_SLICE.relative_to(ROOT)} for the committed slice of the default window")
    w = prefix_trace.Window(args.trace_start, args.trace_window, args.trace_sample, args.trace_compress)
    replay = prefix_trace.build_replay(prefix_trace.read_mooncake(trace, w.start_s, w.window_s), w)
    if not replay.reqs:
        raise SystemExit(f"no request of {trace} in trace seconds {w.start_s:g}-{w.start_s + w.window_s:g}")
    main_rows = prefix_trace.main_rows(args.affinity, args.record)
    keys = [k for k in args.rows.split(",") if k] if args.rows else [r.key for r in main_rows]
    rows = [r for r in main_rows if r.key in keys]
    sweep = prefix_trace.sweep_rows(args.sweep_affinity, args.sweep_record, args.affinity, args.record) \
        if args.sweep else []
    started, rev = time.monotonic(), describe()
    done: list[prefix_trace.RowResult] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-prefix-") as tmp:
        for i, row in enumerate([*rows, *sweep]):
            label = f"{i + 1}/{len(rows) + len(sweep)} {row.key}"
            print(f"- {label}: {len(replay.reqs)} requests", flush=True)
            r = prefix_trace.run_row(row, replay, w, args.trace_kv_tokens, args.trace_speedup, Path(tmp) / row.key,
                                     label)
            f = prefix_trace.figures(r)
            print(f"  [{label}] {r.wall_s:.0f} s: completed {f.completed}/{f.total}, goodput {f.goodput:,.0f} tok/s, "
                  f"TTFT p50 {_num(f.ttft_p50, '.2f')} s, preemptions {f.preemptions}, hit rate "
                  f"{_num(f.hit_rate, '.2f')}" + (f"  ERROR: {r.error}" if r.error else ""), flush=True)
            done.append(r)
    made = " (`make bench-prefix`)" if args.mode == "both" and not args.sweep else ""
    head = (f"Command: `{{command}}`{made}. Revision {rev} when it started, "
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}, shared with other work; the replay took "
            f"{time.monotonic() - started:.0f} s.")
    setup = prefix_trace.describe(w, replay, trace, args.trace_kv_tokens, args.trace_speedup)
    return prefix_trace.report(done[:len(rows)], done[len(rows):], setup, command, head, args.affinity, args.record)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("burst", "trace", "both"), default="both",
                    help="the burst, the Mooncake trace replay, or both (default)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prefix-tokens", type=int, default=10_000, help="system prompt, words (tokens)")
    ap.add_argument("--question-tokens", type=int, default=200, help="each request's question, words")
    ap.add_argument("--max-tokens", type=int, default=800, help="tokens each request generates")
    ap.add_argument("--kv-tokens", type=int, default=32_768, help="the node's KV cache (tokens)")
    ap.add_argument("--block-size", type=int, default=16, help="the node's KV block (tokens)")
    ap.add_argument("--speedup", type=float, default=10.0, help="simulated seconds per real second")
    ap.add_argument("--max-wait", type=float, default=30.0, help="kvgate class max_wait_s (real s)")
    ap.add_argument("--timeout", type=float, default=120.0, help="a request's limit (real s)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "local" / "prefix.md"),
                    help="the burst's results file ('-': print only)")
    t = ap.add_argument_group("trace mode")
    t.add_argument("--trace", default=str(TRACE), help=f"a Mooncake trace (default {TRACE}, from the repository)")
    t.add_argument("--trace-start", type=float, default=TRACE_START_S, help="window start, trace seconds")
    t.add_argument("--trace-window", type=float, default=TRACE_WINDOW_S, help="window length, trace seconds")
    t.add_argument("--trace-sample", type=int, default=TRACE_SAMPLE, help="keep 1 conversation in N")
    t.add_argument("--trace-compress", type=float, default=TRACE_COMPRESS, help="trace seconds per simulated second")
    t.add_argument("--trace-speedup", type=float, default=TRACE_SPEEDUP, help="simulated seconds per real second")
    t.add_argument("--trace-kv-tokens", type=int, default=TRACE_KV_TOKENS, help="each node's KV cache (tokens)")
    t.add_argument("--rows", default="", help="comma-separated subset of round-robin, kvgate-blind, kvgate-prefix, "
                                              "oracle (default: all)")
    t.add_argument("--affinity", type=float, default=PickingConfig().prefix_affinity,
                   help="kvgate-prefix's prefix_affinity (default: kvgate's)")
    t.add_argument("--record", type=int, default=PickingConfig().prefix_record_keys,
                   help="kvgate-prefix's prefix_record_keys (default: kvgate's)")
    t.add_argument("--sweep", action="store_true", help="add prefix-aware rows over --sweep-affinity and --sweep-record")
    t.add_argument("--sweep-affinity", type=lambda v: [float(x) for x in v.split(",")], default=[0, 0.5, 1, 2, 4])
    t.add_argument("--sweep-record", type=lambda v: [int(x) for x in v.split(",")], default=[0, 256, 1024, 8192])
    t.add_argument("--trace-out", default=str(ROOT / "bench" / "results" / "local" / "prefix-trace.md"),
                   help="the trace replay's results file ('-': print only)")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    command = reports.command("bench/bench_prefix.py", ap, args)
    if args.mode in ("burst", "both"):
        started = time.monotonic()
        results = []
        for row in ROWS:
            r = run_row(row, args)
            print(f"{row.burst} {row.name}: {r.completed}/{r.total} in {r.seconds:.1f} s, preemptions "
                  f"{r.preemptions:g}, KV peak {r.kv_peak:.2f}, hit rate {_num(r.hit_rate, '.2f')}", flush=True)
            results.append(r)
        text = report(results, args, command, time.monotonic() - started)
        if args.out == "-":
            print(text)
        else:
            publish(Path(args.out), text)
    if args.mode in ("trace", "both"):
        text = run_trace(args, command)
        if args.trace_out == "-":
            print(text)
        else:
            publish(Path(args.trace_out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
