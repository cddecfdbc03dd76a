"""bench_overhead: what kvgate costs on the hot path, side by side with plain Envoy.

One run starts three stacks on loopback, each an Envoy (one worker thread) in front of its
own copy of the same fast fake upstream (``kvgate_testkit.upstream --fast``, vLLM-shaped
JSON and SSE):

- ``plain``: Envoy with no ext_proc filter: the physical limit;
- ``bare``: ext_proc to a Python processor that answers CONTINUE and nothing else (same
  grpc.aio, same event loop): the floor of any Python processor; in the files that send
  Envoy's access log to the processor's cluster it also takes that log (bytes read and
  dropped), as any processor attached to them must;
- ``kvgate``: ext_proc to kvgate (parsing, token counting, admission, usage tracking).

The Envoy files are ``--variants`` (default: every shipped file, deploy/envoy.yaml first;
each gets its own bare and kvgate setups, named ``bare X`` and ``kvgate X``). Scenarios,
each run against every setup:

- ``latency``: a ~2 KB non-streaming chat, every body different (each one tokenized), at
  1, 16 and 64 concurrent keep-alive clients: p50/p99, added over plain Envoy, CPU per
  request of the processor and of Envoy;
- ``streaming``: 64 concurrent streams of 50 chunks at 50 chunks/s: time to first chunk and
  each chunk's delay from the upstream's write (every chunk carries its write time on the
  host's monotonic clock) to the client's read;
- ``max_rate``: open-loop load on a rising ladder of rates; the highest rate whose p99
  stays under 20 ms with every request answered on time, and the CPU per request there;
- ``memory``: resident memory of the processor and of Envoy with N streams open at once
  (10,000, or what the open-file limit allows), as bytes per in-flight request;
- ``release`` (kvgate only): N times, open a stream, read its first chunk, disconnect, and
  time until kvgate's ``kvgate_inflight_requests`` is back to 0;
- ``progress`` (kvgate, files with periodic access log entries: endpoint-picker-log and its
  interval levers): N streams held open for a window, the periodic entries kvgate received a
  second and its CPU per entry; and how late kvgate's ledger hears of a stream's first token
  (from the client's read of the first chunk to the first progress entry counted).

The load generator is kvgate_testkit/httpload.py (a bare asyncio HTTP/1.1 client), the bare
processor kvgate_testkit/bare.py. It writes ``bench/results/overhead.md``.

    python bench/bench_overhead.py [--quick] [--variants recommended ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.overhead_report import (ProgressCost, RateStep, Results, Sizes, best_rung,
                                   report, spread)
from kvgate_testkit import reports
from kvgate_testkit.bare import COMMAND as BARE, LEVERS
from kvgate_testkit.httpload import (ChatBodies, Inflight, StreamTimes, closed_loop, hold_streams,
                                     open_loop, run, streams)
from kvgate_testkit.procs import exit_on_sigterm
from kvgate_testkit.reports import pct, publish
from kvgate_testkit.sampling import cpu_seconds, rss_bytes
from kvgate_testkit.stack import Stack
from kvgate_testkit.variants import BARE_ONLY, VARIANTS, hot_stack, wait_picker_nodes_up

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
SETUPS = ("plain", "bare", "kvgate")


FULL = Sizes(latency_requests={1: 600, 16: 3000, 64: 3000}, latency_rounds=2, streams=64,
             stream_chunks=50, stream_rounds=6,
             rates=(250, 500, 750, 1000, 1250, 1500, 1750, 2000, 2500, 3000),
             rate_step_s=2.0, open_streams=10000, disconnects=1000, warmup=300,
             progress_streams=1000, progress_window_s=5.0, progress_samples=40)
QUICK = Sizes(latency_requests={1: 20, 16: 64, 64: 64}, latency_rounds=1, streams=8,
              stream_chunks=5, stream_rounds=1, rates=(50, 100), rate_step_s=0.3,
              open_streams=40, disconnects=10, warmup=20, progress_streams=20,
              progress_window_s=0.6, progress_samples=3)


async def release_times(stack: Stack, count: int) -> list[float]:
    """release_times: ``count`` times, a stream is opened and read to its first chunk (so
    the lease is held), then its client disconnects; the time until kvgate holds nothing
    again is one sample (seconds; the reading's own granularity is about a millisecond)."""
    meter = await Inflight.open(stack.admin_port)
    samples = []
    try:
        await meter.wait(0)
        for _ in range(count):
            (conn,) = await hold_streams(stack.envoy_port, 1)
            t0 = time.monotonic()
            conn.close()
            samples.append(await meter.wait(0) - t0)
    finally:
        meter.close()
    return samples


async def progress_cost(stack: Stack, interval_s: float, sizes: Sizes) -> ProgressCost:
    """progress_cost holds ``sizes.progress_streams`` streams (each after its first chunk, as
    a generation in progress) for ``sizes.progress_window_s`` seconds and counts the periodic
    entries kvgate applied and the CPU it used meanwhile; then, one stream at a time, times
    the first progress entry after the client read the first chunk."""
    meter = await Inflight.open(stack.admin_port)
    pid = stack.procs["kvgate"].pid
    try:
        conns = await hold_streams(stack.envoy_port, sizes.progress_streams)
        e0, c0, t0 = await meter.read_sum(Inflight.PROGRESS), cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(sizes.progress_window_s)  # a rate over a window of wall time
        e1, c1, t1 = await meter.read_sum(Inflight.PROGRESS), cpu_seconds(pid), time.monotonic()
        for conn in conns:
            conn.close()
        await meter.wait(0, timeout=60, interval=0.05)
        cost = ProgressCost(interval_s, len(conns), t1 - t0, e1 - e0, c1 - c0)
        # A first entry takes up to an interval: an interval longer than the window (the
        # 60 s lever) would hold every sample that long, so its lateness is not sampled.
        samples = sizes.progress_samples if interval_s <= sizes.progress_window_s else 0
        for _ in range(samples):
            before = await meter.read_sum(Inflight.PROGRESS)
            (conn,) = await hold_streams(stack.envoy_port, 1)
            first = time.monotonic()
            deadline = first + 10 * interval_s + 1
            while await meter.read_sum(Inflight.PROGRESS) == before:
                if time.monotonic() > deadline:
                    raise TimeoutError("no progress entry came for a held stream")
                await asyncio.sleep(0.001)
            cost.late.append(time.monotonic() - first)
            conn.close()
            await meter.wait(0)
    finally:
        meter.close()
    return cost


def flush_interval_s(envoy_file: Path) -> float | None:
    """flush_interval_s is an Envoy file's ``access_log_flush_interval`` (seconds; None: no
    periodic entries)."""
    import yaml
    cfg = yaml.safe_load(envoy_file.read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    text = hcm.get("access_log_options", {}).get("access_log_flush_interval")
    return float(text.removesuffix("s")) if text else None


# --- measurement -------------------------------------------------------------------------------

def _pids(stack: Stack) -> dict[str, int]:
    return {role: stack.procs[name].pid for role, name in
            (("processor", "kvgate"), ("processor", "processor"), ("envoy", "envoy"))
            if name in stack.procs}


async def measure(stacks: dict[str, Stack], sizes: Sizes, scenarios: Sequence[str],
                  seed: int) -> Results:
    """measure runs the scenarios against every setup (interleaved, in shuffled order)."""
    run = _Run(stacks, sizes, random.Random(seed), ChatBodies(seed=seed), Results(setups=list(stacks)),
               list(stacks))
    for stack in stacks.values():  # warm-up: connections, tokenizer, lazy paths
        await closed_loop(stack.envoy_port, run.bodies, 8, sizes.warmup)
    if "latency" in scenarios:
        await _latency(run)
    if "streaming" in scenarios:
        await _streaming(run)
    if "max_rate" in scenarios:
        await _max_rate(run)
    if "memory" in scenarios:
        await _memory(run)
    if "release" in scenarios and "kvgate" in stacks:
        await _release(run)
    if "progress" in scenarios:
        await _progress_entries(run)
    return run.res


@dataclass
class _Run:
    """_Run is what every scenario of one measure call shares: the stacks, the counts, the
    shuffle, the request bodies, the results so far and the setups' current order."""

    stacks: dict[str, Stack]
    sizes: Sizes
    rng: random.Random
    bodies: ChatBodies
    res: Results
    order: list[str]


async def _latency(run: _Run) -> None:
    """_latency: closed loops of 1, 16 and 64 clients, each setup in turn, rounds in shuffled order."""
    for clients, total in run.sizes.latency_requests.items():
        lat = run.res.latency.setdefault(clients, {})
        cpu = run.res.latency_cpu.setdefault(clients, {})
        for _ in range(run.sizes.latency_rounds):
            run.rng.shuffle(run.order)
            for setup in run.order:
                pids = _pids(run.stacks[setup])
                before = {role: cpu_seconds(pid) for role, pid in pids.items()}
                got = await closed_loop(run.stacks[setup].envoy_port, run.bodies, clients, total)
                lat.setdefault(setup, []).extend(got)
                used = cpu.setdefault(setup, {})
                for role, pid in pids.items():
                    used[role] = used.get(role, 0.0) + cpu_seconds(pid) - before[role]
        _progress(f"latency, {clients} clients", {s: pct(v, 0.5) * 1e3 for s, v in lat.items()})


async def _streaming(run: _Run) -> None:
    """_streaming: concurrent streams through each setup, rounds in shuffled order."""
    sizes, res = run.sizes, run.res
    for _ in range(sizes.stream_rounds):
        run.rng.shuffle(run.order)
        for setup in run.order:
            times = res.streaming.setdefault(setup, StreamTimes())
            pids = _pids(run.stacks[setup])
            before = {role: cpu_seconds(pid) for role, pid in pids.items()}
            await streams(run.stacks[setup].envoy_port, sizes.streams, sizes.stream_chunks, 20.0, times)
            for role, pid in pids.items():
                times.cpu_s[role] = times.cpu_s.get(role, 0.0) + cpu_seconds(pid) - before[role]
    _progress("streaming, chunk delay p50", {s: pct(t.chunk, 0.5) * 1e3 for s, t in res.streaming.items()})


async def _max_rate(run: _Run) -> None:
    """_max_rate climbs the open-loop rate ladder for each setup until a rung fails twice."""
    sizes, res = run.sizes, run.res
    for setup in run.order:
        steps = res.rates.setdefault(setup, [])
        pids = _pids(run.stacks[setup])
        for rate in sizes.rates:
            for _ in range(2):  # a rung that fails is tried once more: the cores are shared
                before = {role: cpu_seconds(pid) for role, pid in pids.items()}
                lat, errors, late = await open_loop(run.stacks[setup].envoy_port, run.bodies, rate,
                                                    sizes.rate_step_s)
                step = RateStep(rate, len(lat) + errors, pct(lat, 0.99), errors, late,
                                {role: cpu_seconds(pid) - before[role] for role, pid in pids.items()})
                if step.ok:
                    break
            steps.append(step)
            if not step.ok:
                break
    _progress("max rate (req/s)", {s: float(b.rate if (b := best_rung(v)) else 0) for s, v in res.rates.items()})


async def _memory(run: _Run) -> None:
    """_memory: each setup's resident memory growth with many streams open at once."""
    res = run.res
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Envoy holds two sockets per HTTP/1.1 stream (client and upstream side).
    res.open_streams = max(1, min(run.sizes.open_streams, (soft - 512) // 2))
    for setup in run.order:
        stack = run.stacks[setup]
        pids = _pids(stack)
        before = {role: rss_bytes(pid) for role, pid in pids.items()}
        conns = await hold_streams(stack.envoy_port, res.open_streams)
        res.memory[setup] = {role: rss_bytes(pid) - before[role] for role, pid in pids.items()}
        for conn in conns:
            conn.close()
        await asyncio.gather(*(c.lost for c in conns))
        if setup == "kvgate":
            meter = await Inflight.open(stack.admin_port)
            try:
                await meter.wait(0, timeout=60, interval=0.05)
            finally:
                meter.close()
    _progress("memory, bytes per open stream",
              {s: m.get("processor", m.get("envoy", 0)) / res.open_streams for s, m in res.memory.items()})


async def _release(run: _Run) -> None:
    """_release times kvgate's release after client disconnects, in every kvgate setup."""
    res = run.res
    res.release = await release_times(run.stacks["kvgate"], run.sizes.disconnects)
    for name in [n for n in run.stacks if n.startswith("kvgate ")]:
        res.release_by[name] = await release_times(run.stacks[name], run.sizes.disconnects)
    _progress("release after disconnect (ms)", {"p50": pct(res.release, 0.5) * 1e3,
                                                "p99": pct(res.release, 0.99) * 1e3})


async def _progress_entries(run: _Run) -> None:
    """_progress_entries measures the cost of periodic access log entries in each kvgate setup whose file writes them."""
    for setup in run.order:
        stack = run.stacks[setup]
        interval = flush_interval_s(stack.envoy_template)
        if stack.processor == "kvgate" and interval is not None:
            run.res.progress[setup] = await progress_cost(stack, interval, run.sizes)
    _progress("progress entries, kvgate CPU per entry (us)",
              {s: c.cpu_s / c.entries * 1e6 if c.entries else float("nan")
               for s, c in run.res.progress.items()})


def _progress(what: str, values: dict[str, float]) -> None:
    print(f"  {what}: " + ", ".join(f"{k} {v:.2f}" for k, v in values.items()), flush=True)


# --- main ------------------------------------------------------------------------------------

SCENARIOS = ("latency", "streaming", "max_rate", "memory", "release", "progress")


def main(argv: list[str] | None = None) -> int:
    """main runs the benchmark and writes the report (bench/results/overhead.md by default)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny counts: a smoke test, not a measurement")
    ap.add_argument("--variants", nargs="+",
                    default=["recommended", "four-message", "observe", "reservation", "access-log",
                             "endpoint-picker", "endpoint-picker-log"],
                    choices=VARIANTS,
                    help="Envoy configurations to compare (levers); the first one's bare and "
                         "kvgate setups are the plain names, the others' are suffixed")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--bare-levers", nargs="+", default=[], choices=LEVERS,
                    help="extra bare setups (see kvgate_testkit/bare.py)")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--open-streams", type=int, help="streams held open at once for memory")
    ap.add_argument("--disconnects", type=int, help="disconnects timed for release")
    ap.add_argument("--progress-streams", type=int, help="streams held open for progress")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "overhead.md")
    ap.add_argument("--previous", type=Path,
                    help="an earlier report of the same command: its targets go beside this run's")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    sizes = QUICK if args.quick else FULL
    overrides = {k: v for k, v in (("open_streams", args.open_streams),
                                   ("disconnects", args.disconnects),
                                   ("progress_streams", args.progress_streams)) if v is not None}
    if overrides:
        sizes = Sizes(**{**sizes.__dict__, **overrides})
    load = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        work = Path(tmp)
        processors: dict[str, Any] = {"plain": None, "bare": BARE, "kvgate": "kvgate"}
        stacks: dict[str, Stack] = {}
        for i, variant in enumerate(args.variants):
            for setup in args.setups:
                if (setup == "plain" and i) or (setup == "kvgate" and variant in BARE_ONLY):
                    continue
                name = setup if i == 0 or setup == "plain" else f"{setup} {variant}"
                stacks[name] = hot_stack(work / name.replace(" ", "-"), variant, work, processors[setup])
        for lever in args.bare_levers:
            stacks[f"bare {lever}"] = hot_stack(work / f"bare-{lever}", args.variants[0], work,
                                                [*BARE, f"--{lever}"])
        try:
            for stack in stacks.values():
                stack.start()
            wait_picker_nodes_up(stacks.values())
            res = run(measure(stacks, sizes, args.scenarios, args.seed))
        finally:
            for stack in stacks.values():
                stack.stop()
    command = reports.command("bench/bench_overhead.py", ap, args)
    text = report(res, command=command, variants=args.variants, sizes=sizes,
                  wall_s=time.monotonic() - started, load=load)
    if args.previous is not None and args.previous.exists():
        text += "\n" + "\n".join(spread(text, args.previous.read_text()))
    return publish(args.out, text)


if __name__ == "__main__":
    sys.exit(main())
