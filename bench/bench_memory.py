"""bench_memory: what one in-flight request costs kvgate in memory, and where it goes.

Issue 17's target is at most 2 KiB per in-flight request in the recommended file (the
endpoint-picker-log file, and the access-log file it is built on). Two parts, one report:

- **Python objects, exactly** (in-process, ``tracemalloc``): ``--held`` requests parked for
  their access log entry, sent through the service's own stream loop with the messages Envoy
  sends in each file (``kvgate_testkit.held``); the bytes still allocated afterwards per
  request, by the line that allocated them; and what ten rounds of periodic entries for
  every parked request leave behind.
- **Resident memory, whole process** (``--streams`` streams held open through the real Envoy
  and a fast fake upstream, as ``bench_overhead``'s memory scenario): kvgate's RSS growth per
  stream right after every stream got its first chunk (what bench_overhead reports), and
  ``--settle`` seconds later; with ``--baseline REF``, kvgate as it is at git revision REF
  runs beside it in the same run, in rounds of fresh processes in alternating order, and the
  ratio is this tree's over REF's. RSS moves with the machine's load and the allocator: read
  the rounds' spread.

    python bench/bench_memory.py [--baseline main] [--rounds 2] [--streams 3000] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import linecache
import os
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvgate_testkit import reports
from kvgate_testkit.procs import exit_on_sigterm
from kvgate_testkit.reports import machine, publish

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"


# --- Python objects ------------------------------------------------------------------------

def _service(file: str) -> tuple[Any, Any]:
    """_service is an ExtProcService on a gate whose pool admits every request held here."""
    from extproc.admission import Admission
    from extproc.clock import ManualClock
    try:
        from extproc.configparse import parse_config
    except ImportError:  # a --baseline revision from before configparse.py
        from extproc.config import parse_config  # type: ignore[no-redef]
    from extproc.gate import Gate
    from extproc.metrics import Metrics
    from extproc.service import ExtProcService
    from kvgate_testkit.held import config_for, nodes_up
    config = parse_config(config_for(file))
    clock = ManualClock(1000.0)
    admission = Admission(config, clock)
    metrics = Metrics(CollectorRegistry())
    metrics.attach(admission, tuple(config.tenants.classes))
    if file == "endpoint-picker-log":
        nodes_up(admission, clock.now())
    return ExtProcService(Gate(config, admission, metrics, clock), metrics), metrics


def _traced(run: Callable[[], Any]) -> tuple[int, list[tuple[str, int, int]]]:
    """_traced is the Python memory still allocated after ``run()`` (bytes) and its lines
    (``file:line``, bytes, blocks), largest first."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        run()
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    stats = after.compare_to(before, "lineno")
    lines = [(_where(s.traceback[-1].filename, s.traceback[-1].lineno), s.size_diff, s.count_diff)
             for s in stats if s.size_diff > 0]
    return sum(s.size_diff for s in stats), lines


def _where(filename: str, lineno: int) -> str:
    """_where names a source line: its path in the repository (or its file name) and its text."""
    path = Path(filename)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    text = linecache.getline(filename, lineno).strip().replace("|", "\\|")
    return f"{shown}:{lineno} `{text[:80]}`"


def python_objects(held: int, prompt_chars: int) -> dict[str, Any]:
    """python_objects counts what ``held`` parked requests keep, per file, and what periodic
    entries for them leave behind."""
    from extproc.request.accesslog import AccessLogReceiver
    from kvgate_testkit.held import FILES, chat, hold, periodic_message
    out: dict[str, Any] = {}
    body = chat(prompt_chars)
    for file in FILES:
        service, metrics = _service(file)
        asyncio.run(hold(service, file, body, 50))  # warm-up: caches, metric children, tokenizer
        total, lines = _traced(lambda s=service, f=file: asyncio.run(hold(s, f, body, held)))
        entry = {"total": total, "lines": lines}
        if file == "endpoint-picker-log":
            links = list(service.endings.parked)

            async def rounds(first: int, count: int, s: Any = service, m: Any = metrics) -> None:
                async def stream() -> Any:
                    for events in range(first, first + count):
                        yield periodic_message(links, events).SerializeToString()
                await AccessLogReceiver(s.endings, m).StreamAccessLogs(stream(), None)

            asyncio.run(rounds(1, 2))
            entry["periodic"] = (_traced(lambda: asyncio.run(rounds(3, 10)))[0], 10 * len(links))
        out[file] = entry
    return out


