"""bench_overhead: the latency kvgate adds to a request through Envoy, against two baselines.

One run starts three Envoys (deploy/envoy.yaml, one worker thread each) in front of
identical fake upstreams:

- ``plain``: no ext_proc filter;
- ``bare``: ext_proc to a Python processor that answers CONTINUE to every message and
  parses nothing: the floor of any Python processor (same grpc.aio, same event loop);
- ``kvgate``: ext_proc to kvgate (parsing, token counting, admission, usage tracking).

and measures each with the same load, in interleaved rounds so that drift on a shared
machine hits all three alike. The generator's own cost is measured too (``direct``:
straight to an upstream). Reported: p50/p99 latency per setup, and the latency each
processor adds over plain Envoy; the goal is kvgate's added p50 within 1.3x of the bare
processor's.

Scenarios are entries of ``SCENARIOS``: add one (streaming, max rate, release latency)
by writing a coroutine that returns per-request latencies in seconds.

    python bench/bench_overhead.py [--requests 2000] [--rounds 5] [--concurrency 16]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from the repository root
    sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import aiohttp  # noqa: E402
import orjson  # noqa: E402

from tests.e2e.stack import Stack  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGET_RATIO = 1.3
SETUPS = ("plain", "bare", "kvgate")

BENCH_CONFIG: dict[str, Any] = {
    # Limits far above the load: the benchmark measures the path, not refusals.
    "pools": {"default": {"max_concurrency": 100000, "tpm": 10**12, "context_window": 32768,
                          "default_max_tokens": 1024, "tokenizer": "cl100k_base"}},
    "limits": {"max_body_bytes": 1048576},
    "server": {"drain_s": 0, "grace_s": 1},
}


# --- the bare processor -------------------------------------------------------------------

async def _serve_bare(port: int) -> None:
    """_serve_bare answers CONTINUE to every ext_proc message, reading nothing else."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    answers = {
        "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
        "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
        "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
        "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
    }

    class Bare(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator: Any, context: Any) -> None:  # noqa: N802
            read, write, eof = context.read, context.write, grpc.aio.EOF
            while True:
                req = await read()
                if req is eof:
                    return
                await write(answers[req.WhichOneof("request")])

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(Bare(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


# --- load ------------------------------------------------------------------------------------

# Words of ordinary English prose, so that tokenizing costs what it costs on real prompts.
_WORDS = ("the a of to and in is that for it as was with be by on not he this are or his from at "
          "which but have an they you were her she there been one all we can their has would when "
          "model request token cache memory budget tenant prompt answer stream server node latency "
          "throughput window context completion reserve refund admission gateway envoy processor "
          "explicit implicit beautiful ugly simple complex nested sparse readability practicality "
          "purity errors silently ambiguity temptation obvious implementation namespaces honking "
          "quickly slowly carefully yesterday tomorrow whenever because although therefore however "
          "measured predicted allocated released scheduled preempted swapped evicted admitted").split()


class ChatBodies:
    """ChatBodies makes non-streaming chat requests of about ``size`` bytes, each one unique.

    Every body starts with a fresh counter, so no cache of prompt counts can serve it:
    kvgate tokenizes every request as it would in production.
    """

    def __init__(self, size: int, variants: int = 64, seed: int = 7) -> None:
        rng = random.Random(seed)
        self._texts = []
        for _ in range(variants):
            words: list[str] = []
            while sum(len(w) + 1 for w in words) < size - 180:
                words.append(rng.choice(_WORDS))
            self._texts.append(" ".join(words))
        self._n = 0

    def __call__(self) -> bytes:
        self._n += 1
        text = self._texts[self._n % len(self._texts)]
        return orjson.dumps({"model": "fake", "max_tokens": 16, "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Request {self._n}. {text}"}]})


