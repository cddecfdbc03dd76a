"""bench_usage_filter: what the Lua usage filter costs Envoy per streamed chunk.

In the access-log and picker-log files the response never reaches kvgate: Envoy's Lua usage
filter (extproc/usage_log.py, ``LUA_SOURCE``) reads every chunk as it passes and writes what
it found into dynamic metadata. Its cost is Envoy's, on Envoy's worker thread, on every
token of every stream. This benchmark takes kvgate out to see that cost alone: each setup is
an Envoy (one worker thread) running deploy/envoy-access-log.yaml without ext_proc and
without the access log, in front of its own fast fake upstream, with the route's metadata
saying what kvgate's answer would (the lease's link, and that the usage chunk is kvgate's
own and is hidden from the client), so that the filter follows the stream as it does behind
kvgate. Setups:

- ``none``: the file without the Lua filter: the floor;
- ``reader``: a Lua filter that walks every chunk and reads nothing: what any Lua filter
  that follows a streamed body costs Envoy, the floor of a filter like this one;
- ``shipped``: the filter of this tree;
- ``baseline``: the filter at ``--baseline REV`` (read from git);
- ``--lua NAME=FILE``: any other filter source, to weigh a lever.

One load, the setups in shuffled order each round, ``--rounds`` times: 64 streams of 50
chunks at 50 chunks/s (bench_overhead's streaming scenario), one SSE event a chunk, as an
engine writes them: each chunk's delay from the upstream's write to the client's read, and
Envoy's CPU per chunk (user + system time over the load's chunks).

Every stream is checked (200, every chunk, ``data: [DONE]``), and the report says whether
the usage chunk reached the client (it must not, but for ``none``). It writes ``bench/results/usage-filter.md``.

    python bench/bench_usage_filter.py [--baseline REV] [--lua NAME=FILE ...] [--rounds N]
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
import random  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import orjson  # noqa: E402

from bench import reports  # noqa: E402
from bench.httpload import Conn, http_request  # noqa: E402
from bench.reports import machine, pct, publish  # noqa: E402
from bench.sampling import cpu_seconds  # noqa: E402
from extproc import usage_log  # noqa: E402
from kvgate_testkit.procs import exit_on_sigterm  # noqa: E402
from kvgate_testkit.stack import Stack, metadata_route  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TEMPLATE = ROOT / "deploy" / "envoy-access-log.yaml"
LUA = "envoy.filters.http.lua"
# The route's kvgate metadata: what kvgate's answer to an admitted body writes there.
ADMITTED = {"pool": "default", "release": "access_log", "link": "bench-lease",
            usage_log.STRIP_KEY: True}
ROUTE_HEADER = ("x-bench-admitted", "1")
READER = """\
function envoy_on_response(h)
  for _ in h:bodyChunks() do end
end
"""


@dataclass
class Load:
    """Load is one way of streaming: ``streams`` at once of ``chunks`` chunks, ``delay_ms``
    apart, started over ``spread_ms``."""

    name: str
    streams: int
    chunks: int
    delay_ms: int
    spread_ms: float


LOADS = (Load("paced", 64, 50, 20, 20.0),)
QUICK = (Load("paced", 8, 10, 20, 20.0),)  # a smoke test: its figures mean nothing


@dataclass
class Figures:
    """Figures are one setup's measurements under one load, over every round."""

    delays: list[float] = field(default_factory=list)   # upstream write -> client read (s)
    chunks: int = 0
    envoy_cpu_s: float = 0.0
    wall_s: float = 0.0
    usage_seen: int = 0   # streams whose client received the usage chunk


def stream_bytes(load: Load) -> bytes:
    """stream_bytes is a streamed chat as kvgate forwards it: usage asked of the upstream
    (kvgate adds ``include_usage`` when the filter announces itself), on the route that
    carries the admitted request's metadata."""
    body = orjson.dumps({"model": "fake", "max_tokens": load.chunks, "stream": True,
                         "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": "Tell me a story."}]})
    extra = b"x-fake-delay-ms: %d\r\n%s: %s\r\n" % (
        load.delay_ms, ROUTE_HEADER[0].encode(), ROUTE_HEADER[1].encode())
    return http_request(body, extra=extra)