# --- resident memory -----------------------------------------------------------------------

async def _rss_round(stack: Any, streams: int, settle_s: float) -> tuple[float, float]:
    """_rss_round holds ``streams`` streams open through ``stack``; returns kvgate's RSS growth
    per stream when every first chunk was read, and ``settle_s`` seconds later (bytes)."""
    from kvgate_testkit.httpload import Inflight, hold_streams
    from kvgate_testkit.sampling import rss_bytes
    pid = stack.procs["kvgate"].pid
    await asyncio.sleep(1.0)  # the warm-up's entries and releases are through
    before = rss_bytes(pid)
    conns = await hold_streams(stack.envoy_port, streams)
    opened = rss_bytes(pid) - before
    await asyncio.sleep(settle_s)
    settled = rss_bytes(pid) - before
    for conn in conns:
        conn.close()
    await asyncio.gather(*(c.lost for c in conns))
    meter = await Inflight.open(stack.admin_port)
    try:
        await meter.wait(0, timeout=60, interval=0.05)
    finally:
        meter.close()
    return opened / streams, settled / streams


async def resident(stacks: dict[str, Any], streams: int, settle_s: float,
                   reverse: bool) -> dict[str, tuple[float, float] | None]:
    """resident measures one round over every stack (``reverse``: in the other order). Each
    stack is fresh: a process's second burst reuses the heap its first one left."""
    from kvgate_testkit.httpload import ChatBodies, HttpError, closed_loop
    bodies = ChatBodies(seed=7)
    for stack in stacks.values():
        await closed_loop(stack.envoy_port, bodies, 8, 200)
    order = list(stacks)[::-1] if reverse else list(stacks)
    out: dict[str, tuple[float, float] | None] = {}
    for name in order:
        try:
            out[name] = await _rss_round(stacks[name], streams, settle_s)
        except HttpError as err:  # a loaded machine: the round is lost, not the run
            print(f"{name}: round lost ({err})", file=sys.stderr)
            out[name] = None
    return out


def build_stacks(work: Path, variants: Sequence[str], baseline: str | None) -> dict[str, Any]:
    from kvgate_testkit.revision import checkout
    from kvgate_testkit.variants import hot_stack
    base = checkout(baseline, work / "baseline") if baseline else None
    stacks: dict[str, Any] = {}
    for variant in variants:
        stacks[f"kvgate {variant}"] = hot_stack(work / f"kvgate-{variant}", variant, work)
        if base is not None:
            stacks[f"kvgate@{baseline} {variant}"] = hot_stack(work / f"kvgate-{baseline}-{variant}", variant,
                                                               work, source=base)
    return stacks


# --- report --------------------------------------------------------------------------------