async def closed_loop(url: str, make_body: Callable[[], bytes], concurrency: int,
                      total: int) -> list[float]:
    """closed_loop sends ``total`` POSTs from ``concurrency`` keep-alive clients, each
    waiting for its answer before the next; returns latencies in seconds."""
    latencies: list[float] = []
    remaining = total
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                body = make_body()
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{url}: status {resp.status}")
                latencies.append(time.perf_counter() - t0)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


@dataclass
class Scenario:
    """Scenario is one load shape: a name, a description and how to run it against a URL."""

    name: str
    description: str
    run: Callable[[str, argparse.Namespace], Awaitable[list[float]]]


def _chat_2k(base: str, args: argparse.Namespace) -> Awaitable[list[float]]:
    return closed_loop(f"{base}/v1/chat/completions", args.chat_bodies, args.concurrency,
                       args.requests)


def _chat_2k_repeated(base: str, args: argparse.Namespace) -> Awaitable[list[float]]:
    body = args.chat_bodies()
    return closed_loop(f"{base}/v1/chat/completions", lambda: body, args.concurrency,
                       args.requests)


SCENARIOS = {
    "chat_2k": Scenario("chat_2k", "non-streaming chat, ~2 KB body, every body different "
                        "(each one tokenized)", _chat_2k),
    "chat_2k_repeated": Scenario("chat_2k_repeated", "the same ~2 KB chat again and again (prompt "
                                 "counts served by the tokenizer's cache, as for a repeated "
                                 "system prompt or chat history)", _chat_2k_repeated),
}


# --- report ----------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    """pct is the q-quantile (0..1) of ``values`` by nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def cpu_seconds(pid: int) -> float:
    """cpu_seconds is the user + system CPU time a process has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pids(stack: Stack | None) -> dict[str, int]:
    if stack is None:
        return {}
    return {role: stack.procs[name].pid for role, name in
            (("processor", "kvgate"), ("processor", "processor"), ("envoy", "envoy"),
             ("upstream", "upstream")) if name in stack.procs}


@dataclass
class Result:
    """Result holds one scenario's latencies (seconds) and CPU seconds per process, per setup."""

    scenario: str
    latencies: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)

    def cpu_us(self, setup: str, role: str) -> float | None:
        """cpu_us is the CPU one process of a setup used per request (microseconds)."""
        used = self.cpu.get(setup, {}).get(role)
        return None if used is None else used / len(self.latencies[setup]) * 1e6

    def p(self, setup: str, q: float) -> float:
        return pct(self.latencies[setup], q) * 1000.0

    def added(self, setup: str, q: float) -> float:
        return self.p(setup, q) - self.p("plain", q)