async def run_load(port: int, load: Load, out: Figures, rng: random.Random) -> None:
    """run_load streams ``load`` through one Envoy and checks every answer."""
    data = stream_bytes(load)

    async def one(delay: float) -> None:
        await asyncio.sleep(delay)
        conn = await Conn.open(port)
        seen: list[float] = []
        try:
            status = await conn.request(data, lambda now, sent: seen.append(now - sent))
            body = bytes(conn._buf)  # noqa: SLF001 - the bench's own client
        finally:
            conn.close()
        # The token chunks, then the usage chunk where it passes (it carries a write time too).
        if status != 200 or len(seen) < load.chunks or b"data: [DONE]" not in body:
            raise RuntimeError(f"stream broken: {status}, {len(seen)} of {load.chunks} chunks")
        out.usage_seen += b'"usage"' in body
        out.delays.extend(seen[:load.chunks])
        out.chunks += load.chunks
    await asyncio.gather(*(one(rng.random() * load.spread_ms / 1000) for _ in range(load.streams)))


def lua_source_at(rev: str) -> str:
    """lua_source_at is ``LUA_SOURCE`` as extproc/usage_log.py defined it at ``rev``."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:extproc/usage_log.py"],
                          check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("usage_log_at_" + rev)
    sys.modules[module.__name__] = module  # its dataclasses look themselves up there
    try:
        exec(compile(text, f"{rev}:extproc/usage_log.py", "exec"), module.__dict__)  # noqa: S102
    finally:
        del sys.modules[module.__name__]
    return str(module.LUA_SOURCE)


def with_lua(source: str | None) -> Any:
    """with_lua edits a rendered file: the Lua filter runs ``source`` (None: no filter), and
    the access log is gone (nothing listens for it here)."""
    def edit(cfg: dict[str, Any]) -> None:
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm.pop("access_log", None)
        hcm.pop("access_log_options", None)
        kept = []
        for http_filter in hcm["http_filters"]:
            if http_filter["name"] == LUA:
                if source is None:
                    continue
                http_filter["typed_config"]["default_source_code"] = {"inline_string": source}
            kept.append(http_filter)
        hcm["http_filters"] = kept
    return edit


async def measure(stacks: dict[str, Stack], loads: tuple[Load, ...], rounds: int,
                  seed: int) -> dict[str, dict[str, Figures]]:
    """measure runs every load through every setup, ``rounds`` times in shuffled order after a
    warm-up, and sums each setup's figures by load name."""
    rng = random.Random(seed)
    res: dict[str, dict[str, Figures]] = {load.name: {} for load in loads}
    order = list(stacks)
    for stack in stacks.values():  # warm-up: connections, the Lua state
        await run_load(stack.envoy_port, Load("warm", 8, 20, 0, 1.0), Figures(), rng)
    for _ in range(rounds):
        for load in loads:
            rng.shuffle(order)
            for name in order:
                stack = stacks[name]
                fig = res[load.name].setdefault(name, Figures())
                pid = stack.procs["envoy"].pid
                cpu0, t0 = cpu_seconds(pid), time.monotonic()
                await run_load(stack.envoy_port, load, fig, rng)
                fig.envoy_cpu_s += cpu_seconds(pid) - cpu0
                fig.wall_s += time.monotonic() - t0
    return res