def report(py: dict[str, Any] | None, rss: dict[str, list[tuple[float, float]]] | None, *,
           command: str, held: int, prompt_chars: int, streams: int, settle_s: float,
           baseline: str | None, wall_s: float, load: tuple[float, float, float]) -> str:
    lines = [
        "# Memory per in-flight request", "",
        f"Command: `{command}`", "",
        f"Machine: {machine()}. "
        f"Load average when the run started: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. "
        f"Run took {wall_s:.0f} s. Target (issue 17): at most 2,048 B per in-flight request.", ""]
    if py is not None:
        lines += [
            "## Python objects a parked request keeps (tracemalloc, exact)", "",
            f"{held} requests ({prompt_chars}-character prompt) sent through the service's stream loop "
            "with the messages Envoy sends in each file, each parked for its access log entry; "
            "the bytes still allocated afterwards, per request, by the line that allocated them "
            "(lines under 8 B a request left out).", ""]
        for file, entry in py.items():
            lines += [f"### {file}: {entry['total'] / held:.0f} B per parked request", "",
                      "| line | B / request | blocks / request |", "|---|---:|---:|"]
            for where, size, count in entry["lines"]:
                if size / held >= 8:
                    lines.append(f"| {where} | {size / held:.0f} | {count / held:.2f} |")
            lines.append("")
            if "periodic" in entry:
                kept, entries = entry["periodic"]
                lines += [f"Periodic entries: {entries} of them (ten rounds for every parked request) "
                          f"left {kept} B allocated in all ({kept / entries:.2f} B an entry).", ""]
    if rss is not None:
        lines += [
            "## Resident memory of the kvgate process", "",
            f"{streams} streams held open at once through Envoy (each past its first chunk); kvgate's "
            "RSS growth from before the streams, divided by the streams: when every first chunk was "
            f"read (bench_overhead's figure) and {settle_s:.0f} s later. One value per round, each "
            "round on fresh processes.", "",
            "| setup | at open (B / stream) | settled (B / stream) | settled, best round |",
            "|---|---|---|---:|"]
        for name, rounds in rss.items():
            opened = ", ".join(f"{o:.0f}" for o, _ in rounds)
            settled = ", ".join(f"{s:.0f}" for _, s in rounds)
            lines.append(f"| {name} | {opened} | {settled} | {min(s for _, s in rounds):.0f} |")
        if baseline is not None:
            lines += ["", f"Ratio of this tree's settled RSS growth over `{baseline}`'s (median of the rounds):", ""]
            for name, rounds in rss.items():
                if "@" in name:
                    continue
                variant = name.split(" ", 1)[1]
                base = rss.get(f"kvgate@{baseline} {variant}")
                if base:
                    mine = sorted(s for _, s in rounds)[len(rounds) // 2]
                    theirs = sorted(s for _, s in base)[len(base) // 2]
                    lines.append(f"- {variant}: {mine:.0f} / {theirs:.0f} = {mine / theirs:.2f}x")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--held", type=int, default=3000, help="requests parked in-process")
    ap.add_argument("--prompt-chars", type=int, default=20)
    ap.add_argument("--streams", type=int, default=3000, help="streams held open through Envoy")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds before the second RSS reading")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["access-log", "endpoint-picker-log"])
    ap.add_argument("--baseline", metavar="REF", help="also run kvgate as it is at this git revision")
    ap.add_argument("--skip", choices=("python", "resident"), action="append", default=[])
    ap.add_argument("--out", type=Path, default=RESULTS / "memory.md")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    load = os.getloadavg()
    started = time.monotonic()
    py = None if "python" in args.skip else python_objects(args.held, args.prompt_chars)
    rss = None
    if "resident" not in args.skip:
        from kvgate_testkit.httpload import run
        from kvgate_testkit.variants import wait_picker_nodes_up
        rss: dict[str, list[tuple[float, float]]] = {}
        for i in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="kvgate-bench-memory-") as tmp:
                stacks = build_stacks(Path(tmp), args.variants, args.baseline)
                try:
                    for stack in stacks.values():
                        stack.start()
                    wait_picker_nodes_up(stacks.values())
                    got = run(resident(stacks, args.streams, args.settle, reverse=i % 2 == 1))
                finally:
                    for stack in stacks.values():
                        stack.stop()
            for name, value in got.items():
                if value is not None:
                    rss.setdefault(name, []).append(value)
    command = reports.command("bench/bench_memory.py", ap, args)
    text = report(py, rss, command=command, held=args.held, prompt_chars=args.prompt_chars,
                  streams=args.streams, settle_s=args.settle, baseline=args.baseline,
                  wall_s=time.monotonic() - started, load=load)
    return publish(args.out, text)


if __name__ == "__main__":
    sys.exit(main())