def report(results: list[Result], args: argparse.Namespace, wall_s: float) -> str:
    """report writes the Markdown table of one run."""
    lines = [
        "# Added latency of kvgate through Envoy",
        "",
        f"Command: `python bench/bench_overhead.py --requests {args.requests} --rounds {args.rounds}"
        f" --concurrency {args.concurrency} --body-bytes {args.body_bytes}`",
        "",
        f"Machine: {platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}; "
        f"Envoy, kvgate, the processors, the fake upstream and the load generator share it. "
        f"Run took {wall_s:.0f} s.",
        "",
        "Latencies in milliseconds over all rounds; *added* is the setup's latency minus "
        "plain Envoy's at the same percentile. `direct` is the load generator straight to "
        "an upstream (its own cost). CPU columns: microseconds of CPU per request used by the "
        "processor and by Envoy (from /proc; steadier than latency on a shared machine, "
        "where the latency at a fixed concurrency follows the CPU all processes need).",
        "",
    ]
    for r in results:
        sc = SCENARIOS[r.scenario]
        lines += [f"## {sc.name}: {sc.description}, {args.concurrency} concurrent clients", "",
                  "| setup | requests | p50 | p99 | added p50 | added p99 | processor CPU/req | Envoy CPU/req |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for setup in ("direct", *SETUPS):
            if setup not in r.latencies:
                continue
            added = ("" if setup in ("direct", "plain") else
                     f"{r.added(setup, 0.5):.2f} | {r.added(setup, 0.99):.2f}")
            cpu = " | ".join("" if v is None else f"{v:.0f} us" for v in
                             (r.cpu_us(setup, "processor"), r.cpu_us(setup, "envoy")))
            lines.append(f"| {setup} | {len(r.latencies[setup])} | {r.p(setup, 0.5):.2f} | "
                         f"{r.p(setup, 0.99):.2f} | {added or ' | '} | {cpu} |")
        floor50, floor99 = r.added("bare", 0.5), r.added("bare", 0.99)
        ratio50 = r.added("kvgate", 0.5) / floor50 if floor50 > 0 else float("inf")
        ratio99 = r.added("kvgate", 0.99) / floor99 if floor99 > 0 else float("inf")
        verdict = "meets" if ratio50 <= TARGET_RATIO else "misses"
        lines += ["", f"kvgate / bare processor, added latency: p50 {ratio50:.2f}x, "
                      f"p99 {ratio99:.2f}x (target p50 <= {TARGET_RATIO}x: {verdict})."]
        added_cpu = {s: (r.cpu_us(s, "processor") or 0) + (r.cpu_us(s, "envoy") or 0)
                     - (r.cpu_us("plain", "envoy") or 0) for s in ("bare", "kvgate")}
        if added_cpu["bare"] > 0:
            lines += [f"CPU added per request over plain Envoy (processor + Envoy): bare "
                      f"{added_cpu['bare']:.0f} us, kvgate {added_cpu['kvgate']:.0f} us, "
                      f"ratio {added_cpu['kvgate'] / added_cpu['bare']:.2f}x."]
        lines.append("")
    return "\n".join(lines)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


# --- main ------------------------------------------------------------------------------------

async def measure(stacks: dict[str, Stack], args: argparse.Namespace) -> list[Result]:
    """measure runs every scenario against every setup in shuffled, interleaved rounds."""
    results = []
    rng = random.Random(args.seed)
    for name in args.scenarios:
        sc = SCENARIOS[name]
        result = Result(name)
        targets = {setup: stack.base_url for setup, stack in stacks.items()}
        targets["direct"] = stacks["plain"].upstream_url
        for setup, url in targets.items():  # warm-up: connections, caches, JIT-free but lazy paths
            await sc.run(url, argparse.Namespace(**{**vars(args), "requests": args.warmup}))
        for rnd in range(args.rounds):
            order = list(targets)
            rng.shuffle(order)
            for setup in order:
                pids = _pids(stacks.get(setup))
                before = {role: cpu_seconds(pid) for role, pid in pids.items()}
                lat = await sc.run(targets[setup], args)
                result.latencies.setdefault(setup, []).extend(lat)
                used = result.cpu.setdefault(setup, {})
                for role, pid in pids.items():
                    used[role] = used.get(role, 0.0) + cpu_seconds(pid) - before[role]
            print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{s} p50 {pct(result.latencies[s], 0.5) * 1000:.2f} ms" for s in targets),
                flush=True)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    """main runs the benchmark and writes bench/results/overhead.md."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="requests per setup per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--body-bytes", type=int, default=2048)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "overhead.md")
    ap.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.chat_bodies = ChatBodies(args.body_bytes, seed=args.seed)  # one counter for the whole run
    if args.serve_bare:
        _run(_serve_bare(args.serve_bare))
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        work = Path(tmp)
        bare = [sys.executable, str(Path(__file__).resolve()), "--serve-bare", "{port}"]
        stacks = {"plain": Stack(work / "plain", processor=None),
                  "bare": Stack(work / "bare", processor=bare),
                  "kvgate": Stack(work / "kvgate", BENCH_CONFIG)}
        try:
            for stack in stacks.values():
                stack.start()
            results = _run(measure(stacks, args))
        finally:
            for stack in stacks.values():
                stack.stop()
    text = report(results, args, time.monotonic() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)
    return 0


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