def report(res: dict[str, dict[str, Figures]], *, loads: tuple[Load, ...], command: str, rounds: int,
           wall_s: float, load_avg: tuple[float, float, float], sources: dict[str, str]) -> str:
    """report is the Markdown report of one run: a table per load, the setups in ``sources``'
    order, each figure beside the no-filter setup's."""
    lines = [
        "# The Lua usage filter's cost per streamed chunk, side by side with no filter", "",
        f"Command: `{command}`", "",
        f"Machine: {machine()}; one Envoy worker thread per setup, deploy/envoy-access-log.yaml "
        "without ext_proc and without the access log, the route's metadata as kvgate's answer "
        "writes it for a client that did not ask for usage (the filter counts every event and hides "
        f"the usage chunk). Load average at the start: {' '.join(f'{x:.2f}' for x in load_avg)}. "
        f"{rounds} rounds, {wall_s:.0f} s.", "",
        "Setups: " + "; ".join(f"`{name}`: {what}" for name, what in sources.items()) + ".", "",
        "*Added* is over `none` (the same file without the filter) in the same run. Envoy CPU per "
        "chunk is Envoy's user + system time over the load's chunks (the requests' own cost "
        "included, the same in every setup).", ""]
    for load in loads:
        figs = res[load.name]
        floor = figs.get("none")
        lines += [f"## {load.name}: {load.streams} streams of {load.chunks} chunks"
                  + (f", {1000 // load.delay_ms} chunks/s" if load.delay_ms else ", as fast as the fake writes"), "",
                  "| setup | chunks | chunk delay p50 (ms) | p99 (ms) | added p50 (ms) | Envoy CPU per chunk (us) | added (us) | chunks/s | usage chunk hidden |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for name in [n for n in sources if n in figs]:
            fig = figs[name]
            p50, p99 = pct(fig.delays, 0.5) * 1e3, pct(fig.delays, 0.99) * 1e3
            cpu = fig.envoy_cpu_s / fig.chunks * 1e6
            if floor is None or name == "none":
                added, added_cpu = "", ""
            else:
                added = f"{p50 - pct(floor.delays, 0.5) * 1e3:.3f}"
                added_cpu = f"{cpu - floor.envoy_cpu_s / floor.chunks * 1e6:.1f}"
            lines.append(f"| {name} | {fig.chunks} | {p50:.3f} | {p99:.3f} | {added} | {cpu:.1f} "
                         f"| {added_cpu} | {fig.chunks / fig.wall_s:.0f} "
                         f"| {'no' if fig.usage_seen else 'yes'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """main runs the comparison and writes the report (bench/results/usage-filter.md by default)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", metavar="REV", help="also run the filter at this git revision")
    ap.add_argument("--lua", nargs="+", default=[], metavar="NAME=FILE",
                    help="also run these filter sources")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny counts: a smoke test, not a measurement")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--out", type=Path, default=RESULTS / "usage-filter.md")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    sources: dict[str, str] = {"none": "the file without the Lua filter",
                               "reader": "a Lua filter that walks every chunk and reads nothing",
                               "shipped": "the filter of this tree"}
    lua: dict[str, str | None] = {"none": None, "reader": READER, "shipped": usage_log.LUA_SOURCE}
    if args.baseline:
        lua["baseline"] = lua_source_at(args.baseline)
        sources["baseline"] = f"the filter at {args.baseline}"
    for spec in args.lua:
        name, _, path = spec.partition("=")
        if not name or not path or name in lua:
            ap.error(f"--lua wants NAME=FILE with a new name, got {spec!r}")
        lua[name] = Path(path).read_text()
        sources[name] = f"the filter in {Path(path).name}"
    load_avg = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-lua-") as tmp:
        stacks: dict[str, Stack] = {}
        try:
            for name, source in lua.items():
                stacks[name] = Stack(Path(tmp) / name, processor=None, envoy_template=TEMPLATE,
                                     upstream_args=["--fast"], envoy_edit=with_lua(source),
                                     routes=[metadata_route(ROUTE_HEADER, ADMITTED)]).start()
            loads = QUICK if args.quick else LOADS
            res = asyncio.run(measure(stacks, loads, args.rounds, args.seed))
        finally:
            for stack in stacks.values():
                stack.stop()
    command = reports.command("bench/bench_usage_filter.py", ap, args)
    publish(args.out, report(res, loads=loads, command=command, rounds=args.rounds,
                             wall_s=time.monotonic() - t0, load_avg=load_avg, sources=sources))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
